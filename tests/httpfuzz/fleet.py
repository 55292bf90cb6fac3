"""The fuzzed fleet's credentials and handles: two gateway processes (open, secured) in front of simulated
workers, started by the ``fleet`` fixture of tests/test_fuzz.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import Proc

TENANT_KEY, OPERATOR_KEY, NOROLE_KEY = "fz-tenant-key", "fz-operator-key", "fz-none-key"
REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass
class Gw:
    url: str
    proc: Proc
    auth: bool

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.popen.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


@dataclass
class Fleet:
    open: Gw
    secured: Gw
    jwt_key: Any
    redis_prefix: str
    response_ids: list[str] = field(default_factory=list)
    """Ids of responses the gateways returned: continuations (previous_response_id) draw from them."""


def wait_http(p: Proc, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client() as c:
        while time.monotonic() < deadline:
            if p.popen.poll() is not None:
                raise RuntimeError(f"process exited with {p.popen.returncode}:\n{p.tail()}")
            try:
                if c.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout_s}s:\n{p.tail()}")
