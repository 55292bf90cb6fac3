"""gateway/lifecycle.py: the exchange with a worker as a pure state machine (events in, commands out), the
same for the proxy (trust ``own``) and the endpoint picker (trust ``claim``)."""

from __future__ import annotations

import pytest

from kvgate.gateway.exchange import Prepared
from kvgate.gateway.identity import Identity
from kvgate.gateway.lifecycle import (
    Accepted,
    Acquire,
    CountFailure,
    Ended,
    ExchangeLifecycle,
    Failed,
    FirstToken,
    InFlight,
    Learned,
    MarkFailed,
    Probe,
    Record,
    Relayed,
    Relaying,
    Release,
    RetryElsewhere,
    Trust,
)
from kvgate.gateway.prompts import Prompt
from kvgate.gateway.sse import SseSplitter
from kvgate.router.types import ConversationId, Decision, WorkerId
from kvgate.session.controller import Step
from kvgate.session.state import SessionState

W1, W2 = WorkerId("w1"), WorkerId("w2")


def prepared(length: int = 100, hide_usage: bool = False) -> Prepared:
    ident = Identity(ConversationId("c1"), "header", "t")
    return Prepared("chat", "m", ident, None, Prompt(length, {}, "local"), b"{}", {}, True, hide_usage,
                    Step(SessionState()), 0.0, True)


def started(trust: Trust = "own", cached: int = 40, now: float = 10.0) -> ExchangeLifecycle:
    lc = ExchangeLifecycle(prepared(), 16, {W1: 48, W2: 16}, 48, trust)
    lc.dispatched(Decision(W1, "cost", cached), "n1", now)
    return lc


def test_dispatched_takes_the_slot_and_counts_the_prompt_in_flight() -> None:
    lc = ExchangeLifecycle(prepared(), 16, {W1: 48}, 48)
    cmds = lc.dispatched(Decision(W1, "cost", 40), "n1", 10.0)
    assert cmds == [Acquire(W1, 60), InFlight(W1)]
    ex = lc.current
    assert (ex.started, ex.node, ex.chosen_matched_tokens, ex.best_matched_tokens) == (10.0, "n1", 48, 48)
    assert lc.tried == {W1}


@pytest.mark.parametrize("status", [200, 204, 302])
@pytest.mark.parametrize("trust", ["own", "claim"])
def test_an_answer_below_400_is_accepted_and_the_cache_learns(trust: Trust, status: int) -> None:
    assert started(trust).answered(status, 11.0) == Accepted((Learned(W1),))


@pytest.mark.parametrize("trust", ["own", "claim"])
def test_a_4xx_is_the_workers_answer(trust: Trust) -> None:
    assert started(trust).answered(429, 11.0) == Failed("worker", ())


@pytest.mark.parametrize("status", [502, 503, 504])
def test_own_502_503_504_retry_elsewhere_and_count_against_the_workers_health(status: int) -> None:
    v = started("own").answered(status, 11.0, "overloaded")
    assert v == RetryElsewhere(f"worker w1 answered {status}", True,
                               (MarkFailed(W1, f"HTTP {status}: overloaded", "status_5xx"),))


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_claimed_502_503_504_never_touches_health_it_asks_for_a_probe(status: int) -> None:
    v = started("claim").answered(status, 11.0)
    assert isinstance(v, RetryElsewhere) and v.commands == (Probe(W1),)


@pytest.mark.parametrize("status", [500, 501, 599, 600])
def test_own_other_5xx_is_the_requests_failure_counted_not_a_health_failure(status: int) -> None:
    assert started("own").answered(status, 11.0) == Failed("request_failed", (CountFailure(W1, "status_500"),))


@pytest.mark.parametrize("status", [500, 0, 100])
def test_a_claimed_500_or_no_status_settles_the_request_only(status: int) -> None:
    assert started("claim").answered(status, 11.0) == Failed("worker", ())


def test_two_answered_502s_exhaust_the_retries_and_connection_failures_do_not() -> None:
    lc = started()
    assert isinstance(lc.unsent("refused", "ConnectError", 10.5), RetryElsewhere)
    lc.answered(503, 11.0)
    assert not lc.exhausted
    lc.dispatched(Decision(W2, "cost", 0), "n2", 12.0)
    assert lc.current.chosen_matched_tokens == 16
    assert lc.unsent("refused", "ConnectError", 12.1).answered is False
    assert not lc.exhausted
    lc.answered(502, 13.0)
    assert lc.exhausted and lc.tried == {W1, W2}


