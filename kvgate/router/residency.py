"""Where a conversation's LMCache chunks are, as far as kvgate can tell without asking per key.

- Remote tier (L2, Redis): *checked* — kvgate computes the conversation's LMCache keys and asks Redis
  with a pipelined ``EXISTS`` (``kvstore/tiers.py``). The caller passes that answer in.
- CPU tier (L1, one per node): LMCache's server has no per-key lookup and, on CPU workers, publishes no
  CPU-medium KV events by default, so kvgate *estimates*: a node's L1 holds the full prompt chunks of the
  requests kvgate sent to it (store-on-compute) and the chunks it asked LMCache to prefetch there, for
  ``ttl_s`` after they were last used. Every L1 chunk was also written through to L2, so the estimate is
  capped by the remote answer: a prompt that diverged from the stored one is never credited past the
  divergence.

Pure and immutable: one value per conversation, kept in its record (so every gateway replica sees
the same estimate); time is an argument; the gateway and the fleet benchmark share it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvgate.router.index import PrefixIndex
from kvgate.router.types import WorkerId


@dataclass(frozen=True, slots=True)
class Residency:
    """One conversation's prefix in each node's L1: (node, tokens, when last used)."""

    entries: tuple[tuple[str, int, float], ...] = ()

    def stored(self, node: str, tokens: int, now: float, ttl_s: float, chunk_tokens: int) -> Residency:
        """A prompt of ``tokens`` was prefilled on ``node`` (LMCache stores its full chunks there and in L2),
        or kvgate prefetched that much there."""
        full = tokens // chunk_tokens * chunk_tokens
        if full <= 0:
            return self
        have = next(((t, at) for n, t, at in self.entries if n == node), None)
        keep = max(have[0], full) if have is not None and now - have[1] <= ttl_s else full
        live = tuple(e for e in self.entries if e[0] != node and now - e[2] <= ttl_s)
        return replace(self, entries=(*live, (node, keep, now)))

    def cpu_tokens(self, remote_tokens: int, now: float, ttl_s: float) -> dict[str, int]:
        """Per node, the prefix its L1 is estimated to hold, capped by what Redis (L2) answered."""
        if remote_tokens <= 0:
            return {}
        return {n: min(t, remote_tokens) for n, t, at in self.entries if now - at <= ttl_s}
def hicache_host_tokens(index: PrefixIndex, hashes: Mapping[WorkerId, Sequence[int]],
                        page_sizes: Mapping[WorkerId, int]) -> dict[str, int]:
    """SGLang workers' HiCache host pools, for ``RouteRequest.cpu_tokens``: each worker's longest prefix of
    the prompt (its own page ids, ``SglangHasher.event_ints``) in the index's CPU tier, which SGLang's
    ``CPU_PINNED`` events feed; keyed by worker id, since a host pool belongs to one worker, not a node.

    Under write-through (SGLang's default) every page on the GPU is backed up to host once its copy is
    acknowledged, so the CPU-tier prefix is the longest one the worker can serve without computing; the cost
    model prices what lies beyond the GPU hit at the host-to-device bandwidth, as for LMCache's L1.
    """
    out: dict[str, int] = {}
    for w, hs in hashes.items():
        blocks = index.match(hs, "CPU", workers=[w]).get(w, 0)
        if blocks:
            out[str(w)] = blocks * page_sizes[w]
    return out
