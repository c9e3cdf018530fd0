"""What a deployment can take: the capacity estimate admission decides with.

Learned from finished requests, not configured: the service time (dispatch to finish, an EWMA),
recent throughput (completions over a window), and the dispatch-to-first-token time (mean and
deviation EWMAs). `FlowController` (`controller.py`) turns them into predicted waits: a queued
request's wait is `requests ahead / drain rate`, with drain rate = dispatch slots / service time.
"""

from __future__ import annotations

import time
from collections import deque


class CapacityEstimator:
    """Service time EWMA and recent throughput (completions per second over a window)."""

    def __init__(self, initial_service_s: float, alpha: float, window_s: float = 30.0) -> None:
        self.service_s = initial_service_s
        self.alpha = alpha
        self.window_s = window_s
        self._done: deque[float] = deque()
        # Dispatch -> first token (the replica's own queue plus prefill): an EWMA of the mean and
        # of the absolute deviation. A dispatched request still waits this long for its first
        # token, which is what a client's `timeout` bounds; unknown until something has started.
        self.first_token_s: float | None = None
        self.first_token_dev = 0.0
        self.service_dev = 0.0  # EWMA of |service time - mean|, for the cautious wait below

    def observe_first_token(self, seconds: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = seconds
            return
        self.first_token_dev = (1 - self.alpha) * self.first_token_dev + self.alpha * abs(seconds - self.first_token_s)
        self.first_token_s = (1 - self.alpha) * self.first_token_s + self.alpha * seconds

    def first_token_estimate(self) -> float:
        """A pessimistic dispatch-to-first-token time (mean + 2 deviations): admitting a request
        that then times out costs a prefill and gives its client a 504 after the full wait."""
        return 0.0 if self.first_token_s is None else self.first_token_s + 2 * self.first_token_dev

    def observe(self, service_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        service_s = max(service_s, 1e-3)
        self.service_dev = (1 - self.alpha) * self.service_dev + self.alpha * abs(service_s - self.service_s)
        self.service_s = (1 - self.alpha) * self.service_s + self.alpha * service_s
        self._done.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._done and self._done[0] < now - self.window_s:
            self._done.popleft()

    def throughput(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        return len(self._done) / self.window_s

    def drain_rate(self, slots: int) -> float:
        """Requests per second the deployment finishes when saturated."""
        return max(slots, 1) / max(self.service_s, 1e-3)

    def predicted_wait(self, ahead: int, slots: int) -> float:
        return ahead / self.drain_rate(slots)

    def cautious_wait(self, ahead: int, slots: int) -> float:
        """The queue wait with service time at mean + 2 deviations: what a client's `timeout` is
        checked against. Under load the service time swings (batch size, a busy CPU), and a request
        admitted on the mean alone ends in a 504 after the client's whole timeout."""
        return ahead * (self.service_s + 2 * self.service_dev) / max(slots, 1)
