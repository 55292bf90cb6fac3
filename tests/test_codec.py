"""Conversation records on the wire: round trips, unknown fields kept, packed tokens."""

from __future__ import annotations

from array import array

import msgpack
import pytest

from kvgate.kvstore.codec import CodecError, decode, encode_body, encode_head
from kvgate.router.residency import Residency
from kvgate.router.types import ConversationId, WorkerId
from kvgate.session.conversation import Chain, Conversation, Limits, TurnRecord
from kvgate.session.lifecycle import Event, Lifecycle
from kvgate.session.state import Answer, PendingPrefill, Reservation, SessionState
from kvgate.session.waits import WaitPlan


def record() -> Conversation:
    life = Lifecycle().on(Event.REQUEST, 1.0).on(Event.TOOL_CALLS, 2.0, tools=("grep",),
                                                     plan=WaitPlan(1.5, "reserve", 5.0))
    s = SessionState(life, Reservation(WorkerId("w1"), 900, 5.0, 3), PendingPrefill(WorkerId("w1"), 64, 1.5, 2),
                     Answer("t", 800, 1.0), (("lapse", 3),), 3)
    chain = Chain("<|im_start|>user\nhi", array("I", [5, 70000, 9]), array("I", [0]), array("I", [0]))
    c = Conversation(ConversationId("t/c"), "t", "header:x-conversation-id", created=1.0, session=s,
                     residency=Residency((("node0", 512, 1.0),)))
    c = c.with_turn(TurnRecord(WorkerId("w1"), "longest_prefix", 10, 5, 2, 0.01, 5, "gpu", at=2.0), Limits())
    c = c.with_turn(TurnRecord(WorkerId("w1"), "longest_prefix", 30, 8, 4, None, 8, "gpu", at=3.0,
                               recomputed_tokens=12, kv_bytes=4096, tpot_s=0.02, trace_id="ab" * 16,
                               span_id="cd" * 8), Limits())
    return c.with_reply("m", ({"role": "user", "content": "hi \ud800"},), {"role": "assistant", "content": "ok"},
                        [{"type": "function"}], chain, "resp-1", Limits())


def test_round_trip() -> None:
    c = record()
    back = decode(encode_head(c), encode_body(c))
    assert back == c and back.chain is not None and back.chain.tokens.tolist() == [5, 70000, 9]
    assert back.totals.turns == 2 and back.totals.uncached_prefill_tokens == 5 + 22
    assert back.totals.recomputed_history_tokens == 12 and back.totals.ttft_count == 1 and back.totals.tpot_count == 1
    assert back.turns[-1].trace_id == "ab" * 16 and back.turns[-1].kv_bytes == 4096
    head_only = decode(encode_head(c), None)
    assert head_only.session == c.session and head_only.history == () and head_only.body_gen == c.body_gen


def test_tokens_are_packed() -> None:
    c = record()
    body = msgpack.unpackb(encode_body(c), raw=False, unicode_errors="surrogatepass")
    assert body["chain"]["tokens"] == array("I", [5, 70000, 9]).tobytes()


def test_fields_a_newer_version_wrote_are_kept_and_written_back() -> None:
    c = record()
    head = msgpack.unpackb(encode_head(c), raw=False)
    head["priority_class"] = "interactive"  # a field this version does not know
    head["session"]["new_thing"] = 1  # and one inside a known map: ignored
    old = decode(msgpack.packb(head, use_bin_type=True), encode_body(c))
    assert old.session == c.session
    again = msgpack.unpackb(encode_head(old), raw=False)
    assert again["priority_class"] == "interactive"


def test_missing_fields_take_their_defaults_and_garbage_is_an_error() -> None:
    minimal = decode(msgpack.packb({"id": "x"}), None)
    assert minimal.session == SessionState() and minimal.turns == ()
    with pytest.raises(CodecError):
        decode(b"\xc1", None)
    with pytest.raises(CodecError):
        decode(msgpack.packb({"id": "x", "session": {"lifecycle": {"state": "flying"}}}), None)
