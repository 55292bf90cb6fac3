"""The ``kvgate`` command line: serve, sim, demo, build-model, bench, dev."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError


def _settings_or_exit(factory: Any, **kw: Any) -> Any:
    import yaml
    from pydantic_settings import SettingsError

    from kvgate.config import format_settings_error, format_validation_error

    try:
        return factory(**{k: v for k, v in kw.items() if v is not None})
    except ValidationError as exc:
        print(format_validation_error(exc), file=sys.stderr)
    except SettingsError as exc:
        print(format_settings_error(exc, factory), file=sys.stderr)
    except yaml.YAMLError as exc:
        where = getattr(factory, "config_env_var", "config")
        print(f"invalid configuration: {where}: not valid YAML: {' '.join(str(exc).split())}", file=sys.stderr)
    except FileNotFoundError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
    raise SystemExit(2)


def _cannot_listen(cmd: str, host: str, port: int, exc: OSError) -> NoReturn:
    # One line and exit 2, as a bad setting gets: a port in use is a configuration problem, not a crash
    # (uvicorn logs "[Errno 98] ... address already in use" and exits 1; the traceback told no more).
    print(f"kvgate {cmd}: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
    raise SystemExit(2)


def _check_free(cmd: str, host: str, port: int | None) -> None:
    """The gRPC and ext_proc ports bind inside the app's start-up, where a port in use ends in uvicorn's
    lifespan traceback: tried here first, so it gets the HTTP port's one line."""
    import socket

    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            _cannot_listen(cmd, host, port, exc)


WORKER_SPEC = "URL=MODEL[@ENGINE][,KEY=VALUE...]"


def _parse_worker(spec: str) -> dict[str, str]:
    # e.g. http://127.0.0.1:8001=Qwen/Qwen3-8B@vllm,kv_events=auto: the KEY=VALUE pairs are any other
    # fields of a workers: entry (validated with them), so the command line reaches KV events too.
    head, *pairs = spec.split(",")
    if "=" not in head or any("=" not in p for p in pairs):
        raise argparse.ArgumentTypeError(f"worker must be {WORKER_SPEC}, got {spec!r}")
    url, rest = head.split("=", 1)
    model, _, engine = rest.partition("@")
    extra = dict(p.split("=", 1) for p in pairs)
    return {"url": url, "model": model, **({"engine": engine} if engine else {}), **extra}


async def _serve(args: argparse.Namespace) -> None:
    from kvgate.assembly import create_app
    from kvgate.config import GatewaySettings
    from kvgate.podview import PodView
    from kvgate.serving import freeze_startup_heap, start_server
    from kvgate.settings_cli import overrides
    from kvgate.supervisor import CHILD_ENV, ChildSpec

    # `kvgate epp` is `serve` with the endpoint picker on (port 9002 unless configured).
    epp_port = getattr(args, "epp_port", None)
    if args.cmd == "epp" and epp_port is None and "KVGATE_EPP_PORT" not in os.environ:
        epp_port = EPP_PORT
    given = {**overrides(args, GatewaySettings), "workers": args.worker or None, "epp_port": epp_port}
    settings = _settings_or_exit(GatewaySettings, **given)
    spec = os.environ.pop(CHILD_ENV, None)  # popped: nothing this child starts is a child of its supervisor
    child = ChildSpec.parse(spec) if spec else None
    if child is None and settings.processes > 1:
        raise SystemExit(await _supervise(args, settings))
    if child is not None:
        settings = child.settings(settings)
    if not settings.workers:
        # Warn, not refuse: a gateway started before its workers (or, with discovery, before any joins) is
        # a normal state for an orchestrator; it answers /health, and /ready says 503 until one is healthy.
        logging.getLogger("kvgate").warning(
            "no workers configured: every completion will get 503 no_healthy_worker until one is named "
            "(--worker URL=MODEL[@ENGINE], KVGATE_WORKERS='[{\"url\": ..., \"model\": ...}]' or workers: in "
            "the KVGATE_CONFIG file)")
    if child is None:  # a child's supervisor tried them
        for extra_port in (settings.grpc_port, settings.epp_port):
            _check_free(args.cmd, settings.host, extra_port)
    app = create_app(settings)
    gw = app.state.gateway

    def drain() -> None:
        gw.draining = True

    view = None if child is None else PodView(app, child.index, child.count, child.run_dir)
    try:
        handle = await start_server(view or app, settings.host, settings.port,
                                    graceful_timeout_s=settings.drain_timeout_s, on_drain=drain,
                                    install_signal_handlers=True, limits=settings.hostile.connections,
                                    sock=None if child is None else child.listener(),
                                    accept_batch=None if child is None else SHARED_ACCEPT_BATCH,
                                    shedding=gw.shedding())
    except OSError as exc:
        _cannot_listen(args.cmd, settings.host, settings.port, exc)
    freeze_startup_heap()
    if child is not None and view is not None:
        await _serve_child(child, app, view, handle)
        return
    logging.getLogger("kvgate").info("gateway on %s with %d workers", handle.url, len(settings.workers))
    grpc = app.state.grpc
    if grpc.epp_port is not None:
        logging.getLogger("kvgate").info("endpoint picker (Envoy ext_proc) on port %d", grpc.epp_port)
    if grpc.control_port is not None:
        logging.getLogger("kvgate").info("gRPC control API on port %d", grpc.control_port)
    await handle.task


