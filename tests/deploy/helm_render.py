"""Helm's own lint and render of the chart, run by tests/deploy/test_helm.py in a Python >= 3.12 venv
holding helm-sdkpy (the Helm v4 library) and kubernetes-validate.

helm-sdkpy exposes Lint but no template/dry-run action, so the chart is rendered the way `helm install`
renders it: its Install action runs against a loopback stand-in for the Kubernetes API that answers
discovery, finds nothing existing and records every object Helm creates. Nothing here interprets a
template: the objects are exactly what Helm would send to a cluster. They are then validated offline
against the Kubernetes JSON schemas of the version the stand-in announces.

Input (argv[1], JSON): {"lint": [chart paths], "chart": path, "cases": {name: values}, "validate": [objects]}.
Output (stdout, JSON): each linted chart's messages, per case the rendered objects with each one's schema
errors, and the schema errors of each object of "validate" (proof that a check can fail).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KUBE_VERSION = ("1", "31")
# (group, version) -> [(plural, kind, namespaced)]: the API the chart's objects need.
RESOURCES: dict[tuple[str, str], list[tuple[str, str, bool]]] = {
    ("", "v1"): [("configmaps", "ConfigMap", True), ("secrets", "Secret", True), ("services", "Service", True),
                 ("serviceaccounts", "ServiceAccount", True), ("pods", "Pod", True),
                 ("namespaces", "Namespace", False)],
    ("apps", "v1"): [("deployments", "Deployment", True), ("statefulsets", "StatefulSet", True)],
    ("policy", "v1"): [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    ("autoscaling", "v2"): [("horizontalpodautoscalers", "HorizontalPodAutoscaler", True)],
    ("rbac.authorization.k8s.io", "v1"): [("roles", "Role", True), ("rolebindings", "RoleBinding", True)],
    ("networking.k8s.io", "v1"): [("networkpolicies", "NetworkPolicy", True)],
    ("discovery.k8s.io", "v1"): [("endpointslices", "EndpointSlice", True)],
    ("monitoring.coreos.com", "v1"): [("servicemonitors", "ServiceMonitor", True),
                                      ("prometheusrules", "PrometheusRule", True)],
    ("inference.networking.k8s.io", "v1"): [("inferencepools", "InferencePool", True)],
    ("gateway.networking.k8s.io", "v1"): [("httproutes", "HTTPRoute", True)],
}
# Custom resources: no schema in kubernetes-validate's set. InferencePool and PrometheusRule are checked against
# their vendored CRDs (crds/README.md); the others are not schema-checked.
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "InferencePool", "HTTPRoute"}
CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
               ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml"}


class Recorder(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeApi)
        self.created: list[dict[str, Any]] = []


class FakeApi(BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self) -> None:
        self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                         "code": 404, "message": "not found"})

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/version":
            return self._send(200, {"major": KUBE_VERSION[0], "minor": KUBE_VERSION[1],
                                    "gitVersion": f"v{KUBE_VERSION[0]}.{KUBE_VERSION[1]}.0", "platform": "linux/amd64"})
        if path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})
        if path == "/apis":
            groups = [{"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                       "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}}
                      for (g, v) in RESOURCES if g]
            return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        for (g, v), res in RESOURCES.items():
            if path == (f"/apis/{g}/{v}" if g else f"/api/{v}"):
                return self._send(200, {"kind": "APIResourceList", "apiVersion": "v1",
                                        "groupVersion": f"{g}/{v}" if g else v, "resources": [
                    {"name": n, "singularName": k.lower(), "namespaced": ns, "kind": k,
                     "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}
                    for n, k, ns in res]})
        if path.endswith("/secrets") or path.endswith("/configmaps"):  # Helm's release storage: none yet
            return self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": []})
        return self._not_found()

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n)
        if "protobuf" in (self.headers.get("Content-Type") or ""):
            # Helm's release record (a Secret, sent by the typed client as protobuf): not the chart's.
            return {"kind": "Secret", "apiVersion": "v1", "metadata": {"labels": {"owner": "helm"}}}
        body: dict[str, Any] = json.loads(raw or b"{}")
        return body

    def do_POST(self) -> None:
        obj = self._body()
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("resourceVersion", "1")
        meta.setdefault("creationTimestamp", "2024-01-01T00:00:00Z")
        if not (obj.get("kind") == "Secret" and (meta.get("labels") or {}).get("owner") == "helm"):
            self.server.created.append(obj)
        self._send(201, obj)

    def do_PUT(self) -> None:
        obj = self._body()
        obj.setdefault("metadata", {}).setdefault("resourceVersion", "2")
        self._send(200, obj)

    def do_PATCH(self) -> None:
        self._send(200, self._body())


def serve(workdir: str) -> tuple[Recorder, str]:
    srv = Recorder()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    kubeconfig = json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "loopback",
        "clusters": [{"name": "loopback", "cluster": {"server": url}}],
        "contexts": [{"name": "loopback", "context": {"cluster": "loopback", "user": "nobody", "namespace": "kvgate"}}],
        "users": [{"name": "nobody", "user": {}}]})
    path = f"{workdir}/kubeconfig.json"  # JSON is YAML; helm-sdkpy takes a string only if it looks like YAML
    with open(path, "w") as f:
        f.write(kubeconfig)
    return srv, path


def validate_crd(obj: dict[str, Any], crd_file: str) -> list[str]:
    """Against the CRD's structural schema (unknown fields refused, as the API server prunes or rejects
    them); the CRD's CEL rules are not evaluated."""
    from pathlib import Path

    import jsonschema
    import yaml

    crd = yaml.safe_load((Path(__file__).parent / "crds" / crd_file).read_text())
    version = obj["apiVersion"].split("/")[1]
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)

    def strict(node: Any) -> Any:
        if isinstance(node, dict):
            node = {k: strict(v) for k, v in node.items()}
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
        elif isinstance(node, list):
            node = [strict(v) for v in node]
        return node

    schema = strict(schema)
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the API server itself
    v = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(str(p) for p in e.path)}: {e.message}" for e in v.iter_errors(obj)]


