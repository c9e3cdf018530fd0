"""One sequence's speculation state: its proposer (n-gram or suffix index) and how much it drafts next.

Why adaptive: a draft row is not free here. On CPUs a verification row costs a sizeable part of
a decode step, so drafting K tokens that get rejected makes a step slower for nothing. Two rules
decide how many tokens a sequence drafts next:

1. The cap (the earlier rule, kept): at most one more than it last had accepted (up to K), and
   after a step that accepted *every* draft, double instead (1, 2, 4, 8, 16): a copy that keeps
   matching is the case where long drafts pay, and growing one token a step spent most of a
   copied run on short drafts (the `edit` workload's greedy output, K = 16: 140 steps for 400
   tokens with doubling, 165 with one more a step). After a step that accepted nothing it pauses
   drafting for 1, 2, 4, ... 32 steps (reset by any acceptance).
2. The price (draft_policy "cost", selectable, not the default; cost.py): under the cap, it drafts the k that
   maximizes expected tokens per unit of step time, (1 + a + ... + a^k) / price(1 + k rows) over
   price(1 row), with `accept` (a) an EWMA of its drafts' acceptance and the prices the engine's
   own recent decode-step times by rows (threads, model, host as they are). None beating a plain
   step by 5%: no drafts, and a pause, after which one draft probes whether drafting pays again.
   In a batch the step's other rows count (cost.best_drafts): extra rows are cheaper there.

After a step that accepted every draft the doubled cap itself is drafted, unpriced: pricing a
fresh copy from an estimate starting at 0.5 ramped it up too slowly (`quote_copy`, 144 tokens:
18 steps against the doubling's 14, 0.75x by CPU time, loaded).

Why both: the cap is what ramps a copy up quickly and stops at once when a copy ends (the EWMA
alone takes a few misses to fall); the price is what stops paraphrase and free text from paying
for rows that one configuration can afford and another cannot. Measured on 2 cores, SmolLM2-135M
Q4_1, context 400 (benchmarks/step_rows.py): one thread by CPU time, a 2-row step 1.18x a 1-row
step, 5 rows 1.48x, 9 rows 2.31x, 17 rows 4.24x (of a 11.7 ms step); two threads, by their CPU,
17 rows 3.40x of an 18.6 ms step, and by the wall clock under load 5.78x, noise mostly
(benchmarks/results/spec_cost.md). The same fixed rule won on one thread and lost on `quote`
(0.86x) on two by the wall clock: what a row costs is the configuration's, so it is measured.
Measured quiet afterwards (2 threads, wall clock, benchmarks/results/spec_cost_vs_adaptive_quiet.md),
the prices drafted too little: against the cap alone `edit` 0.87x, `free` 0.95x, `quote` 1.05x,
while the cap alone lost nowhere against no speculation (`quote` 1.03x, `free` 1.19x). So the
default is "adaptive", the cap alone; "cost" stays for A/B runs on other hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenpath.engine.spec.ngram import NgramIndex
from tokenpath.engine.spec.suffix import SuffixProposer

MAX_PAUSE = 32
ACCEPT_PRIOR = 0.5  # a new sequence's acceptance estimate: drafts a few tokens at a 1-row step's prices
ACCEPT_RATE = 0.2  # the estimate's step toward each verified draft's outcome (EWMA)


@dataclass
class DraftState:
    index: NgramIndex | SuffixProposer | None  # the n-gram or suffix proposer (None: a draft model proposes)
    k: int  # the most tokens it drafts next step
    pause: int = 0  # steps left without drafting
    backoff: int = 0  # the pause after the next step that accepts nothing
    # The chance a draft is accepted given the drafts before it were (an EWMA over verified
    # drafts: an accepted one counts 1, the first rejected one 0), the cost policy's input.
    accept: float = ACCEPT_PRIOR
    full: bool = False  # the last verification accepted every draft: the doubling decides, not the prices
    probe: bool = False  # the pause just ended: draft at least one token, to see whether drafts pay again
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
        full = self.full = 0 < proposed == accepted
        if accepted:  # (`accepted` EWMA steps towards 1 at once: each keeps 1 - ACCEPT_RATE of the gap)
            self.accept = 1.0 - (1.0 - self.accept) * (1.0 - ACCEPT_RATE) ** accepted
        if accepted < proposed:
            self.accept -= ACCEPT_RATE * self.accept
        self.k = min(max_k, max(accepted + 1, 2 * self.k) if full else accepted + 1)
        if accepted:
            self.backoff = 0
        else:
            self.hold_off()

    def hold_off(self) -> None:
        """Stop drafting for the next 1, 2, 4, ... `MAX_PAUSE` steps (doubling each time until
        an acceptance resets it)."""
        self.backoff = min(MAX_PAUSE, 2 * self.backoff or 1)
        self.pause = self.backoff
