"""The HiCache file-storage probe: the leading run of pages present, namespaces apart, an unreadable
directory treated as an empty tier until the retry delay passes (``tests/engine/test_sglang_parity.py``
reads files written by SGLang's own backend)."""

from pathlib import Path

from kvgate.kvstore.hicache_files import HiCacheFileProbe
from kvgate.router.sglang import HiCacheFileKeys

KEYS = HiCacheFileKeys("org/m", 4)
TOKENS = list(range(100, 130))  # 7 full pages


def touch(d: Path, names: list[str]) -> None:
    for n in names:
        (d / n).write_bytes(b"\0" * 8)


async def test_counts_the_leading_run_of_pages(tmp_path: Path) -> None:
    names = KEYS.file_names(TOKENS)
    touch(tmp_path, names[:3] + names[4:6])  # page 3 missing: pages 4 and 5 cannot be used
    probe = HiCacheFileProbe(str(tmp_path), KEYS, lambda: 0.0)
    assert await probe.prefix_tokens(TOKENS) == 12
    assert await probe.prefix_tokens(TOKENS, cache_salt="s") == 0
    assert await probe.prefix_tokens(TOKENS[:3]) == 0 and probe.lookups == 2  # shorter than a page: not asked


async def test_missing_directory_opens_the_breaker(tmp_path: Path) -> None:
    now = [0.0]
    probe = HiCacheFileProbe(str(tmp_path / "nope"), KEYS, lambda: now[0], retry_s=5.0)
    assert await probe.prefix_tokens(TOKENS) == 0 and probe.breaker.errors == 1
    (tmp_path / "nope").mkdir()
    touch(tmp_path / "nope", KEYS.file_names(TOKENS)[:2])
    assert await probe.prefix_tokens(TOKENS) == 0  # still inside the retry delay
    now[0] = 6.0
    assert await probe.prefix_tokens(TOKENS) == 8 and probe.breaker.up
