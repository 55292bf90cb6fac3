"""PrefixKnowledge: every worker matched with the prompt's hashes for its own hash identity."""

from __future__ import annotations

from kvgate.gateway.prefix import PrefixKnowledge
from kvgate.gateway.prompts import Prompt
from kvgate.router.hashing import HashSpec, event_int, make_hasher
from kvgate.router.types import WorkerId, WorkerView

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")


def views(*ids: WorkerId, in_flight: int = 0) -> list[WorkerView]:
    return [WorkerView(w, "m", True, in_flight) for w in ids]
SA, SB = HashSpec(16, "sha256", "0"), HashSpec(64, "sha256_cbor", "0")


def hashes(spec: HashSpec, tokens: list[int]) -> tuple[int, ...]:
    return tuple(event_int(h) for h in make_hasher(spec).block_hashes(tokens))


def knowledge() -> PrefixKnowledge:
    specs = {A: SA, B: SB, C: SA}
    k = PrefixKnowledge(specs.get, lambda m: [SA, SB], approx_ttl_s=60)
    for w in (A, B):
        k.events.add_worker(w)
    return k


def test_each_worker_is_matched_with_its_own_hashes_in_the_fleets_unit() -> None:
    k = knowledge()
    tokens = list(range(300))
    prompt = Prompt(len(tokens), {SA: hashes(SA, tokens), SB: hashes(SB, tokens)}, "local")
    k.index.store(A, hashes(SA, tokens)[:10])  # 160 tokens
    k.index.store(B, hashes(SB, tokens))       # 4 blocks of 64 = 256 tokens
    k.routed("m", C, prompt, now=0.0)          # C has no events: approximate, in its own (16) hashes
    assert k.block_size("m") == 16
    assert k.match("m", prompt, views(A, B, C), now=1.0) == {A: 10, B: 16, C: 18}
    # A worker whose hashes the prompt lacks (its spec was learned after the prompt was hashed) gets nothing.
    assert k.match("m", Prompt(300, {SA: hashes(SA, tokens)}, "local"), views(B), now=1.0) == {}


def test_a_match_stops_where_the_engine_would_recompute_the_last_token() -> None:
    k = knowledge()
    tokens = list(range(256))  # exactly 4 blocks of 64: vLLM recomputes the last token, so 3 are reused
    prompt = Prompt(256, {SA: hashes(SA, tokens), SB: hashes(SB, tokens)}, "local")
    k.index.store(B, hashes(SB, tokens))
    k.index.store(A, hashes(SA, tokens))
    assert k.match("m", prompt, views(A, B), now=0.0) == {A: 15, B: 12}


def test_a_stale_or_restarted_worker_is_expected_to_hold_nothing() -> None:
    k = knowledge()
    tokens = list(range(300))
    prompt = Prompt(len(tokens), {SA: hashes(SA, tokens), SB: hashes(SB, tokens)}, "local")
    k.index.store(A, hashes(SA, tokens))
    k.routed("m", C, prompt, now=0.0)
    k.events.mark_stale(A)
    assert k.match("m", prompt, views(A, C), now=1.0) == {C: 18}
    k.worker_restarted(C)
    k.worker_restarted(A)
    assert k.match("m", prompt, views(A, C), now=1.0) == {} and k.index.block_count(A) == 0


def _batch(kind: str, hs: tuple[int, ...]) -> bytes:
    import msgpack

    ev = {"type": kind, "block_hashes": list(hs), "medium": "GPU"}
    if kind == "BlockStored":
        ev |= {"parent_block_hash": None, "token_ids": [], "block_size": 16}
    return bytes(msgpack.packb([0.0, [ev], 0]))


def test_a_prompt_in_flight_counts_until_its_blocks_arrive_by_events() -> None:
    k = knowledge()
    system = list(range(160))
    first = system + [900] * 40
    second = Prompt(200, {SA: hashes(SA, [*system, *([901] * 40)])}, "local")
    k.dispatched("m", A, Prompt(200, {SA: hashes(SA, first)}, "local"), now=0.0)
    k.dispatched("m", C, Prompt(200, {SA: hashes(SA, first)}, "local"), now=0.0)  # C has no events: ignored
    assert k.match("m", second, views(A, C, in_flight=1), now=1.0) == {A: 10}
    # The blocks arrive by events, then the worker evicts them: the in-flight entry no longer vouches for them.
    hs = hashes(SA, first)
    k.events.on_message(A, 0, _batch("BlockStored", hs))
    k.events.on_message(A, 1, _batch("BlockRemoved", hs))
    assert k.match("m", second, views(A, in_flight=1), now=1.0) == {}


def test_a_prompt_in_flight_stops_counting_when_nothing_is_in_flight_or_after_its_ttl() -> None:
    k = knowledge()
    p = Prompt(200, {SA: hashes(SA, list(range(200)))}, "local")
    k.dispatched("m", A, p, now=0.0)
    assert k.match("m", p, views(A, in_flight=1), now=29.0) == {A: 12}
    assert k.match("m", p, views(A, in_flight=1), now=31.0) == {}  # inflight_ttl_s = 30
    k.dispatched("m", A, p, now=40.0)
    assert k.match("m", p, views(A, in_flight=0), now=41.0) == {}  # every request there has ended
    assert not k.inflight.holds(A)
