"""One sequence's speculation state: its proposer index and how much it drafts next.

Why adaptive: a draft row is not free here. On CPUs a verification row costs a sizeable part of
a decode step (measured on 2 cores with SmolLM2-135M: a 5-row step ~3.5x a 1-row step under load),
so drafting K tokens that get rejected makes a step slower for nothing. Each sequence drafts
one more token than it last had accepted (up to K), and after a step that accepted nothing it
pauses drafting for 1, 2, 4, ... 32 steps (reset by any acceptance): text that copies keeps
drafting long runs, free text soon stops paying for rows it does not use.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenpath.engine.spec.ngram import NgramIndex

MAX_PAUSE = 32


@dataclass
class DraftState:
    index: NgramIndex
    k: int  # the most tokens it drafts next step
    pause: int = 0  # steps left without drafting
    backoff: int = 0  # the pause after the next step that accepts nothing

    def settle(self, accepted: int, max_k: int) -> None:
        """After a verification that accepted `accepted` drafts."""
        self.k = min(max_k, accepted + 1)
        if accepted:
            self.backoff = 0
        else:
            self.backoff = min(MAX_PAUSE, 2 * self.backoff or 1)
            self.pause = self.backoff
