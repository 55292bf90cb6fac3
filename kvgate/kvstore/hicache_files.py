"""What SGLang's HiCache ``file`` storage backend (L3) holds of a prompt, read from its directory.

kvgate names the files itself (``router/sglang.HiCacheFileKeys``: the storage hash chain of every full
page, checked against SGLang 0.5.23's own ``HiCacheFile`` in the engine suite) and counts how many exist
from the first page on: that run is what a queued request would prefetch from storage. Advisory like the
LMCache probe: an unreadable directory makes the tier look empty (counted), never fails a request. The
hashing and the ``stat`` calls run in a worker thread, off the event loop (a page size of 1 means one
hash per token).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence

from kvgate.kvstore.tiers import _Breaker
from kvgate.router.sglang import HiCacheFileKeys


def leading_pages(directory: str, names: Sequence[str]) -> int:
    """How many of ``names``, from the first, exist in ``directory`` (raises OSError if it is unreadable)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(directory)
    n = 0
    for name in names:
        if not os.path.exists(os.path.join(directory, name)):
            break
        n += 1
    return n


class HiCacheFileProbe:
    def __init__(self, directory: str, keys: HiCacheFileKeys, now: Callable[[], float], *,
                 retry_s: float = 5.0, max_pages: int = 1 << 16) -> None:
        self.directory = directory
        self.keys = keys
        self.max_pages = max_pages
        self.breaker = _Breaker(now, retry_s)
        self.lookups = 0

    def _count(self, tokens: Sequence[int], extra_key: str | None, cache_salt: str | None) -> int:
        limit = self.max_pages * self.keys.page_size
        names = self.keys.file_names(tokens[:limit], extra_key, cache_salt)
        return leading_pages(self.directory, names) * self.keys.page_size

    async def prefix_tokens(self, tokens: Sequence[int], extra_key: str | None = None,
                            cache_salt: str | None = None) -> int:
        """Tokens of ``tokens``' prefix whose pages the backend holds (0 when unknown)."""
        if not self.breaker.open() or len(tokens) < self.keys.page_size:
            return 0
        try:
            n = await asyncio.to_thread(self._count, list(tokens), extra_key, cache_salt)
        except OSError as exc:
            self.breaker.failed(f"HiCache file storage at {self.directory}", exc)
            return 0
        self.breaker.ok()
        self.lookups += 1
        return n