SHARED_ACCEPT_BATCH = 1
"""Connections a ``--workers`` child accepts per wake-up. asyncio's default takes every queued one at once,
so the first child awake took all 48 of a client's opening connections and the other served none (the
measured N=2 rate equalled N=1's); one at a time, a busy child leaves the next to an idle sibling."""


async def _supervise(args: argparse.Namespace, settings: Any) -> int:
    from kvgate.serving import bind
    from kvgate.supervisor import Supervisor, child_env

    try:
        sock = bind(settings.host, settings.port)
    except OSError as exc:
        _cannot_listen(args.cmd, settings.host, settings.port, exc)
    _check_free(args.cmd, settings.host, settings.grpc_port)
    host, port = sock.getsockname()[:2]
    logging.getLogger("kvgate").info("gateway on %s:%d with %d processes", host, port, settings.processes)
    env = child_env(dict(os.environ), settings.request_log, settings.request_log_key)
    # Drain, then the lifespan's shutdown (gRPC, stores): a child past this is stuck, not draining.
    return await Supervisor(args.argv, sock, settings.processes, settings.drain_timeout_s + 15, env).run()


async def _serve_child(child: Any, app: Any, view: Any, handle: Any) -> None:
    """The rest of a ``--workers`` child's life: its private socket for its siblings (kvgate/podview.py),
    ``up`` to the supervisor, drained when the supervisor is gone."""
    import contextlib
    import signal

    from kvgate.podview import PidTagged, socket_path
    from kvgate.serving import start_unix_server
    from kvgate.supervisor import announce_and_watch

    path = socket_path(child.run_dir, child.index)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by this index's previous process
    private = await start_unix_server(PidTagged(app), path)
    announce_and_watch(child.link(), lambda: handle.server.handle_exit(signal.SIGTERM, None))
    logging.getLogger("kvgate").info("gateway process %d of %d serving (pid %d)", child.index, child.count,
                                     os.getpid())
    try:
        await handle.task
    finally:
        await private.stop()
        await view.aclose()


async def _sim(args: argparse.Namespace) -> None:
    from kvgate.serving import start_server
    from kvgate.sim.server import SimWorker
    from kvgate.sim.settings import SimSettings

    settings = _settings_or_exit(SimSettings, host=args.host, port=args.port, model=args.model,
                                 profile=args.profile, speed=args.speed, num_blocks=args.num_blocks,
                                 block_size=args.block_size, kv_events_endpoint=args.kv_events,
                                 kv_replay_endpoint=args.kv_replay, model_dir=args.model_dir,
                                 hash_algo=args.hash_algo, engine=args.engine,
                                 priority_scheduling=args.priority_scheduling or None)
    worker = SimWorker(settings)
    try:
        handle = await start_server(worker.build_app(), settings.host, settings.port, install_signal_handlers=True)
    except OSError as exc:
        _cannot_listen("sim", settings.host, settings.port, exc)
    logging.getLogger("kvgate").info("simulated worker %s on %s", settings.model, handle.url)
    await handle.task


DESCRIPTION = """\
kvgate: a session-aware gateway for LLM agents in front of vLLM / SGLang workers.

It maps each conversation to its KV blocks, routes every request to the worker where its prefix is
cached (KV events over ZMQ, a TTFT cost model), keeps the history byte-stable per model protocol and
tiers KV (GPU, CPU, Redis via LMCache) while tools run. OpenAI-compatible: point any client at it."""

