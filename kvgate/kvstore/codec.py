"""Conversation records on the wire: versioned, name-keyed, compact (msgpack, token ids packed).

A record is two values: the *head* (home worker, the controller's state, turn records, counters:
small, rewritten on every change) and the *body* (the last turn's history, tools, exact replies,
response ids and chain: large, rewritten only when a turn completes). The body carries a generation
number so a replica that already holds it skips reading it.

Every field is keyed by its name. A reader ignores fields it does not know and keeps them: an older
replica rewriting a record during a rolling upgrade writes a newer replica's fields back unchanged.
A missing field takes its default. Token ids are packed little-endian ``uint32`` bytes, not lists.
"""

from __future__ import annotations

import enum
import functools
import sys
import types
import typing
from array import array
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass, replace
from typing import Any, TypeVar, cast, get_args, get_origin

import msgpack

from kvgate.router.residency import Residency
from kvgate.router.types import ConversationId
from kvgate.session.conversation import Chain, Conversation, Totals, TurnRecord
from kvgate.session.state import SessionState

SCHEMA = 1
"""Bumped when a field changes meaning (not when one is added: added fields are read by name)."""

_HEAD = ("id", "tenant", "id_source", "version", "created", "last_activity", "home", "session", "residency",
         "turns", "turn_count", "totals", "body_gen", "reset")
_BODY = ("model", "history", "tools", "exact", "responses")
EXTRAS = "_extras"
"""Where a decoded map keeps the fields this version does not know (written back on encode)."""

T = TypeVar("T")


class CodecError(ValueError):
    """A value that is not a conversation record (corrupt, or not kvgate's)."""


def _pack(obj: Any) -> bytes:
    # Surrogates survive a JSON body ("\ud800" is valid JSON): keep them rather than fail the write.
    out: bytes = msgpack.packb(obj, use_bin_type=True, unicode_errors="surrogatepass")
    return out


def _unpack(raw: bytes) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False, unicode_errors="surrogatepass")
    except (ValueError, msgpack.UnpackException) as exc:
        raise CodecError(f"not msgpack: {exc}") from exc


# -- dataclasses by field name --------------------------------------------------------------------
def to_map(obj: Any) -> dict[str, Any]:
    assert is_dataclass(obj) and not isinstance(obj, type)
    return {name: _enc(getattr(obj, name)) for name in _names(type(obj))}


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if f.compare)


def _enc(v: Any) -> Any:
    if is_dataclass(v) and not isinstance(v, type):
        return to_map(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple | list):
        return [_enc(x) for x in v]
    return v


Decoder = Callable[[Any], Any]


def from_map(cls: type[T], d: Any) -> T:
    out: T = _decoder(cast(Any, cls))(d)
    return out


