"""The request log: what a gateway writes for each request (content-free), how prompts are logged
incrementally, rotation and the bound on what waits to be written."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx

from kvgate.gateway.requestlog import MAX_QUEUED_BYTES, RequestLog
from tests.conftest import MODEL
from tests.helpers import TOOLS, eventually

SECRET = "the secret word is xylophone"


def lines(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return rows[0], rows[1:]


async def test_every_request_is_logged_without_its_content(make_cluster: Any, tmp_path: Path) -> None:
    log = tmp_path / "requests.log"
    c = await make_cluster(2, events=True, request_log=str(log), tenant_header="x-tenant-id")
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"{SECRET}. " * 40},
                                  {"role": "user", "content": f"{SECRET}: find it"}]
    hdr = {"x-conversation-id": "logged", "x-tenant-id": "acme"}
    usages = []
    async with httpx.AsyncClient(timeout=30) as h:
        for step in range(3):
            r = await h.post(c.url + "/v1/chat/completions", headers=hdr, json={
                "model": MODEL, "messages": msgs, "tools": TOOLS,
                "sim": {"tool_calls": 1 if step < 2 else 0, "reasoning_tokens": 20}})
            assert r.status_code == 200
            body = r.json()
            usages.append(body["usage"])
            m = body["choices"][0]["message"]
            msgs.append({k: v for k, v in m.items() if v is not None})
            if m.get("tool_calls"):
                msgs.append({"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": f"{SECRET} " * 30})
    await eventually(lambda: log.exists() and len(log.read_text().splitlines()) == 4)
    text = log.read_text()
    assert "xylophone" not in text and "find it" not in text  # no content, in any form
    header, rows = lines(log)
    assert header["kvgate_request_log"] == 1 and header["policy"] == "cost_model"
    assert {w["id"] for w in header["workers"]} == {f"127.0.0.1:{hh.port}" for _, hh in c.sims}
    assert header["waits"]["reserve_max_s"] == 5.0 and "backlog_weight" in header["cost"]
    assert [r["conv"] for r in rows] == ["acme/logged"] * 3 and {r["tenant"] for r in rows} == {"acme"}
    assert [r["usage"] for r in rows] == [[u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                                           u["completion_tokens"]] for u in usages]
    assert [r["tools"] for r in rows] == [["search"], ["search"], []]
    assert [r["user_turn"] for r in rows] == [True, False, False]
    assert all(r["outcome"] == "done" and r["end"] >= r["t"] for r in rows)
    assert rows[1]["waited"] is not None and rows[0]["waited"] is None  # the tool wait that ended
    bs = rows[0]["bs"]
    # Prompts are logged from where they leave the previous one: the first whole, the others short.
    nblocks = [len(base64.b64decode(r["h"])) // 8 for r in rows]
    assert rows[0]["k"] == 0 and nblocks[0] == rows[0]["prompt"] // bs
    for prev, r, n in zip(rows, rows[1:], nblocks[1:], strict=False):
        assert 0 < r["k"] <= prev["prompt"] // bs and r["k"] + n == r["prompt"] // bs
        assert r["c"] >= r["k"]  # blocks shared with the cached chain (prompt and reply)
        assert n < r["prompt"] // bs  # not the whole history again


def test_rotation_keeps_the_newest_files_within_their_size(tmp_path: Path) -> None:
    log = RequestLog(str(tmp_path / "r.log"), max_bytes=4096, backups=2, key=b"k" * 16)
    log.start({"policy": "cost_model"})
    for i in range(200):
        log._q.put(({"t": float(i), "conv": f"c{i}"}, (i, i + 1)))
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["r.log", "r.log.1", "r.log.2"]
    for name in files:
        text = (tmp_path / name).read_text()
        assert len(text) < 4096 + 200
        assert json.loads(text.splitlines()[0])["kvgate_request_log"] == 1  # every file opens with a header
    newest = [json.loads(x)["t"] for x in (tmp_path / "r.log").read_text().splitlines()[1:]]
    older = [json.loads(x)["t"] for x in (tmp_path / "r.log.1").read_text().splitlines()[1:]]
    assert newest[-1] == 199.0 and max(older) < min(newest)
    # Keyed: the same hash logs alike within a log, differently under another key.
    again = RequestLog(str(tmp_path / "s.log"), key=b"x" * 16)
    assert log._key_hashes((5,)) == log._key_hashes((5,)) != again._key_hashes((5,))


def test_a_full_queue_drops_entries_instead_of_growing(tmp_path: Path) -> None:
    log = RequestLog(str(tmp_path / "r.log"))
    log._thread = object()  # type: ignore[assignment]  # started, but nothing drains the queue

    class Ex:  # what entry() reads of an exchange, for a prompt of many blocks
        pass

    from kvgate.gateway import requestlog

    calls = 0

    def fake_entry(ex: Any, outcome: str, now: float) -> tuple[dict[str, Any], tuple[int, ...]]:
        nonlocal calls
        calls += 1
        return {"t": now}, tuple(range(100_000))

    orig, requestlog.entry = requestlog.entry, fake_entry
    try:
        for _ in range(100):
            log.write(Ex(), "done")  # type: ignore[arg-type]
    finally:
        requestlog.entry = orig
    assert calls == 100
    assert log._q.qsize() == MAX_QUEUED_BYTES // (512 + 8 * 100_000) and log.dropped == 100 - log._q.qsize()