EPILOG = """\
configuration: `kvgate serve` reads KVGATE_* environment variables and the YAML file KVGATE_CONFIG
names (precedence: command line > environment > YAML > defaults); `kvgate sim` reads KVGATE_SIM_* and
KVGATE_SIM_CONFIG. Bad values stop start-up with one line per field and exit code 2.

examples:
  kvgate sim --port 8101 &
  kvgate serve --worker http://127.0.0.1:8101=kvgate-tiny@sim
  kvgate demo
more: README.md (Configuration, API, Deploy) and `kvgate <command> --help`."""


def _default(model: Any, name: str) -> str:
    """The settings model's default for ``name`` and the variable that overrides it, for help texts."""
    field = model.model_fields[name]
    value = field.get_default(call_default_factory=True)
    prefix = str(model.model_config.get("env_prefix", ""))
    shown = "none" if value is None or value == [] else value
    return f"default: {shown}; env {prefix.upper()}{name.upper()}"


EPP_PORT = 9002
"""The endpoint picker's port when nothing sets it (the Gateway API Inference Extension's convention)."""


def _serve_parser(sub: Any, name: str = "serve") -> None:
    from typing import get_args

    from kvgate.config import EngineKind, GatewaySettings
    from kvgate.serving import LOOPS
    from kvgate.settings_cli import add_options

    g = GatewaySettings
    if name == "epp":
        s = sub.add_parser("epp", help="run the gateway as an Envoy endpoint picker (Gateway API Inference Extension)",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Run the gateway as the endpoint picker of an inference gateway: Envoy's "
                           "ext_proc v3 on\nEPP_PORT (default 9002) picks each request's worker; the HTTP port "
                           "keeps /health, /ready,\n/metrics, /admin/* (and the OpenAI API). docs/epp.md.")
    else:
        s = sub.add_parser("serve", help="run the gateway", formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Run the gateway: one process (--workers N: N), OpenAI-compatible API on "
                           "HOST:PORT,\n/health, /ready, /metrics and /admin/*. Every setting is an option below, a "
                           "KVGATE_* variable\nand a key of the KVGATE_CONFIG file (README: Configuration).")
    s.add_argument("--worker", action="append", type=_parse_worker, metavar=WORKER_SPEC,
                   help="a worker, repeatable, e.g. http://10.0.0.5:8000=Qwen/Qwen3-8B@vllm,kv_events=auto; ENGINE "
                   f"is one of {', '.join(get_args(EngineKind))} (default vllm); KEY=VALUE: any field of a workers: "
                   "entry (kv_events=auto|tcp://HOST:PORT, block_size, hash_algo, id, ...; block size and hash "
                   "algorithm are learned from the worker's /metrics when it publishes them); given here, replaces "
                   "KVGATE_WORKERS and the YAML list")
    # Also after the command: the image's ENTRYPOINT is `kvgate serve`, so the chart's args come after it.
    # SUPPRESS: left out, the value given before the command (or its default) stands.
    s.add_argument("--log-level", default=argparse.SUPPRESS, type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level, as before the command "
                   "(default: INFO)")
    s.add_argument("--loop", default=argparse.SUPPRESS, choices=LOOPS, help="the event loop, as before the "
                   "command (default: asyncio)")
    s.add_argument("--workers", "--processes", dest="processes", type=int, metavar="N",
                   help="gateway processes on the one port, like uvicorn's and gunicorn's --workers (not the "
                   "inference workers: --worker); above 1 needs session_store: redis, docs/operations.md "
                   f"({_default(g, 'processes')})")
    add_options(s, g, skip=frozenset({"workers", "processes"}),
                defaults={"epp_port": f"{EPP_PORT} for kvgate epp"} if name == "epp" else None)


