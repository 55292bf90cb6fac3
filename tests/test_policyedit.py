"""The one validation of cost-model changes (HTTP PATCH /admin/policy and gRPC UpdatePolicy share it)
and its log of who changed what."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel

from kvgate.errors import ApiError, BadRequest, UnprocessableEntity
from kvgate.gateway.policyedit import PolicyLog, validate_cost
from kvgate.router.cost import CostModel, CostParams


def test_a_valid_change_is_applied_whole_and_logged_with_who_and_what() -> None:
    model, log = CostModel(), PolicyLog()
    change = log.apply(model, {"affinity_bonus_ms": 9, "token_budget": 8192}, "alice", "grpc", "tune")
    assert model.params.affinity_bonus_ms == 9
    # token_budget was already 8192: not a change.
    assert [(c.field, c.old, c.new) for c in change.changes] == [("affinity_bonus_ms", 2.0, 9.0)]
    assert (change.who, change.via, change.reason) == ("alice", "grpc", "tune")
    assert log.recent() == [change]


@pytest.mark.parametrize(("cost", "err", "param"), [
    ([1, 2], BadRequest, "cost"),
    (None, BadRequest, "cost"),
    ({"token_budget": -5, "affinity_bonus_ms": 9}, UnprocessableEntity, "cost.token_budget"),
    ({"p0_ms": math.inf}, UnprocessableEntity, "cost.p0_ms"),
    ({"p0_ms": math.nan}, UnprocessableEntity, "cost.p0_ms"),
    ({"warp_factor": 9}, UnprocessableEntity, "cost.warp_factor"),
])
def test_a_bad_change_changes_nothing(cost: object, err: type[ApiError], param: str) -> None:
    model, log = CostModel(), PolicyLog()
    before = model.params
    with pytest.raises(err) as info:
        log.apply(model, cost, "bob", "http")
    assert info.value.param == param
    assert model.params is before and log.recent() == []


def test_the_log_is_bounded_and_keeps_the_newest() -> None:
    model, log = CostModel(), PolicyLog(keep=3)
    for i in range(5):
        log.apply(model, {"affinity_bonus_ms": i + 10}, f"u{i}", "http")
    assert [c.who for c in log.recent()] == ["u2", "u3", "u4"]
    assert [c.who for c in log.recent(2)] == ["u3", "u4"]


def test_validate_cost_returns_the_new_set_without_touching_the_current() -> None:
    cur = CostParams()
    new = validate_cost(cur, {"load_epsilon": 0.5})
    assert new.load_epsilon == 0.5 and cur.load_epsilon == CostParams().load_epsilon


class _Sections:
    """A policy target with the gateway's three sections, kept in a dict."""

    def __init__(self) -> None:
        from kvgate.session.prefill import PrefillParams
        from kvgate.session.waits import WaitParams

        self.params: dict[str, BaseModel] = {"cost": CostParams(), "waits": WaitParams(), "prefill": PrefillParams()}

    def current(self) -> dict[str, BaseModel]:
        return dict(self.params)

    def swap(self, new: dict[str, BaseModel]) -> None:
        self.params.update(new)


def test_sections_change_together_and_are_logged_by_section() -> None:
    target, log = _Sections(), PolicyLog()
    change = log.apply(target, {"cost": {"backlog_weight": 2.0}, "waits": {"reserve_max_s": 0.0,
                                                                           "tool_priors_s": {"grep": 1.0}}},
                       "alice", "http")
    assert {c.field for c in change.changes} == {"backlog_weight", "waits.reserve_max_s", "waits.tool_priors_s"}
    assert target.params["waits"].reserve_max_s == 0.0  # type: ignore[attr-defined]


@pytest.mark.parametrize(("changes", "err", "param"), [
    ({"routing": {"x": 1}}, BadRequest, "routing"),
    ({"waits": 3}, BadRequest, "waits"),
    ({}, BadRequest, "cost"),
    ({"cost": {"backlog_weight": 2.0}, "prefill": {"min_continue": 2}}, UnprocessableEntity, "prefill.min_continue"),
])
def test_a_bad_section_changes_no_section(changes: object, err: type[ApiError], param: str) -> None:
    target, log = _Sections(), PolicyLog()
    before = target.current()
    with pytest.raises(err) as info:
        log.apply(target, changes, "bob", "http")
    assert info.value.param == param
    assert target.current() == before and log.recent() == []


@pytest.mark.parametrize(("changes", "param"), [
    # pydantic's lax mode reads the string "Infinity" as a float: checked after validation, not only before.
    ({"cost": {"p0_ms": "Infinity"}}, "cost.p0_ms"),
    ({"cost": {"decode_u1_ms": "-inf"}}, "cost.decode_u1_ms"),
    ({"cost": {"decode_u1_ms": -1e9}}, "cost.decode_u1_ms"),
    ({"cost": {"affinity_bonus_ms": 1e300}}, "cost.affinity_bonus_ms"),
    ({"cost": {"kv_capacity_tokens": 10**90}}, "cost.kv_capacity_tokens"),
    # Each within ±1e7, but together a decode step of -4 ms at full KV occupancy.
    ({"cost": {"decode_ms": 6.0, "decode_u2_ms": -10.0}}, "cost"),
    ({"waits": {"tool_priors_s": {"grep": -1.0}}}, "waits.tool_priors_s"),
    ({"waits": {"tool_priors_s": {f"t{i}": 1.0 for i in range(2000)}}}, "waits.tool_priors_s"),
    ({"waits": {"tool_priors_s": {"x" * 1000: 1.0}}}, "waits.tool_priors_s"),
    ({"waits": {"max_keys": 10**12}}, "waits.max_keys"),
    ({"cost": {"backlog_weight": 2.0}, "prefill": {"settle_s": 1e12}}, "prefill.settle_s"),
])
def test_unbounded_or_non_finite_values_are_refused_whole(changes: object, param: str) -> None:
    target, log = _Sections(), PolicyLog()
    before = target.current()
    with pytest.raises(UnprocessableEntity) as info:
        log.apply(target, changes, "mallory", "http")
    assert info.value.param == param, info.value.message
    assert target.current() == before and log.recent() == []


def test_a_fitted_decode_curve_with_a_negative_term_is_accepted() -> None:
    # Dynamo's mocker profile: u2 < 0, yet the decode step stays positive over the whole occupancy range.
    model, log = CostModel(), PolicyLog()
    log.apply(model, {"decode_ms": 5.74, "decode_u1_ms": 54.01, "decode_u2_ms": -25.74}, "alice", "http")
    assert model.params.decode_u2_ms == -25.74
