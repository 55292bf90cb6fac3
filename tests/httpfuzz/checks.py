"""What every answer to the fuzz must satisfy, and the tally of what it saw (findings are recorded, not
raised, so one run lists every distinct problem)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.httpfuzz.fleet import Fleet


@dataclass
class Tally:
    requests: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    findings: dict[str, str] = field(default_factory=dict)
    seconds: list[tuple[float, str]] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)
    """4xx answers by status, error type and code: which checks the fuzz reached."""


TALLY = Tally()


def check(fleet: Fleet, what: str, r: httpx.Response) -> None:
    """No 5xx; every 4xx OpenAI-shaped; nothing answered by the proxy's catch-all (a validation gap).
    A violation is recorded, not raised: one run lists every distinct problem with the request that
    showed it (the run is derandomized, so it replays)."""
    TALLY.requests += 1
    TALLY.by_status[r.status_code] = TALLY.by_status.get(r.status_code, 0) + 1
    problem = None
    if r.status_code >= 500:
        problem = f"{r.status_code}: {r.text[:300]}"
    elif r.status_code >= 400 and r.request.method != "HEAD":  # an answer to HEAD has no body
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = None
        if not (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)):
            problem = f"{r.status_code} without an OpenAI error body: {r.text[:300]}"
        elif err.get("code") == "invalid_request":
            problem = f"input reached the catch-all: {err['message'][:300]}"
        else:
            k = f"{r.status_code} {err['type']} {err.get('code')}"
            TALLY.codes[k] = TALLY.codes.get(k, 0) + 1
    elif r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        # A stream that failed after its first byte ends with an SSE error event instead of [DONE].
        if not r.text.rstrip().endswith("data: [DONE]"):
            problem = f"stream did not finish: {r.text[-300:]}"
    elif r.status_code == 200 and r.request.method == "PATCH":
        # An accepted policy change: whatever it set must be finite and within the bounds policy edits
        # promise (docs/hostile-input.md), or the cost model computes with inf and NaN from now on.
        bad = [(k, v) for k, v in numbers(r.json()) if not (math.isfinite(v) and abs(v) <= 2**40
                                                            and (isinstance(v, int) or abs(v) <= 1e7))]
        if bad:
            problem = f"policy accepted out-of-bounds values {bad[:3]}"
    elif r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json"):
        body = r.json()
        rid = body.get("id") if isinstance(body, dict) else None
        if isinstance(rid, str) and len(fleet.response_ids) < 64:
            fleet.response_ids.append(rid)
    if problem is not None:
        key = re.sub(r"[0-9]+", "N", problem[:120])
        if key not in TALLY.findings:
            TALLY.findings[key] = f"{problem}\n    request: {what}"


def numbers(doc: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in ``doc`` with where it is."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from numbers(v, f"{path}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from numbers(v, f"{path}[{i}]")
    elif isinstance(doc, int | float) and not isinstance(doc, bool):
        yield path, doc