def _sim_parser(sub: Any) -> None:
    from kvgate.sim.settings import SimSettings
    from kvgate.sim.timing import PROFILES

    m = SimSettings
    p = sub.add_parser("sim", help="run one simulated vLLM or SGLang worker",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run one simulated vLLM or SGLang worker: the engine's API, block hashes, KV "
                       "events and\ncached-token accounting, with timing from a profile. Settings: these options, "
                       "KVGATE_SIM_* or KVGATE_SIM_CONFIG.")
    p.add_argument("--engine", choices=["vllm", "sglang"], help="whose wire formats and prefix cache to imitate "
                   f"({_default(m, 'engine')})")
    p.add_argument("--priority-scheduling", action="store_true", help="honour request priorities, as vLLM's "
                   "--scheduling-policy priority or SGLang's --enable-priority-scheduling "
                   f"({_default(m, 'priority_scheduling')})")
    p.add_argument("--host", help=f"listen address ({_default(m, 'host')})")
    p.add_argument("--port", type=int, help=f"listen port, 0 picks a free one ({_default(m, 'port')})")
    p.add_argument("--model", help=f"served model name ({_default(m, 'model')})")
    p.add_argument("--model-dir", metavar="DIR", help="tokenizer + chat template directory (default: the tiny "
                   "model, built on first use; env KVGATE_SIM_MODEL_DIR)")
    p.add_argument("--profile", choices=sorted(PROFILES), help=f"timing profile ({_default(m, 'profile')})")
    p.add_argument("--speed", type=float, help=f"run the timing model this many times faster ({_default(m, 'speed')})")
    p.add_argument("--num-blocks", type=int, metavar="N", help="KV blocks (default: the profile's; env "
                   "KVGATE_SIM_NUM_BLOCKS)")
    p.add_argument("--block-size", type=int, metavar="TOKENS", help="tokens per KV block (default: the profile's, "
                   "cpu-tiny 128; env KVGATE_SIM_BLOCK_SIZE)")
    p.add_argument("--hash-algo", choices=["sha256", "sha256_cbor"], help=f"block hash, as vLLM's "
                   f"--prefix-caching-hash-algo ({_default(m, 'hash_algo')})")
    p.add_argument("--kv-events", metavar="ENDPOINT", help="publish KV events on this ZMQ PUB endpoint, e.g. "
                   "tcp://*:5557 (default: none; env KVGATE_SIM_KV_EVENTS_ENDPOINT)")
    p.add_argument("--kv-replay", metavar="ENDPOINT", help="serve event replay on this ZMQ ROUTER endpoint, e.g. "
                   "tcp://*:5558 (default: none; env KVGATE_SIM_KV_REPLAY_ENDPOINT)")


