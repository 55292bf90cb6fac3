"""The Helm chart, checked by Helm itself and by the Kubernetes schemas, offline.

helm-sdkpy (the Helm v4 library; needs Python >= 3.12, so it runs in a venv of its own, see tools.py)
lints the chart and renders it through its Install action against a loopback stand-in for the API
server (helm_render.py); every rendered object is validated against the Kubernetes 1.31 JSON schemas
(kubernetes-validate, strict: unknown fields fail). The rendered kvgate.yaml is then loaded by kvgate's
own settings model, so the ConfigMap is known to start a gateway.

What only a real cluster can show: that pods schedule and become ready, that probes, the preStop
hook and the grace period drain a pod without failed requests, that the NetworkPolicies admit exactly
the traffic they mean to (only a CNI enforces them), that the RBAC rules suffice for discovery, that
the images pull, and that vLLM and LMCache start from the arguments rendered here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.config import GatewaySettings
from tests.deploy.tools import HELM, REPO, ToolUnavailable, ensure

CHART = REPO / "deploy" / "helm" / "kvgate"

CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "vllm": {"workers": {"mode": "vllm", "replicas": 2}, "lmcache": {"enabled": True},
             "autoscaling": {"enabled": True}, "serviceMonitor": {"enabled": True},
             "config": {"drain_timeout_s": 45}},
    "external": {"workers": {"mode": "none", "external": [
                     {"url": "http://vllm-a.models:8000", "model": "Qwen/Qwen3-8B", "block_size": 16,
                      "kv_events": "tcp://vllm-a.models:5557"}]},
                 "redis": {"enabled": False, "urlSecret": {"name": "kvgate-redis", "key": "url"}},
                 "auth": {"apiKeySecret": {"name": "kvgate-keys"}, "upstreamKeySecret": {"name": "vllm-key"}},
                 "pdb": {"enabled": False}, "networkPolicy": {"enabled": False}, "rbac": {"create": False}},
    "no-workers": {"workers": {"mode": "none"}},
    "processes": {"gateway": {"workers": 3, "cpuPerWorkerMillicores": 900}},
    "epp": {"epp": {"enabled": True, "httpRoute": {"create": True, "gatewayNamespace": "gateways"}}},
    "epp-pool": {"workers": {"mode": "none"}, "networkPolicy": {"enabled": False},
                 "epp": {"enabled": True, "replicas": 2, "port": 9100,
                         "inferencePool": {"name": "llama", "selector": {"app": "vllm-llama"}, "targetPort": 8080,
                                           "failureMode": "FailOpen"}}},
    # The schema refuses these before anything renders.
    "bad-mode": {"workers": {"mode": "gpu"}},
    "redis-nowhere": {"redis": {"enabled": False}},
    "workers-in-extra": {"extraConfig": {"workers": []}},
    "processes-on-memory": {"gateway": {"workers": 2}, "config": {"session_store": "memory"}},
    "epp-bad-failure-mode": {"epp": {"enabled": True, "inferencePool": {"failureMode": "Sometimes"}}},
    # Rendering stops with the chart's own message.
    "epp-no-selector": {"workers": {"mode": "none"}, "epp": {"enabled": True}},
    # kube-prometheus-stack: rules selected by its release label, dashboards by its sidecar's default label.
    "observability": {"observability": {
        "prometheusRules": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "grafanaDashboards": {"enabled": True, "annotations": {"grafana_folder": "kvgate"}}}},
    "observability-elsewhere": {"observability": {
        "prometheusRules": {"enabled": True, "namespace": "monitoring"},
        "grafanaDashboards": {"enabled": True, "label": "example.com/dashboard", "labelValue": "kvgate",
                              "namespace": "grafana"}}},
    "observability-bad-label": {"observability": {"grafanaDashboards": {"enabled": True, "label": "not a label"}}},
}


OBSERVABILITY = REPO / "deploy" / "observability"
CHART_FILES = CHART / "files"
# The chart's copies of deploy/observability/ (Helm reads no file outside the chart): relative path in
# deploy/observability/ -> relative path in the chart's files/.
COPIES = {f"{d}/{p.name}": f"{d}/{p.name}" for d, pattern in (("rules", "*.yml"), ("dashboards", "*.json"))
          for p in sorted((OBSERVABILITY / d).glob(pattern))}

BAD_RULE = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "bad"},
            "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0", "for": "5 minutes",
                                                          "severity": "page"}]}]}}
"""A PrometheusRule the vendored CRD refuses twice: a duration Prometheus cannot parse, a field it does not know."""

BAD_POOL = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "bad"},
            "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 0}], "replicas": 3,
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Sometimes"}}}
"""An InferencePool the vendored CRD refuses three times over: the check can fail."""


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    try:
        bin_ = ensure(HELM)
    except ToolUnavailable as exc:
        pytest.skip(f"helm-sdkpy: {exc}")
    # A broken copy proves lint can fail.
    broken = tmp_path_factory.mktemp("chart") / "kvgate"
    shutil.copytree(CHART, broken)
    with open(broken / "templates" / "service.yaml", "a") as f:
        f.write("{{ .Values.nosuch.field }}\n")
    spec = {"lint": [str(CHART), str(broken)], "chart": str(CHART), "cases": CASES, "validate": [BAD_POOL, BAD_RULE]}
    r = subprocess.run([str(bin_ / "python"), str(Path(__file__).with_name("helm_render.py")), json.dumps(spec)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout)
    out["broken"] = str(broken)
    return out


def objects(helm: dict[str, Any], case: str) -> dict[tuple[str, str], dict[str, Any]]:
    c = helm["cases"][case]
    assert c["error"] is None, c["error"]
    for o in c["objects"]:
        assert o["errors"] == [], (o["object"]["kind"], o["object"]["metadata"]["name"], o["errors"])
    return {(o["object"]["kind"], o["object"]["metadata"]["name"]): o["object"] for o in c["objects"]}


def gateway_settings(objs: dict[tuple[str, str], dict[str, Any]], tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> GatewaySettings:
    path = tmp_path / "kvgate.yaml"
    path.write_text(objs[("ConfigMap", "kvgate")]["data"]["kvgate.yaml"])
    for k in [k for k in __import__("os").environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVGATE_CONFIG", str(path))
    return GatewaySettings()


def test_lint_passes_and_catches_a_broken_template(helm: dict[str, Any]) -> None:
    ok = helm["lint"][str(CHART)]
    assert ok["errors"] == 0 and all(m["severity"] == "INFO" for m in ok["messages"]), ok
    bad = helm["lint"][helm["broken"]]
    assert bad["errors"] > 0 and {"severity": "ERROR", "path": "templates/"} in bad["messages"], bad


@pytest.mark.parametrize("case", ["bad-mode", "redis-nowhere", "workers-in-extra", "epp-bad-failure-mode",
                                  "observability-bad-label", "processes-on-memory"])
def test_schema_refuses_bad_values(helm: dict[str, Any], case: str) -> None:
    err = helm["cases"][case]["error"]
    assert err is not None and "schema" in err, err
    assert helm["cases"][case]["objects"] == []


def test_default_runs_gateways_simulated_workers_and_redis(helm: dict[str, Any], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    objs = objects(helm, "default")
    assert {k for k, _ in objs} == {"ConfigMap", "Deployment", "Service", "StatefulSet", "ServiceAccount", "Role",
                                    "RoleBinding", "PodDisruptionBudget", "NetworkPolicy"}
    s = gateway_settings(objs, tmp_path, monkeypatch)
    assert s.session_store == "redis" and s.redis_url == "redis://kvgate-redis:6379/0"
    assert s.tokenizers == {"kvgate-tiny": "/opt/kvgate/kvgate-tiny"}  # built into the image
    sts = objs[("StatefulSet", "kvgate-worker")]
    svc = objs[("Service", "kvgate-worker")]
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "kvgate-worker"
    # kvgate.yaml names exactly the pods the StatefulSet makes, with their KV-event endpoints.
    pods = [f"kvgate-worker-{i}.kvgate-worker.kvgate.svc" for i in range(sts["spec"]["replicas"])]
    assert [w.url for w in s.workers] == [f"http://{p}:8000" for p in pods]
    assert [w.kv_events for w in s.workers] == [f"tcp://{p}:5557" for p in pods]
    env = {e["name"]: e["value"] for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    # The simulator hashes like kvgate expects: same block size, algorithm and seed.
    assert int(env["KVGATE_SIM_BLOCK_SIZE"]) == s.workers[0].block_size
    assert env["KVGATE_SIM_HASH_ALGO"] == s.workers[0].hash_algo and env["KVGATE_SIM_HASH_SEED"] == s.hash_seed
    assert env["KVGATE_SIM_KV_EVENTS_ENDPOINT"] == "tcp://*:5557"


def test_gateway_pod_drains_and_runs_locked_down(helm: dict[str, Any], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for case in ("default", "vllm"):
        objs = objects(helm, case)
        s = gateway_settings(objs, tmp_path, monkeypatch)
        dep = objs[("Deployment", "kvgate")]
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        sleep_s = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > s.drain_timeout_s + sleep_s
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
        assert pod["serviceAccountName"] == "kvgate"
        assert dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    assert objects(helm, "vllm")[("Deployment", "kvgate")]["spec"].get("replicas") is None  # the HPA owns it
    assert objects(helm, "default")[("Deployment", "kvgate")]["spec"]["replicas"] == 2


def test_gateway_workers_become_processes_and_their_cpu_request(helm: dict[str, Any], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    one = objects(helm, "default")[("Deployment", "kvgate")]["spec"]["template"]["spec"]["containers"][0]
    assert "--workers" not in one["args"] and one["resources"]["requests"]["cpu"] == "500m"
    objs = objects(helm, "processes")
    c = objs[("Deployment", "kvgate")]["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][-2:] == ["--workers", "3"]
    # The image's ENTRYPOINT is `kvgate serve`: kvgate's own parser takes the args the chart renders.
    from kvgate.cli import _build_parser

    for args in (one["args"], c["args"]):
        parsed = _build_parser().parse_args(["serve", *args])
        assert parsed.log_level == "INFO" and parsed.processes == (3 if args is c["args"] else None)
    assert _build_parser().parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"  # not the default
    assert c["resources"]["requests"] == {"cpu": "2700m", "memory": "512Mi"}
    # The rendered kvgate.yaml is one the processes can share: start-up accepts it with --workers 3.
    assert gateway_settings(objs, tmp_path, monkeypatch).session_store == "redis"
    monkeypatch.setenv("KVGATE_PROCESSES", "3")
    assert GatewaySettings().processes == 3


def test_vllm_workers_publish_kv_events_and_use_lmcache(helm: dict[str, Any], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    objs = objects(helm, "vllm")
    assert ("HorizontalPodAutoscaler", "kvgate") in objs and ("ServiceMonitor", "kvgate") in objs
    s = gateway_settings(objs, tmp_path, monkeypatch)
    c = objs[("StatefulSet", "kvgate-worker")]["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)
    env = {e["name"]: e.get("value") for e in c["env"]}
    w = s.workers[0]
    assert int(args["--block-size"]) == w.block_size and args["--prefix-caching-hash-algo"] == w.hash_algo
    assert env["PYTHONHASHSEED"] == s.hash_seed
    events = json.loads(args["--kv-events-config"])
    assert events["enable_kv_cache_events"] and events["endpoint"].endswith(f":{w.kv_events.rsplit(':', 1)[1]}")
    lmc = json.loads(args["--kv-transfer-config"])
    assert lmc["kv_connector"] == "LMCacheMPConnector"
    assert lmc["kv_connector_extra_config"]["lmcache.mp.host"] == "tcp://kvgate-lmcache"
    assert w.lmcache_url == "http://kvgate-lmcache:8080" and w.lmcache_model == args["--model"]
    assert s.tier_redis_url == s.redis_url
    l2 = next(a for a in objs[("Deployment", "kvgate-lmcache")]["spec"]["template"]["spec"]["containers"][0]["args"]
              if a.startswith("--l2-adapter="))
    assert json.loads(l2.split("=", 1)[1]) == {"type": "resp", "host": "kvgate-redis", "port": 6379, "num_workers": 2}
    assert s.drain_timeout_s == 45


def test_external_workers_redis_and_credentials_from_secrets(helm: dict[str, Any], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    objs = objects(helm, "external")
    kinds = {k for k, _ in objs}
    assert "StatefulSet" not in kinds and "PodDisruptionBudget" not in kinds and "Role" not in kinds
    assert ("Deployment", "kvgate-redis") not in objs
    s = gateway_settings(objs, tmp_path, monkeypatch)
    assert [w.url for w in s.workers] == ["http://vllm-a.models:8000"] and s.workers[0].block_size == 16
    env = {e["name"]: e for e in objs[("Deployment", "kvgate")]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVGATE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "kvgate-redis", "key": "url"}
    assert env["KVGATE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "kvgate-keys", "key": "api-keys",
                                                                    "optional": True}
    assert env["KVGATE_UPSTREAM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "vllm-key"


def test_discovery_rbac_reads_endpointslices_and_pods_only(helm: dict[str, Any]) -> None:
    role = objects(helm, "default")[("Role", "kvgate-discovery")]
    assert {(r["apiGroups"][0], res) for r in role["rules"] for res in r["resources"]} == {
        ("discovery.k8s.io", "endpointslices"), ("", "pods")}
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in role["rules"])


def test_network_policies_admit_the_callers_of_each_component(helm: dict[str, Any]) -> None:
    objs = objects(helm, "vllm")
    comp = lambda np: np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]  # noqa: E731
    pols = {comp(o): o for (k, _), o in objs.items() if k == "NetworkPolicy"}
    assert set(pols) == {"gateway", "worker", "redis", "lmcache"}

    def callers(component: str) -> set[str]:
        return {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                for rule in pols[component]["spec"]["ingress"] for p in rule.get("from", []) if "podSelector" in p}

    assert "from" not in pols["gateway"]["spec"]["ingress"][0]  # clients: anyone, unless restricted
    assert callers("worker") == {"gateway"} and callers("redis") == {"gateway", "lmcache"}
    assert callers("lmcache") == {"worker", "gateway"}


def test_notes_and_helm_test_hook(helm: dict[str, Any]) -> None:
    notes = helm["cases"]["default"]["notes"]
    assert "port-forward svc/kvgate 8000:8000" in notes and "3 sim worker(s)" in notes
    assert "WARNING: no workers" in helm["cases"]["no-workers"]["notes"]
    hook = yaml.safe_load(helm["cases"]["default"]["hooks"][0])
    assert hook["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert hook["spec"]["containers"][0]["command"][-1] == "http://kvgate:8000/ready"


def epp_settings(objs: dict[tuple[str, str], dict[str, Any]], name: str, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> GatewaySettings:
    path = tmp_path / "epp.yaml"
    path.write_text(objs[("ConfigMap", name)]["data"]["kvgate.yaml"])
    for k in [k for k in __import__("os").environ if k.startswith("KVGATE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("KVGATE_CONFIG", str(path))
    return GatewaySettings()


def test_epp_mode_points_an_inference_pool_at_kvgate_and_discovers_the_same_pods(
        helm: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = objects(helm, "epp")  # every object schema-valid; the InferencePool against its CRD
    dep, svc = objs[("Deployment", "kvgate-epp")], objs[("Service", "kvgate-epp")]
    pool, route = objs[("InferencePool", "kvgate")], objs[("HTTPRoute", "kvgate")]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["kvgate"] and c["args"][-1] == "epp"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert int(env["KVGATE_EPP_PORT"]) == ports["ext-proc"] == 9002
    # The kubelet probes the health services the endpoint picker protocol names.
    assert c["readinessProbe"]["grpc"] == {"port": ports["ext-proc"], "service": "readiness"}
    assert c["livenessProbe"]["grpc"] == {"port": ports["ext-proc"], "service": "liveness"}
    # The pool's endpoint picker is this Service's ext_proc port, which reaches the container's.
    ref = pool["spec"]["endpointPickerRef"]
    sport = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert ref["name"] == svc["metadata"]["name"] and sport["targetPort"] == "ext-proc"
    assert sport["appProtocol"] == "kubernetes.io/h2c" and ref["failureMode"] == "FailClose"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # The pool selects exactly the worker pods, on their HTTP port ...
    sts = objs[("StatefulSet", "kvgate-worker")]
    sel = pool["spec"]["selector"]["matchLabels"]
    assert sel.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    wport = {p["name"]: p["containerPort"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": wport["http"]}]
    # ... and kvgate discovers the same pods with the same selector, on the same port, with their KV events.
    s = epp_settings(objs, "kvgate-epp", tmp_path, monkeypatch)
    d = s.discovery
    assert d is not None and d.kind == "kubernetes" and d.resource == "pods" and d.namespace == "kvgate"
    assert dict(kv.split("=") for kv in d.label_selector.split(",")) == sel
    assert wport[d.port_name] == wport["http"] and d.kv_events_port_name in wport and d.kv_replay_port_name in wport
    assert s.workers == [] and s.epp_port == 9002 and s.session_store == "redis"
    assert s.redis_url == gateway_settings(objs, tmp_path, monkeypatch).redis_url  # conversations shared
    assert d.worker.block_size == 128 and d.worker.model == "kvgate-tiny"  # as the chart runs the workers
    # The example route sends the Gateway's traffic to the pool.
    rule = route["spec"]["rules"][0]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "kvgate"}]
    assert route["spec"]["parentRefs"][0]["namespace"] == "gateways"
    # Envoy reaches the EPP and the workers; the EPP reaches the workers' KV events and Redis.
    comp = lambda np: np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]  # noqa: E731
    pols = {comp(o): o for (k, _), o in objs.items() if k == "NetworkPolicy"}
    assert "from" not in pols["epp"]["spec"]["ingress"][0]
    froms = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in pols["worker"]["spec"]["ingress"]
             for p in r.get("from", []) if "podSelector" in p]
    assert {"gateway", "epp"} <= set(froms)
    assert any("from" not in r and r["ports"] == [{"port": "http", "protocol": "TCP"}]
               for r in pols["worker"]["spec"]["ingress"])
    assert "epp" in {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                     for r in pols["redis"]["spec"]["ingress"] for p in r.get("from", [])}


def test_the_inference_pool_crd_check_can_fail(helm: dict[str, Any]) -> None:
    errors = " | ".join(helm["validate"][0])
    assert "failureMode" in errors and "targetPorts.0.number" in errors and "'replicas' was unexpected" in errors


def test_epp_mode_for_a_pool_of_external_model_servers(helm: dict[str, Any], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    objs = objects(helm, "epp-pool")
    pool = objs[("InferencePool", "llama")]
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm-llama"}
    assert pool["spec"]["targetPorts"] == [{"number": 8080}] and pool["spec"]["endpointPickerRef"]["port"] == \
        {"number": 9100} and pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert objs[("Deployment", "kvgate-epp")]["spec"]["replicas"] == 2
    s = epp_settings(objs, "kvgate-epp", tmp_path, monkeypatch)
    assert s.discovery is not None and s.discovery.label_selector == "app=vllm-llama" and s.epp_port == 9100
    assert ("HTTPRoute", "kvgate") not in objs
    err = helm["cases"]["epp-no-selector"]["error"]
    assert err is not None and "epp.inferencePool.selector is required" in err


def test_the_chart_carries_identical_copies_of_the_dashboard_and_rules() -> None:
    """Helm reads no file outside the chart, so files/ holds copies; they must not drift (docs/deploy.md:
    `cp deploy/observability/rules/*.yml deploy/helm/kvgate/files/rules/` and the same for dashboards)."""
    assert {"rules/kvgate-alerts.yml", "rules/kvgate-recording.yml", "dashboards/kvgate-agents.json"} <= set(COPIES)
    chart_files = {p.relative_to(CHART_FILES).as_posix() for p in CHART_FILES.rglob("*") if p.is_file()}
    assert chart_files == set(COPIES.values()), "the chart's files/ and deploy/observability/ list different files"
    for src, dst in COPIES.items():
        assert (CHART_FILES / dst).read_bytes() == (OBSERVABILITY / src).read_bytes(), \
            f"deploy/helm/kvgate/files/{dst} differs from deploy/observability/{src}: copy it again"


def rule_groups() -> list[Any]:
    groups: list[Any] = []
    for rel in sorted(COPIES):  # the template's order: files/rules/*.yml by name
        if rel.startswith("rules/"):
            groups += yaml.safe_load((OBSERVABILITY / rel).read_text())["groups"]
    return groups


def test_observability_renders_the_rules_and_the_dashboard_for_the_operator_and_grafana(helm: dict[str, Any]) -> None:
    objs = objects(helm, "observability")  # the PrometheusRule validated against the operator's CRD
    rule = objs[("PrometheusRule", "kvgate")]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "namespace" not in rule["metadata"] or rule["metadata"]["namespace"] == "kvgate"
    groups = rule["spec"]["groups"]
    assert groups == rule_groups()
    names = [g["name"] for g in groups]
    assert len(names) == len(set(names)) and {"kvgate-agents-alerts", "kvgate-agents-recording"} <= set(names)
    # Annotations keep their Prometheus templates: Helm did not interpret them.
    assert any("{{ $labels.instance }}" in r.get("annotations", {}).get("summary", "")
               for g in groups for r in g["rules"])
    cm = objs[("ConfigMap", "kvgate-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "kvgate"
    assert cm["data"] == {"kvgate-agents.json": (OBSERVABILITY / "dashboards/kvgate-agents.json").read_text()}
    assert json.loads(cm["data"]["kvgate-agents.json"])["uid"] == "kvgate-agents"
    # The rest of the release is the default one.
    assert {k for k in objs} - {("PrometheusRule", "kvgate"), ("ConfigMap", "kvgate-dashboards")} == \
        set(objects(helm, "default"))


def test_observability_label_and_namespaces_are_configurable(helm: dict[str, Any]) -> None:
    objs = objects(helm, "observability-elsewhere")
    assert objs[("PrometheusRule", "kvgate")]["metadata"]["namespace"] == "monitoring"
    cm = objs[("ConfigMap", "kvgate-dashboards")]
    assert cm["metadata"]["namespace"] == "grafana"
    assert cm["metadata"]["labels"]["example.com/dashboard"] == "kvgate" and "grafana_dashboard" not in \
        cm["metadata"]["labels"]


def test_observability_is_off_by_default(helm: dict[str, Any]) -> None:
    for case in ("default", "vllm", "external", "epp"):
        objs = objects(helm, case)
        assert not any(k == "PrometheusRule" for k, _ in objs), case
        assert ("ConfigMap", "kvgate-dashboards") not in objs, case
        assert not any("grafana_dashboard" in (o["metadata"].get("labels") or {}) for o in objs.values()), case


def test_the_prometheus_rule_crd_check_can_fail(helm: dict[str, Any]) -> None:
    errors = " | ".join(helm["validate"][1])
    assert "5 minutes" in errors and "'severity' was unexpected" in errors, errors
