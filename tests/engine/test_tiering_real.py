"""Tiering on real engines: kvgate in front of a vLLM (the small random model, 40 KV blocks, KV events)
backed by LMCache (L1 CPU memory, L2 the local Redis)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgate.bench.tiering_real import Engine, measure, report, start
from kvgate.dev.engines import EngineSet, ensure_lmcache, ensure_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    model = ensure_model(ensure_lmcache().venv, "small")
    s = EngineSet(run_dir=tmp_path_factory.mktemp("tiering"))
    try:
        yield start(s, model, core=1)
    finally:
        s.stop()


async def test_resume_from_lmcache_and_background_prefill(engine: Engine) -> None:
    r = await measure(engine, seed=42)
    text, _ = report(r)
    print("\n" + text)  # the timings are the benchmark's to judge; here only behaviour is asserted
    # A session resumed after its KV left the GPU is served from LMCache, and kvgate saw it coming:
    # it found the chunks in Redis itself and expected exactly what vLLM reported.
    assert all(x > 0 for x in r.external_tokens), r.external_tokens
    assert r.resumed_expected == r.resumed_cached, (r.resumed_expected, r.resumed_cached)
    assert all(x.endswith(("/cpu", "/remote")) for x in r.resumed_reasons), r.resumed_reasons
    # The background prefill made the next user turn find the canonical prefix; without it the turn
    # reused only the history before the dropped reasoning.
    assert r.prefill_stats["issued"] == 1 and r.prefill_stats["used"] == 1, r.prefill_stats
    assert r.prefill_cached >= r.prefill_prefix_tokens // 128 * 128
    assert r.baseline_cached < r.prefill_cached
    # kvgate's prefetch warms LMCache's L1 from Redis: the next request hits L1.
    assert r.prefetch_found == (5, 5) and r.prefetch_l1_hit_tokens == 1280, (r.prefetch_found, r.prefetch_l1_hit_tokens)
