"""Changing routing and session parameters at run time, shared by ``PATCH /admin/policy`` and the gRPC
``Policy.UpdatePolicy``: one validation (every new parameter set is checked whole, then all are swapped
in at once, so no change is half-applied) and one bounded log of who changed what.

Two cost parameters are also learned, the tier load rates (``gateway/tierview.py``, from LMCache's
metrics). An operator's value for one of them pins it: it is kept in the ``pinned`` section of the policy
(versioned and shared like every section), wins over what is learned on every replica, and holds until
the operator clears it with a null; then each replica's learned value (else the configured one) is back."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvgate.errors import BadRequest, UnprocessableEntity
from kvgate.router.cost import CostModel, CostParams
from kvgate.session.prefill import PrefillParams
from kvgate.session.waits import WaitParams

if TYPE_CHECKING:
    from kvgate.gateway.runtime import SessionRuntime

MAX_REASON = 1024
MAX_ABS = 1e7
"""Every real-valued parameter is finite and within ±1e7: milliseconds, weights, fractions and GB/s are all
far below it, and an absurd value (1e300) would overflow the cost model's arithmetic into inf and NaN."""
MAX_INT = 2**40
"""Counts and capacities (tokens, bytes per token, window sizes) stay below 2^40 (~1.1e12): past the largest
real KV capacity, and exact as floats in the cost model's arithmetic."""
MAX_ENTRIES = 1024
"""Entries of a map parameter (per-tool wait priors): each is a per-request lookup and lives in memory."""
MAX_KEY_CHARS = 256


LEARNED_RATES = ("cpu_load_gbps", "remote_load_gbps")
"""Cost parameters kvgate learns at run time; an operator's value pins them (``RatePins``)."""


class RatePins(BaseModel):
    """The learned cost parameters an operator set: each wins over what is learned until cleared (null)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    cpu_load_gbps: float | None = Field(None, gt=0)
    remote_load_gbps: float | None = Field(None, gt=0)


OPTIONAL_SECTIONS: dict[str, type[BaseModel]] = {"pinned": RatePins}
"""Sections a policy document leaves out while they hold nothing, so that a replica of an earlier
version, which rejects a document with a section it does not know, applies every edit that pins
nothing; a document without one means it is at its default (nothing pinned)."""


def pin_rates(changes: Any) -> Any:
    """An operator's edit with the learned rates it names pinned: a value is also put in ``pinned``, a null
    only clears the pin (and is taken out of ``cost``, where null is no value). Anything malformed is
    left as it is, for ``validate`` to answer."""
    if not isinstance(changes, dict) or not isinstance(changes.get("cost"), dict) \
            or not isinstance(changes.get("pinned", {}), dict):
        return changes
    cost, pins = dict(changes["cost"]), dict(changes.get("pinned", {}))
    for k in LEARNED_RATES:
        if k in cost:
            pins[k] = cost[k]
            if cost[k] is None:
                del cost[k]
    if not pins:
        return changes
    out = {k: v for k, v in changes.items() if k != "cost"}
    return {**({"cost": cost} if cost else {}), **out, "pinned": pins}


@dataclass(frozen=True, slots=True)
class FieldChange:
    field: str
    """A cost-model field by its name; a tool-wait or background-prefill one as ``waits.x`` / ``prefill.x``."""
    old: Any
    new: Any


@dataclass(frozen=True, slots=True)
class PolicyChange:
    at: float
    who: str
    via: str
    """"http" or "grpc"."""
    changes: tuple[FieldChange, ...]
    reason: str = ""
    version: int = 0
    """The fleet's policy version this change made (gateway/policysync.py); 0 before any."""


class PolicyTarget(Protocol):
    """The parameter sets that can change at run time, by section: ``cost`` (the cost model), ``waits``
    (tool-wait planning), ``prefill`` (background prefill)."""

    def current(self) -> dict[str, BaseModel]: ...

    def swap(self, new: dict[str, BaseModel]) -> None: ...


def validate(current: dict[str, BaseModel], changes: Any) -> dict[str, BaseModel]:
    """The sections ``changes`` ({section: {field: value}}) names, as they become, each validated whole;
    nothing is touched. BadRequest (400) for an unknown section or one that is not an object;
    UnprocessableEntity (422) for a value out of range, not finite or of an unknown field."""
    expected = " | ".join(f'"{k}"' for k in current)
    if not isinstance(changes, dict) or not changes:
        raise BadRequest(f"expected {{{expected}: {{field: value}}}}", param=next(iter(current)), code="invalid_type")
    new: dict[str, BaseModel] = {}
    for section, fields in changes.items():
        if section not in current or not isinstance(fields, dict):
            raise BadRequest(f"expected {{{expected}: {{field: value}}}}", param=str(section), code="invalid_type")
        # Values as given first, so the error names the field rather than a check across fields it upset.
        for k, v in fields.items():
            problem = _out_of_bounds(v) if isinstance(v, int | float | dict) else None
            if problem is not None:
                raise UnprocessableEntity(f"{section}.{k}: {problem}", param=f"{section}.{k}", code="invalid_value")
        try:
            new[section] = type(current[section]).model_validate({**current[section].model_dump(), **fields})
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = err["loc"]  # empty for a check across fields (the decode curve)
            where = ".".join((section, *(str(x) for x in loc)))
            raise UnprocessableEntity(f"{where}: {err['msg']}", param=f"{section}.{loc[0]}" if loc else section,
                                      code="invalid_value") from None
        # And as validated: each field states its own range, but few an upper end, and pydantic's lax mode
        # reads strings ("1e300") as numbers.
        for name in type(new[section]).model_fields:
            problem = _out_of_bounds(getattr(new[section], name))
            if problem is not None:
                raise UnprocessableEntity(f"{section}.{name}: {problem}", param=f"{section}.{name}",
                                          code="invalid_value")
    return new


