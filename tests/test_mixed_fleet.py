"""A mixed fleet of simulated vLLM and SGLang engines behind one prefix index: each worker's KV events,
decoded from its own wire format, and each worker's own hasher predict exactly the cached tokens it then
reports (what the gateway's per-worker hasher does, in virtual time)."""

import random

from kvgate.router.index import PrefixIndex
from kvgate.router.kvevents import Cleared, KvEventState, Removed, Stored, decode_batch
from kvgate.router.types import WorkerId
from kvgate.sim.engine import EngineCore, SimRequest, make_core
from kvgate.sim.kinds import encode_batch
from kvgate.sim.timing import TimingProfile


def profile(block: int, blocks: int) -> TimingProfile:
    return TimingProfile("t", "test", block_size=block, num_blocks=blocks, max_num_seqs=8,
                         max_num_batched_tokens=512, p1=0.01, d0=1.0)


def run(core: EngineCore, req: SimRequest, state: KvEventState, wid: WorkerId, seq: list[int]) -> int:
    """Serve ``req``; returns how many blocks the worker's events said it evicted meanwhile."""
    removed = 0
    core.add_request(req)
    t = 0.0
    while core.has_work():
        plan = core.schedule()
        t += plan.duration_ms
        core.finish_step(plan, t)
        events = core.take_events()
        if events:  # through the wire format and kvgate's decoder, as the gateway receives them
            payload = encode_batch(core.kind, events, t)
            removed += sum(len(e.hashes) for e in decode_batch(payload) if isinstance(e, Removed))
            state.on_message(wid, seq[0], payload)
            seq[0] += 1
    return removed


def test_expected_equals_reported_on_both_kinds() -> None:
    fleet = {WorkerId("vllm-16"): make_core("vllm", profile(16, 24)),
             WorkerId("sglang-1"): make_core("sglang", profile(1, 300)),
             WorkerId("sglang-16"): make_core("sglang", profile(16, 24))}
    state = KvEventState(PrefixIndex())
    seqs = {w: [0] for w in fleet}
    for w in fleet:
        state.add_worker(w)
    rng = random.Random(3)
    convs = [[rng.randrange(10, 3000) for _ in range(rng.randrange(20, 90))] for _ in range(5)]
    checked = evicted = 0
    for turn in range(40):
        c = rng.randrange(len(convs))
        wid = rng.choice(list(fleet))
        core = fleet[wid]
        prompt = convs[c] + [rng.randrange(10, 3000) for _ in range(rng.randrange(1, 40))]
        hashes = [core.kind.event_int(h) for h in core.hasher.block_hashes(prompt)]
        depth = state.index.match(hashes, workers=[wid]).get(wid, 0)
        bs = core.block_size
        expected = min(depth, (len(prompt) - 1) // bs) * bs
        out = [rng.randrange(10, 3000) for _ in range(rng.randrange(1, 12))]
        req = SimRequest(f"r{turn}", prompt, out)
        evicted += run(core, req, state, wid, seqs[wid])
        assert req.num_cached_tokens == expected, (wid, turn)
        checked += expected > 0
        convs[c] = prompt + out  # the next turn extends the conversation with the answer
    assert checked >= 10 and evicted > 0 and state.stats.malformed == 0 and state.stats.gaps == 0


def test_sglang_events_decode_to_what_the_index_holds() -> None:
    core = make_core("sglang", profile(4, 40))
    req = SimRequest("a", list(range(50, 73)), [1, 2, 3])
    core.add_request(req)
    t = 0.0
    evs = []
    while core.has_work():
        plan = core.schedule()
        t += plan.duration_ms
        core.finish_step(plan, t)
        evs += core.take_events()
    decoded = decode_batch(encode_batch(core.kind, evs, 0.0))
    ids = [core.kind.event_int(h) for h in core.hasher.block_hashes([*range(50, 73), 1, 2])]
    assert [i for e in decoded if isinstance(e, Stored) for i in e.hashes] == ids
    assert not any(isinstance(e, Cleared) for e in decoded)