def _tune(args: argparse.Namespace) -> None:
    from kvgate.tune.log import LogError
    from kvgate.tune.report import parse_grid, tune

    try:
        text, _ = tune(args.log, profile=args.profile, speed=args.speed, hidden_tokens=args.hidden_tokens,
                       model=args.model, candidates=args.candidate,
                       grid=parse_grid(args.grid) or None, sweep=args.sweep, objective=args.objective)
    except (LogError, ValueError, OSError) as exc:
        print(f"kvgate tune: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(text)


def _global_options(ap: argparse.ArgumentParser) -> None:
    """The options given before the command."""
    from kvgate.serving import LOOPS

    ap.add_argument("--log-level", default="INFO", type=str.upper,
                    choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level (default: INFO)")
    # asyncio by default: uvloop measured no different in kvgate's CPU per request (docs/routing.md), and
    # every recorded figure is asyncio's.
    ap.add_argument("--loop", default=os.environ.get("KVGATE_LOOP", "asyncio"), choices=LOOPS,
                    help="serve, epp and sim: the event loop, as uvicorn's --loop: asyncio, uvloop, or auto (uvloop "
                    "if installed, except for sim and --workers children) (default: asyncio; env KVGATE_LOOP)")


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvgate", description=DESCRIPTION, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _global_options(ap)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")
    _serve_parser(sub)
    _serve_parser(sub, "epp")
    _sim_parser(sub)
    from kvgate.grpc.ctl import add_parser as ctl_parser

    ctl_parser(sub)

    d = sub.add_parser("demo", help="3 simulated workers + the gateway + a scripted agent session (no GPU)")
    d.add_argument("--workers", type=int, default=3, help="simulated workers (default: 3)")
    d.add_argument("--profile", default="h100-llama3-8b", help="their timing profile (default: h100-llama3-8b)")
    d.add_argument("--agents", type=int, default=3, help="agents at once (default: 3)")
    d.add_argument("--tool-s", type=float, default=0.0, metavar="S", help="how long the agents' tools run: each "
                   "tool step waits up to twice this (default: 0)")
    d.add_argument("--request-log", metavar="PATH", help="the gateway writes its request log there, for "
                   "`kvgate tune PATH`")

    b = sub.add_parser("build-model", help="build the tiny test model (tokenizer, template[, weights])")
    b.add_argument("out", nargs="?", help="output directory (default: ~/.cache/kvgate/tiny-model-v1)")
    b.add_argument("--weights", action="store_true", help="also random weights (needs torch)")

    bn = sub.add_parser("bench", help="benchmarks from a source checkout: mooncake, swe, tiering, stores, overhead, "
                        "tracing, epp, tenants, hostile, regroup, kvevents, upstream")
    bn.add_argument("which", choices=["mooncake", "swe", "tiering", "stores", "overhead", "tracing", "epp", "tenants",
                                          "hostile", "regroup", "kvevents", "upstream"])
    bn.add_argument("--trace", help="Mooncake-format trace, .jsonl or .jsonl.gz "
                    "(default: data/mooncake/conversation_trace.jsonl.gz)")
    bn.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    bn.add_argument("--quick", action="store_true", help="a smoke run (mooncake: first 3000 requests)")
    bn.add_argument("--no-dynamo", action="store_true", help="skip Dynamo's replay")
    bn.add_argument("--no-peers", action="store_true", help="skip the real-process peer routers")
    bn.add_argument("--no-real", action="store_true", help="tiering: skip the real vLLM + LMCache + Redis part")
    bn.add_argument("--loadgen", choices=["aiperf"], help="overhead: drive the routers with this outside load "
                    "generator (installed into its own venv on first use) instead of the paired client")
    bn.add_argument("--tiered", action="store_true", help="mooncake: only kvgate precise and the tiered fleet's rows "
                    "(round robin + shared pool, Dynamo tier credits, kvgate with tiers, GPU and GPU + CPU bounds)")
    bn.add_argument("--choose", action="store_true", help="mooncake: the cost-model weight sweep on the first half "
                    "of the conversation trace (the only traffic weights are chosen on)")
    bn.add_argument("--loads", choices=["sync", "async"], default="sync", help="mooncake, tiering: how the simulated "
                    "engines wait for tier loads: sync (LMCache's default) or async (LMCache enable_async_loading)")
    bn.add_argument("--only", default="", help="mooncake: only the tables whose title contains every "
                    "comma-separated part (e.g. 'agentic,4 workers')")

    t = sub.add_parser("tune", help="replay a request log with candidate settings, in virtual time",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Replay a gateway's request log (KVGATE_REQUEST_LOG) through kvgate's router and "
                       "session controller\non simulated workers in virtual time, with the current settings (from "
                       "the log) and with\neach candidate; print reuse, TTFT, recomputed tokens, prefill waste and "
                       "KV parked\nper candidate, the replay's fidelity, and the PATCH /admin/policy that applies "
                       "the best.")
    t.add_argument("log", nargs="+", type=Path, help="request log file(s): the log and its rotated backups")
    t.add_argument("--profile", default="h100-llama3-8b", help="the workers' timing profile (default: "
                   "h100-llama3-8b; kvgate sim --help lists them)")
    t.add_argument("--speed", type=float, default=1.0, help="the workers ran the profile this many times faster "
                   "(simulated workers started with --speed; default: 1)")
    t.add_argument("--hidden-tokens", type=int, default=0, metavar="N", help="output tokens the workers' reasoning "
                   "parser hides before the first visible output (Qwen3's <think> and newline: 2; default 0), so "
                   "the replay's TTFT is the gateway's")
    t.add_argument("--model", help="the model whose traffic to replay (default: the busiest)")
    t.add_argument("--candidate", action="append", default=[], metavar="SECTION.FIELD=VALUE[,...]",
                   help="a candidate, repeatable, e.g. waits.reserve_max_s=2,cost.backlog_weight=0.5 (sections: "
                   "cost, waits, prefill; and cpu_tier_ttl_s)")
    t.add_argument("--sweep", action="store_true", help="also search a small grid (reservation threshold x home "
                   "charge [x prefill continuation threshold])")
    t.add_argument("--grid", action="append", default=[], metavar="SECTION.FIELD=V1,V2,...",
                   help="search this grid instead (repeatable: the product of all)")
    t.add_argument("--objective", default="ttft_mean", choices=["ttft_mean", "ttft_p50", "ttft_p99", "reuse",
                                                                "recomputed"], help="what best means")

    dv = sub.add_parser("dev", help="developer tools from a source checkout: `kvgate dev engines "
                        "up|down|status|install`")
    dv.add_argument("tool", choices=["engines"])
    dv.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def _bench(args: argparse.Namespace) -> None:
    """`kvgate bench WHICH`: each benchmark imported only when it runs (they pull in plotting and trace data)."""
    from kvgate.bench import mooncake
    from kvgate.bench.data import SWE_TRAJECTORIES

    if args.which == "overhead":
        if args.loadgen:
            from kvgate.bench import loadgen

            loadgen.run(Path(args.out), args.quick)
        else:
            from kvgate.bench import overhead

            overhead.run(Path(args.out), args.quick)
    elif args.which == "tracing":
        from kvgate.bench import tracing

        print(asyncio.run(tracing.run(rounds=2 if args.quick else 5)))
    elif args.which == "stores":
        from kvgate.bench import stores

        stores.run()
    elif args.which == "tenants":
        from kvgate.bench import tenants

        tenants.run_bench(quick=args.quick, out=Path(args.out))
    elif args.which == "hostile":
        from kvgate.bench import hostile

        print(hostile.run(Path(args.out) / "hostile"))
    elif args.which == "epp":
        from kvgate.bench import epp

        epp.run(quick=args.quick, out=Path(args.out))
    elif args.which == "swe":
        from kvgate.bench import swe

        swe.run(SWE_TRAJECTORIES, Path(args.out))
    elif args.which == "kvevents":
        from kvgate.bench import kvevents

        kvevents.main(quick=args.quick)
    elif args.which == "upstream":
        from kvgate.bench import upstream

        upstream.main(quick=args.quick)
    elif args.which == "regroup":
        from kvgate.bench import regroup

        asyncio.run(regroup.main())
    elif args.which == "tiering":
        from kvgate.bench import tiering

        raise SystemExit(tiering.run(Path(args.out), args.quick, real=not args.no_real, loads=args.loads))
    elif args.choose:
        from kvgate.bench import choose

        print(choose.run(Path(args.trace) if args.trace else mooncake.DEFAULT_TRACE))
    else:
        raise SystemExit(mooncake.run(Path(args.trace) if args.trace else mooncake.DEFAULT_TRACE, Path(args.out),
                                      args.quick, not args.no_dynamo, not args.no_peers, tiered_only=args.tiered,
                                      only=args.only, loads=args.loads))



def _run_served(args: argparse.Namespace) -> None:
    """``serve``, ``epp`` or ``sim`` on the event loop ``--loop`` chooses."""
    from kvgate.serving import loop_factory
    from kvgate.supervisor import CHILD_ENV

    # auto stays on asyncio for two kinds of process. A --workers child shares its supervisor's listening
    # socket and takes a few connections per wake-up (SHARED_ACCEPT_BATCH), so a burst spreads over
    # the children; uvloop (libuv) accepts until the queue is empty whatever the backlog, which would
    # hand the burst to the first child awake. The simulator's timing model sleeps for steps of about a
    # millisecond: asyncio rounds those up to its clock's millisecond, libuv truncates (2.4 ms sleeps
    # 2.2), and its calibration and every recorded run are asyncio's.
    keep = args.cmd == "sim" or CHILD_ENV in os.environ
    loop = "asyncio" if args.loop == "auto" and keep else args.loop
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        running = type(runner.get_loop()).__module__
        logging.getLogger("kvgate").debug("event loop: %s", "uvloop" if running.startswith("uvloop") else "asyncio")
        runner.run(_sim(args) if args.cmd == "sim" else _serve(args))

def main(argv: Sequence[str] | None = None) -> None:
    ap = _build_parser()
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a --workers supervisor gives its children the same
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)  # one line per request drowns everything else
    if args.cmd == "ctl":
        from kvgate.grpc.ctl import run as ctl_run

        raise SystemExit(ctl_run(args))
    if args.cmd in ("serve", "epp", "sim"):
        try:
            _run_served(args)
        except KeyboardInterrupt:
            # Ctrl-C: the server has drained and stopped; uvicorn passes the signal on once it is done, and a
            # traceback would only hide that this is a clean stop (uvicorn.run swallows it likewise).
            raise SystemExit(130) from None
    elif args.cmd == "demo":
        from kvgate.demo import run_demo

        logging.getLogger().setLevel(logging.WARNING)
        asyncio.run(run_demo(args.workers, args.profile, agents=args.agents, request_log=args.request_log,
                             tool_s=args.tool_s))
    elif args.cmd == "bench":
        _bench(args)
    elif args.cmd == "tune":
        _tune(args)
    elif args.cmd == "dev":
        from kvgate.dev.engines import cli as engines_cli

        raise SystemExit(engines_cli(args.rest))
    elif args.cmd == "build-model":
        from kvgate.tokens.tinymodel import main as build_main

        build_main(([args.out] if args.out else []) + (["--weights"] if args.weights else []))


if __name__ == "__main__":
    main()
