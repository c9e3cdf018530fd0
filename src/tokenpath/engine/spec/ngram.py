"""The n-gram (prompt lookup) proposer: the K tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, n from `max_n` down to `min_n`.

It runs every step for every speculating sequence, so it keeps an incremental index per
sequence: for each n, a dict from an n-gram to the position just after its latest occurrence.
Each step inserts only the n-grams the new tokens completed (a few dict writes) and looks up
at most `max_n - min_n + 1` keys: O(new tokens), not O(context). The prompt is indexed once, on
the sequence's first proposal (about 1 microsecond a token and n). The index lags one n-gram
behind the end, so the lookup of the last n tokens finds an *earlier* occurrence, never itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """One sequence's index: `last[n - min_n]` maps an n-gram to where its latest indexed
    occurrence ends; n-grams ending before `upto` are indexed."""

    min_n: int
    max_n: int
    last: list[dict[tuple[int, ...], int]] = field(default_factory=list)
    upto: int = 0

    def __post_init__(self) -> None:
        self.last = [{} for _ in range(self.min_n, self.max_n + 1)]

    def _index(self, tokens: list[int], end: int) -> None:
        """Index the n-grams ending at positions upto+1 .. end (exclusive of `end` itself: end is
        the sequence's length, whose n-gram is the query)."""
        for stop in range(max(self.upto, self.min_n), end):
            for j, n in enumerate(range(self.min_n, self.max_n + 1)):
                if stop >= n:
                    self.last[j][tuple(tokens[stop - n : stop])] = stop
        self.upto = max(self.upto, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens for what follows `tokens` (empty: no n-gram matched)."""
        end = len(tokens)
        if end < self.upto:  # the sequence got shorter (never in the engine): start over
            self.last = [{} for _ in self.last]
            self.upto = 0
        self._index(tokens, end)
        for j in range(self.max_n - self.min_n, -1, -1):
            n = self.min_n + j
            if end <= n:
                continue
            follow = self.last[j].get(tuple(tokens[end - n :]))
            if follow is not None:
                return tokens[follow : follow + k]
        return []
