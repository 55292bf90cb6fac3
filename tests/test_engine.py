from kvgate.router.hashing import VllmHasher
from kvgate.sim.blockpool import BlockRemoved, BlockStored
from kvgate.sim.engine import EngineCore, SimRequest, make_core
from kvgate.sim.timing import TimingProfile, get_profile
from tests.helpers import run

PROFILE = TimingProfile(name="t", source="test", block_size=4, num_blocks=64, max_num_seqs=8,
                        max_num_batched_tokens=64, p0=1.0, p1=0.1, d0=1.0)


def core(profile: TimingProfile = PROFILE, salt_seed: str = "0") -> EngineCore:
    return EngineCore(profile, VllmHasher(profile.block_size, seed=salt_seed))


def test_cached_tokens_follow_vllm_rules() -> None:
    c = core()
    a = SimRequest("a", list(range(10)), [100, 101, 102])
    c.add_request(a)
    run(c)
    assert a.num_cached_tokens == 0
    # Same prompt again: prompt blocks 0..1 are cached; hits are capped at num_tokens - 1, whole blocks.
    b = SimRequest("b", list(range(10)), [1])
    c.add_request(b)
    run(c)
    assert b.num_cached_tokens == 8
    # An exactly block-aligned repeat must recompute its whole last block.
    d = SimRequest("d", list(range(8)), [1])
    c.add_request(d)
    run(c)
    assert d.num_cached_tokens == 4


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    c = core()
    a = SimRequest("a", list(range(6)), [50, 51, 52, 53])
    c.add_request(a)
    run(c)
    # Next turn = prompt + the generated tokens + new text: 8 of its tokens were computed and cached
    # (the last generated token's KV is never computed).
    nxt = SimRequest("n", [*range(6), 50, 51, 52, 53, 7, 7, 7], [1])
    c.add_request(nxt)
    run(c)
    assert nxt.num_cached_tokens == 8


def test_a_request_behind_another_hits_the_blocks_it_is_still_computing() -> None:
    # vLLM commits blocks when it schedules their computation: the second of two requests with one
    # prefix, admitted in the same step, reports it cached (measured on vLLM 0.32 CPU: 2,048 of 2,082
    # tokens for the second of two sent at once). SGLang's radix tree takes them after the forward.
    for engine, expected in (("vllm", 8), ("sglang", 0)):
        c = make_core(engine, PROFILE)
        a = SimRequest("a", [*range(10), 50], [1, 2])
        b = SimRequest("b", [*range(10), 60], [1, 2])
        c.add_request(a)
        c.add_request(b)
        plan = c.schedule()
        assert {s.request.id for s in plan.scheduled} == {"a", "b"}
        assert (a.num_cached_tokens, b.num_cached_tokens) == (0, expected), engine
        assert plan.scheduled[1].num_new == 11 - expected  # and computes only the rest
        run(c)


def test_salt_isolates_chains() -> None:
    c = core()
    c.add_request(SimRequest("a", list(range(12)), [1], cache_salt="t1"))
    run(c)
    b = SimRequest("b", list(range(12)), [1], cache_salt="t2")
    c.add_request(b)
    run(c)
    assert b.num_cached_tokens == 0
    s = SimRequest("s", list(range(12)), [1], cache_salt="t1")
    c.add_request(s)
    run(c)
    assert s.num_cached_tokens == 8


def test_a_prefill_one_token_short_is_not_run_as_a_decode_burst() -> None:
    c = core()
    d = SimRequest("d", list(range(4)), list(range(50)))  # decoding: takes one token of every pass
    c.add_request(d)
    for _ in range(2):
        c.finish_step(c.schedule(), 0.0)
    # 64-token budget: 1 for d's decode, 63 for r's 64-token prompt; r's last prompt token is left over.
    r = SimRequest("r", list(range(100, 164)), list(range(10)))
    c.add_request(r)
    c.finish_step(c.schedule(), 1.0)
    assert r.known_len - r.num_computed == 1 and r.generated == 0
    assert c.decode_burst(1e9) == (0, 0.0)  # a burst would emit r's first token unseen
    outs = c.finish_step(c.schedule(), 2.0)
    assert any(o.request is r for o in outs) and r.first_token_time == 2.0


def test_chunked_prefill_respects_token_budget() -> None:
    c = core()
    r = SimRequest("a", list(range(150)), [1, 2])
    c.add_request(r)
    plans = []
    while c.has_work():
        p = c.schedule()
        plans.append([s.num_new for s in p.scheduled])
        c.finish_step(p, 0.0)
    assert plans[:3] == [[64], [64], [22]]
    assert r.first_token_time is not None


def test_eviction_emits_removed_events_under_pressure() -> None:
    small = TimingProfile(name="s", source="test", block_size=4, num_blocks=7, max_num_seqs=4,
                          max_num_batched_tokens=64, p0=1.0)
    c = core(small)
    c.add_request(SimRequest("a", list(range(16)), [1]))
    run(c)
    ev1 = c.take_events()
    assert any(isinstance(e, BlockStored) for e in ev1)
    c.add_request(SimRequest("b", list(range(100, 116)), [1]))
    run(c)
    removed = [e for e in c.take_events() if isinstance(e, BlockRemoved)]
    assert removed, "the second prompt needs the first one's blocks"


def test_preemption_recomputes_and_still_finishes() -> None:
    tight = TimingProfile(name="p", source="test", block_size=4, num_blocks=6, max_num_seqs=4,
                          max_num_batched_tokens=64, p0=1.0, d0=1.0)
    c = core(tight)
    a = SimRequest("a", list(range(8)), list(range(200, 208)))
    b = SimRequest("b", list(range(50, 58)), list(range(300, 308)))
    c.add_request(a)
    c.add_request(b)
    run(c)
    assert a.generated == 8 and b.generated == 8
    assert c.stats.preemptions > 0


def test_abort_frees_blocks() -> None:
    c = core()
    c.add_request(SimRequest("a", list(range(30)), [1, 2, 3]))
    c.finish_step(c.schedule(), 1.0)
    assert c.pool.usage() > 0
    assert c.abort("a")
    assert c.pool.usage() == 0 and not c.has_work()


def test_dynamo_profile_matches_its_polynomials() -> None:
    p = get_profile("dynamo-mocker")
    assert abs(p.prefill_ms([(8192, 0)]) - (4.209989e-7 * 8192**2 + 1.518344e-2 * 8192 + 16.50142)) < 1e-9
    full = p.num_blocks * p.block_size
    assert abs(p.decode_ms(1, full // 2) - (-25.74 * 0.25 + 54.01 * 0.5 + 5.74)) < 1e-9
    assert p.decode_ms(1, 0) == 5.74
