"""Bounded tenant labels and the active-conversation sketch."""

from __future__ import annotations

import random

import pytest

from kvgate.gateway.cardinality import NO_TENANT, OTHER, ActiveConversations, TenantLabels
from kvgate.gateway.identity import BadIdentity, resolve


def test_label_values_stay_bounded_under_a_flood_of_invented_tenants() -> None:
    g = TenantLabels(top_n=5, refresh_s=10)
    rng = random.Random(1)
    seen = set()
    demoted = []
    for i in range(20_000):  # 200 s, 20 refreshes, every request from a tenant never seen before
        t = f"t{rng.randrange(10**9)}"
        demoted += g.observe(t, rng.randrange(1, 5000), now=i * 0.01)
        seen.add(g.label(t))
        seen.add(g.label(""))
    # No tenant sent a real share of the traffic, so the first five keep the labels: no series churn.
    assert demoted == [] and len(g.members) == 5
    assert seen == {*g.members, OTHER, NO_TENANT}
    assert len(g._weights) <= 64  # fixed candidate slots, not one per tenant seen


def test_heavy_tenants_win_their_labels_from_a_crowd_of_light_ones() -> None:
    g = TenantLabels(top_n=3, refresh_s=1)
    now = 0.0
    # The crowd arrives first and takes the free labels.
    for i in range(50):
        g.observe(f"light{i}", 10, now)
    assert len(g.members) == 3 and all(m.startswith("light") for m in g.members)
    demoted: list[str] = []
    for step in range(200):
        now = step * 0.05
        for heavy in ("acme", "globex", "initech"):
            demoted += g.observe(heavy, 2000, now)
        demoted += g.observe(f"light{step % 50}", 10, now)
    assert g.members == {"acme", "globex", "initech"}
    assert sorted(set(demoted)) == sorted(f"light{i}" for i in range(3))
    assert g.label("acme") == "acme" and g.label("light7") == OTHER and g.label("") == NO_TENANT


def test_a_slightly_heavier_outsider_does_not_flap_the_labels() -> None:
    g = TenantLabels(top_n=1, refresh_s=1, challenge=1.25)
    g.observe("a", 1000, 0.0)
    g.observe("b", 1100, 0.5)  # 1.1x: not clearly heavier
    assert g.observe("a", 0, 1.0) == [] and g.members == {"a"}
    g.observe("b", 2000, 1.5)  # now b is about 3x a
    assert g.observe("a", 0, 2.0) == ["a"] and g.members == {"b"}


def test_a_tenant_that_went_quiet_is_replaced_as_its_weight_decays() -> None:
    g = TenantLabels(top_n=1, refresh_s=60, half_life_s=60)
    g.observe("old", 100_000, 0.0)
    gone: list[str] = []
    for minute in range(1, 30):
        gone += g.observe("new", 2_000, minute * 60.0)
    assert gone == ["old"] and g.members == {"new"}


def test_no_labels_at_all() -> None:
    g = TenantLabels(top_n=0, refresh_s=1)
    for i in range(10):
        g.observe("acme", 100, float(i))
    assert g.label("acme") == OTHER and g.members == frozenset()


def test_reserved_values_cannot_be_tenant_ids() -> None:
    for reserved in (OTHER, NO_TENANT):
        with pytest.raises(BadIdentity):
            resolve({"x-tenant-id": reserved}, {}, ["x-conversation-id"], "x-tenant-id")


@pytest.mark.parametrize("n", [1, 40, 3_000, 60_000])
def test_active_conversations_are_counted_within_a_few_percent(n: int) -> None:
    a = ActiveConversations(window_s=300, slots=5)
    for i in range(n):
        a.add("m", f"tenant/conv-{i}", now=i * 0.001)
        if i % 3 == 0:
            a.add("m", f"tenant/conv-{i}", now=i * 0.001)  # a conversation's later turns count once
    est = a.count("m", now=n * 0.001)
    assert abs(est - n) <= max(1.0, 0.05 * n), est
    assert a.count("other-model", now=0.0) == 0.0


def test_active_conversations_forget_what_left_the_window() -> None:
    a = ActiveConversations(window_s=300, slots=5)
    for i in range(100):
        a.add("m", f"early-{i}", now=10.0)
    for i in range(30):
        a.add("m", f"late-{i}", now=250.0)
    assert round(a.count("m", now=299.0)) == 130
    # 60 s slots: the early ones (slot 0) leave once the window no longer covers it.
    assert round(a.count("m", now=330.0)) == 30
    assert a.count("m", now=1000.0) == 0.0
    # A slot that comes round again starts empty.
    a.add("m", "again", now=1000.0)
    assert round(a.count("m", now=1000.0)) == 1
