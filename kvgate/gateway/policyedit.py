"""Changing routing and session parameters at run time, shared by ``PATCH /admin/policy`` and the gRPC
``Policy.UpdatePolicy``: one validation (every new parameter set is checked whole, then all are swapped
in at once, so no change is half-applied) and one bounded log of who changed what."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

from pydantic import BaseModel, ValidationError

from kvgate.errors import BadRequest, UnprocessableEntity
from kvgate.router.cost import CostModel, CostParams
from kvgate.session.prefill import PrefillParams
from kvgate.session.waits import WaitParams

if TYPE_CHECKING:
    from kvgate.gateway.runtime import SessionRuntime

MAX_REASON = 1024


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
        bad = next((k for k, v in fields.items() if isinstance(v, float) and not math.isfinite(v)), None)
        if bad is not None:
            raise UnprocessableEntity(f"{section}.{bad}: must be a finite number", param=f"{section}.{bad}",
                                      code="invalid_value")
        try:
            new[section] = type(current[section]).model_validate({**current[section].model_dump(), **fields})
        except ValidationError as exc:
            err = exc.errors()[0]
            raise UnprocessableEntity(f"{section}.{'.'.join(str(x) for x in err['loc'])}: {err['msg']}",
                                      param=f"{section}.{err['loc'][0]}", code="invalid_value") from None
    return new


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


class GatewayPolicy:
    """A gateway's run-time parameters: its cost model, and its session runtime's tool-wait planning and
    background prefill."""

    def __init__(self, cost: CostModel, runtime: SessionRuntime) -> None:
        self.cost, self.runtime = cost, runtime

    def current(self) -> dict[str, BaseModel]:
        rt = self.runtime
        return {"cost": self.cost.params, "waits": rt.learned.waits.params, "prefill": rt.controller.params.prefill}

    def swap(self, new: dict[str, BaseModel]) -> None:
        rt = self.runtime
        if "cost" in new:
            self.cost.params = cast(CostParams, new["cost"])
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
        old = target.current()
        new = validate(old, changes)
        diff = tuple(FieldChange(k if section == "cost" else f"{section}.{k}", getattr(old[section], k),
                                 getattr(model, k))
                     for section, model in new.items() for k in type(model).model_fields
                     if getattr(old[section], k) != getattr(model, k))
        target.swap(new)
        change = PolicyChange(time.time(), who, via, diff, reason[:MAX_REASON])
        self._changes.append(change)
        return change

    def recent(self, limit: int = 0) -> list[PolicyChange]:
        items = list(self._changes)
        return items[-limit:] if limit > 0 else items
