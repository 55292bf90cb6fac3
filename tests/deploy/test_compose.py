"""docker-compose.yml, validated by docker-compose itself (`config` parses, interpolates and checks it
against the compose schema without a Docker daemon), then checked for what the stack must be.

What `config` cannot show: that images build and containers start, that health checks pass, that the
network aliases resolve — test_compose_topology.py runs the same topology from the same config files as
processes; only a Docker host can run the containers themselves.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.dockerfile import parse
from tests.deploy.tools import COMPOSE, REPO, ensure

COMPOSE_FILE = REPO / "docker-compose.yml"


def compose_config(*args: str, file: Path = COMPOSE_FILE) -> subprocess.CompletedProcess[str]:
    bin_ = ensure(COMPOSE)
    return subprocess.run([str(bin_ / "docker-compose"), "--project-directory", str(REPO), "-f", str(file), *args,
                           "config"], capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def stack() -> dict[str, Any]:
    r = compose_config()
    assert r.returncode == 0, r.stderr
    cfg: dict[str, Any] = yaml.safe_load(r.stdout)
    return cfg


def test_config_rejects_an_invalid_file(tmp_path: Path) -> None:
    # `config` really validates: a misspelt key fails it.
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE_FILE.read_text().replace("stop_grace_period:", "stop_grace_periode:", 1))
    r = compose_config(file=bad)
    assert r.returncode != 0 and "stop_grace_periode" in r.stderr


def test_profiles_swap_the_worker_set(stack: dict[str, Any]) -> None:
    services = stack["services"]
    by_profile: dict[str, dict[str, str]] = {}
    for name, svc in services.items():
        for prof in svc.get("profiles", []):
            for alias in svc["networks"]["default"]["aliases"]:
                assert alias not in by_profile.setdefault(prof, {}), f"{alias} twice in profile {prof}"
                by_profile[prof][alias] = name
    # Each profile answers on worker-0..2 alone; everything else runs in both.
    assert by_profile == {"sim": {f"worker-{i}": f"sim-{i}" for i in range(3)},
                          "vllm": {f"worker-{i}": f"vllm-{i}" for i in range(3)}}
    always = {n for n, s in services.items() if not s.get("profiles")}
    assert always == {"gateway-1", "gateway-2", "redis", "lmcache", "prometheus", "redis-exporter"}


def test_services_build_from_dockerfile_targets(stack: dict[str, Any]) -> None:
    targets = {s.name for s in parse()}
    built = {n: s["build"]["target"] for n, s in stack["services"].items() if "build" in s}
    assert set(built.values()) <= targets
    assert built["gateway-1"] == "gateway" and built["sim-0"] == "sim" and built["vllm-0"] == "engines"


def test_gateways_share_redis_and_outlast_their_drain(stack: dict[str, Any]) -> None:
    kvgate = yaml.safe_load((REPO / "deploy/compose/kvgate.yaml").read_text())
    assert kvgate["session_store"] == "redis" and kvgate["redis_url"].startswith("redis://redis:")
    for n in ("gateway-1", "gateway-2"):
        g = stack["services"][n]
        grace = g["stop_grace_period"]
        seconds = int(re.fullmatch(r"(\d+)s", grace).group(1))  # type: ignore[union-attr]
        assert seconds > kvgate["drain_timeout_s"]
        assert g["depends_on"]["redis"]["condition"] == "service_healthy"
        assert g["environment"]["KVGATE_CONFIG"] == "/etc/kvgate/kvgate.yaml"


def test_lmcache_uses_redis_as_l2_and_the_vllm_workers_use_lmcache(stack: dict[str, Any]) -> None:
    import json

    lmc = stack["services"]["lmcache"]["command"]
    l2 = json.loads(lmc[lmc.index("--l2-adapter") + 1])
    assert l2["type"] == "resp" and l2["host"] == "redis"
    cmd = stack["services"]["vllm-0"]["command"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://lmcache", "lmcache.mp.port": 5555}
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5558"
    assert cmd[cmd.index("--prefix-caching-hash-algo") + 1] == "sha256"
    assert stack["services"]["vllm-0"]["environment"]["PYTHONHASHSEED"] == "0"


def test_every_mounted_config_file_exists_and_is_loaded_by_the_topology_test(stack: dict[str, Any]) -> None:
    topology = (Path(__file__).with_name("test_compose_topology.py")).read_text()
    mounted = set()
    for svc in stack["services"].values():
        for vol in svc.get("volumes", []):
            src = Path(vol.split(":")[0])
            if src.is_absolute() and REPO in src.parents:
                mounted.add(src.relative_to(REPO).as_posix())
    assert mounted == {"deploy/compose/kvgate.yaml", "deploy/compose/sim.yaml", "deploy/compose/prometheus.yml"}
    for rel in mounted:
        assert (REPO / rel).is_file(), rel
        assert f'"{rel}"' in topology, f"{rel} is mounted by the stack but no test starts anything from it"