def validate(obj: dict[str, Any]) -> list[str]:
    import kubernetes_validate

    crd = CRD_SCHEMAS.get((obj.get("apiVersion", ""), obj.get("kind", "")))
    if crd is not None:
        return validate_crd(obj, crd)
    if obj.get("kind") in CRD_KINDS:
        return []
    try:
        kubernetes_validate.validate(obj, f"{KUBE_VERSION[0]}.{KUBE_VERSION[1]}.0", strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(str(p) for p in exc.path)}: {exc.message}"]
    return []


async def render(chart: str, values: dict[str, Any], srv: Recorder, kubeconfig: str) -> dict[str, Any]:
    import helm_sdkpy as helm

    srv.created = []
    cfg = helm.Configuration(namespace="kvgate", kubeconfig=kubeconfig)
    out: dict[str, Any] = {"error": None}
    try:
        rel = await helm.Install(cfg).run("kvgate", chart, values=values or None, wait=False, timeout=60)
        out["hooks"] = [h.get("manifest", "") for h in rel.get("hooks") or []] if isinstance(rel, dict) else []
        out["notes"] = ((rel.get("info") or {}).get("notes", "")) if isinstance(rel, dict) else ""
    except helm.HelmError as exc:
        out["error"] = str(exc)
    out["objects"] = [{"object": o, "errors": validate(o)} for o in srv.created]
    return out


async def lint(chart: str) -> dict[str, Any]:
    import helm_sdkpy as helm

    res = await helm.Lint(helm.Configuration(namespace="kvgate")).run(chart)
    sev = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}
    return {"messages": [{"severity": sev.get(m.get("Severity"), str(m.get("Severity"))), "path": m.get("Path")}
                         for m in res.get("Messages") or []],
            "errors": len(res.get("Errors") or [])}


async def main() -> None:
    import tempfile

    spec = json.loads(sys.argv[1])
    workdir = tempfile.mkdtemp(prefix="kvgate-helm-")
    srv, kubeconfig = serve(workdir)
    try:
        result: dict[str, Any] = {"lint": {p: await lint(p) for p in spec["lint"]}, "cases": {},
                                  "validate": [validate(o) for o in spec.get("validate", [])]}
        for name, values in spec["cases"].items():
            result["cases"][name] = await render(spec["chart"], values, srv, kubeconfig)
    finally:
        srv.shutdown()
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