@functools.cache
def _decoder(tp: Any) -> Decoder:
    """A function that decodes a stored value of type ``tp``, built once per type: resolving annotations
    and inspecting types per value would cost more than the values (a record holds dozens of turns)."""
    origin, args = get_origin(tp), get_args(tp)
    if hasattr(tp, "__supertype__"):  # a NewType (WorkerId): checked as what it wraps
        return _decoder(tp.__supertype__)
    if origin in (typing.Union, types.UnionType):
        inner = _decoder(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if isinstance(tp, type) and is_dataclass(tp):
        return _dataclass_decoder(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return functools.partial(_enum, tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _decoder(args[0])
            return lambda v: tuple(item(x) for x in _array(v))
        items = tuple(_decoder(a) for a in args)
        return lambda v: tuple(f(x) for f, x in zip(items, _array(v), strict=True))
    if tp is float:
        return _float
    if tp in (int, str, bool, bytes):
        return functools.partial(_scalar, tp)
    return lambda v: v


def _dataclass_decoder(cls: type) -> Decoder:
    hints = typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    known = {f.name: _decoder(hints[f.name]) for f in fields(cls) if f.compare}

    def decode_one(d: Any) -> Any:
        if not isinstance(d, Mapping):
            raise CodecError(f"{cls.__name__}: expected a map, got {type(d).__name__}")
        try:
            return cls(**{k: known[k](v) for k, v in d.items() if k in known})
        except (TypeError, ValueError) as exc:
            raise CodecError(f"{cls.__name__}: {exc}") from exc

    return decode_one


def _enum(tp: type[enum.Enum], v: Any) -> enum.Enum:
    try:
        return tp(v)
    except ValueError as exc:
        raise CodecError(str(exc)) from None


def _array(v: Any) -> list[Any] | tuple[Any, ...]:
    if not isinstance(v, list | tuple):
        raise CodecError(f"expected an array, got {type(v).__name__}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise CodecError(f"expected a number, got {type(v).__name__}")
    return float(v)


def _scalar(tp: type, v: Any) -> Any:
    # A value of the wrong type would be read back fine and fail later, far from the store (a str where
    # the controller adds tokens): refused here, where the record can still be reset.
    if not isinstance(v, tp) or (tp is int and isinstance(v, bool)):
        raise CodecError(f"expected {tp.__name__}, got {type(v).__name__}")
    return v


# -- the record ------------------------------------------------------------------------------------
def encode_head(c: Conversation) -> bytes:
    m = {k: _enc(getattr(c, k)) for k in _HEAD}
    m["schema"] = SCHEMA
    m.update(c.extras.get("head", {}))
    return _pack(m)


def encode_body(c: Conversation) -> bytes:
    m: dict[str, Any] = {k: _enc(getattr(c, k)) for k in _BODY}
    m["body_gen"] = c.body_gen
    m["chain"] = None if c.chain is None else _chain(c.chain)
    m.update(c.extras.get("body", {}))
    return _pack(m)


def _chain(ch: Chain) -> dict[str, Any]:
    return {"text": ch.text, "tokens": _u32(ch.tokens), "anchor_chars": _u32(ch.anchor_chars),
            "anchor_tokens": _u32(ch.anchor_tokens), "engine": None if ch.engine is None else _u32(ch.engine)}


def _u32(a: array[int]) -> bytes:
    b = a if a.typecode == "I" and sys.byteorder == "little" else array("I", a)
    if sys.byteorder != "little":
        b.byteswap()
    return b.tobytes()


def _from_u32(raw: Any) -> array[int]:
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise CodecError("packed token ids must be bytes of uint32")
    a = array("I")
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def decode(head: bytes, body: bytes | None) -> Conversation:
    """A record from its head and (when given) its body; without a body the record has no history.
    Every field is checked for its type: a value that would fail later (in the controller, in a reply)
    fails here, as a ``CodecError``."""
    try:
        return _decode(head, body)
    except CodecError:
        raise
    except (TypeError, ValueError, AttributeError, OverflowError, RecursionError, KeyError) as exc:
        raise CodecError(f"not a conversation record: {exc}") from exc


def _get(m: Mapping[str, Any], key: str, tp: type[T] | tuple[type, ...], default: Any) -> Any:
    v = m.get(key)
    if v is None:
        return default
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if not isinstance(v, tp) or (tp is int and isinstance(v, bool)):
        raise CodecError(f"{key}: expected {getattr(tp, '__name__', tp)}, got {type(v).__name__}")
    return v


def _decode(head: bytes, body: bytes | None) -> Conversation:
    h = _unpack(head)
    if not isinstance(h, dict) or not isinstance(h.get("id"), str):
        raise CodecError("a conversation head is a map with an id")
    if not isinstance(h.get("schema", SCHEMA), int):
        raise CodecError("schema: expected an int")
    extras: dict[str, dict[str, Any]] = {"head": {k: v for k, v in h.items() if k not in (*_HEAD, "schema")}}
    kw: dict[str, Any] = {
        "id": ConversationId(h["id"]), "tenant": _get(h, "tenant", str, ""), "id_source": _get(h, "id_source", str, ""),
        "version": _get(h, "version", int, 0), "created": _get(h, "created", float, 0.0),
        "last_activity": _get(h, "last_activity", float, 0.0), "home": _get(h, "home", str, None),
        "session": from_map(SessionState, h.get("session") or {}),
        "residency": from_map(Residency, h.get("residency") or {}),
        "turns": tuple(from_map(TurnRecord, t) for t in _get(h, "turns", list, ())),
        "turn_count": _get(h, "turn_count", int, 0), "totals": from_map(Totals, h.get("totals") or {}),
        "body_gen": _get(h, "body_gen", int, 0), "reset": _get(h, "reset", str, "")}
    if body is not None:
        kw.update(_decode_body(body, extras))
    return Conversation(**kw, extras=extras)


def _decode_body(raw: bytes, extras: dict[str, dict[str, Any]]) -> dict[str, Any]:
    b = _unpack(raw)
    if not isinstance(b, dict):
        raise CodecError("a conversation body is a map")
    extras["body"] = {k: v for k, v in b.items() if k not in (*_BODY, "body_gen", "chain")}
    ch = b.get("chain")
    chain = None
    if ch is not None:
        if not isinstance(ch, dict):
            raise CodecError("chain: expected a map")
        engine = ch.get("engine")
        chain = Chain(_get(ch, "text", str, ""), _from_u32(ch.get("tokens", b"")),
                      _from_u32(ch.get("anchor_chars", b"")), _from_u32(ch.get("anchor_tokens", b"")),
                      None if engine is None else _from_u32(engine))
        if (len(chain.anchor_chars) != len(chain.anchor_tokens) or max(chain.anchor_chars, default=0) > len(chain.text)
                or max(chain.anchor_tokens, default=0) > len(chain.tokens)):
            raise CodecError("chain: anchors that do not fit its text and tokens")
    return {"model": _get(b, "model", str, ""), "history": _messages(b, "history"), "tools": b.get("tools"),
            "exact": _messages(b, "exact"), "responses": tuple(_strings(_get(b, "responses", list, ()))),
            "chain": chain}


def _messages(b: Mapping[str, Any], key: str) -> tuple[dict[str, Any], ...]:
    msgs = _get(b, key, list, ())
    if not all(isinstance(m, dict) and all(isinstance(k, str) for k in m) for m in msgs):
        raise CodecError(f"{key}: expected maps of named fields")
    return tuple(msgs)


def _strings(items: list[Any]) -> list[str]:
    if not all(isinstance(x, str) for x in items):
        raise CodecError("expected strings")
    return items


def with_body(head: Conversation, body: Conversation) -> Conversation:
    """``head``'s record with the body (history, tools, exact replies, responses, chain) of ``body``, a
    record of the same body generation this replica already decoded."""
    extras = {**head.extras, "body": body.extras.get("body", {})}
    return replace(head, model=body.model, history=body.history, tools=body.tools, exact=body.exact,
                   responses=body.responses, chain=body.chain, extras=extras)
