"""The worker pool: configured workers, their health (active checks and passive marking), their load.

Active checks poll ``/health`` and the engine's ``/metrics`` every interval; requests report what they
saw. Both feed each worker's ``HealthTracker`` (``gateway/health.py``: hysteresis, a half-open probation
after an ejection). ``snapshot()`` freezes what the router may read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.admission.capacity import SlotEstimate, foreign, free_slots, learn_slots
from kvgate.clock import Clock
from kvgate.config import WorkerConfig
from kvgate.gateway.enginemetrics import EngineMetrics, parse_metrics
from kvgate.gateway.health import Health, HealthTracker
from kvgate.gateway.inputlimits import context_length
from kvgate.kvstore.health import HealthBoard
from kvgate.router.hashing import HASH_ALGOS, HashSpec
from kvgate.router.load import WorkerLoad
from kvgate.router.types import FleetView, WorkerId, WorkerView
from kvgate.tasks import cancel_and_wait, stopping

log = logging.getLogger(__name__)

# Request failures that prove nothing listens at the worker: ejected at once, no hysteresis.
_HARD_FAILURES = frozenset({"ConnectError"})
_DEPARTED_KEPT = 1024


@dataclass(slots=True)
class WorkerState(WorkerLoad):
    """A worker as the pool knows it: its configuration, its health, what its engine publishes, and the
    requests kvgate sent there (``WorkerLoad``: the queue the router prices, as the simulator keeps it)."""

    config: WorkerConfig
    health: HealthTracker = field(default_factory=HealthTracker)
    joining: bool = False
    """Discovered, not yet health-checked and subscribed: no traffic."""
    draining: bool = False
    """Gone from discovery: no new requests; removed once the ones in flight end."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    last_error: str = ""
    last_check: float = 0.0
    reserved: int = 0
    """KV tokens of sessions parked here on short tool waits (the session controller's reservations)."""
    kv_capacity: int = 0
    """GPU KV capacity in tokens: configured, else ``vllm:cache_config_info`` (blocks x block size)."""
    started_at: float | None = None
    """The worker's ``process_start_time_seconds`` at the last poll."""
    max_model_len: int | None = None
    """Its context length from its /v1/models, read when it first answers and after a restart; 0 when its
    answer does not say (then it is not asked again until it restarts), None until it answered."""
    learned_block_size: int | None = None
    learned_hash_algo: str | None = None
    """The hashing setup the worker publishes (None until seen); it wins over the configured one."""
    slots: SlotEstimate = field(default_factory=SlotEstimate)
    """Requests its engine runs at once, as learned from its counters (``admission/capacity.py``)."""
    configured_slots: int | None = None
    """``admission.worker_slots``: wins over the learned cap."""
    foreign: int = 0
    """Requests on it at the last poll that were not this replica's (other replicas', other clients')."""

    def hash_spec(self, default_seed: str | None) -> HashSpec:
        c = self.config
        algo = self.learned_hash_algo if self.learned_hash_algo in HASH_ALGOS else c.hash_algo
        seed = c.hash_seed if c.hash_seed is not None else default_seed
        return HashSpec.for_engine(c.engine, self.learned_block_size or c.block_size, algo or c.hash_algo, seed)

    @property
    def id(self) -> WorkerId:
        return WorkerId(self.config.id)

    @property
    def cap(self) -> int | None:
        """Requests its engine runs at once: configured, else learned, else unknown."""
        return self.configured_slots or self.slots.cap

    def free_slots(self) -> int | None:
        """What this replica may run on it at once (None: no cap known)."""
        return free_slots(self.cap, self.foreign)

    @property
    def healthy(self) -> bool:
        """Eligible for new requests."""
        return self.health.eligible and not self.joining and not self.draining

    def view(self) -> WorkerView:
        return WorkerView(self.id, self.config.model, self.healthy, self.in_flight, self.running,
                          self.waiting, self.kv_usage, self.pending_prefill, self.pending_requests,
                          self.decode_requests, self.decode_tokens, self.reserved,
                          self.config.kv_capacity_tokens or self.kv_capacity, self.config.node,
                          self.cap or 0, self.foreign, 1000 * self.service_s if self.service_s else 0.0)


