"""LMCache's multiprocess coordinator (``lmcache coordinator``, 0.5.6) at the edge: which tier and which
LMCache instance holds a prompt's chunks, warming one instance's L1 from L2, and L2 pins.

The coordinator keeps a fleet-wide key directory fed by the servers' cache events (servers started with
``--coordinator-event-reporting``); kvgate asks it by token ids (+ model path and the tenant's
``cache_salt``), the same unit vLLM and LMCache speak, so kvgate never computes a key for it. Its
``--chunk-size`` and ``--hash-algorithm`` must equal the servers'.

Advisory like the other tier adapters (``kvstore/tiers.py``): a failing coordinator looks empty, is
counted, and is tried again after ``retry_s``. Its API is checked once at start-up
(:meth:`LMCacheCoordinator.check`): a coordinator whose routes or request fields differ from the ones
this adapter was written against, or an LMCache server of another version, is a configuration error
(:class:`CoordinatorAPIError`, naming the version expected), not an empty tier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvgate.kvstore.tiers import TierResidency, _Breaker

LMCACHE_VERSION = "0.5.6"
"""The LMCache release this adapter was written and tested against (``kvgate/dev/engines.py`` pins it)."""

TITLE = "LMCache MP Coordinator"
ROUTES: dict[str, tuple[str, ...]] = {
    "/directory/lookup": ("post",),
    "/cache/prefetches": ("post",),
    "/cache/prefetches/{instance_id}/{request_id}": ("get",),
    "/cache/pins": ("post", "delete"),
    "/instances": ("get",),
}
FIELDS: dict[str, tuple[str, ...]] = {
    "DirectoryLookupRequest": ("token_ids", "model_name", "world_size", "cache_salt"),
    "DirectoryLookupResponse": ("chunks", "results"),
    "DirectoryKeyPlacements": ("placements",),
    "Placement": ("instance_id", "tier"),
    "PrefetchRequest": ("instance_id", "model_name", "world_size", "token_ids", "cache_salt"),
    "PinRequest": ("model_name", "world_size", "token_ids", "cache_salt"),
    "PinResponse": ("requested", "affected", "status"),
}


class CoordinatorAPIError(RuntimeError):
    """The coordinator (or an LMCache server) is not the API this adapter speaks."""


@dataclass(frozen=True)
class PinResult:
    chunks: int
    """Whole chunks the tokens resolved to."""
    keys: int
    """L2 keys (un)pinned."""


@dataclass
class CoordinatorStats:
    lookups: int = 0
    prefetches: int = 0
    pins: int = 0
    unpins: int = 0
    last: dict[str, Any] = field(default_factory=dict)


def prefix_by_tier(chunks: int, results: Sequence[dict[str, Any]], chunk_tokens: int) -> TierResidency:
    """The longest run from the start of chunks every key of which has a placement in L2 (any instance:
    the L2 is shared), and per instance in its L1. ``results`` are in request order, ``chunks`` x the
    per-rank (and object-group) fan-out."""
    if chunks <= 0 or not results or len(results) % chunks:
        return TierResidency()
    fan = len(results) // chunks
    l2 = 0
    l2_open = True
    l1: dict[str, int] = {}
    l1_open: set[str] | None = None
    for c in range(chunks):
        keys = results[c * fan:(c + 1) * fan]
        in_l2 = all(any(p.get("tier") == "l2" for p in k.get("placements", ())) for k in keys)
        held = [{p.get("instance_id") for p in k.get("placements", ()) if p.get("tier") == "l1"} for k in keys]
        in_l1 = set.intersection(*held) if held else set()
        in_l1.discard(None)
        l1_open = set(in_l1) if l1_open is None else l1_open & in_l1
        for inst in l1_open:
            l1[str(inst)] = (c + 1) * chunk_tokens
        if l2_open and in_l2:
            l2 = (c + 1) * chunk_tokens
        else:
            l2_open = False
        if not l1_open and not l2_open:
            break
    return TierResidency(l1=l1, l2=l2)


class LMCacheCoordinator:
    def __init__(self, url: str, client: httpx.AsyncClient, now: Callable[[], float], *, chunk_tokens: int = 256,
                 timeout_s: float = 0.2, retry_s: float = 5.0, max_chunks: int = 2048) -> None:
        self.url = url.rstrip("/")
        self._client = client
        self._timeout = timeout_s
        self.chunk_tokens = chunk_tokens
        self.max_chunks = max_chunks
        self.breaker = _Breaker(now, retry_s)
        self.stats = CoordinatorStats()

    # -- start-up check ------------------------------------------------------------------------------
    async def check(self, server_urls: Iterable[str] = ()) -> None:
        """Raise :class:`CoordinatorAPIError` unless the coordinator serves the routes and request fields
        this adapter uses and each LMCache server in ``server_urls`` reports version ``LMCACHE_VERSION``.
        The coordinator itself publishes no version: its OpenAPI document is what is compared."""
        want = f"kvgate expects LMCache {LMCACHE_VERSION}'s coordinator (lmcache coordinator)"
        try:
            r = await self._client.get(f"{self.url}/openapi.json", timeout=5.0)
            r.raise_for_status()
            doc = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise CoordinatorAPIError(f"{want} at {self.url}: its API description is unreadable ({exc!r})") from exc
        title = doc.get("info", {}).get("title") if isinstance(doc, dict) else None
        if title != TITLE:
            raise CoordinatorAPIError(f"{want} at {self.url}, found {title!r}")
        paths = doc.get("paths", {})
        missing = [f"{m.upper()} {p}" for p, ms in ROUTES.items() for m in ms if m not in paths.get(p, {})]
        schemas = doc.get("components", {}).get("schemas", {})
        missing += [f"{s}.{f}" for s, fs in FIELDS.items() for f in fs if f not in schemas.get(s, {}).get(
            "properties", {})]
        if missing:
            raise CoordinatorAPIError(f"{want} at {self.url}; it lacks {', '.join(missing)}")
        for url in server_urls:
            try:
                r = await self._client.get(f"{url.rstrip('/')}/lmc_version", timeout=5.0)
                r.raise_for_status()
                got = r.json()
            except (httpx.HTTPError, ValueError) as exc:
                raise CoordinatorAPIError(f"kvgate expects LMCache {LMCACHE_VERSION} at {url}: "
                                          f"no version ({exc!r})") from exc
            if got != LMCACHE_VERSION:
                raise CoordinatorAPIError(f"kvgate expects LMCache {LMCACHE_VERSION} at {url}, found {got!r}")

    # -- calls -------------------------------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        if not self.breaker.open():
            return None
        try:
            r = await self._client.request(method, f"{self.url}{path}", json=body, timeout=self._timeout)
            r.raise_for_status()
            out = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.breaker.failed(f"LMCache coordinator at {self.url}", exc)
            return None
        self.breaker.ok()
        return out if isinstance(out, dict) else None

    def _body(self, model_path: str, tokens: Sequence[int], cache_salt: str | None) -> dict[str, Any]:
        return {"model_name": model_path, "world_size": 1, "cache_salt": cache_salt or "",
                "token_ids": list(tokens[: self.max_chunks * self.chunk_tokens])}

    async def residency(self, model_path: str, tokens: Sequence[int], cache_salt: str | None = None
                        ) -> TierResidency:
        """Per LMCache instance its L1's prefix of ``tokens``, and L2's (tokens; empty when unknown)."""
        if len(tokens) < self.chunk_tokens:
            return TierResidency()
        body = await self._call("POST", "/directory/lookup", self._body(model_path, tokens, cache_salt))
        if body is None:
            return TierResidency()
        self.stats.lookups += 1
        res = body.get("results")
        return prefix_by_tier(int(body.get("chunks", 0)), res if isinstance(res, list) else [], self.chunk_tokens)

    async def prefetch(self, instance: str, model_path: str, tokens: Sequence[int], cache_salt: str | None = None
                       ) -> str | None:
        """Warm ``instance``'s L1 from L2; LMCache's request id, or None (nothing to warm, or unreachable)."""
        body = await self._call("POST", "/cache/prefetches",
                                {"instance_id": instance, **self._body(model_path, tokens, cache_salt)})
        if body is None:
            return None
        self.stats.prefetches += 1
        rid = body.get("request_id")
        return rid if isinstance(rid, str) and rid else None

    async def prefetch_result(self, instance: str, request_id: str) -> tuple[int, int] | None:
        """(found chunks, total chunks) once the prefetch completed; None while pending or unreachable. The
        first poll that sees it completed consumes it (LMCache drops the job)."""
        try:
            r = await self._client.get(f"{self.url}/cache/prefetches/{instance}/{request_id}",
                                       timeout=self._timeout)
            r.raise_for_status()
            body = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            self.breaker.failed(f"LMCache coordinator at {self.url}", exc)
            return None
        if not isinstance(body, dict) or body.get("status") != "completed":
            return None
        return int(body.get("found_keys", 0)), int(body.get("total_keys", 0))

    async def pin(self, model_path: str, tokens: Sequence[int], cache_salt: str | None = None) -> PinResult | None:
        """Protect the chunks from the coordinator's L2 eviction (reference-counted, fleet-wide per salt)."""
        return await self._pin("POST", model_path, tokens, cache_salt)

    async def unpin(self, model_path: str, tokens: Sequence[int], cache_salt: str | None = None
                    ) -> PinResult | None:
        return await self._pin("DELETE", model_path, tokens, cache_salt)

    async def _pin(self, method: str, model_path: str, tokens: Sequence[int], cache_salt: str | None
                   ) -> PinResult | None:
        if len(tokens) < self.chunk_tokens:
            return None
        body = await self._call(method, "/cache/pins", self._body(model_path, tokens, cache_salt))
        if body is None:
            return None
        if method == "POST":
            self.stats.pins += 1
        else:
            self.stats.unpins += 1
        return PinResult(int(body.get("requested", 0)), int(body.get("affected", 0)))

    async def aclose(self) -> None:
        """The HTTP client is the gateway's: nothing of its own to close."""
