"""One sequence's speculation state: its proposer (n-gram or suffix index) and how much it drafts next.

Why adaptive: a draft row is not free here. On CPUs a verification row costs a sizeable part of
a decode step (measured on 2 cores with SmolLM2-135M: a 5-row step ~3.5x a 1-row step under load),
so drafting K tokens that get rejected makes a step slower for nothing. Each sequence drafts
one more token than it last had accepted (up to K), and after a step that accepted nothing it
pauses drafting for 1, 2, 4, ... 32 steps (reset by any acceptance): text that copies keeps
drafting long runs, free text soon stops paying for rows it does not use.

After a step that accepted *every* draft it doubles instead (1, 2, 4, 8, 16, up to K): a copy
that keeps matching is the case where long drafts pay, and growing one token a step spent most
of a copied run on short drafts. Measured (stop of 2026-12-05): a row costs ~0.16 of a 1-row
step on SmolLM2 (benchmarks/step_rows.py, CPU time), and on the `edit` workload's greedy output
K = 16 with doubling takes 140 steps for 400 tokens where one more a step took 165.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenpath.engine.spec.ngram import NgramIndex
from tokenpath.engine.spec.suffix import SuffixProposer

MAX_PAUSE = 32


@dataclass
class DraftState:
    index: NgramIndex | SuffixProposer | None  # the n-gram or suffix proposer (None: a draft model proposes)
    k: int  # the most tokens it drafts next step
    pause: int = 0  # steps left without drafting
    backoff: int = 0  # the pause after the next step that accepts nothing
    # A draft model's last proposal (draft_model.py): the sequence's length then, and its drafts.
    proposed_at: int = 0
    proposed: list[int] = field(default_factory=list)

    def valid_draft_kv(self, tokens: list[int]) -> int:
        """Positions whose draft-model KV holds this sequence's own tokens: all before the last
        proposal's first draft, and after them the drafts the target accepted (the last draft
        was never fed to the draft, so its KV was never written)."""
        n = m = 0
        if self.proposed_at:
            n = self.proposed_at
            for d in self.proposed[:-1]:
                if n + m >= len(tokens) or tokens[n + m] != d:
                    break
                m += 1
        return min(n + m, max(len(tokens) - 1, 0))

    def forget_draft_kv(self) -> None:
        """The sequence lost its blocks (preempted): the draft's KV must be recomputed."""
        self.proposed_at, self.proposed = 0, []

    def settle(self, accepted: int, max_k: int, proposed: int) -> None:
        """After a verification that accepted `accepted` of its `proposed` drafts: all of them
        doubles the next draft length, fewer sets it to one more than were accepted."""
        full = 0 < proposed == accepted
        self.k = min(max_k, max(accepted + 1, 2 * self.k) if full else accepted + 1)
        if accepted:
            self.backoff = 0
        else:
            self.backoff = min(MAX_PAUSE, 2 * self.backoff or 1)
            self.pause = self.backoff
