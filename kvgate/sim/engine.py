"""The simulated engine's core: vLLM v1-style continuous batching over a paged prefix cache — vLLM's block
pool or SGLang's radix tree, chosen by the ``EngineKind`` (``kinds.py``).

No clocks and no I/O: ``schedule()`` plans one step and says how long it takes, ``finish_step()``
applies it and returns the tokens it produced. A driver (real time in ``runner.py``, virtual time in
the benchmarks) decides when steps happen.

Per request, ``num_computed`` tokens have KV. A step computes ``num_new`` more; when the request's
KV then covers every known token (prompt plus generated), the step emits one new token. Prefill,
chunked prefill, decode and recompute after preemption are all this one rule.

Tier loads (LMCache's CPU tier or a shared pool, ``tiers.EngineTiers``) come in two modes:

- synchronous (LMCache's default, ``enable_async_loading: false``): the connector retrieves the KV
  before the forward pass of the step that admits the request, so that step — and every request
  in it — waits for the load;
- asynchronous (``EngineTiers.async_loads``; LMCache's ``async_loading`` with vLLM's
  ``get_num_new_matched_tokens`` returning ``load_kv_async=True``): the request's blocks are allocated,
  it waits in ``WAITING_FOR_REMOTE_KVS`` (here ``Status.LOADING``) without being scheduled or taking
  token budget, its loaded blocks join the prefix cache only when the load ends (vLLM's
  ``delay_cache_blocks``), and it is scheduled from the step after the worker reports it in
  ``finished_recving``. Meanwhile the other requests keep stepping; the loads of one engine queue on
  its transfer channel (``transfer.py``).

SGLang's HiCache host-tier load-back (``hicache.py``) stays in the step either way: SGLang overlaps it
layer by layer with that step's forward (its HiCache design doc, "Compute-Transfer Overlap"), which
neither mode models exactly.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from kvgate.router.hashing import BlockHash, BlockHasher
from kvgate.sim.blockpool import KVEvent
from kvgate.sim.kinds import KINDS, VLLM, EngineKind, PrefixPool, make_hasher
from kvgate.sim.tiers import EngineTiers
from kvgate.sim.timing import TimingProfile
from kvgate.sim.transfer import TransferChannel


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    """Admitted, blocks allocated, waiting for an asynchronous tier load (vLLM's WAITING_FOR_REMOTE_KVS)."""
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class SimRequest:
    id: str
    prompt: list[int]
    output: list[int]
    """The scripted completion; its length is the number of tokens that will be generated."""
    cache_salt: str | None = None
    arrival: float = 0.0
    status: Status = Status.WAITING
    num_computed: int = 0
    generated: int = 0
    num_cached_tokens: int = -1
    """Prefix-cache hit at first admission (vLLM's ``num_cached_tokens``); -1 until admitted."""
    blocks: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0
    """Blocks committed to the prefix cache (findable by other requests)."""
    num_stored_blocks: int = 0
    """Blocks whose KV the tiers have (stored by this request, or loaded from them, or a GPU hit)."""
    first_token_time: float | None = None
    finish_time: float | None = None
    background: bool = False
    """A background prefill: scheduled only when no foreground request is prefilling (vLLM's priority
    scheduling with the lowest priority; kvgate also sends it only to an idle queue)."""
    external_tokens: int = 0
    """Tokens loaded from the CPU or remote tier at admission (vLLM's external_kv_transfer)."""

    @property
    def known_len(self) -> int:
        return len(self.prompt) + self.generated

    def token(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:] + self.output[: end - p]


@dataclass(frozen=True, slots=True)
class Scheduled:
    request: SimRequest
    num_new: int
    context: int
    """Tokens already in KV before this chunk (the attention term)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    scheduled: tuple[Scheduled, ...]
    duration_ms: float


@dataclass(frozen=True, slots=True)
class TokenOutput:
    request: SimRequest
    token_id: int
    finished: bool


@dataclass(slots=True)
class EngineStats:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    computed_prefill_tokens: int = 0
    external_tokens: int = 0
    loaded_cpu_tokens: int = 0
    loaded_remote_tokens: int = 0
    load_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class _TierHit:
    tokens: int
    ms: float
    keys: list[BlockHash]
    cpu_tokens: int
    remote_tokens: int


_NO_HIT = _TierHit(0, 0.0, [], 0, 0)


class EngineCore:
    def __init__(self, profile: TimingProfile, hasher: BlockHasher, num_blocks: int | None = None,
                 tiers: EngineTiers | None = None, background_chunk: int = 2048, kind: EngineKind = VLLM,
                 pool: PrefixPool | None = None) -> None:
        if hasher.block_size != profile.block_size:
            raise ValueError("hasher and profile disagree on block size")
        if tiers is not None and tiers.chunk_tokens % profile.block_size:
            raise ValueError("the tier chunk must be a whole number of blocks")
        self.profile = profile
        self.hasher = hasher
        self.block_size = profile.block_size
        self.kind = kind
        if pool is not None and pool.block_size != profile.block_size:
            raise ValueError("pool and profile disagree on block size")
        self.pool = pool or kind.make_pool(num_blocks or profile.num_blocks, profile.block_size)
        self.tiers = tiers
        self.background_chunk = background_chunk
        self.waiting: deque[SimRequest] = deque()
        self.waiting_bg: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = EngineStats()
        self._stats = (0, 0)
        self._step_open = False
        """A planned step has not finished: its events are not published yet."""
        self._by_id: dict[str, SimRequest] = {}
        self.channel: TransferChannel[SimRequest] = TransferChannel()
        """Asynchronous tier loads in flight (empty in the synchronous mode)."""
        self._async_loads = tiers is not None and tiers.async_loads

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        if not req.output:
            raise ValueError("a request must generate at least one token")
        if req.id in self._by_id:
            raise ValueError(f"duplicate request id {req.id}")
        self._by_id[req.id] = req
        (self.waiting_bg if req.background else self.waiting).append(req)
        self.stats.prompt_tokens += len(req.prompt)

    def abort(self, req_id: str) -> bool:
        req = self._by_id.pop(req_id, None)
        if req is None:
            return False
        if req.status is Status.WAITING:
            (self.waiting_bg if req.background else self.waiting).remove(req)
        elif req.status in (Status.RUNNING, Status.LOADING):
            if req.status is Status.RUNNING:
                self.running.remove(req)
            else:
                self.channel.cancel(req)
            self.pool.free(req.blocks)
            req.blocks = []
        req.status = Status.ABORTED
        return True

    @property
    def num_running(self) -> int:
        return len(self.running)

    def step_stats(self) -> tuple[int, int]:
        """(running, waiting) as vLLM publishes them: counted when the last step was scheduled, so a waiting
        request is one that step could not fit (a request that arrived since is not counted yet); (0, 0)
        once there is nothing to run."""
        return self._stats if self.has_work() else (0, 0)

    @property
    def num_waiting(self) -> int:
        """Loading requests count as waiting, as vLLM counts WAITING_FOR_REMOTE_KVS."""
        return len(self.waiting) + len(self.waiting_bg) + len(self.channel)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.waiting_bg or self.channel)

    def take_events(self) -> list[KVEvent]:
        """What the engine has published. vLLM publishes a step's KV events (blocks committed and evicted
        when it was scheduled) after the step, with its outputs (``update_from_output``): while a
        scheduled step runs, nothing."""
        return [] if self._step_open else self.pool.take_events()

    # -- hashing -------------------------------------------------------------------------------
    def _ensure_hashes(self, req: SimRequest, n_blocks: int) -> None:
        have = len(req.hashes)
        if n_blocks <= have:
            return
        bs = self.block_size
        req.hashes.extend(
            self.hasher.block_hashes(
                req.tokens(have * bs, n_blocks * bs),
                parent=req.hashes[-1] if req.hashes else None,
                cache_salt=req.cache_salt,
                start_block=have,
            )
        )

    # -- scheduling ----------------------------------------------------------------------------
    def _blocks_needed(self, req: SimRequest, upto_tokens: int) -> int:
        return -(-upto_tokens // self.block_size) - len(req.blocks)

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.num_stored_blocks = 0
        req.status = Status.WAITING
        (self.waiting_bg if req.background else self.waiting).appendleft(req)
        self.stats.preemptions += 1

    def _victim(self) -> SimRequest:
        """LIFO, background prefills first."""
        for r in reversed(self.running):
            if r.background:
                return r
        return self.running[-1]

    def _foreground_prefilling(self) -> bool:
        return bool(self.waiting) or any(not r.background and r.known_len - r.num_computed > 1 for r in self.running)

    def schedule(self) -> StepPlan:
        budget = self.profile.max_num_batched_tokens
        out: list[Scheduled] = []
        fg_prefill = self._foreground_prefilling()
        budget = self._schedule_running(budget, out, fg_prefill)
        load_ms = self._admit_waiting(budget, out, fg_prefill)
        self._stats = (len(self.running), self.num_waiting)
        self._step_open = bool(out)
        if not out and self.channel:
            # Only loads are in progress: vLLM's engine keeps stepping empty batches to poll the connector
            # for finished_recving; a poll as long as a one-request decode step lets an arrival meanwhile
            # start about when it would on a decoding engine.
            return StepPlan((), min(self.channel.head_ms(), self.profile.decode_ms(1, 1)))
        chunks = []
        dec_batch = 0
        dec_ctx = 0
        for s in out:
            if s.num_new == 1 and s.request.generated > 0:
                dec_batch += 1
                dec_ctx += s.context + 1
            else:
                chunks.append((s.num_new, s.context))
        # A tier load is synchronous here: the step that admits the request waits for its KV.
        return StepPlan(tuple(out), self.profile.step_ms(chunks, dec_batch, dec_ctx) + load_ms)

    def _schedule_running(self, budget: int, out: list[Scheduled], fg_prefill: bool) -> int:
        """Running requests first, in admission order; preempt from the back (LIFO) when out of blocks.
        Returns the token budget left."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.background and fg_prefill:
                i += 1
                continue
            num_new = min(budget, req.known_len - req.num_computed,
                          self.background_chunk if req.background else budget)
            need = self._blocks_needed(req, req.num_computed + num_new)
            preempted_self = False
            while need > 0 and self.pool.num_free < need:
                victim = self._victim()
                self._preempt(victim)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break
            if need > 0:
                got = self.pool.allocate(need)
                assert got is not None, "free count was checked"
                req.blocks.extend(got)
            out.append(Scheduled(req, num_new, req.num_computed))
            self._committed_when_scheduled(req, req.num_computed + num_new)
            budget -= num_new
            i += 1
        return budget

    def _admit_waiting(self, budget: int, out: list[Scheduled], fg_prefill: bool) -> float:
        """Then waiting requests, FCFS, while there is budget, room and memory; background prefills only
        when no foreground request waits or prefills. Returns the ms the step waits for tier loads."""
        load_ms = 0.0
        while budget > 0 and len(self.running) + len(self.channel) < self.profile.max_num_seqs:
            if self.waiting:
                queue = self.waiting
            elif self.waiting_bg and not fg_prefill:
                queue = self.waiting_bg
            else:
                break
            req = queue[0]
            max_hit_blocks = (req.known_len - 1) // self.block_size
            self._ensure_hashes(req, max_hit_blocks)
            hit = self.pool.longest_hit(req.hashes, max_hit_blocks)
            hit_tokens = len(hit) * self.block_size
            host = self.pool.host_hit(req.hashes, len(hit), max_hit_blocks)  # SGLang HiCache's host tier
            th = self._tier_hit(req, hit_tokens + host * self.block_size, max_hit_blocks)
            done = hit_tokens + host * self.block_size + th.tokens
            deferred = self._async_loads and th.tokens > 0
            # An asynchronous load is scheduled with no new tokens: it takes blocks, not budget.
            num_new = 0 if deferred else min(budget, req.known_len - done,
                                             self.background_chunk if req.background else budget)
            need = -(-(done + num_new) // self.block_size) - len(hit)
            # Hit blocks sitting in the free queue are not free for this request's allocation.
            free_after_touch = self.pool.num_free - sum(1 for b in hit if self.pool.is_free(b))
            if need > free_after_touch:
                bg = next((r for r in reversed(self.running) if r.background), None)
                if queue is self.waiting and bg is not None:
                    self._preempt(bg)  # a paused background prefill must not hold a user's memory
                    continue
                break
            queue.popleft()
            self.pool.touch(hit)
            got = self.pool.allocate(need) if need > 0 else []
            assert got is not None, "free count was checked"
            req.blocks = hit + got
            req.num_cached_blocks = req.num_stored_blocks = len(hit) + host
            req.num_computed = done
            load_ms += self._load_host(req, hit, got, host)
            tier_ms = self._load_tier(req, th, commit=not deferred)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = done
                self.stats.prefix_cache_queries += req.known_len
                self.stats.prefix_cache_hits += hit_tokens
            if deferred:
                req.status = Status.LOADING
                self.channel.submit(req, tier_ms)
                continue
            load_ms += tier_ms
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(Scheduled(req, num_new, done))
            self._committed_when_scheduled(req, done + num_new)
            budget -= num_new
        return load_ms

    def _load_host(self, req: SimRequest, hit: list[int], got: list[int], host: int) -> float:
        """An admitted request's KV beyond its GPU hit in SGLang's host memory (``init_load_back``), loaded
        before its prefill. Returns the ms it takes."""
        if not host:
            return 0.0
        ms = self.pool.load_back(req.hashes[len(hit) : len(hit) + host], got[:host])
        self.stats.loaded_cpu_tokens += host * self.block_size
        self.stats.load_ms += ms
        return ms

    def _load_tier(self, req: SimRequest, th: _TierHit, commit: bool) -> float:
        """The KV beyond that in LMCache's tiers. ``commit``: its blocks join the prefix cache now (a
        synchronous load is done before anyone can read them); otherwise when the load lands. Returns
        the ms it takes."""
        if not th.tokens:
            return 0.0
        assert self.tiers is not None
        self.tiers.retrieve(th.keys)
        if commit:
            # Loaded blocks are full and join the prefix cache; LMCache does not store them again.
            self._cache_full_blocks(req, store=False)
        req.external_tokens += th.tokens
        self.stats.external_tokens += th.tokens
        self.stats.loaded_cpu_tokens += th.cpu_tokens
        self.stats.loaded_remote_tokens += th.remote_tokens
        self.stats.load_ms += th.ms
        return th.ms

    def _land(self, ms: float) -> None:
        """``ms`` pass on the transfer channel; the requests whose loads finished run from the next step,
        behind the running ones (vLLM promotes them from its waiting queue), with their blocks cached."""
        for req in self.channel.advance(ms):
            self._cache_full_blocks(req, store=False)
            req.status = Status.RUNNING
            self.running.append(req)

    def _tier_hit(self, req: SimRequest, hit_tokens: int, max_hit_blocks: int) -> _TierHit:
        """Tokens beyond the GPU hit that LMCache's tiers hold (chunk-aligned), the load time, and the
        chunk keys served."""
        t = self.tiers
        if t is None:
            return _NO_HIT
        keys = t.chunk_keys(req.hashes[:max_hit_blocks], self.block_size)
        sources = t.lookup(keys)
        tier_tokens = len(sources) * t.chunk_tokens
        if tier_tokens <= hit_tokens:
            return _NO_HIT
        first = hit_tokens // t.chunk_tokens  # the chunk the GPU hit ends in (loaded whole)
        beyond = sources[first:]
        cpu, remote = beyond.count("cpu"), beyond.count("remote")
        return _TierHit(tier_tokens - hit_tokens, t.load_ms(cpu, remote), keys[: len(sources)],
                        cpu * t.chunk_tokens, remote * t.chunk_tokens)

    def _committed_when_scheduled(self, req: SimRequest, upto_tokens: int) -> None:
        """vLLM commits a request's blocks to the prefix cache when it allocates them for the tokens this
        step computes (``allocate_slots`` -> ``cache_blocks``), so a request scheduled after it, in the
        same step too, hits blocks still being computed: a layer's KV is written before its attention
        reads it. Measured on vLLM 0.32 CPU: of two requests sharing a 2,048-token prefix sent at once,
        the second reports 2,048 cached tokens. SGLang inserts into its radix tree after the forward."""
        if self.kind.cache_when_scheduled:
            self._commit(req, upto_tokens)

    def _commit(self, req: SimRequest, upto_tokens: int) -> None:
        bs = self.block_size
        full = upto_tokens // bs
        if full <= req.num_cached_blocks:
            return
        self._ensure_hashes(req, full)
        a = req.num_cached_blocks
        req.blocks[a:full] = self.pool.cache_blocks(
            req.blocks[a:full], req.hashes[a:full], req.hashes[a - 1] if a > 0 else None,
            req.tokens(a * bs, full * bs), (req.cache_salt,) if req.cache_salt else None)
        req.num_cached_blocks = full

    def _cache_full_blocks(self, req: SimRequest, store: bool = True) -> None:
        """Blocks that became full (their KV computed) join the prefix cache (if scheduling has not
        committed them already); with tiers, every chunk completed is stored to LMCache (store-on-compute,
        after the forward)."""
        bs = self.block_size
        full = req.num_computed // bs
        self._commit(req, req.num_computed)
        a = req.num_stored_blocks
        if full <= a:
            return
        req.num_stored_blocks = full
        if self.tiers is not None and store:
            per = self.tiers.chunk_tokens // bs
            upto = full if self.tiers.save_decode else min(full, len(req.prompt) // bs)
            self.tiers.store([req.hashes[i] for i in range(per - 1, upto, per) if i >= a])

    def finish_step(self, plan: StepPlan, now: float) -> list[TokenOutput]:
        self._step_open = False
        self._land(plan.duration_ms)
        outs: list[TokenOutput] = []
        for s in plan.scheduled:
            req = s.request
            if req.status is not Status.RUNNING:
                continue  # aborted or preempted while the step ran
            extend = req.generated == 0 or s.num_new > 1
            if extend:
                self.stats.computed_prefill_tokens += s.num_new
            req.num_computed += s.num_new
            if extend or self.kind.cache_while_decoding:
                self._cache_full_blocks(req)
            if req.num_computed == req.known_len:
                tok = req.output[req.generated]
                req.generated += 1
                self.stats.generation_tokens += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                done = req.generated >= len(req.output)
                if done:
                    self._finish(req, now)
                outs.append(TokenOutput(req, tok, done))
        return outs

    def decode_burst(self, max_ms: float) -> tuple[int, float]:
        """Run consecutive pure-decode steps at once, for virtual-time drivers: up to the step before the
        first request would finish, within ``max_ms``, and only while nothing waits and no step would
        need to preempt (evicting free cached blocks is allowed, as the step-by-step path does).
        Returns (steps, elapsed ms); (0, 0) when the normal path must run.

        Same tokens, timing and cached blocks as the step-by-step path; only the order in which block
        ids are taken within the burst differs (each request takes its new blocks together).
        """
        if self.waiting or self.waiting_bg or not self.running:
            return 0, 0.0
        bs = self.block_size
        for r in self.running:
            # A request one prompt token short of its first token (a chunked prefill that ended one token
            # before the prompt's end) is not decoding yet: its next step emits the first token.
            if r.known_len - r.num_computed != 1 or r.generated == 0:
                return 0, 0.0
        k_max = min(len(r.output) - r.generated for r in self.running) - 1
        if k_max < 2:
            return 0, 0.0
        max_ms = min(max_ms, self.channel.head_ms())  # a landed load joins the batch at its next step
        batch = len(self.running)
        ctx = sum(r.known_len for r in self.running)
        elapsed, k = 0.0, 0
        while k < k_max:
            dt = self.profile.decode_ms(batch, ctx + batch * k)
            if elapsed + dt > max_ms:
                break
            elapsed += dt
            k += 1
        if k < 2:
            return 0, 0.0
        need = sum(-(-(r.num_computed + k) // bs) - len(r.blocks) for r in self.running)
        if need > self.pool.num_free:
            return 0, 0.0  # would preempt: leave it to the step-by-step path
        for r in self.running:
            new_blocks = -(-(r.num_computed + k) // bs) - len(r.blocks)
            if new_blocks > 0:
                got = self.pool.allocate(new_blocks)
                assert got is not None, "free count was checked"
                r.blocks.extend(got)
            r.num_computed += k
            r.generated += k
            if self.kind.cache_while_decoding:
                self._cache_full_blocks(r)
        self.stats.generation_tokens += k * batch
        self._land(elapsed)
        return k, elapsed

    def _finish(self, req: SimRequest, now: float) -> None:
        if not self.kind.cache_while_decoding:
            self._cache_full_blocks(req)  # SGLang's final insert: prompt and output, page-aligned
        self.running.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.status = Status.FINISHED
        req.finish_time = now
        self._by_id.pop(req.id, None)
        self.stats.finished += 1

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    def cached_block_count(self) -> int:
        return len(self.pool.cached_hashes())


def make_core(engine: str, profile: TimingProfile, num_blocks: int | None = None, hash_seed: str | None = "0",
              tiers: EngineTiers | None = None, hicache_ratio: float | None = None) -> EngineCore:
    """One simulated worker of ``engine`` ("vllm" or "sglang") for virtual-time drivers (the fleet
    benchmarks): its hasher is ``core.hasher``, and ``core.kind.event_int`` turns the digests in its
    ``take_events()`` into the ids its KV events carry. ``hicache_ratio`` (SGLang only) adds a HiCache
    host tier of that many times the device pages (SGLang's ``--hicache-ratio``)."""
    kind = KINDS[engine]
    blocks = num_blocks or profile.num_blocks
    pool: PrefixPool | None = None
    if hicache_ratio is not None:
        if kind.name != "sglang":
            raise ValueError("HiCache is SGLang's; vLLM's host tier is LMCache (tiers=)")
        from kvgate.sim.hicache import HiCachePool

        pool = HiCachePool(blocks, profile.block_size, max(1, int(blocks * hicache_ratio)))
    return EngineCore(profile, make_hasher(kind, profile.block_size, "sha256", hash_seed), blocks, tiers, kind=kind,
                      pool=pool)
