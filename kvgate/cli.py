"""The ``kvgate`` command: ``serve``, ``sim``, ``demo``, ``build-model``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError


def _settings_or_exit(factory: Any, **kw: Any) -> Any:
    try:
        return factory(**{k: v for k, v in kw.items() if v is not None})
    except ValidationError as exc:
        from kvgate.config import format_validation_error

        print(format_validation_error(exc), file=sys.stderr)
        raise SystemExit(2) from None
    except FileNotFoundError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _parse_worker(spec: str) -> dict[str, str]:
    # URL=MODEL[@ENGINE], e.g. http://127.0.0.1:8001=Qwen/Qwen3-8B@vllm
    if "=" not in spec:
        raise argparse.ArgumentTypeError(f"worker must be URL=MODEL[@ENGINE], got {spec!r}")
    url, rest = spec.split("=", 1)
    model, _, engine = rest.partition("@")
    return {"url": url, "model": model, **({"engine": engine} if engine else {})}


async def _serve(args: argparse.Namespace) -> None:
    from kvgate.config import GatewaySettings
    from kvgate.gateway.app import create_app
    from kvgate.serving import start_server

    settings = _settings_or_exit(GatewaySettings, host=args.host, port=args.port, policy=args.policy,
                                 workers=args.worker or None)
    app = create_app(settings)
    gw = app.state.gateway

    def drain() -> None:
        gw.draining = True

    handle = await start_server(app, settings.host, settings.port, graceful_timeout_s=settings.drain_timeout_s,
                                on_drain=drain, install_signal_handlers=True)
    logging.getLogger("kvgate").info("gateway on %s with %d workers", handle.url, len(settings.workers))
    await handle.task


async def _sim(args: argparse.Namespace) -> None:
    from kvgate.config import SimSettings
    from kvgate.serving import start_server
    from kvgate.sim.server import SimWorker

    settings = _settings_or_exit(SimSettings, host=args.host, port=args.port, model=args.model,
                                 profile=args.profile, speed=args.speed, num_blocks=args.num_blocks,
                                 block_size=args.block_size, kv_events_endpoint=args.kv_events,
                                 kv_replay_endpoint=args.kv_replay, model_dir=args.model_dir,
                                 hash_algo=args.hash_algo)
    worker = SimWorker(settings)
    handle = await start_server(worker.build_app(), settings.host, settings.port, install_signal_handlers=True)
    logging.getLogger("kvgate").info("simulated worker %s on %s", settings.model, handle.url)
    await handle.task


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the gateway (config: KVGATE_* env vars, KVGATE_CONFIG yaml)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--policy")
    s.add_argument("--worker", action="append", type=_parse_worker, help="URL=MODEL[@ENGINE], repeatable")

    m = sub.add_parser("sim", help="run one simulated vLLM worker (KVGATE_SIM_* env vars)")
    m.add_argument("--host")
    m.add_argument("--port", type=int)
    m.add_argument("--model")
    m.add_argument("--model-dir")
    m.add_argument("--profile")
    m.add_argument("--speed", type=float)
    m.add_argument("--num-blocks", type=int)
    m.add_argument("--block-size", type=int)
    m.add_argument("--hash-algo")
    m.add_argument("--kv-events", help="ZMQ PUB endpoint, e.g. tcp://*:5557")
    m.add_argument("--kv-replay", help="ZMQ ROUTER replay endpoint, e.g. tcp://*:5558")

    d = sub.add_parser("demo", help="simulated workers + gateway + a scripted agent session")
    d.add_argument("--workers", type=int, default=3)
    d.add_argument("--profile", default="h100-llama3-8b")

    b = sub.add_parser("build-model", help="build the tiny test model (tokenizer, template[, weights])")
    b.add_argument("out", nargs="?")
    b.add_argument("--weights", action="store_true")

    bn = sub.add_parser("bench", help="benchmarks: `kvgate bench mooncake [--quick]`, `kvgate bench swe`, "
                        "`kvgate bench tiering [--quick] [--no-real]`")
    bn.add_argument("which", choices=["mooncake", "swe", "tiering"])
    bn.add_argument("--trace", help="Mooncake trace (default: ../shared/data/mooncake/conversation_trace.jsonl)")
    bn.add_argument("--out", default="bench-out")
    bn.add_argument("--quick", action="store_true", help="first 3000 requests only")
    bn.add_argument("--no-dynamo", action="store_true", help="skip Dynamo's replay")
    bn.add_argument("--no-peers", action="store_true", help="skip the real-process peer routers")
    bn.add_argument("--no-real", action="store_true", help="tiering: skip the real vLLM + LMCache + Redis part")

    dv = sub.add_parser("dev", help="developer tools: `kvgate dev engines up|down|status|install`")
    dv.add_argument("tool", choices=["engines"])
    dv.add_argument("rest", nargs=argparse.REMAINDER)

    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # one line per request drowns everything else
    if args.cmd == "serve":
        asyncio.run(_serve(args))
    elif args.cmd == "sim":
        asyncio.run(_sim(args))
    elif args.cmd == "demo":
        from kvgate.demo import run_demo

        logging.getLogger().setLevel(logging.WARNING)
        asyncio.run(run_demo(args.workers, args.profile))
    elif args.cmd == "bench":
        from pathlib import Path

        from kvgate.bench import mooncake

        if args.which == "swe":
            from kvgate.bench import swe

            swe.run(mooncake.DEFAULT_TRACE.parents[1] / "swe-agent-trajectories", Path(args.out))
        elif args.which == "tiering":
            from kvgate.bench import tiering

            raise SystemExit(tiering.run(Path(args.out), args.quick, real=not args.no_real))
        else:
            mooncake.run(Path(args.trace) if args.trace else mooncake.DEFAULT_TRACE, Path(args.out), args.quick,
                         not args.no_dynamo, not args.no_peers)
    elif args.cmd == "dev":
        from kvgate.dev.engines import cli as engines_cli

        raise SystemExit(engines_cli(args.rest))
    elif args.cmd == "build-model":
        from kvgate.tokens.tinymodel import main as build_main

        build_main(([args.out] if args.out else []) + (["--weights"] if args.weights else []))


if __name__ == "__main__":
    main()
