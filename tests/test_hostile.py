"""Hostile input cannot hurt others (docs/hostile-input.md): malformed JSON of every kind is a 400 at
every entry point, never a 5xx, and the gateway stays healthy."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvgate import safejson
from kvgate.gateway.auth import key_hash
from kvgate.gateway.send import worker_error
from tests.conftest import MODEL

CHAT = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": %s}]}'


def deep_args(n: int) -> bytes:
    args = "[" * n + "]" * n
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "", "tool_calls": [call]},
                                                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
                      ).encode()


HOSTILE: list[tuple[str, bytes]] = [
    ("deep_1000", b"[" * 1000 + b"]" * 1000),
    ("deep_object_200", CHAT % (b'{"a":' * 200 + b"1" + b"}" * 200)),
    ("long_int", b'{"model": "' + MODEL.encode() + b'", "max_tokens": ' + b"9" * 5000 + b', "messages": []}'),
    ("long_float", CHAT.replace(b"}]}", b'}], "temperature": 0.' + b"1" * 500 + b"}") % b'"x"'),
    ("lone_surrogate", CHAT % b'"\\ud800"'),
    ("lone_surrogate_key", b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "\\udfff": 1}]}'),
    ("nan", CHAT.replace(b"}]}", b'}], "temperature": NaN}') % b'"x"'),
    ("infinity", CHAT.replace(b"}]}", b'}], "top_p": -Infinity}') % b'"x"'),
    ("overflow_float", CHAT.replace(b"}]}", b'}], "temperature": 1e999}') % b'"x"'),
    ("invalid_utf8", CHAT % b'"\xff\xfe"'),
]


@pytest.mark.parametrize(("name", "body"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_json_is_400_everywhere(make_cluster: Any, name: str, body: bytes) -> None:
    c = await make_cluster(n=1)
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = await h.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (name, path, r.status_code, r.text[:300])
            assert r.json()["error"]["type"] == "invalid_request_error"
        r = await h.patch("/admin/policy", content=body)
        assert r.status_code == 400, (name, r.status_code, r.text[:300])
        assert (await h.get("/health")).status_code == 200


async def test_deeply_nested_tool_arguments_are_the_clients_text(make_cluster: Any) -> None:
    c = await make_cluster(n=1)
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        r = await h.post("/v1/chat/completions", content=deep_args(5000), headers={"content-type": "application/json"})
        assert r.status_code < 500, r.text[:300]


def test_safejson_limits() -> None:
    assert safejson.loads(b'{"a": [1, 2.5, "\\u00e9"]}') == {"a": [1, 2.5, "é"]}
    for bad in (b"NaN", b"[Infinity]", b'"\\ud800"', b"1" * 101, b"[" * 65 + b"]" * 65, b'"\xff"', b"1e400"):
        with pytest.raises(safejson.JsonRejected):
            safejson.loads(bad)
    assert safejson.loads(b"[" * 64 + b"]" * 64) is not None
    assert safejson.try_loads("[[") == (False, None)


def big_chat(n_bytes: int) -> dict[str, Any]:
    """Many short messages: the shape that cost the event loop most (rendered and tokenized whole)."""
    n = n_bytes // 100
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": ("user", "assistant")[i % 2], "content": "word " * 20} for i in range(n)]}


class HealthProbe:
    """/health polled from another thread (the gateway runs on this test's event loop, so a poller on
    the loop would stall with it and see nothing); the slowest answer while it ran."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.latencies, self._stop = url, [0.0], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        with httpx.Client(base_url=self.url, timeout=60) as h:
            while not self._stop.is_set():
                t = time.perf_counter()
                h.get("/health")
                self.latencies.append(time.perf_counter() - t)
                time.sleep(0.005)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.latencies)


async def test_2mb_prompt_does_not_delay_health_and_is_refused_before_tokenizing(make_cluster: Any) -> None:
    c = await make_cluster(n=1)
    async with httpx.AsyncClient(base_url=c.url, timeout=120) as h:
        assert (await h.get("/health")).status_code == 200
        body = json.dumps(big_chat(2_000_000)).encode()  # encoded before: the client shares the loop
        probe = HealthProbe(c.url)
        r = await h.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        # Off the loop: the probe's last /health may still be waiting for this loop to answer it, and a join
        # here would hold the loop until that request timed out (60 s, and its latency lost).
        worst = await asyncio.to_thread(probe.stop)
    print(f"WORST {worst*1000:.1f} ms")
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "maximum context length is 4096" in err["message"]
    # 2.8-3.0 s before the prompt moved off the loop, 22-106 ms after on 2 shared cores, 599 ms once with a
    # 300 req/s benchmark and another test run on the same cores: a bound between the two that a loaded
    # machine does not cross.
    assert worst < 1.0, f"/health took {worst * 1000:.0f} ms while a 2 MB prompt was handled"
    sim, _ = c.sims[0]
    assert c.gateway.prompt_limits.limit(MODEL) == sim.settings.max_model_len  # learned from /v1/models


