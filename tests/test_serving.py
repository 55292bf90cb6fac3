"""serving.start_server: port 0, TCP_NODELAY on accepted sockets, signal ownership, drain hook."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import httpx
from fastapi import FastAPI

from kvgate.serving import start_server


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict[str, bool]:
        return {"ok": True}

    return app


async def test_port_zero_is_known_before_start_and_accepted_sockets_have_nodelay() -> None:
    h = await start_server(_app(), port=0)
    try:
        assert h.port > 0 and h.url == f"http://127.0.0.1:{h.port}"
        async with httpx.AsyncClient() as c:
            assert (await c.get(h.url + "/ping")).json() == {"ok": True}
            # The connection is kept alive: its server-side socket is still open to look at.
            conns = list(h.server.server_state.connections)
            assert conns
            sock = conns[0].transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        await h.stop()
    assert h.task.done()


async def test_only_the_owning_server_installs_signal_handlers_and_sigterm_drains_it() -> None:
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda sig, frame: seen.append(sig))
    try:
        side = await start_server(_app())
        recorder = signal.getsignal(signal.SIGTERM)
        drained: list[bool] = []
        try:
            main = await start_server(_app(), on_drain=lambda: drained.append(True), install_signal_handlers=True)
            handler = signal.getsignal(signal.SIGTERM)
            assert handler is not recorder and getattr(handler, "__self__", None) is main.server
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(main.task, 10)
            # Drained first; then uvicorn restored the previous handler and passed the signal on to it.
            assert drained == [True] and seen == [signal.SIGTERM]
            assert signal.getsignal(signal.SIGTERM) is recorder
            async with httpx.AsyncClient() as c:  # the server that does not own signals is untouched
                assert (await c.get(side.url + "/ping")).status_code == 200
        finally:
            await side.stop()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_serving_loop_is_chosen_as_uvicorns_loop_option() -> None:
    import uvloop

    from kvgate.serving import loop_factory

    assert loop_factory("auto") is uvloop.new_event_loop  # uvicorn[standard] installs it
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None


def test_kvgate_serve_runs_on_the_chosen_loop() -> None:
    """A served process names its loop in a start-up debug line."""
    import subprocess
    import sys

    from kvgate.supervisor import CHILD_ENV

    # A --workers child keeps asyncio's loop under auto (its accept batch spreads bursts over the children),
    # and so does the simulator (its timing model's sleeps); the default is asyncio. A bad --port ends each run
    # right after the loop is chosen.
    for cmd, loop, child, want in (("serve", None, False, "asyncio"), ("serve", "auto", False, "uvloop"),
                                   ("serve", "uvloop", False, "uvloop"), ("serve", "auto", True, "asyncio"),
                                   ("sim", "auto", False, "asyncio"), ("sim", "uvloop", False, "uvloop")):
        env = {k: v for k, v in os.environ.items() if k != "KVGATE_LOOP"}
        env.update({CHILD_ENV: "not a spec"} if child else {})
        chosen = [] if loop is None else ["--loop", loop]
        out = subprocess.run([sys.executable, "-m", "kvgate.cli", "--log-level", "DEBUG", *chosen, cmd,
                              "--port", "-1"], capture_output=True, text=True, timeout=60, env=env)
        assert f"event loop: {want}" in out.stderr, (cmd, loop, child, out.stderr[-2000:])
