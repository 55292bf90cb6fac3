"""kvgate's estimate of a conversation's LMCache L1 residency."""

from __future__ import annotations

from kvgate.router.residency import TierResidency


def test_stored_prompt_chunks_are_credited_up_to_the_remote_answer_within_the_ttl() -> None:
    r = TierResidency(ttl_s=100, chunk_tokens=256)
    r.stored("c", "node0", 1300, now=0)
    assert r.cpu_tokens("c", remote_tokens=1280, now=50) == {"node0": 1280}
    assert r.cpu_tokens("c", remote_tokens=512, now=50) == {"node0": 512}  # the prompt diverged after 512
    assert r.cpu_tokens("c", remote_tokens=0, now=50) == {}  # Redis holds nothing: neither does L1
    assert r.cpu_tokens("c", remote_tokens=1280, now=101) == {}  # assumed evicted
    assert r.cpu_tokens("other", remote_tokens=1280, now=1) == {}


def test_prefetch_credits_another_node_and_a_longer_prefix() -> None:
    r = TierResidency(ttl_s=100, chunk_tokens=256)
    r.stored("c", "node0", 600, now=0)
    r.prefetched("c", "node1", 2000, now=10)
    assert r.cpu_tokens("c", remote_tokens=4096, now=20) == {"node0": 512, "node1": 1792}


def test_bounded() -> None:
    r = TierResidency(max_conversations=2)
    for c in "abc":
        r.stored(c, "n", 512, now=0)
    assert r.cpu_tokens("a", 512, 0) == {} and r.cpu_tokens("c", 512, 0) == {"n": 512}
