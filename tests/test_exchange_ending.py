"""gateway/lifecycle.py: what the end of one exchange must do, for every front."""

from __future__ import annotations

import pytest

from kvgate.gateway.lifecycle import ending


def test_a_whole_answer_is_timed_recorded_counted_and_logged() -> None:
    e = ending("done", 200, started=10.0, now=12.5)
    assert (e.held_s, e.record, e.status, e.disconnected, e.logged) == (2.5, True, "200", False, True)


def test_a_whole_error_answer_is_timed_but_not_recorded() -> None:
    e = ending("done", 429, 10.0, 11.0)
    assert e.held_s == 1.0 and not e.record and not e.logged and e.status == "429"


@pytest.mark.parametrize(("outcome", "status", "logged"), [("cancelled", "499", True), ("failed", "502", True),
                                                           ("unread", "200", False)])
def test_an_answer_not_read_whole_teaches_no_service_time_and_records_nothing(outcome: str, status: str,
                                                                              logged: bool) -> None:
    e = ending(outcome, 200, 10.0, 11.0)  # type: ignore[arg-type]
    assert e.held_s is None and not e.record and e.status == status and e.logged is logged
    assert e.disconnected is (outcome == "cancelled")


def test_an_answer_with_no_status_yet_counts_as_other() -> None:
    assert ending("unread", 0, 1.0, 2.0).status == "other"
