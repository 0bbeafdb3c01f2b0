"""The circuit breaker, on a fake clock: when it opens, how long it stays open, how it probes and closes."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock

from kvtierd.storage.circuit_breaker import BreakerState, BreakerStatus, CircuitBreaker


def make_breaker(clock: FakeClock, threshold: int = 3) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=threshold, backoff_s=1.0, max_backoff_s=4.0, clock=clock)


def test_it_opens_after_threshold_failures_in_a_row() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    assert breaker.allow()
    assert not breaker.record_failure("timeout")
    assert not breaker.record_failure("timeout")
    assert breaker.status().state is BreakerState.CLOSED and breaker.allow()
    assert breaker.record_failure("refused")  # the third one opens it
    status = breaker.status()
    assert (status.state, status.reason, status.retry_in_s, status.num_opens) == (BreakerState.OPEN, "refused", 1.0, 1)
    assert not breaker.allow()


def test_a_success_resets_the_count() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    breaker.record_failure("a")
    breaker.record_failure("b")
    assert not breaker.record_success()  # it was closed: nothing came back
    breaker.record_failure("c")
    breaker.record_failure("d")
    assert breaker.status().state is BreakerState.CLOSED


def test_after_the_backoff_one_probe_goes_and_its_success_closes() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock, threshold=1)
    breaker.record_failure("down")
    clock.advance(0.99)
    assert not breaker.allow()
    clock.advance(0.01)
    assert breaker.allow()  # the probe
    assert breaker.status().state is BreakerState.HALF_OPEN
    assert not breaker.allow()  # only one at a time
    assert breaker.record_success()
    assert breaker.status() == BreakerStatus(BreakerState.CLOSED, reason=None, retry_in_s=0.0, num_opens=1)
    assert breaker.allow()


def test_a_failed_probe_reopens_with_twice_the_backoff_up_to_the_cap() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock, threshold=1)
    breaker.record_failure("down")
    waits = []
    for _ in range(4):
        wait = breaker.status().retry_in_s
        waits.append(wait)
        clock.advance(wait)
        assert breaker.allow()
        assert not breaker.record_failure("still down")  # reopened from half-open: not a new opening
    assert waits == [1.0, 2.0, 4.0, 4.0]
    assert breaker.status().num_opens == 1
    clock.advance(4.0)
    assert breaker.allow()
    breaker.record_success()
    breaker.record_failure("down again")  # a fresh opening starts from the base backoff
    assert breaker.status().retry_in_s == 1.0 and breaker.status().num_opens == 2


def test_a_probe_that_never_reports_does_not_wedge_it() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock, threshold=1)
    breaker.record_failure("down")
    clock.advance(1.0)
    assert breaker.allow()  # this probe's caller vanishes
    clock.advance(0.5)
    assert not breaker.allow()
    clock.advance(0.5)
    assert breaker.allow()  # given up on: another probe goes


def test_a_late_failure_while_open_keeps_the_newest_reason_but_not_the_clock() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock, threshold=1)
    breaker.record_failure("refused")
    clock.advance(0.5)
    breaker.record_failure("timeout")  # a call made before it opened
    assert breaker.status().reason == "timeout" and breaker.status().retry_in_s == 0.5


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError, match="backoff"):
        CircuitBreaker(backoff_s=10, max_backoff_s=1)
