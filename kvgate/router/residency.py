"""Where a conversation's LMCache chunks are, as far as kvgate can tell without asking per key.

- Remote tier (L2, Redis): *checked* — kvgate computes the conversation's LMCache keys and asks Redis
  with a pipelined ``EXISTS`` (``kvstore/tiers.py``). The caller passes that answer in.
- CPU tier (L1, one per node): LMCache's server has no per-key lookup and, on CPU workers, publishes no
  CPU-medium KV events by default, so kvgate *estimates*: a node's L1 holds the full prompt chunks of the
  requests kvgate sent to it (store-on-compute) and the chunks it asked LMCache to prefetch there, for
  ``ttl_s`` after they were last used. Every L1 chunk was also written through to L2, so the estimate is
  capped by the remote answer: a prompt that diverged from the stored one is never credited past the
  divergence.

Pure: time is an argument; the gateway and the fleet benchmark share it.
"""

from __future__ import annotations

from collections import OrderedDict


class TierResidency:
    def __init__(self, ttl_s: float = 300.0, chunk_tokens: int = 256, max_conversations: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.chunk_tokens = chunk_tokens
        self._max = max_conversations
        self._cpu: OrderedDict[str, dict[str, tuple[int, float]]] = OrderedDict()
        """conversation -> node -> (prefix tokens in that node's L1, when last used)."""

    def _note(self, conversation: str, node: str, tokens: int, now: float) -> None:
        full = tokens // self.chunk_tokens * self.chunk_tokens
        if full <= 0:
            return
        nodes = self._cpu.setdefault(conversation, {})
        have, _ = nodes.get(node, (0, 0.0))
        nodes[node] = (max(have, full) if have and self._live(nodes[node], now) else full, now)
        self._cpu.move_to_end(conversation)
        while len(self._cpu) > self._max:
            self._cpu.popitem(last=False)

    def _live(self, item: tuple[int, float], now: float) -> bool:
        return now - item[1] <= self.ttl_s

    def stored(self, conversation: str, node: str, prompt_tokens: int, now: float) -> None:
        """A prompt was prefilled on ``node``: LMCache stores its full chunks there (and in L2)."""
        self._note(conversation, node, prompt_tokens, now)

    def prefetched(self, conversation: str, node: str, tokens: int, now: float) -> None:
        self._note(conversation, node, tokens, now)

    def cpu_tokens(self, conversation: str, remote_tokens: int, now: float) -> dict[str, int]:
        nodes = self._cpu.get(conversation)
        if not nodes:
            return {}
        if remote_tokens <= 0:
            return {}
        return {n: min(t, remote_tokens) for n, (t, at) in nodes.items() if now - at <= self.ttl_s}