def _out_of_bounds(v: Any) -> str | None:
    """Why a validated parameter value is unacceptable whatever its field's own range says, or None."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return None
    if isinstance(v, float):
        if not math.isfinite(v):
            return "must be a finite number"
        return None if abs(v) <= MAX_ABS else f"must be within ±{MAX_ABS:g}"
    if isinstance(v, int):
        return None if abs(v) <= MAX_INT else f"must be within ±{MAX_INT} (2^40)"
    if isinstance(v, dict):
        if len(v) > MAX_ENTRIES:
            return f"at most {MAX_ENTRIES} entries"
        for k, x in v.items():
            if isinstance(k, str) and len(k) > MAX_KEY_CHARS:
                return f"keys of at most {MAX_KEY_CHARS} characters"
            problem = _out_of_bounds(x)
            if problem is not None:
                return f"[{str(k)[:40]}] {problem}"
    return None


def validate_cost(current: CostParams, cost: Any) -> CostParams:
    """The cost parameters ``current`` becomes with ``cost`` ({field: value}) applied, validated whole."""
    if not isinstance(cost, dict):
        raise BadRequest('expected {"cost": {field: value}}', param="cost", code="invalid_type")
    return cast(CostParams, validate({"cost": current}, {"cost": cost})["cost"])


class CostOnly:
    """A cost model alone as a policy target (the cost section only)."""

    def __init__(self, model: CostModel) -> None:
        self.model = model

    def current(self) -> dict[str, BaseModel]:
        return {"cost": self.model.params}

    def swap(self, new: dict[str, BaseModel]) -> None:
        self.model.params = cast(CostParams, new["cost"])


class RateSource(Protocol):
    """Where the learned rates come from (``gateway/tierview.py``): it holds the pins and says what the
    cost parameters are with them and with what it learned."""

    pinned: RatePins

    def rated(self, params: CostParams) -> CostParams: ...


class GatewayPolicy:
    """A gateway's run-time parameters: its cost model, and its session runtime's tool-wait planning and
    background prefill; with ``rates``, the operator's pins of the learned rates too."""

    def __init__(self, cost: CostModel, runtime: SessionRuntime, rates: RateSource | None = None) -> None:
        self.cost, self.runtime, self.rates = cost, runtime, rates

    def current(self) -> dict[str, BaseModel]:
        rt = self.runtime
        pinned = {} if self.rates is None else {"pinned": self.rates.pinned}
        return {"cost": self.cost.params, "waits": rt.learned.waits.params, "prefill": rt.controller.params.prefill,
                **pinned}

    def swap(self, new: dict[str, BaseModel]) -> None:
        rt = self.runtime
        if "cost" in new:
            self.cost.params = cast(CostParams, new["cost"])
        if self.rates is not None and ("cost" in new or "pinned" in new):
            if "pinned" in new:
                self.rates.pinned = cast(RatePins, new["pinned"])
            # The document's rates are its writer's (learned there); here they are pinned, else our own.
            self.cost.params = self.rates.rated(self.cost.params)
        if "waits" in new:
            rt.learned.waits.params = cast(WaitParams, new["waits"])
        if "prefill" in new:
            prefill = cast(PrefillParams, new["prefill"])
            rt.controller.params = replace(rt.controller.params, prefill=prefill)
            rt.learned.continues.params = prefill


class PolicyLog:
    """The last ``keep`` accepted changes, oldest first (each gateway process keeps its own)."""

    def __init__(self, keep: int = 256) -> None:
        self._changes: deque[PolicyChange] = deque(maxlen=keep)

    def apply(self, target: PolicyTarget | CostModel, changes: Any, who: str, via: str, reason: str = ""
              ) -> PolicyChange:
        """Validate ``changes`` ({section: {field: value}}; a bare cost model takes {field: value}) against
        the target's parameters, swap every section in at once, log what changed."""
        if isinstance(target, CostModel):
            if not isinstance(changes, dict):
                raise BadRequest('expected {"cost": {field: value}}', param="cost", code="invalid_type")
            target, changes = CostOnly(target), {"cost": changes}
        change, new = self.prepare(target, changes, who, via, reason)
        self.commit(target, new, change)
        return change

    @staticmethod
    def prepare(target: PolicyTarget, changes: Any, who: str, via: str, reason: str = "", at: float | None = None
                ) -> tuple[PolicyChange, dict[str, BaseModel]]:
        """The change ``changes`` makes to ``target``'s parameters, validated, and the sections it makes;
        nothing is touched."""
        old = target.current()
        new = validate(old, changes)
        diff = tuple(FieldChange(k if section == "cost" else f"{section}.{k}", getattr(old[section], k),
                                 getattr(model, k))
                     for section, model in new.items() for k in type(model).model_fields
                     if getattr(old[section], k) != getattr(model, k))
        return PolicyChange(time.time() if at is None else at, who, via, diff, reason[:MAX_REASON]), new

    def commit(self, target: PolicyTarget, new: dict[str, BaseModel], change: PolicyChange) -> None:
        target.swap(new)
        self._changes.append(change)

    def recent(self, limit: int = 0) -> list[PolicyChange]:
        items = list(self._changes)
        return items[-limit:] if limit > 0 else items
