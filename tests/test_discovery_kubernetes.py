"""Kubernetes discovery's translation of API objects, on objects built with the official client's models
(no API server can run here: the list/watch loop around these is not exercised)."""

from __future__ import annotations

from datetime import UTC, datetime

from kubernetes.client import (
    DiscoveryV1EndpointPort,
    V1Container,
    V1ContainerPort,
    V1Endpoint,
    V1EndpointConditions,
    V1EndpointSlice,
    V1ObjectMeta,
    V1ObjectReference,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from kvgate.config import KubernetesDiscovery, WorkerTemplate
from kvgate.discovery.kubernetes import KubernetesSource, apply_event, workers_from_pods, workers_from_slices

CFG = KubernetesDiscovery(label_selector="kubernetes.io/service-name=vllm",
                          worker=WorkerTemplate(model="llama", engine="vllm", block_size=16))


def endpoint(ip: str, ready: bool | None = True, terminating: bool | None = None) -> V1Endpoint:
    return V1Endpoint(addresses=[ip], conditions=V1EndpointConditions(ready=ready, terminating=terminating),
                      node_name="node-1", target_ref=V1ObjectReference(kind="Pod", name=f"vllm-{ip}"))


def endpoint_slice(name: str, *endpoints: V1Endpoint, events: bool = True) -> V1EndpointSlice:
    ports = [DiscoveryV1EndpointPort(name="http", port=8000, protocol="TCP")]
    if events:
        ports += [DiscoveryV1EndpointPort(name="kv-events", port=5557), DiscoveryV1EndpointPort(name="kv-replay",
                                                                                                port=5558)]
    return V1EndpointSlice(address_type="IPv4", endpoints=list(endpoints), ports=ports,
                           metadata=V1ObjectMeta(name=name, namespace="default",
                                                 labels={"kubernetes.io/service-name": "vllm"}))


def test_ready_endpoints_become_workers_with_their_named_ports() -> None:
    slices = [endpoint_slice("vllm-abc", endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=None),
                             endpoint("10.0.0.3", ready=False), endpoint("10.0.0.4", ready=False, terminating=True)),
              endpoint_slice("vllm-def", endpoint("10.0.1.1"), events=False)]
    got = workers_from_slices(slices, CFG)
    # Not ready and terminating endpoints are out (a terminating pod leaves: kvgate drains it); a nil
    # ready condition means ready, as the API says.
    assert [w.url for w in got] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.1.1:8000"]
    assert got[0].kv_events == "tcp://10.0.0.1:5557" and got[0].kv_replay == "tcp://10.0.0.1:5558"
    assert got[2].kv_events is None  # no KV-event port: approximate mode
    assert {(w.model, w.engine, w.block_size) for w in got} == {("llama", "vllm", 16)}


def test_a_slice_without_the_http_port_names_no_worker() -> None:
    s = endpoint_slice("other", endpoint("10.0.0.9"))
    s.ports = [DiscoveryV1EndpointPort(name="metrics", port=9090)]
    assert workers_from_slices([s], CFG) == []


def pod(name: str, ip: str | None, ready: str = "True", annotations: dict[str, str] | None = None,
        deleting: bool = False) -> V1Pod:
    ports = [V1ContainerPort(name="http", container_port=8000), V1ContainerPort(name="kv-events", container_port=5557)]
    return V1Pod(metadata=V1ObjectMeta(name=name, namespace="default", annotations=annotations,
                                       deletion_timestamp=datetime.now(UTC) if deleting else None),
                 spec=V1PodSpec(containers=[V1Container(name="vllm", ports=ports)]),
                 status=V1PodStatus(pod_ip=ip, conditions=[V1PodCondition(type="Ready", status=ready)]))


def test_pods_ready_and_annotated_become_workers() -> None:
    cfg = CFG.model_copy(update={"resource": "pods", "label_selector": "app=vllm"})
    pods = [pod("a", "10.0.0.1", annotations={"kvgate.io/model": "qwen3", "kvgate.io/engine": "sglang",
                                             "kvgate.io/block-size": "64"}),
            pod("b", "10.0.0.2"), pod("c", "10.0.0.3", ready="False"), pod("d", None),
            pod("e", "10.0.0.5", deleting=True),
            pod("f", "10.0.0.6", annotations={"kvgate.io/engine": "tgi"})]  # not an engine kvgate knows: left out
    got = workers_from_pods(pods, cfg)
    assert [(w.url, w.model, w.engine, w.block_size) for w in got] == [
        ("http://10.0.0.1:8000", "qwen3", "sglang", 64), ("http://10.0.0.2:8000", "llama", "vllm", 16)]
    assert got[1].kv_events == "tcp://10.0.0.2:5557"
    assert KubernetesSource(cfg).translate(pods) == got


def test_watch_events_keep_the_listed_set_current() -> None:
    objects = {"default/vllm-abc": endpoint_slice("vllm-abc", endpoint("10.0.0.1"))}
    moved = endpoint_slice("vllm-abc", endpoint("10.0.0.1", ready=False, terminating=True), endpoint("10.0.0.7"))
    assert apply_event(objects, "MODIFIED", moved)
    assert apply_event(objects, "ADDED", endpoint_slice("vllm-xyz", endpoint("10.0.2.1")))
    src = KubernetesSource(CFG)
    assert [w.url for w in src.translate(objects.values())] == ["http://10.0.0.7:8000", "http://10.0.2.1:8000"]
    assert apply_event(objects, "DELETED", moved)
    assert [w.url for w in src.translate(objects.values())] == ["http://10.0.2.1:8000"]
    assert not apply_event(objects, "ERROR", moved)  # 410 Gone and the like: relist