class PoolCollector(Collector):
    """The pool's own figures, read at scrape time."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily("kvgate_worker_config_mismatches", "Values a worker published that its "
                                "configuration disagreed with (the worker's value is used).",
                                labels=["worker", "field"])
        for (wid, field_), n in self._pool.mismatches.items():
            c.add_metric([wid, field_], n)
        yield c
        r = CounterMetricFamily("kvgate_worker_restarts", "Worker restarts the health poll detected, by signal: "
                                "process_restarted (process_start_time_seconds moved), readmitted (healthy "
                                "again after being out).", labels=["worker", "signal"])
        for (wid, sig), n in self._pool.restarts.items():
            r.add_metric([wid, sig], n)
        yield r
        yield CounterMetricFamily("kvgate_worker_ejections_learned", "Workers ejected here because another "
                                  "replica ejected them (the shared health board).", value=self._pool.learned_ejections)
        yield CounterMetricFamily("kvgate_worker_timeouts_loop_blamed", "Connect and health-check timeouts not "
                                  "counted against a worker: kvgate's own event loop ran late.",
                                  value=self._pool.loop_blamed)


class WorkerPool:
    def __init__(self, workers: list[WorkerConfig], client: httpx.AsyncClient, clock: Clock,
                 interval_s: float = 5.0, timeout_s: float = 2.0, hash_seed: str | None = None,
                 fall: int = 3, worker_slots: int | None = None) -> None:
        self._fall = fall
        self._slots = worker_slots
        self._workers = {WorkerId(w.id): self._state(w) for w in workers}
        self._seed = hash_seed
        self.mismatches: dict[tuple[WorkerId, str], int] = {}
        """(worker, field) -> times the worker published a value its configuration disagreed with."""
        self.restarts: dict[tuple[WorkerId, str], int] = {}
        """(worker, signal) -> restarts detected by the health poll (process_restarted, readmitted)."""
        self._on_restart: list[Callable[[WorkerId], None]] = []
        self._on_context: list[Callable[[str, int], None]] = []
        self._departed: OrderedDict[WorkerId, WorkerState] = OrderedDict()
        self.blames_loop: Callable[[float], bool] = lambda timeout_s: False
        """Whether a timeout of this many seconds that just fired is kvgate's own late event loop's
        (gateway/looplag.py): then it is no evidence against the worker."""
        self.connect_timeout_s = 3.0
        """The proxied requests' connect timeout (a ``ConnectTimeout`` failure is judged against it)."""
        self.loop_blamed = 0
        """Timeouts not counted against a worker because the loop was late."""
        self.board: HealthBoard | None = None
        """Where ejections are shared with the other replicas (kvstore/health.py); None: not shared."""
        self.replica = uuid.uuid4().hex[:12]
        self._learned: dict[WorkerId, float] = {}
        """Per worker, the newest board entry already applied here."""
        self.learned_ejections = 0
        self._posting: set[asyncio.Task[None]] = set()
        """Workers that left, kept (bounded) so late accounting calls and lookups still find them."""
        self._client = client
        self._clock = clock
        self._interval = interval_s
        self._timeout = timeout_s
        self._task: asyncio.Task[None] | None = None

    def _state(self, config: WorkerConfig) -> WorkerState:
        return WorkerState(config, HealthTracker(self._fall), configured_slots=self._slots)

    def on_restart(self, listener: Callable[[WorkerId], None]) -> None:
        """Call ``listener(worker)`` when a worker restarted or came back after being out, before it is
        eligible for routing again."""
        self._on_restart.append(listener)

    def on_context(self, listener: Callable[[str, int], None]) -> None:
        """Call ``listener(model, max_model_len)`` when a worker's context length is read: a worker that
        was not up when kvgate started, or joined later, still sets its model's prompt limit."""
        self._on_context.append(listener)

    # -- reading -------------------------------------------------------------------------------
    def get(self, wid: WorkerId) -> WorkerState:
        w = self._workers.get(wid) or self._departed.get(wid)
        if w is None:
            raise KeyError(wid)
        return w

    def all(self) -> list[WorkerState]:
        return list(self._workers.values())

    def _members(self) -> list[WorkerState]:
        return [w for w in self._workers.values() if not w.draining]

    def models(self) -> list[str]:
        return sorted({w.config.model for w in self._members()})

    def serves(self, model: str) -> bool:
        return any(w.config.model == model for w in self._members())

    def snapshot(self, model: str) -> FleetView:
        """What the router may read: a draining worker is no longer part of the fleet (its conversations
        pick a new home), a joining one is, but not eligible yet."""
        return FleetView(tuple(w.view() for w in self._members() if w.config.model == model))

    def spec(self, wid: WorkerId) -> HashSpec | None:
        w = self._workers.get(wid)
        return None if w is None else w.hash_spec(self._seed)

    def specs(self, model: str) -> list[HashSpec]:
        """The distinct hash identities among the model's workers (a prompt is hashed once per each)."""
        return list(dict.fromkeys(w.hash_spec(self._seed) for w in self._members() if w.config.model == model))

    def ready(self) -> dict[str, bool]:
        """Per served model: is at least one of its workers healthy?"""
        out: dict[str, bool] = {}
        for w in self._members():
            out[w.config.model] = out.get(w.config.model, False) or w.healthy
        return out

    # -- request accounting (router/load.py: what kvgate sent and what came back) ------------------
    def acquire(self, wid: WorkerId, prefill_tokens: int = 0) -> None:
        self.get(wid).acquire(prefill_tokens)

    def first_token(self, wid: WorkerId, prefill_tokens: int, context_tokens: int) -> None:
        w = self.get(wid)
        self._success(w)
        w.first_token(prefill_tokens, context_tokens)

    def release(self, wid: WorkerId, prefill_tokens: int = 0, context_tokens: int = 0,
                got_first_token: bool = False, held_s: float | None = None) -> None:
        w = self.get(wid)
        w.release(prefill_tokens, context_tokens, got_first_token, held_s)
        if w.draining and w.in_flight == 0:
            self._remove(w)

    def reserve(self, wid: WorkerId, tokens: int) -> None:
        w = self._workers.get(wid)
        if w is not None:
            w.reserved = max(0, w.reserved + tokens)

    def set_reserved(self, totals: dict[WorkerId, int]) -> None:
        """The fleet's reservations (every replica's), as the shared store last answered."""
        for wid, w in self._workers.items():
            w.reserved = totals.get(wid, 0)

    # -- membership ----------------------------------------------------------------------------
    def add(self, config: WorkerConfig) -> WorkerState:
        """A worker joins: part of the fleet, but no traffic until ``admit`` (after its health check and
        its event subscription)."""
        w = self._state(config)
        w.joining = True
        self._workers[w.id] = w
        self._departed.pop(w.id, None)
        return w

    def admit(self, wid: WorkerId) -> None:
        w = self._workers.get(wid)
        if w is not None:
            w.joining = False

    def update(self, config: WorkerConfig) -> None:
        """New settings for a worker kvgate has (same id): its health and accounting are kept."""
        w = self._workers.get(WorkerId(config.id))
        if w is not None:
            w.config = config

    def drain(self, wid: WorkerId) -> None:
        """A worker leaves: no new requests; it is removed once the ones in flight have ended."""
        w = self._workers.get(wid)
        if w is None or w.draining:
            return
        w.draining = True
        log.info("worker %s leaves: draining %d request(s) in flight", wid, w.in_flight)
        if w.in_flight == 0:
            self._remove(w)

    def _remove(self, w: WorkerState) -> None:
        self._workers.pop(w.id, None)
        self._departed[w.id] = w
        while len(self._departed) > _DEPARTED_KEPT:
            self._departed.popitem(last=False)
        log.info("worker %s removed", w.id)

    def mark_failed(self, wid: WorkerId, error: str, kind: str = "") -> None:
        """A request failed at this worker (passive check). ``kind``: the httpx error's class name or the
        proxy's label; a refused connection ejects at once, anything else counts toward ``fall``."""
        w = self._workers.get(wid)
        if w is None or w.draining:
            return
        if kind == "ConnectTimeout" and self.blames_loop(self.connect_timeout_s):
            self.loop_blamed += 1
            log.info("worker %s: connect timeout while kvgate's event loop ran late; not counted", wid)
            return
        self._failure(w, error, hard=kind in _HARD_FAILURES)

    def _failure(self, w: WorkerState, error: str, hard: bool) -> None:
        w.last_error = error
        was = w.health.state
        if w.health.failure(hard):
            log.warning("worker %s ejected (%s, %d failure(s) in a row): %s", w.id,
                        "on probation" if was is Health.PROBATION else "hard failure" if hard else "soft failures",
                        w.health.failures, error)
            self._post(w.id)

    def capacity_tokens(self, wid: WorkerId) -> int:
        """A worker's KV capacity in tokens, as configured or as its engine reports it (0: not known)."""
        w = self._workers.get(wid)
        return (w.config.kv_capacity_tokens or w.kv_capacity) if w is not None else 0

    def _post(self, wid: WorkerId) -> None:
        """Tell the other replicas (off the caller's path: an ejection happens inside a request)."""
        if self.board is None:
            return
        with contextlib.suppress(RuntimeError):  # no running loop (a unit test's pool): nothing to tell
            task = asyncio.get_running_loop().create_task(self.board.ejected(wid, time.time(), self.replica))
            self._posting.add(task)
            task.add_done_callback(self._posting.discard)

    async def learn(self) -> None:
        """Eject here what another replica ejected since this one last looked; this replica's own next check
        then decides (an answering worker comes back on probation)."""
        if self.board is None:
            return
        for wid, (at, by) in (await self.board.read()).items():
            w = self._workers.get(WorkerId(wid))
            if w is None or by == self.replica or at <= self._learned.get(w.id, 0.0):
                continue
            self._learned[w.id] = at
            if w.health.eligible and not w.draining:
                w.health.failure(hard=True)  # up before, so its next good check is probation
                self.learned_ejections += 1
                log.warning("worker %s ejected: replica %s ejected it at %.3f", w.id, by, at)

    def _success(self, w: WorkerState) -> bool:
        """True when the worker is let back after an ejection (it may have restarted meanwhile)."""
        was = w.health.state
        readmitted = w.health.success()
        if was is not w.health.state:
            log.info("worker %s is %s", w.id, w.health.state)
        return readmitted

    # -- active checks -------------------------------------------------------------------------
    async def check(self, w: WorkerState) -> None:
        try:
            r = await self._client.get(f"{w.config.url}/health", timeout=self._timeout)
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TimeoutException) and self.blames_loop(self._timeout):
                self.loop_blamed += 1
            else:
                self._failure(w, f"/health: {exc!r}", hard=type(exc).__name__ in _HARD_FAILURES)
            w.last_check = self._clock.now()
            return
        if r.status_code != 200:
            self._failure(w, f"/health answered {r.status_code}", hard=False)
        else:
            restart = await self._poll_load(w)
            if w.health.state is Health.DOWN and w.health.ever_up:
                restart = restart or "readmitted"
            if restart is not None:
                # Before the worker is eligible again: nothing it held before may be expected there.
                self._restarted(w, restart)
            if w.max_model_len is None or restart is not None:
                await self._read_context(w)
            self._success(w)
            w.last_error = ""
        w.last_check = self._clock.now()

    def _restarted(self, w: WorkerState, signal: str) -> None:
        """The worker's cache may be empty now: whatever kvgate believed it held is dropped (by the
        listeners) before the worker is eligible again."""
        log.warning("worker %s %s: dropping what kvgate knew of its cache", w.id,
                    "restarted" if signal == "process_restarted" else "is back after being out")
        self.restarts[(w.id, signal)] = self.restarts.get((w.id, signal), 0) + 1
        for listener in self._on_restart:
            listener(w.id)

    async def _read_context(self, w: WorkerState) -> None:
        try:
            r = await self._client.get(f"{w.config.url}/v1/models", timeout=self._timeout)
            if r.status_code != 200:
                return  # not ready to say: the next check asks again
            n = context_length(r.json())
        except (httpx.HTTPError, ValueError):
            return  # the limit stays as it was; the next check asks again
        w.max_model_len = n or 0
        if n is not None:
            for listener in self._on_context:
                listener(w.config.model, n)

    async def _poll_load(self, w: WorkerState) -> str | None:
        """Read the worker's /metrics; returns ``process_restarted`` when its process start time moved."""
        try:
            r = await self._client.get(f"{w.config.url}/metrics", timeout=self._timeout)
            if r.status_code != 200:
                return None
            m = parse_metrics(r.text, w.config.engine)
        except (httpx.HTTPError, ValueError):
            return None  # load is advisory; health decides eligibility
        if m.running is not None:
            w.running, w.waiting, w.kv_usage = m.running, m.waiting or 0, m.kv_usage or 0.0
            w.slots = learn_slots(w.slots, w.running, w.waiting, self._clock.now())
            w.foreign = foreign(w.running, w.waiting, w.in_flight)
        if m.num_gpu_blocks and m.kv_block_size:
            w.kv_capacity = m.num_gpu_blocks * m.kv_block_size
        self._learn(w, m)
        before, w.started_at = w.started_at, m.started_at or w.started_at
        return "process_restarted" if before is not None and w.started_at != before else None

    def _learn(self, w: WorkerState, m: EngineMetrics) -> None:
        """Adopt the hashing setup the worker publishes; a configured value that disagrees is a mistake
        in the configuration (the worker is what hashes), so it is logged loudly and counted, once per
        value seen."""
        c = w.config
        for field_, configured, learned in (("block_size", c.block_size, m.hash_block_size),
                                            ("hash_algo", c.hash_algo, m.hash_algo)):
            if learned is None or learned == getattr(w, f"learned_{field_}"):
                continue
            setattr(w, f"learned_{field_}", learned)
            if learned != configured and field_ not in c.model_fields_set:
                # Left at its default, the value was never a claim about this worker: learning it is the
                # normal path (a CPU vLLM or the simulator hashes 128-token blocks), not a mistake.
                log.info("worker %s publishes %s=%s; using it", w.id, field_, learned)
            elif learned != configured:
                self.mismatches[(w.id, field_)] = self.mismatches.get((w.id, field_), 0) + 1
                log.warning("WORKER CONFIG MISMATCH: worker %s publishes %s=%s but kvgate is configured with "
                            "%s; using the worker's value", w.id, field_, learned, configured)
        if m.hash_algo is not None and m.hash_algo not in HASH_ALGOS:
            log.error("worker %s hashes with %r, which kvgate cannot compute: its prefix cache is invisible to "
                      "routing", w.id, m.hash_algo)

    async def check_all(self) -> None:
        # Joining workers are checked by whoever admits them; draining ones need no more checks.
        todo = [w for w in self._workers.values() if not w.joining and not w.draining]
        results = await asyncio.gather(*(self.check(w) for w in todo), return_exceptions=True)
        for w, r in zip(todo, results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                # One worker's odd answer must not stop the checks that bring the others back.
                log.warning("health check of %s failed: %r", w.id, r)
                self._failure(w, repr(r), hard=False)

    async def _loop(self) -> None:
        # The gateway checked every worker and read the board just before starting this: the first round
        # is one interval away (checking again at once would overturn, with one passing /health, what the
        # board said of a worker that answers its checks but fails its requests).
        while not stopping():
            await asyncio.sleep(self._interval)
            await self.check_all()
            try:
                await self.learn()
            except Exception:  # the board is advice: a bad round must not stop the checks
                log.exception("health board")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="worker-health")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
