"""What a verification row costs in THIS engine, and how many drafts pay at that price.

Why learned, not a constant: a row's price depends on the threads, the model, its quantization
and the host. On 2 cores with SmolLM2-135M Q4_1 (benchmarks/step_rows.py, context 400) a 17-row
step was 4.2x a 1-row step by one thread's CPU time but more than that by the wall clock on two
threads, where the 1-row step splits over the threads better than extra rows do (state.py has
the table). The engine already times every step; `StepPrices` keeps the recent times of decode
steps keyed by the step's total rows, and `best_drafts` weighs the tokens a draft is expected to
add against what its rows cost at those prices.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque

# A row's price, as a fraction of a 1-row step, used only until the engine has timed steps of
# other sizes (then the timings replace it): between the one-thread and two-thread figures of
# state.py's table, so a fresh engine neither drafts long blindly nor never tries drafting.
PRIOR_ROW_COST = 0.25
WINDOW = 9  # recent timings kept per row count: the median shrugs off a step the host delayed
MAX_ROWS = 512  # step sizes above this are not kept (no drafting step is that big)


class StepPrices:
    """Median recent wall time of a decode-only step, by its total rows; unseen sizes are
    interpolated between seen ones, and extrapolated past the largest at the average per-row
    slope seen (optimistic where the curve bends up, so a longer draft gets tried and timed)."""

    def __init__(self, window: int = WINDOW, prior_row_cost: float = PRIOR_ROW_COST) -> None:
        self.window = window
        self.prior_row_cost = prior_row_cost
        self._times: dict[int, deque[float]] = {}
        self._median: dict[int, float] = {}
        self._keys: list[int] = []

    def observe(self, rows: int, seconds: float) -> None:
        """One decode step of `rows` rows (all sequences' tokens, drafts included) took `seconds`."""
        if not 0 < rows <= MAX_ROWS or seconds <= 0:
            return
        times = self._times.get(rows)
        if times is None:
            times = self._times[rows] = deque(maxlen=self.window)
            self._keys.insert(bisect_left(self._keys, rows), rows)
        times.append(seconds)
        self._median[rows] = _median(times)

    def observed(self, rows: int) -> int:
        """How many recent timings of `rows`-row steps it holds."""
        return len(self._times.get(rows, ()))

    def price(self, rows: int) -> float:
        """A `rows`-row step's expected time (seconds; with no timing at all, in 1-row steps)."""
        keys = self._keys
        if not keys:
            return 1.0 + self.prior_row_cost * (rows - 1)
        if rows in self._median:
            return self._median[rows]
        i = bisect_left(keys, rows)
        if i == 0:  # below the smallest size seen: scale it by the prior's shape
            lo = keys[0]
            return self._median[lo] * (1 + self.prior_row_cost * (rows - 1)) / (1 + self.prior_row_cost * (lo - 1))
        lo = keys[i - 1]
        if i < len(keys):
            hi = keys[i]
            f = (rows - lo) / (hi - lo)
            return self._median[lo] * (1 - f) + self._median[hi] * f
        first = keys[0]
        if lo == first:  # one size seen: the prior's per-row cost, relative to it
            per_row = self._median[lo] * self.prior_row_cost / (1 + self.prior_row_cost * (lo - 1))
        else:
            per_row = max(0.0, (self._median[lo] - self._median[first]) / (lo - first))
        return self._median[lo] + per_row * (rows - lo)


def expected_tokens(accept: float, k: int) -> float:
    """Tokens a step emits for a sequence drafting `k` tokens, each accepted with probability
    `accept` given the ones before it were: 1 + a + a^2 + ... + a^k (the last is the target's own)."""
    total, term = 1.0, 1.0
    for _ in range(k):
        term *= accept
        total += term
    return total


def best_drafts(prices: StepPrices, accept: float, limit: int, rows: int = 1, margin: float = 0.05) -> int:
    """The draft length (0..`limit`) that maximizes the step's tokens per second for a sequence
    whose drafts are accepted with probability `accept`, in a step already holding `rows` rows
    (its own plain row included; the other rows' sequences emit one token each): 0 unless some
    length beats plain decoding by `margin`. In a batch the extra rows are cheaper per row, and
    the gain is weighed against the whole step's time, so it drafts more there where rows are cheap."""
    rows = max(1, rows)
    base = rows / prices.price(rows)
    best, best_k = base * (1 + margin), 0
    for k in range(1, limit + 1):
        rate = (rows - 1 + expected_tokens(accept, k)) / prices.price(rows + k)
        if rate > best:
            best, best_k = rate, k
    return best_k


def _median(values: deque[float]) -> float:
    """statistics.median's value (the middle one, or the mean of the middle two), without importing
    statistics, whose `fractions` and `decimal` are ~1 MiB of every engine process."""
    data = sorted(values)
    n = len(data)
    return data[n // 2] if n % 2 else (data[n // 2 - 1] + data[n // 2]) / 2
