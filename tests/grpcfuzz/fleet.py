"""The gateways under test in tests/test_grpc_fuzz.py: their credentials and limits, both started
(``start``), each seen from the test (``Side``), what the fuzz found (``Tally``), and the fleet hypothesis's
thread hands its requests to (``Fleet.run``)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import httpx
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from kvgate.gateway.auth import key_hash
from tests.conftest import MODEL, Cluster
from tests.httpfuzz.strategies import MAX_BODY

if TYPE_CHECKING:
    from tests.grpcfuzz.control import WatchRun
    from tests.grpcfuzz.scripts import Script

# --- the fleet under test -------------------------------------------------------------------------------

TENANT_KEY, OPERATOR_KEY, NOROLE_KEY = "gf-tenant-key", "gf-operator-key", "gf-none-key"
TENANT = "gf"
REDIS_URL = "redis://127.0.0.1:6379/0"
GRPC_LIMIT = MAX_BODY + (1 << 20)
"""The servers' message size limit (``max_body_bytes`` + 1 MiB, kvgate/grpc/server.py)."""
CALL_TIMEOUT_S = 20.0
"""Every call's deadline: far above what any request here costs, so DEADLINE_EXCEEDED means a hang."""


@dataclass
class Side:
    name: str
    cluster: Cluster
    control: grpc.aio.Channel
    epp: grpc.aio.Channel
    secured: bool

    @property
    def gw(self) -> Any:
        return self.cluster.gateway

    @property
    def servers(self) -> Any:
        return self.cluster.gateway_handle.server.config.app.state.grpc  # type: ignore[union-attr]

    @property
    def workers(self) -> list[str]:
        return sorted(w.id for w in self.gw.pool.all())

    @property
    def endpoints(self) -> list[str]:
        from kvgate.epp.endpoints import endpoint_of

        return sorted(endpoint_of(w.config) for w in self.gw.pool.all())

    def operator_md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {OPERATOR_KEY}"),) if self.secured else ()

    def slots(self) -> dict[str, tuple[int, int, int, int]]:
        return {w.id: (w.in_flight, w.pending_prefill, w.pending_requests, w.decode_requests)
                for w in self.gw.pool.all()}

    def idle(self) -> bool:
        return all(v == (0, 0, 0, 0) for v in self.slots().values()) and self.admitted() == 0

    def admitted(self) -> int:
        """Admission slots held (a ticket not given back holds one for good)."""
        a = self.gw.admission
        return 0 if a is None else int(a.busy(MODEL))


@dataclass
class Tally:
    requests: Counter[str] = field(default_factory=Counter)
    """Hostile requests sent, by surface (control, epp); each ext_proc stream counts once."""
    messages: int = 0
    """ext_proc messages written over all streams."""
    codes: Counter[str] = field(default_factory=Counter)
    findings: dict[str, str] = field(default_factory=dict)
    seconds: list[tuple[float, str]] = field(default_factory=list)
    stop: bool = False
    """A leak was found: the gateways' state is no longer what later checks assume (and requests may queue
    behind leaked admission slots), so nothing more is sent; the finding is reported at once."""

    def find(self, problem: str, what: str) -> None:
        key = re.sub(r"[0-9]+", "N", problem[:120])
        if key not in self.findings:
            self.findings[key] = f"{problem[:600]}\n    request: {what[:900]}"


@dataclass
class Fleet:
    open: Side
    secured: Side
    loop: asyncio.AbstractEventLoop
    jwt_key: Any
    forged_key: Any
    tally: Tally = field(default_factory=Tally)
    watches: list[WatchRun] = field(default_factory=list)
    replay_epp: list[tuple[Side, Script]] = field(default_factory=list)
    replay_control: list[tuple[Side, str, bytes, tuple[tuple[str, str | bytes], ...]]] = field(default_factory=list)

    def side(self, secured: bool) -> Side:
        return self.secured if secured else self.open

    def run(self, coro: Coroutine[Any, Any, Any]) -> None:
        """From hypothesis's thread: ``coro`` on the gateways' loop, waited for."""
        if self.tally.stop:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=4 * CALL_TIMEOUT_S)


def jwks(key: Any) -> dict[str, Any]:
    jwk = json.loads(RSAAlgorithm.to_jwk(key.public_key()))
    return {"keys": [{**jwk, "kid": "gf", "alg": "RS256"}]}


async def start(make_cluster: Any, tmp: Path) -> tuple[Cluster, Cluster, Any, Any, str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp / "jwks.json").write_text(json.dumps(jwks(key)))
    prefix = f"kvgate-grpcfuzz:{uuid.uuid4().hex[:8]}:"
    # Admission on both, with limits no fuzz run reaches: every endpoint-picker request takes a ticket it must
    # give back when its stream ends, however it ends.
    admission = {"enabled": True, "defaults": {"max_concurrent": 256, "requests_per_minute": 1_000_000,
                                               "tokens_per_minute": 1_000_000_000}}
    common: dict[str, Any] = {"grpc_port": 0, "epp_port": 0, "max_body_bytes": MAX_BODY, "drain_timeout_s": 1,
                              "max_store_bytes": 32 * 1024 * 1024, "max_conversation_bytes": 1024 * 1024,
                              "admission": admission}
    auth = {"mode": "both", "cache_salt_secret": "gf-salt",
            "api_keys": [{"sha256": key_hash(TENANT_KEY), "tenant": TENANT, "role": "tenant", "name": "t"},
                         {"sha256": key_hash(OPERATOR_KEY), "tenant": TENANT, "role": "operator", "name": "o"},
                         {"sha256": key_hash(NOROLE_KEY), "tenant": TENANT, "role": "none", "name": "n"}],
            "jwt": {"jwks_file": str(tmp / "jwks.json"), "tenant_claim": "org.id", "role_claim": "roles"}}
    open_c = await make_cluster(2, **common)
    secured_c = await make_cluster(2, **common, auth=auth, policy="round_robin", session_store="redis",
                                   redis_url=REDIS_URL, redis_prefix=prefix, session_ttl_s=600,
                                   epp_body_mode="buffered")
    return open_c, secured_c, key, forged, prefix


async def settled(pred: Callable[[], bool], within_s: float) -> bool:
    """Whether ``pred`` holds, now or within ``within_s``."""
    for _ in range(int(within_s / 0.01) + 1):
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


async def seed(side: Side) -> None:
    """Two conversations with a completed turn each, for the conversation reads to find."""
    headers = {"authorization": f"Bearer {TENANT_KEY}"} if side.secured else {}
    async with httpx.AsyncClient(timeout=30) as h:
        for cid in ("seed-1", "seed-2"):
            r = await h.post(side.cluster.url + "/v1/chat/completions", headers={**headers, "x-conversation-id": cid},
                             json={"model": MODEL, "max_tokens": 4,
                                   "messages": [{"role": "user", "content": f"hello {cid}"}]})
            assert r.status_code == 200, r.text
