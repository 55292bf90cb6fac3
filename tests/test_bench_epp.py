"""``kvgate bench epp`` runs end to end on a few requests and reports both fronts for both cases (the
figures themselves belong to the benchmark's output, not to a test)."""

from __future__ import annotations

import asyncio

from kvgate.bench import epp


async def test_bench_epp_reports_both_fronts_for_a_known_and_a_cold_32k_conversation() -> None:
    res = await asyncio.wait_for(epp._run(2), 600)
    assert set(res) == {"known", "cold"}
    for r in res.values():
        assert r["prompt_tokens"] >= epp.TARGET_TOKENS
        assert 0 < r["epp_p50"] <= r["epp_p99"] and 0 < r["proxy_p50"] <= r["proxy_p99"]
    assert "EPP p50 ms" in epp.table(res)
