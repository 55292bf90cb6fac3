"""A real three-node Redis Cluster on loopback, for the tests that must run against one."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis


def _free_ports(n: int) -> list[int]:
    """Ports whose cluster-bus port (port + 10000) is free and valid too: taken below the ephemeral range."""
    import random
    import socket

    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        p = rng.randrange(12000, 22000)
        if p in ports:
            continue
        try:
            for q in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        ports.append(p)
    return ports


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of one node of a fresh three-master cluster (redis-server from Debian)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server/redis-cli are not installed")
    base: Path = tmp_path_factory.mktemp("redis-cluster")
    ports = _free_ports(3)
    procs = []
    for p in ports:
        d = base / str(p)
        d.mkdir()
        procs.append(subprocess.Popen(
            ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(d / "nodes.conf"), "--dir", str(d), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        for p in ports:
            _wait(p)
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 20
        while redis.Redis(port=ports[0]).cluster("info").get("cluster_state") != "ok":
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not reach state ok")
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def _wait(port: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            if redis.Redis(port=port).ping():
                return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
