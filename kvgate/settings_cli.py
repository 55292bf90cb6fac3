"""Command-line options generated from a settings model: one per field, with its env var, its default and
its docstring's first sentence, so ``--help`` lists every setting and never drifts from the model."""

from __future__ import annotations

import argparse
import json
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

SCALARS = (int, float, str)
MAX_DEFAULT_CHARS = 60


def option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at character {exc.pos})") from None


def summary(field: FieldInfo) -> str:
    """The docstring's first sentence on one line, in plain text (no reST literals)."""
    text = " ".join((field.description or "").split("\n\n")[0].split()).replace("``", "`")
    end = text.find(". ")
    return (text if end < 0 else text[:end + 1]).rstrip()


def shown_default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None or value == [] or value == {}:
        return "none"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = json.dumps(value, separators=(",", ":")) if isinstance(value, dict | list) else str(value)
    return text if len(text) <= MAX_DEFAULT_CHARS else "see README"


def env_name(model: type[BaseModel], name: str) -> str:
    return f"{model.model_config.get('env_prefix', '')}{name}".upper()


def add_options(parser: argparse.ArgumentParser, model: type[BaseModel], skip: frozenset[str] = frozenset(),
                defaults: dict[str, str] | None = None) -> None:
    """One option per field of ``model`` not in ``skip``; ``defaults`` overrides the default shown."""
    group = parser.add_argument_group("settings", "every key of the configuration, as the KVGATE_* variable and "
                                      "the KVGATE_CONFIG file\nname it; a JSON value is merged into the file's.")
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        kind = _unwrap_optional(field.annotation)
        default = (defaults or {}).get(name) or shown_default(field)
        help_text = f"{summary(field)} (default: {default}; env {env_name(model, name)})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": name, "help": help_text, "default": None}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif get_origin(kind) is Literal:
            kw["choices"] = [str(a) for a in get_args(kind)]
        elif kind in SCALARS:
            kw["type"], kw["metavar"] = kind, "SECONDS" if name.endswith("_s") else kind.__name__.upper()
        else:
            kw["type"], kw["metavar"] = _json_value, "JSON"
        group.add_argument(option(name), **kw)


def overrides(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The settings given on the command line (options left out are None: the environment and file decide)."""
    return {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}
