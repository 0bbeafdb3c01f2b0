"""Waiting in tests: a condition decides when the wait ends, never the clock.

The guard only turns a hang (a condition that never comes true) into a failure
that says what was awaited. It is no speed bound: it is far longer than any
machine needs, so a slow or busy machine passes the same tests as a fast one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

HANG_GUARD_S = 300.0  # a test waiting this long on one condition is hung, not slow
T = TypeVar("T")


def wait_until(condition: Callable[[], T], what: str, poll_s: float = 0.05, guard_s: float = HANG_GUARD_S) -> T:
    """Polls `condition` until it returns something true, and returns that."""
    deadline = time.monotonic() + guard_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"hung: {what} did not happen in {guard_s:.0f} s (a hang guard, not a speed bound)")
        time.sleep(poll_s)
    return value