def test_lost_marks_the_worker_and_fails_the_request() -> None:
    assert started().lost("reset", "ReadError", 11.0) == Failed("lost", (MarkFailed(W1, "reset", "ReadError"),))


def test_a_whole_answer_ends_with_its_service_time_record_and_end_in_order() -> None:
    lc = started()
    lc.answered(200, 10.5)
    cmds = lc.ended("done", 200, 12.5)
    assert [type(c) for c in cmds] == [Release, Relayed, Record, Ended]
    rel = cmds[0]
    assert rel == Release(W1, 60, 100, False, 2.5)
    end = cmds[-1]
    assert isinstance(end, Ended) and end.ending.logged and end.ending.counted and end.ending.status == "200"
    assert lc.ended("done", 200, 13.0) == [] and lc.abandoned(13.0) == []  # once


def test_a_cancelled_stream_teaches_no_service_time_records_nothing_and_counts_a_disconnect() -> None:
    lc = started()
    cmds = lc.ended("cancelled", 200, 12.0)
    assert not any(isinstance(c, Record) for c in cmds)
    assert isinstance(cmds[0], Release) and cmds[0].held_s is None
    end = cmds[-1]
    assert isinstance(end, Ended) and end.ending.disconnected and end.ending.status == "499" and end.ending.logged


def test_a_failed_stream_is_a_502_and_not_a_disconnect() -> None:
    end = started().ended("failed", 200, 12.0)[-1]
    assert isinstance(end, Ended) and end.ending.status == "502" and not end.ending.disconnected


def test_an_unread_answer_is_not_logged_and_a_front_may_count_it_itself() -> None:
    end = started().ended("unread", 503, 12.0)[-1]
    assert isinstance(end, Ended) and not end.ending.logged and end.ending.status == "503"
    end = started().ended("done", 200, 12.0, streamed=False, counted=False)[-1]
    assert isinstance(end, Ended) and not end.ending.counted and end.ending.logged


def test_abandoned_gives_only_the_slot_back() -> None:
    lc = started()
    assert lc.abandoned(11.0) == [Release(W1, 60)]
    assert lc.abandoned(11.0) == []


def test_moved_gives_the_slot_to_the_endpoint_that_served() -> None:
    lc = started("claim")
    cmds = lc.moved(W2, "n2", 11.0)
    assert cmds == [Release(W1, 60), Acquire(W2, 100), InFlight(W2)]  # no cached tokens expected there
    ex = lc.current
    assert (ex.decision.worker, ex.decision.reason, ex.node, ex.chosen_matched_tokens, ex.best_matched_tokens) \
        == (W2, "fallback", "n2", 0, 48)
    rel = lc.ended("done", 200, 12.0)[0]
    assert isinstance(rel, Release) and rel.worker == W2 and rel.prefill_tokens == 100


def test_events_read_the_first_token_usage_and_id() -> None:
    lc = started()
    evs = SseSplitter().feed(b'data: {"id":"r1","choices":[{"delta":{"role":"assistant"}}]}\n\n'
                             b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
                             b'data: {"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":2}}\n\n')
    out = [lc.event(ev, 10.0 + i) for i, ev in enumerate(evs)]
    assert [first for _, first in out] == [None, FirstToken(W1, 60, 100, 11.0), None]
    assert all(b is not None for b, _ in out)
    ex = lc.current
    assert ex.ttft_s == 1.0 and ex.response_id == "r1" and ex.usage is not None and ex.usage.completion_tokens == 2
    rel = lc.ended("done", 200, 13.0)[0]
    assert isinstance(rel, Release) and rel.got_first_token and rel.held_s == 3.0


def test_usage_the_client_did_not_ask_for_is_hidden() -> None:
    lc = ExchangeLifecycle(prepared(hide_usage=True), 16)
    lc.dispatched(Decision(W1, "cost", 0), "n1", 0.0)
    (usage_only, mixed) = SseSplitter().feed(
        b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n')
    assert lc.event(usage_only, 1.0)[0] is None
    out, _ = lc.event(mixed, 1.0)
    assert out is not None and b"usage" not in out and b'"x"' in out


def test_a_unary_body_is_read_whole() -> None:
    lc = started()
    body = b'{"id":"r2","choices":[{"message":{"role":"assistant","content":"ok"}}],' \
           b'"usage":{"prompt_tokens":100,"completion_tokens":1}}'
    assert lc.body(body, 11.0) == body
    ex = lc.current
    assert ex.response_id == "r2" and ex.usage is not None and ex.reply.content == "ok"


def test_the_answer_starting_to_come_back_is_a_hook() -> None:
    assert started().relaying(11.0) == [Relaying()]
