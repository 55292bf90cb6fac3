"""docker-compose.yml, validated by docker-compose itself (`config` parses, interpolates and checks it
against the compose schema without a Docker daemon), then checked for what the stack must be.

What `config` cannot show: that images build and containers start, that health checks pass, that the
network aliases resolve — test_compose_topology.py runs the same topology from the same config files as
processes; only a Docker host can run the containers themselves.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
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
    assert always == {"gateway-1", "gateway-2", "redis", "lmcache", "prometheus", "redis-exporter", "grafana"}


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
        assert g["environment"]["KVGATE_PROCESSES"] == "1"  # KVGATE_GATEWAY_PROCESSES unset


def test_gateway_processes_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_GATEWAY_PROCESSES", "2")
    r = compose_config()
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    assert {services[n]["environment"]["KVGATE_PROCESSES"] for n in ("gateway-1", "gateway-2")} == {"2"}


def test_lmcache_uses_redis_as_l2_and_the_vllm_workers_use_lmcache(stack: dict[str, Any]) -> None:
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


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A service's bind mounts from the repository: container path -> path in the checkout."""
    out = {}
    for vol in service.get("volumes", []):
        src, dst = vol.split(":")[:2]
        if Path(src).is_absolute() and (REPO == Path(src) or REPO in Path(src).parents):
            out[dst] = Path(src)
    return out


def in_container(path: str, service: dict[str, Any]) -> Path:
    """Where a path seen inside the container is in the checkout, through the service's mounts."""
    for dst, src in sorted(mounts(service).items(), key=lambda m: -len(m[0])):
        if path == dst or path.startswith(dst.rstrip("/") + "/"):
            return src / path[len(dst):].lstrip("/")
    raise AssertionError(f"{path} is not on a mount from the repository")


def test_every_mounted_config_file_exists_and_is_loaded_by_the_topology_test(stack: dict[str, Any]) -> None:
    topology = (Path(__file__).with_name("test_compose_topology.py")).read_text()
    mounted = {src.relative_to(REPO).as_posix(): src for svc in stack["services"].values()
               for src in mounts(svc).values()}
    grafana = {"deploy/observability/grafana/provisioning/datasources",
               "deploy/observability/grafana/provisioning/dashboards", "deploy/observability/dashboards"}
    assert set(mounted) == {"deploy/compose/kvgate.yaml", "deploy/compose/sim.yaml", "deploy/compose/prometheus.yml",
                            "deploy/observability", *grafana}
    for rel, src in mounted.items():
        assert src.is_dir() if rel in grafana or rel == "deploy/observability" else src.is_file(), rel
        # Grafana does not run here: test_grafana_is_provisioned_with_prometheus_and_the_dashboard checks its files.
        if rel not in grafana:
            assert f'"{rel}"' in topology, f"{rel} is mounted by the stack but no test starts anything from it"


def test_prometheus_loads_the_repositorys_rule_files_through_its_mount(stack: dict[str, Any]) -> None:
    prom = stack["services"]["prometheus"]
    config = in_container("/etc/prometheus/prometheus.yml", prom)
    assert config == REPO / "deploy/compose/prometheus.yml"
    patterns = yaml.safe_load(config.read_text())["rule_files"]
    loaded = {p for pattern in patterns for p in in_container(pattern, prom).parent.glob(Path(pattern).name)}
    rules = REPO / "deploy/observability/rules"
    assert loaded == set(rules.glob("*.yml")) and {p.name for p in loaded} == {"kvgate-alerts.yml",
                                                                               "kvgate-recording.yml"}
    assert not any("tests" in p.relative_to(rules).parts for p in loaded)  # promtool's unit tests stay out
    assert prom["volumes"] and all(v.endswith(":ro") for v in prom["volumes"])


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(stack: dict[str, Any]) -> None:
    grafana = stack["services"]["grafana"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])  # pinned
    assert all(v.endswith(":ro") for v in grafana["volumes"])
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "admin"  # ${GRAFANA_ADMIN_PASSWORD:-admin}, unset here
    # The datasource is the stack's Prometheus, on the port it listens on, and the default one.
    (ds_file,) = in_container("/etc/grafana/provisioning/datasources", grafana).glob("*.yml")
    ds = yaml.safe_load(ds_file.read_text())
    assert ds["apiVersion"] == 1
    (prom,) = ds["datasources"]
    assert prom["type"] == "prometheus" and prom["isDefault"] is True and prom["uid"] == "prometheus"
    assert prom["url"] == "http://prometheus:9090" and "prometheus" in stack["services"]
    assert "--web.listen-address" not in " ".join(stack["services"]["prometheus"]["command"])  # :9090, the default
    assert "prometheus" in grafana["depends_on"]
    scrape = yaml.safe_load((REPO / "deploy/compose/prometheus.yml").read_text())["global"]["scrape_interval"]
    assert prom["jsonData"]["timeInterval"] == scrape
    # The provider reads the mounted dashboards folder, which is the repository's.
    (prov_file,) = in_container("/etc/grafana/provisioning/dashboards", grafana).glob("*.yml")
    (provider,) = yaml.safe_load(prov_file.read_text())["providers"]
    assert provider["type"] == "file"
    assert in_container(provider["options"]["path"], grafana) == REPO / "deploy/observability/dashboards"
    home = in_container(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"], grafana)
    assert home == REPO / "deploy/observability/dashboards/kvgate-agents.json"
    # Every datasource reference in the dashboard resolves to that datasource: its `datasource` variable
    # (type prometheus, nothing pinned) starts on the default Prometheus, or a reference names its uid.
    dash = json.loads(home.read_text())
    (var,) = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert var["query"] == prom["type"] and not (var.get("current") or {}).get("value")

    def refs(node: Any) -> Iterator[Any]:
        if isinstance(node, dict):
            if "datasource" in node:
                yield node["datasource"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    found = list(refs(dash))
    assert found and all(r == {"type": "prometheus", "uid": f"${{{var['name']}}}"} or
                         r == {"type": "prometheus", "uid": prom["uid"]} for r in found), \
        {json.dumps(r) for r in found}
    assert "__inputs" not in dash  # an export with inputs would need them filled in; this one has none
