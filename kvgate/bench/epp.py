"""``kvgate bench epp``: the endpoint picker's per-request decision time beside proxy mode's routing time.

One gateway with two simulated vLLM workers (KV events, h100-llama3-8b timing run fast) serves both
fronts. Two cases, each with a ~32k-token prompt:

- known: the next turn of a conversation whose first turn (the 32k-token context) kvgate has recorded,
  so the prompt is tokenized incrementally from the conversation's chain and matched against the
  worker's cache through KV events;
- cold: a new conversation with 32k tokens nobody has seen (full tokenization, no prefix anywhere).

EPP decision time: a real gRPC channel to the picker, exactly Envoy's FULL_DUPLEX_STREAMED sequence
(request headers, the body in 64 KiB chunks, end of stream) until the picker's answer is complete (the
headers response with the pick, then the canonical body back in chunks), i.e. headers+body in ->
response out. The stream is then reset, as Envoy resets it when a client leaves, so nothing is sent or
recorded and every repetition asks about the same known conversation.

Proxy routing time: what kvgate's own proxy spends on the same request before it sends it: parsing the
body, ``Preparer.prepare_body`` (identity, canonical history, tokenization), ``Router.plan`` and
``Router.pick``, in process.

Timings are wall-clock on this machine, single request at a time; run under the heavy-work lock when
the machine is shared.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from kvgate.assembly import Gateway, create_app, make_client
from kvgate.config import GatewaySettings, WorkerConfig
from kvgate.grpc.gen.envoy.config.core.v3 import base_pb2 as core
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvgate.grpc.gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epgrpc
from kvgate.serving import ServerHandle, free_port, start_server
from kvgate.sim.server import SimWorker
from kvgate.sim.settings import SimSettings
from kvgate.tokens.tinymodel import ensure_tiny_model
from kvgate.tokens.tokenizer import ChatTokenizer

MODEL = "kvgate-tiny"
TARGET_TOKENS = 32_000
WORDS = ("cache", "token", "worker", "prefix", "block", "router", "session", "agent", "tool", "result", "engine",
         "latency", "prefill", "decode", "history", "conversation", "gateway", "kernel", "tensor", "request")


def long_text(tok: ChatTokenizer, seed: int, tokens: int = TARGET_TOKENS) -> str:
    """Text of about ``tokens`` tokens (seeded: a different seed shares no prefix)."""
    rng = random.Random(seed)
    words: list[str] = [f"[{seed}]"]
    while True:
        words += [rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(2000)]
        text = " ".join(words)
        if len(tok.encode(text)) >= tokens:
            return text


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def _headers(items: dict[str, str]) -> core.HeaderMap:
    return core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()])


async def epp_decision_ms(stub: Any, body: bytes, conv: str) -> float:
    """Headers + body in (FULL_DUPLEX_STREAMED) -> the picker's complete answer out, ms."""
    hs = {":method": "POST", ":path": "/v1/chat/completions", ":authority": "bench", "content-type": "application/json",
          "content-length": str(len(body)), "x-conversation-id": conv}
    call: Any = stub.Process()
    t0 = time.perf_counter()
    await call.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=_headers(hs))))
    step = 65536
    for i in range(0, len(body), step):
        await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body[i:i + step],
                                                                       end_of_stream=i + step >= len(body))))
    first = await call.read()
    if not first.HasField("request_headers"):
        raise RuntimeError(f"the picker did not pick: {first}")
    while not (await call.read()).request_body.response.body_mutation.streamed_response.end_of_stream:
        pass
    ms = (time.perf_counter() - t0) * 1000
    call.cancel()  # reset, as Envoy does when the client leaves: nothing is sent or recorded
    return ms


async def proxy_routing_ms(gw: Gateway, body: bytes, conv: str) -> float:
    t0 = time.perf_counter()
    p = await gw.proxy.preparer.prepare_body(json.loads(body), {"x-conversation-id": conv}, "chat", act=False)
    plan = await gw.router.plan(p)
    if gw.router.pick(p, plan, set(), observe=False) is None:
        raise RuntimeError("no worker")
    return (time.perf_counter() - t0) * 1000


async def _measure(n: int, fn: Callable[[int], Awaitable[float]]) -> list[float]:
    for i in range(3):  # warm up: connections, caches, the allocator
        await fn(-1 - i)
    return [await fn(i) for i in range(n)]


def _timed(fn: Callable[[Any, bytes, str], Awaitable[float]], target: Any, body_of: Callable[[int], bytes],
           conv_of: Callable[[int], str]) -> Callable[[int], Awaitable[float]]:
    return lambda i: fn(target, body_of(i), conv_of(i))


