"""One sequence's speculation state: its proposer (n-gram or suffix index) and how much it drafts next.

Why adaptive: a draft row is not free here. On CPUs a verification row costs a sizeable part of
a decode step, so drafting K tokens that get rejected makes a step slower for nothing. Three
rules decide how many tokens a sequence drafts next:

1. The cap (draft_policy "rule" is this alone): at most one more than it last had accepted (up to
   K), and after a step that accepted *every* draft, double instead (1, 2, 4, 8, 16): a copy that
   keeps matching is the case where long drafts pay, and growing one token a step spent most of a
   copied run on short drafts (the `edit` workload's greedy output, K = 16: 140 steps for 400
   tokens with doubling, 165 with one more a step). After a step that accepted nothing it pauses
   drafting for 1, 2, 4, ... 32 steps (reset by any acceptance).
2. The price (the default "adaptive", and "cost"; cost.py): under the cap, the k that maximizes
   expected tokens per unit of step time, (1 + a + ... + a^k) / price(1 + k rows) over price(1
   row), at the engine's own recent decode-step times by rows (threads, model, host as they are;
   a seeded sampled sequence prices by the prior's fixed shape, so its draws do not follow the
   host). `a` is an EWMA of its drafts' acceptance, and while a copy keeps matching (the last step
   accepted every draft) at least (run + 1) / (run + 2) over the drafts it has matched in a row:
   a copy that has held longer is likelier to go on, which the average over all its drafts misses.
   No length expected to beat a plain step: no drafts, and a pause, after which one draft probes.
3. The ledger ("adaptive"): each drafting step's gain over plain decoding in the same time, its
   accepted drafts less what its extra rows cost at the measured prices (in plain-step tokens),
   summed with the past halved each step. Below zero, the stream is losing whatever the
   expectation said: it pauses as after a miss, for pauses that double, and a gaining step only
   halves them, so a low-acceptance stream's lucky steps do not restart it at full rate.

Why: replaying the benchmarks' greedy outputs through the policies at the step prices measured
quiet (benchmarks/spec_policy_replay.py, 2 threads: a 2-row step 1.24x a 1-row one, 5 rows 1.79x,
9 rows 2.99x, 17 rows 5.35x) the rule alone gains on every workload (`edit` 1.82x, `quote` 1.08x,
`free` 1.19x) but nothing stops it where rows cost more than that table: with each drafting step
0.5 of a plain step dearer it falls to 0.95x on `quote`, at twice the per-row price 0.90x, while the
adaptive policy stays at 0.97x or above there and draws at least even on `free`; at the measured
prices it gains as much or more (`edit` 1.88x, `quote_copy` 2.79x, `quote` 1.13x, `free` 1.21x).
"cost" (no ledger, a 5% margin, the doubled cap drafted unpriced) drafted too little quiet
(benchmarks/results/spec_cost_vs_adaptive_quiet.md: `edit` 0.87x the rule's) and stays for A/B runs.
"""


from __future__ import annotations

from dataclasses import dataclass, field

from tokenpath.engine.spec.ngram import NgramIndex
from tokenpath.engine.spec.suffix import SuffixProposer

MAX_PAUSE = 32
ACCEPT_PRIOR = 0.5  # a new sequence's acceptance estimate: drafts a few tokens at a 1-row step's prices
ACCEPT_RATE = 0.2  # the estimate's step toward each verified draft's outcome (EWMA)
LEDGER_KEEP = 0.5  # the share of the gain ledger a drafting step keeps (the rest is forgotten)


@dataclass
class DraftState:
    index: NgramIndex | SuffixProposer | None  # the n-gram or suffix proposer (None: a draft model proposes)
    k: int  # the most tokens it drafts next step
    pause: int = 0  # steps left without drafting
    backoff: int = 0  # the pause after the next step that accepts nothing
    # The chance a draft is accepted given the drafts before it were (an EWMA over verified
    # drafts: an accepted one counts 1, the first rejected one 0), the cost policy's input.
    accept: float = ACCEPT_PRIOR
    full: bool = False  # the last verification accepted every draft (a copy in progress)
    probe: bool = False  # the pause just ended: draft at least one token, to see whether drafts pay again
    run: int = 0  # drafts accepted since the last rejected one: how long the copy in progress has held
    # The adaptive policy's ledger: tokens its drafting steps gained over plain decoding in the same
    # time (each step's accepted drafts less what its extra rows cost, in plain-step tokens at the
    # engine's measured prices), halved every step so that it follows the text as it changes.
    ledger: float = 0.0
    rows: int = 1  # the decode rows of the step it last drafted in (its drafts are priced against them)
    # A draft model's last proposal (draft_model.py): the sequence's length then, and its drafts.
    proposed_at: int = 0
    proposed: list[int] = field(default_factory=list)

    def expected_accept(self) -> float:
        """The chance the next draft is accepted: the acceptance estimate, or while a copy keeps
        matching (the last verification accepted every draft) at least the rule of succession's
        (run + 1) / (run + 2) over the drafts it has matched in a row: a copy that has held for
        longer is likelier to go on, which the average over the sequence's drafts misses."""
        if self.full:
            return max(self.accept, (self.run + 1) / (self.run + 2))
        return self.accept

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

    def settle(self, accepted: int, max_k: int, proposed: int, gain: float | None = None) -> None:
        """After a verification that accepted `accepted` of its `proposed` drafts: all of them
        doubles the next draft length, fewer sets it to one more than were accepted. `gain` (the
        adaptive policy): the tokens this step gained over a plain step's worth of time (negative:
        it lost); when the ledger of recent gains goes negative, drafting stops for a pause that
        doubles each time, as after a step that accepted nothing, however many it accepted."""
        full = self.full = 0 < proposed == accepted
        if accepted:  # (`accepted` EWMA steps towards 1 at once: each keeps 1 - ACCEPT_RATE of the gap)
            self.accept = 1.0 - (1.0 - self.accept) * (1.0 - ACCEPT_RATE) ** accepted
        if accepted < proposed:
            self.accept -= ACCEPT_RATE * self.accept
        self.run = self.run + accepted if full else 0
        self.k = min(max_k, max(accepted + 1, 2 * self.k) if full else accepted + 1)
        losing = False
        if gain is not None:
            self.ledger = LEDGER_KEEP * self.ledger + gain
            losing = self.ledger < 0
        if accepted and not losing:
            # (a gaining step halves the backing off where the ledger decides, so a losing
            # stream's pauses keep growing through its lucky steps; a copy's run of gains ends it)
            self.backoff = self.backoff // 2 if gain is not None else 0
        else:
            self.hold_off()
            if losing:
                self.ledger = 0.0  # (the pause paid for it: the probe after it starts afresh)

    def hold_off(self) -> None:
        """Stop drafting for the next 1, 2, 4, ... `MAX_PAUSE` steps (doubling each time until
        an acceptance resets it)."""
        self.backoff = min(MAX_PAUSE, 2 * self.backoff or 1)
        self.pause = self.backoff
