"""A circuit breaker: stops calling a backend that keeps failing, and probes it again after a backoff.

    closed     calls go through; `failure_threshold` failures in a row open it
    open       calls are refused at once (the caller answers a miss); after the
               backoff one call goes through as a probe
    half-open  that probe is in flight: a success closes the breaker, a failure
               opens it again with twice the backoff (up to `max_backoff_s`)

Any success closes the breaker, a late one from a call made before it opened too:
the backend answered. A probe that never reports back (its caller died) does not
wedge the breaker: once another backoff has passed, the next call probes.

Thread-safe: the tier manager's workers share one breaker per store.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@dataclass(frozen=True, slots=True)
class BreakerStatus:
    state: BreakerState
    reason: str | None  # the last failure while not closed
    retry_in_s: float  # until the next probe may go (0 when closed, or when one may go now)
    num_opens: int  # times it opened from closed since it was made (failed probes not counted)


class CircuitBreaker:
    def __init__(self, *, failure_threshold: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, got {failure_threshold}")
        if not 0 < backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s} and {max_backoff_s}")
        self.failure_threshold = failure_threshold
        self.base_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0  # in a row
        self._reason: str | None = None
        self._backoff_s = backoff_s
        self._retry_at = 0.0  # when open: the next probe's time; when half-open: when a lost probe is given up
        self._num_opens = 0

    def allow(self) -> bool:
        """Whether to make the call now; the caller then reports `record_success` or `record_failure`."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            now = self._clock()
            if now < self._retry_at:
                return False
            self._state = BreakerState.HALF_OPEN
            self._retry_at = now + self._backoff_s
            return True

    def record_success(self) -> bool:
        """Closes the breaker; True if it was not closed (the backend is back)."""
        with self._lock:
            reopened = self._state is not BreakerState.CLOSED
            self._state = BreakerState.CLOSED
            self._failures = 0
            self._reason = None
            self._backoff_s = self.base_backoff_s
            return reopened

    def record_failure(self, reason: str) -> bool:
        """Counts a failure (an error or a timeout); True if this one opened the breaker from closed."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN:
                self._backoff_s = min(2 * self._backoff_s, self.max_backoff_s)
                self._open(reason)
            elif self._state is BreakerState.CLOSED and self._failures >= self.failure_threshold:
                self._num_opens += 1
                self._open(reason)
                return True
            elif self._state is BreakerState.OPEN:
                self._reason = reason  # a call made before it opened: the newest word on the backend
            return False

    def status(self) -> BreakerStatus:
        with self._lock:
            retry_in = 0.0 if self._state is BreakerState.CLOSED else max(0.0, self._retry_at - self._clock())
            return BreakerStatus(self._state, self._reason, retry_in, self._num_opens)

    def _open(self, reason: str) -> None:
        self._state = BreakerState.OPEN
        self._reason = reason
        self._retry_at = self._clock() + self._backoff_s
