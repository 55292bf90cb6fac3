"""`kvgate bench upstream`: the proxied request's client alone, CPU per streamed request.

Each of gateway/upstream.py's clients posts a chat body (40 KB, as an agent turn's) and reads its streamed
answer to the end, 16 requests at a time, from a process pinned to one core; the worker is a plain socket
server in another process on the other core that answers each request with SSE events in HTTP chunks, a
millisecond apart (an engine's inter-token gap at a few times an H100's speed). The client's process CPU
time over the requests is what the client costs; nothing else runs in that process. Two answers: 17 events
(a short reply) and 200 (a long one), so the cost per request and per read can be told apart.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import httpx

from kvgate.dev.engines import free_port
from kvgate.gateway.upstream import make_upstream

Client = Literal["httptools", "aiohttp", "httpx"]
CLIENTS: tuple[Client, ...] = ("httptools", "aiohttp", "httpx")
EVENTS = (17, 200)
CONCURRENCY = 16
BODY = json.dumps({"model": "m", "stream": True,
                   "messages": [{"role": "user", "content": "tool output " * 3400}]}).encode()


def _events(n: int) -> list[bytes]:
    delta = [b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                     "choices": [{"index": 0, "delta": {"content": f"tok{i} "}}]}).encode() + b"\n\n"
             for i in range(n - 1)]
    return [b"%x\r\n%s\r\n" % (len(e), e) for e in [*delta, b"data: [DONE]\n\n"]]


async def _serve(port: int) -> None:
    answers = {n: _events(n) for n in EVENTS}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                n = int(head.split(b" ", 2)[1].rsplit(b"/", 1)[1])
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for chunk in answers[n]:
                    writer.write(chunk)
                    await writer.drain()
                    await asyncio.sleep(0.001)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, StopIteration):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    await server.serve_forever()


@dataclass(frozen=True)
class Row:
    client: Client
    events: int
    cpu_ms: float
    """CPU per request, the median of the rounds."""
    rounds_ms: tuple[float, ...]
    per_s: float


async def _measure(client: Client, port: int, events: int, n: int) -> tuple[float, float]:
    async with httpx.AsyncClient() as spare:
        up = make_upstream(client, spare, 3.0, 60.0)
        url = f"http://127.0.0.1:{port}/v1/chat/completions/{events}"
        slots = asyncio.Semaphore(CONCURRENCY)

        async def one() -> None:
            async with slots:
                resp = await up.post(url, BODY, {"content-type": "application/json", "authorization": "Bearer k"})
                async for _ in resp.chunks():
                    pass
                await resp.close()

        await asyncio.gather(*[one() for _ in range(CONCURRENCY * 4)])  # connections open, code warm
        c0, t0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*[one() for _ in range(n)])
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        await up.aclose()
    return cpu * 1000 / n, n / wall


def _pin(pick: Callable[[set[int]], int]) -> set[int] | None:
    """This process on one of its cores (the lowest for the client, the highest for the worker); the cores
    it had, to give back."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        return None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {pick(before)})
    return before


def run(quick: bool = False) -> list[Row]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kvgate.bench.upstream", "--serve", str(port)])
    before = _pin(min)
    rows: list[Row] = []
    try:
        time.sleep(1.0)
        rounds = 1 if quick else 3
        for events in EVENTS:
            n = (200 if quick else 3000) * 17 // events
            got: dict[Client, list[tuple[float, float]]] = {c: [] for c in CLIENTS}
            for _ in range(rounds):  # the clients alternate, so the machine's drift touches each alike
                for client in CLIENTS:
                    got[client].append(asyncio.run(_measure(client, port, events, n)))
                    print(f"  {client}, {events} events: {got[client][-1][0]:.3f} ms", file=sys.stderr)
            for client, xs in got.items():
                cpu = sorted(x[0] for x in xs)
                rows.append(Row(client, events, cpu[len(cpu) // 2], tuple(x[0] for x in xs),
                                sorted(x[1] for x in xs)[len(xs) // 2]))
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
        server.terminate()
        server.wait(timeout=10)
    return rows


def render(rows: list[Row]) -> str:
    lines = ["### The upstream client alone (CPU per streamed request, 40 KB body, 16 at a time)", "",
             "| client | events per answer | CPU per request (ms, median) | rounds (ms) | per event (µs) "
             "| requests/s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.client} | {r.events} | {r.cpu_ms:.3f} | {' / '.join(f'{x:.3f}' for x in r.rounds_ms)} | "
              f"{r.cpu_ms * 1000 / r.events:.1f} | {r.per_s:.0f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(quick: bool = False) -> None:
    print(render(run(quick)))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _pin(max)
        asyncio.run(_serve(int(sys.argv[2])))