async def _known_body(gw_url: str, text: str) -> bytes:
    """Record a 32k-token first turn through the proxy; the measured request is the next turn."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": text}]
    async with make_client(600.0) as h:
        r = await h.post(gw_url + "/v1/chat/completions", headers={"x-conversation-id": "bench-known"},
                         json={"model": MODEL, "messages": msgs, "max_tokens": 16})
        r.raise_for_status()
    msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "Now summarise what you found."}]
    return json.dumps({"model": MODEL, "messages": msgs, "max_tokens": 16, "stream": True}).encode()


async def _run(n: int) -> dict[str, dict[str, float]]:
    model_dir = ensure_tiny_model()
    tok = ChatTokenizer(model_dir)
    sims: list[tuple[SimWorker, ServerHandle]] = []
    gw_handle: ServerHandle | None = None
    try:
        for _ in range(2):
            w = SimWorker(SimSettings(model_dir=str(model_dir), profile="h100-llama3-8b", hash_seed="0", speed=50.0,
                                      max_model_len=65536,
                                      kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                                      kv_replay_endpoint=f"tcp://127.0.0.1:{free_port()}"))
            sims.append((w, await start_server(w.build_app())))
        settings = GatewaySettings(
            workers=[WorkerConfig(url=h.url, model=MODEL, engine="sim", block_size=w.profile.block_size,
                                  kv_events="auto") for w, h in sims],
            tokenizers={MODEL: str(model_dir)}, hash_seed="0", epp_port=0, max_body_bytes=16 << 20)
        app = create_app(settings)
        gw_handle = await start_server(app)
        gw: Gateway = app.state.gateway
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc.epp_port}",
                                            options=[("grpc.max_send_message_length", 32 << 20),
                                                     ("grpc.max_receive_message_length", 32 << 20)])
        stub = epgrpc.ExternalProcessorStub(channel)
        known = await _known_body(gw_handle.url, long_text(tok, 1))
        cold_texts = [long_text(tok, 1000 + i) for i in range(4)]

        def cold(i: int) -> bytes:
            text = f"[cold {i}] " + cold_texts[i % len(cold_texts)]  # a new first token: nothing shared
            return json.dumps({"model": MODEL, "stream": True, "max_tokens": 16, "messages": [
                {"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": text}]}).encode()

        async def prompt_tokens(body: bytes, conv: str) -> int:
            p = await gw.proxy.preparer.prepare_body(json.loads(body), {"x-conversation-id": conv}, "chat", act=False)
            return p.prompt.length

        cases: list[tuple[str, Callable[[int], bytes], Callable[[int], str]]] = [
            ("known", lambda i: known, lambda i: "bench-known"), ("cold", cold, lambda i: f"bench-cold-{i}")]
        out: dict[str, dict[str, float]] = {}
        for case, body_of, conv_of in cases:
            epp = await _measure(n, _timed(epp_decision_ms, stub, body_of, conv_of))
            proxy = await _measure(n, _timed(proxy_routing_ms, gw, body_of, conv_of))
            out[case] = {"prompt_tokens": await prompt_tokens(body_of(0), conv_of(0)), "epp_p50": pct(epp, 50),
                         "epp_p99": pct(epp, 99), "proxy_p50": pct(proxy, 50), "proxy_p99": pct(proxy, 99), "n": n}
        await channel.close()
        return out
    finally:
        if gw_handle is not None:
            await gw_handle.stop()
        for _, h in sims:
            await h.stop()


def table(res: dict[str, dict[str, float]]) -> str:
    head = (f"{'case':<8} {'prompt tokens':>13} {'EPP p50 ms':>11} {'EPP p99 ms':>11} "
            f"{'proxy routing p50 ms':>21} {'proxy routing p99 ms':>21} {'n':>4}")
    lines = [head, "-" * len(head)]
    for case, r in res.items():
        lines.append(f"{case:<8} {int(r['prompt_tokens']):>13} {r['epp_p50']:>11.2f} {r['epp_p99']:>11.2f} "
                     f"{r['proxy_p50']:>21.2f} {r['proxy_p99']:>21.2f} {int(r['n']):>4}")
    return "\n".join(lines)


def run(quick: bool = False, out: Path | None = None) -> dict[str, dict[str, float]]:
    res = asyncio.run(_run(10 if quick else 100))
    print("endpoint picker decision time (headers+body in -> answer out, gRPC, FULL_DUPLEX_STREAMED) beside "
          "proxy mode's routing time (parse + prepare + plan + pick, in process), one request at a time\n")
    print(table(res))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "epp.json").write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    run()
