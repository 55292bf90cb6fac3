from kvgate.demo import run_demo


async def test_demo_shows_cached_tokens_rising_on_the_sessions_worker() -> None:
    rows = await run_demo(n_workers=3, speed=10.0)
    assert len(rows) >= 6
    for conv in {r.conversation for r in rows}:
        mine = [r for r in rows if r.conversation == conv]
        assert len({r.worker for r in mine}) == 1, "a session stays on its worker"
        tool_turns = [r for r in mine if r.kind == "tool result"]
        assert all(r.cached_tokens > 0 for r in tool_turns)
        assert [r.cached_tokens for r in tool_turns] == sorted(r.cached_tokens for r in tool_turns)
        assert all(r.finish in ("stop", "tool_calls") for r in mine)