async def test_prompt_over_context_by_exact_count_is_refused_by_the_gateway(make_cluster: Any) -> None:
    c = await make_cluster(n=1, hostile={"max_prompt_tokens": 64})
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        # Under the character bound (few characters per token), over the limit once tokenized.
        r = await h.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "a b c d e f g h " * 20}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert "at least" not in r.json()["error"]["message"]  # the exact count
        ok = await h.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text


# Found by the fuzz (tests/test_fuzz.py) or asked for by issue 11; each against a real gateway.

async def test_out_of_range_token_ids_are_a_400_naming_the_id(make_cluster: Any) -> None:
    # Negative ids broke the gateway's own token array (unsigned 32-bit) and reached the catch-all.
    c = await make_cluster(n=1)
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        for prompt, bad in (([853, 593, -5, 261], 2), ([2**32], 0), ([1, 2**40], 1)):
            r = await h.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["code"], err["param"]) == ("invalid_value", f"prompt[{bad}]"), err
        ok = await h.post("/v1/completions", json={"model": MODEL, "prompt": [853, 593, 261], "max_tokens": 2})
        assert ok.status_code == 200, ok.text


async def test_policy_patch_with_infinite_or_huge_decode_coefficient_changes_nothing(make_cluster: Any) -> None:
    c = await make_cluster(n=1)
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        before = (await h.get("/admin/policy")).json()
        for body in (b'{"cost": {"decode_u1_ms": Infinity}}',  # not JSON: refused by the parser
                     b'{"cost": {"decode_u1_ms": 1e999}}',
                     b'{"cost": {"decode_u1_ms": "Infinity", "affinity_bonus_ms": 9}}',
                     b'{"cost": {"decode_u2_ms": -1e9}, "waits": {"reserve_max_s": 1}}'):
            r = await h.patch("/admin/policy", content=body)
            assert r.status_code in (400, 422), (body, r.status_code, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert (await h.get("/admin/policy")).json() == before, body
        assert c.gateway.cost.params.decode_u1_ms == before["cost"]["decode_u1_ms"]


async def test_a_request_the_worker_rejected_leaves_no_conversation(make_cluster: Any) -> None:
    c = await make_cluster(n=1)
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        # The simulated worker (like vLLM) refuses max_tokens beyond its context; the gateway passes it on.
        r = await h.post("/v1/chat/completions", headers={"x-conversation-id": "rejected"}, json={
            "model": MODEL, "max_tokens": 10**6, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400, r.text
        assert (await h.get("/admin/conversations/rejected")).status_code == 404
        ok = await h.post("/v1/chat/completions", headers={"x-conversation-id": "accepted"}, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200, ok.text
        assert (await h.get("/admin/conversations/accepted")).json()["turn_count"] == 1


async def test_an_sglang_workers_error_reaches_the_client_in_openai_shape(make_cluster: Any) -> None:
    # SGLang answers {"object": "error", "message", ...}; passed on unchanged, it was the one 4xx a client of
    # kvgate could get without an "error" object (the fuzz's mixed fleet found it).
    c = await make_cluster(n=1, per_sim=[{"engine": "sglang"}])
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 10**6})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and "context length" in err["message"], err


@pytest.mark.parametrize(("content", "status", "message", "code"), [
    (b'{"error": "Unauthorized"}', 401, "Unauthorized", 401),  # vLLM's --api-key check
    (b"upstream says no", 429, "upstream says no", 429),  # a proxy in front of the worker
    (b"", 404, "The worker answered HTTP 404.", 404),
    (b'{"object": "error", "message": "m", "type": "T", "code": "c"}', 400, "m", "c"),
])
def test_worker_errors_are_put_in_openai_shape(content: bytes, status: int, message: str, code: object) -> None:
    body, media = worker_error(content, status, "text/plain")
    err = json.loads(body)["error"]
    assert (err["message"], err["code"], media) == (message, code, "application/json")
    vllm = b'{"error": {"message": "m", "type": "BadRequestError", "param": null, "code": 400}}'
    assert worker_error(vllm, 400, "application/json") == (vllm, "application/json")


async def test_a_client_gone_mid_body_is_a_disconnect_not_a_validation_gap(make_cluster: Any,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    # Found probing framing by hand (docs/hostile-input.md): a body cut short (or broken chunked framing,
    # which makes the server drop the client) surfaced as Starlette's ClientDisconnect, which the proxy's
    # catch-all logged with a traceback as input that broke preparation.
    import time

    c = await make_cluster(n=1)
    port = int(c.url.rsplit(":", 1)[1])
    _, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{\"model\": ")
    await w.drain()
    w.close()
    await w.wait_closed()
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        deadline = time.monotonic() + 20
        while "kvgate_client_disconnects_total 1.0" not in (await h.get("/metrics")).text:
            assert time.monotonic() < deadline, "the disconnect was never counted"
            await asyncio.sleep(0.05)
        assert (await h.get("/health")).status_code == 200
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text[-2000:]


async def raw_http(port: int, data: bytes) -> bytes:
    """What the gateway answers to ``data`` written as is on a new connection (framing no client would send)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    head = await r.readuntil(b"\r\n\r\n")
    length = next((int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")), 0)
    body = await r.readexactly(length)
    w.close()
    return head + body


@pytest.mark.parametrize(("name", "request_head", "body", "status"), [
    # Refused from the declared length alone, before any of the body is read.
    ("declared", b"content-length: 999999999999\r\n", b"", b"413"),
    # No length declared: counted as it arrives.
    ("chunked", b"transfer-encoding: chunked\r\n", (b"100000\r\n" + b"a" * 0x100000 + b"\r\n") * 9 + b"0\r\n\r\n",
     b"413"),
])
async def test_oversized_bodies_are_413_in_openai_shape_however_framed(make_cluster: Any, name: str,
                                                                       request_head: bytes, body: bytes,
                                                                       status: bytes) -> None:
    c = await make_cluster(n=1)
    port = int(c.url.rsplit(":", 1)[1])
    for path in (b"/v1/chat/completions", b"PATCH /admin/policy"):
        line = b"POST " + path if path.startswith(b"/") else path
        got = await raw_http(port, line + b" HTTP/1.1\r\nhost: x\r\n" + request_head + b"\r\n" + body)
        head, _, payload = got.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == status, got[:300]
        assert json.loads(payload)["error"]["code"] == "request_too_large", (name, path)


def chat_of(n: int) -> bytes:
    """A chat request of exactly ``n`` bytes, padded with JSON whitespace: a prompt that long would be
    refused for the context length (the 400 the attack report took for the body limit's)."""
    core = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
    return core[:-1] + b" " * (n - len(core)) + b"}"


async def in_chunks(data: bytes) -> AsyncIterator[bytes]:
    """No length declared: httpx sends it chunked, and the gateway counts it as it arrives."""
    for i in range(0, len(data), 1000):
        yield data[i:i + 1000]


@pytest.mark.parametrize("framing", ["declared", "chunked"])
async def test_a_body_of_exactly_max_body_bytes_passes_and_one_more_is_413(make_cluster: Any, framing: str) -> None:
    limit = 4096
    c = await make_cluster(n=1, max_body_bytes=limit)
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        for n, status in ((limit, 200), (limit + 1, 413)):
            body = chat_of(n)
            assert len(body) == n
            r = await h.post("/v1/chat/completions", content=body if framing == "declared" else in_chunks(body),
                             headers={"content-type": "application/json"})
            assert r.status_code == status, (n, r.text[:300])
        err = r.json()["error"]
        assert (err["type"], err["code"]) == ("invalid_request_error", "request_too_large")


async def test_an_oversized_credential_is_refused_before_it_is_hashed_or_decoded(make_cluster: Any) -> None:
    c = await make_cluster(n=1, auth={"mode": "api_key", "api_keys": [{"sha256": key_hash("k"), "tenant": "t"}],
                                      "cache_salt_secret": "s" * 32})
    jwt_shaped = "e30." + "a" * (60 * 1024) + ".c2ln"  # over MAX_CREDENTIAL_BYTES, under the header limit
    chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=c.url, timeout=30) as h:
        assert (await h.post("/v1/chat/completions", json=chat, headers={"x-api-key": "k"})).status_code == 200
        for headers in ({"authorization": f"Bearer {jwt_shaped}"}, {"x-api-key": jwt_shaped}):
            r = await h.post("/v1/chat/completions", json=chat, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "credential_too_long", r.text[:300]
        # Over the header limit: refused by the HTTP layer before the gateway sees a request at all.
        r = await h.post("/v1/chat/completions", json=chat, headers={"authorization": "Bearer " + "a" * (512 << 10)})
        assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"
        assert (await h.get("/health")).status_code == 200
