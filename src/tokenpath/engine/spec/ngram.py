"""The n-gram (prompt lookup) proposer: the K tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, n from `max_n` down to `min_n`.

It runs every step for every speculating sequence, so it keeps an incremental index per
sequence: for each n, a dict from an n-gram to the position just after its latest occurrence.
Each step inserts only the n-grams the new tokens completed (a few dict writes) and looks up
at most `max_n - min_n + 1` keys: O(new tokens), not O(context). The prompt is indexed once, on
the sequence's first proposal (about 1 microsecond a token and n). The index lags one n-gram
behind the end, so the lookup of the last n tokens finds an *earlier* occurrence, never itself.

A copy in progress continues from its source: when everything the sequence gained since the last
proposal is what followed that proposal's source, the next drafts are what follows there, without
a lookup. That source matches the sequence's last n + (tokens gained) tokens, a longer match than
any n-gram of at most max_n, and the lookup would otherwise jump to the latest occurrence of a
short n-gram that code and prose repeat (`    return`, `, and the`), away from the text being
copied. Measured on the `edit` workload's greedy output (benchmarks/spec_decode.py, K = 16,
lookup 2..3): 140 -> 112 verification steps for 400 tokens.
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
    # The last proposal: where its drafts were copied from, and the sequence's length then
    # (source -1: it proposed nothing).
    source: int = -1
    proposed_at: int = 0

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
            self.upto, self.source = 0, -1
        self._index(tokens, end)
        follow = self._continued(tokens, end)
        if follow < 0:
            follow = self._lookup(tokens, end)
        self.source, self.proposed_at = follow, end
        return tokens[follow : follow + k] if follow >= 0 else []

    def _continued(self, tokens: list[int], end: int) -> int:
        """Where the last proposal's source continues, if the tokens gained since then are the
        ones that followed it there (-1: they are not, or there was no source)."""
        src, at = self.source, self.proposed_at
        if src < 0 or at > end:
            return -1
        gained = end - at
        follow = src + gained
        if follow >= end or tokens[src:follow] != tokens[at:end]:
            return -1
        return follow

    def _lookup(self, tokens: list[int], end: int) -> int:
        """Where the latest earlier occurrence of the longest matching n-gram ends (-1: none)."""
        for j in range(self.max_n - self.min_n, -1, -1):
            n = self.min_n + j
            if end <= n:
                continue
            follow = self.last[j].get(tuple(tokens[end - n :]))
            if follow is not None:
                return follow
        return -1
