"""Asynchronous tier loads: the transfer channel, and an engine whose loading requests wait alone."""

from __future__ import annotations

from kvgate.router.hashing import VllmHasher
from kvgate.sim.engine import EngineCore, SimRequest, Status, StepPlan
from kvgate.sim.tiers import EngineTiers, TierPool
from kvgate.sim.timing import TimingProfile
from kvgate.sim.transfer import TransferChannel
from tests.test_engine import run

# 4-token blocks, 8-token chunks; 1 MB a token at 1 GB/s: a load takes 1 ms a token, the 24 tokens of
# three chunks 24 ms, where a decode step takes 1 ms.
PROFILE = TimingProfile(name="t", source="test", block_size=4, num_blocks=64, max_num_seqs=8,
                        max_num_batched_tokens=64, p0=1.0, p1=0.1, d0=1.0)
PROMPT = list(range(30))  # three full chunks (24 tokens) in the CPU tier once computed


def engine(cpu: TierPool, async_loads: bool) -> EngineCore:
    tiers = EngineTiers(cpu, None, chunk_tokens=8, kv_bytes_per_token=1_000_000, cpu_gbps=1.0,
                        async_loads=async_loads)
    return EngineCore(PROFILE, VllmHasher(4, seed="0"), tiers=tiers)


def warm_tier() -> TierPool:
    """A CPU tier holding PROMPT's chunks, computed by another engine of the node."""
    cpu = TierPool("cpu", None)
    other = engine(cpu, async_loads=False)
    other.add_request(SimRequest("warm", PROMPT, [1]))
    run(other)
    return cpu


def step(c: EngineCore, now: float) -> tuple[StepPlan, float]:
    plan = c.schedule()
    assert plan.scheduled or plan.duration_ms > 0, "engine stalled"
    now += plan.duration_ms
    c.finish_step(plan, now)
    return plan, now


def decoding(c: EngineCore) -> tuple[SimRequest, float]:
    """A request decoding on ``c`` (its prompt shares nothing with PROMPT), after its prefill step."""
    d = SimRequest("d", list(range(500, 510)), [1] * 200)
    c.add_request(d)
    _, now = step(c, 0.0)
    assert d.generated == 1
    return d, now


def test_channel_serves_loads_one_after_another() -> None:
    ch: TransferChannel[str] = TransferChannel()
    ch.submit("a", 24.0)
    ch.submit("b", 24.0)
    assert ch.backlog_ms() == 48.0 and ch.head_ms() == 24.0
    assert ch.advance(30.0) == ["a"]  # b started when a ended: 18 ms of it left
    assert ch.backlog_ms() == 18.0 and "b" in ch
    assert ch.advance(17.0) == [] and ch.advance(1.0) == ["b"]
    assert not ch and ch.head_ms() == float("inf")


def test_async_load_does_not_stall_the_batch() -> None:
    c = engine(warm_tier(), async_loads=True)
    _, now = decoding(c)
    b = SimRequest("b", [*PROMPT, 7, 7], [1])
    c.add_request(b)
    plan, now = step(c, now)
    # b is admitted with its 24 tokens to load and is not in the step; d's decode step is not 24 ms longer.
    assert b.status is Status.LOADING and b.num_cached_tokens == 24 and b.external_tokens == 24
    assert [s.request.id for s in plan.scheduled] == ["d"] and plan.duration_ms < 5.0
    arrival, decode_steps = now - plan.duration_ms, 1
    while b.status is Status.LOADING:
        plan, now = step(c, now)
        assert [s.request.id for s in plan.scheduled] == ["d"] and plan.duration_ms < 5.0
        decode_steps += 1
    assert decode_steps >= 24 // 5  # d kept decoding while b loaded
    plan, now = step(c, now)
    assert {s.request.id: s.num_new for s in plan.scheduled} == {"d": 1, "b": 8}  # the 8 tokens not loaded
    assert b.first_token_time == now and now - arrival >= 24.0  # b's TTFT includes its load
    assert c.stats.load_ms == 24.0


def test_loads_of_one_engine_queue_on_its_channel() -> None:
    c = engine(warm_tier(), async_loads=True)
    b1, b2 = SimRequest("b1", [*PROMPT, 1, 1], [1]), SimRequest("b2", [*PROMPT, 2, 2], [1])
    c.add_request(b1)
    c.add_request(b2)
    now = 0.0
    first: dict[str, float] = {}
    while c.has_work():
        plan, now = step(c, now)
        for s in plan.scheduled:
            first.setdefault(s.request.id, now - plan.duration_ms)
    # b2 hits the GPU blocks b1's load brings only once they have landed; admitted together, both load,
    # b2's load starting when b1's ends.
    assert b1.external_tokens == b2.external_tokens == 24
    assert 24.0 <= first["b1"] < 48.0 <= first["b2"]


def test_a_load_landed_joins_the_prefix_cache_only_then() -> None:
    c = engine(warm_tier(), async_loads=True)
    b = SimRequest("b", [*PROMPT, 7, 7], [1])
    c.add_request(b)
    c.schedule()
    hashes = c.hasher.block_hashes(PROMPT)
    assert not c.pool.longest_hit(hashes, 6)  # still loading: nobody may read those blocks
    run_loads(c)
    assert len(c.pool.longest_hit(hashes, 6)) == 6


def run_loads(c: EngineCore) -> None:
    now = 0.0
    while c.has_work():
        _, now = step(c, now)


def test_sync_mode_keeps_the_load_in_the_step() -> None:
    c = engine(warm_tier(), async_loads=False)
    decoding(c)
    b = SimRequest("b", [*PROMPT, 7, 7], [1])
    c.add_request(b)
    plan = c.schedule()
    # The step admits b and computes its 8 new tokens, and waits 24 ms for its load: d waits with it.
    assert b.status is Status.RUNNING and {s.request.id for s in plan.scheduled} == {"d", "b"}
    assert plan.duration_ms >= 24.0 and not c.channel


def test_an_idle_engine_waits_for_its_load_and_an_abort_frees_the_blocks() -> None:
    c = engine(warm_tier(), async_loads=True)
    b = SimRequest("b", [*PROMPT, 7, 7], [1])
    c.add_request(b)
    plan = c.schedule()
    assert not plan.scheduled and 0 < plan.duration_ms <= 24.0 and c.has_work() and c.num_waiting == 1
    free = c.pool.num_free
    assert c.abort("b") and not c.channel and c.pool.num_free > free and not c.has_work()
