"""The health state machine: hysteresis on the way out, a half-open probation on the way back."""

from kvgate.gateway.health import Health, HealthTracker


def test_soft_failures_eject_only_after_fall_in_a_row() -> None:
    h = HealthTracker(fall=3)
    assert not h.eligible and h.success() is False and h.state is Health.UP
    assert h.failure() is False and h.failure() is False and h.eligible
    h.success()  # any success resets the count
    assert h.failure() is False and h.failure() is False and h.failure() is True
    assert h.state is Health.DOWN and h.ejections == 1 and not h.eligible


def test_a_hard_failure_ejects_at_once() -> None:
    h = HealthTracker(fall=3)
    h.success()
    assert h.failure(hard=True) is True and h.state is Health.DOWN


def test_an_ejected_worker_comes_back_on_probation_and_one_failure_sends_it_out_again() -> None:
    h = HealthTracker(fall=3)
    h.success()
    h.failure(hard=True)
    assert h.success() is True and h.state is Health.PROBATION and h.eligible  # readmitted
    assert h.failure() is True and h.state is Health.DOWN and h.ejections == 2
    h.success()
    assert h.success() is False and h.state is Health.UP


def test_a_worker_down_from_the_start_is_not_readmitted_but_first_seen() -> None:
    h = HealthTracker()
    assert h.failure() is True and h.state is Health.DOWN
    assert h.success() is False and h.state is Health.UP
