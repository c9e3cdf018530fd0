"""The speculation policy: who drafts, how many tokens, and the engine's counters (see
`tokenpath.engine.spec` for the whole design)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenpath.config import SpeculativeConfig
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.cost import StepPrices, best_drafts
from tokenpath.engine.spec.grammar import grammar_drafts
from tokenpath.engine.spec.ngram import NgramIndex
from tokenpath.engine.spec.state import DraftState
from tokenpath.engine.spec.suffix import SuffixCache, SuffixProposer

if TYPE_CHECKING:
    from tokenpath.engine.spec.draft_model import DraftModel


@dataclass
class SpecStats:
    """Engine-wide counters, vLLM's spec-decode metrics: drafts (sequence-steps that drafted),
    draft tokens, accepted tokens, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None

    def as_list(self, k: int) -> list[int]:
        """`EngineState.spec_decode`: [drafts, draft tokens, accepted, accepted per position...]."""
        return [self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                *(self.accepted_per_pos or [0] * k)]

    def record(self, proposed: int, accepted: int, k: int) -> None:
        if self.accepted_per_pos is None:
            self.accepted_per_pos = [0] * k
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


class SpecDecoder:
    """The per-engine speculation policy and the per-sequence proposers."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, drafter: DraftModel | None = None) -> None:
        """`drafter`: the draft model (method draft_model), None for the n-gram proposer."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self.drafter = drafter
        self.prices = StepPrices()  # decode steps' times by their rows (cost.py), fed by `observe_step`
        self.prior = StepPrices()  # never timed: the prior's shape, for timing-blind sequences
        # method suffix: the global trie over recent requests' outputs (suffix.py), one an engine.
        self.suffix = (SuffixCache(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests)
                       if config.method == "suffix" else None)

    @property
    def writes_kv(self) -> bool:
        """Whether proposing writes KV in the slots of the rows it drafts (a draft model does), so
        the scheduler allocates them before asking, not after."""
        return self.drafter is not None

    def allowed(self, decoding: int) -> bool:
        """The batch rule: a step with more decoding sequences than `max_batch` drafts nothing
        (docs/architecture.md: there the step is compute-bound and rejected drafts cost the batch)."""
        return decoding <= self.config.max_batch

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows (drafts included) took `seconds`, drafting and
        verifying included: the prices the cost policy drafts by (the engine calls it only under
        that policy, `keeps_prices`)."""
        self.prices.observe(rows, seconds)

    @property
    def keeps_prices(self) -> bool:
        """Whether the engine times its decode steps for this decoder (the priced policies read
        them, the default included; the rule alone does not, so the step does nothing for it)."""
        return self.config.draft_policy != "rule"

    def drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens of a decoding `seq` for this step (empty: plain decode), at most
        `budget` of them, and never past its max_tokens or the context length (`state.py`: how
        many it drafts adapts to what it had accepted). Every sequence may draft: a LoRA request's
        1 + K verification rows all run with its adapter, because the runners map adapters per
        scheduled (sequence, tokens) pair and a drafting sequence's tokens count its drafts."""
        return self.propose(seq, self.draft_len(seq, budget))

    def draft_len(self, seq: Sequence, budget: int, rows: int = 1) -> int:
        """How many tokens `seq` drafts this step (0: plain decode), in a step already holding
        `rows` decode rows (its own included): at most its state's adaptive K and `budget`, never
        past its max_tokens or the context length; under the priced policies, the length whose
        expected tokens per unit of step time (at the engine's measured prices) is best, 0 when no
        length beats a plain step (then it pauses, and probes with one draft after the pause);
        under "rule" the cap itself. `state.py` says why."""
        state = seq.spec
        if state is None:
            state = seq.spec = DraftState(self._index(), self.k)
        if state.pause:
            state.pause -= 1
            state.probe = state.pause == 0
            return 0
        k = min(state.k, budget, self.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        policy = self.config.draft_policy
        if k <= 0 or policy == "rule":
            return max(k, 0)
        blind = self._timing_blind(seq)
        if policy == "cost":
            if blind or state.full:
                return k
            accept = state.accept
        else:  # adaptive: a copy that keeps matching is likelier to go on (state.py)
            accept = state.expected_accept()
        # (adaptive drafts whatever is expected to beat a plain step at all: its ledger, not a
        # margin, stops a stream whose drafts lose)
        best = best_drafts(self._prices(seq, blind), accept, k, rows, margin=0.05 if policy == "cost" else 0.0)
        if best == 0 and state.probe:
            best = 1  # the cheapest look at whether drafting pays again
        elif best == 0:
            state.hold_off()
        state.probe = False
        state.rows = rows
        return best

    def _prices(self, seq: Sequence, blind: bool | None = None) -> StepPrices:
        """The prices `seq` drafts by: the engine's measured ones, or for a timing-blind sequence
        the prior's fixed shape (its drafts must not follow the host's timings)."""
        return self.prior if (self._timing_blind(seq) if blind is None else blind) else self.prices

    @staticmethod
    def _timing_blind(seq: Sequence) -> bool:
        """A seeded sampled sequence keeps the rule that ignores step timings: its acceptance
        tests draw from its random stream once per draft, so draft lengths that followed the
        host's timings would make its output irreproducible (greedy and unseeded ones are not)."""
        return seq.params.seed is not None and not seq.params.greedy

    def _index(self) -> NgramIndex | SuffixProposer | None:
        """A new sequence's proposer index (None: the draft model proposes)."""
        c = self.config
        if self.drafter is not None:
            return None
        if self.suffix is not None:
            return SuffixProposer(self.suffix, c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob)
        return NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max)

    def finished(self, seq: Sequence) -> None:
        """A sequence is done: method suffix remembers its output for later requests' drafts."""
        if self.suffix is not None:
            self.suffix.add(seq.token_ids[seq.num_prompt_tokens :])

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """The proposer's `k` tokens for `seq` (fewer or none where it finds less), cut
        where a grammar refuses them (grammar_drafts)."""
        state = seq.spec
        if k <= 0 or state is None:
            return []
        if self.drafter is not None:
            drafts = self.drafter.propose(seq, state, k)
        elif state.index is not None:
            drafts = state.index.propose(seq.token_ids, k)
        else:
            return []
        if seq.grammar is not None:
            drafts = grammar_drafts(seq.grammar.matcher, drafts)
        return drafts

    def settle(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Count a verification, and let the sequence adapt its next draft length."""
        self.stats.record(proposed, accepted, self.k)
        state = seq.spec
        if state is None:
            return
        gain = None
        if self.config.draft_policy == "adaptive" and proposed:
            # What plain decoding would have emitted in the drafts' extra time: the step's plain
            # rows times the share its price grew by (one stream: price(1 + k) / price(1) - 1).
            prices, rows = self._prices(seq), state.rows
            gain = accepted - rows * (prices.price(rows + proposed) / prices.price(rows) - 1.0)
        state.settle(accepted, self.k, proposed, gain)
