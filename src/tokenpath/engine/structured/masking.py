"""Per-sequence grammar state and the per-row logits mask of one sampling step.

Only the rows that carry a grammar are touched: their bitmasks are filled in one parallel call
(llguidance's executor drops the GIL), unpacked to booleans and applied with `masked_fill`, so a
batch mixing constrained and free rows pays for the constrained ones only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance
import llguidance.torch as llt
import torch

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class GrammarState:
    """One sequence's matcher and what it cost (for the request's trace and audit row)."""

    matcher: llguidance.LLMatcher
    compile_seconds: float = 0.0
    cache_hit: bool = False
    mask_seconds: float = 0.0
    masked_steps: int = 0

    def accept(self, token: int) -> None:
        """Advance past a sampled token. A token the grammar refuses (it was masked, so only EOS
        or a bug) leaves the matcher in its error state, which `terminated` reports."""
        self.matcher.consume_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepts nothing more (EOS only), or it failed."""
        return self.matcher.is_stopped()

    @property
    def failed(self) -> str | None:
        return self.matcher.get_error() or None if self.matcher.is_error() else None

    @property
    def mask_us_per_token(self) -> float:
        return 1e6 * self.mask_seconds / self.masked_steps if self.masked_steps else 0.0


class MaskBuilder:
    """Owns the executor (a thread pool) and the reusable bitmask buffer."""

    def __init__(self, grammar_vocab: int) -> None:
        self.executor = llguidance.LLExecutor()
        self.words = (grammar_vocab + 31) // 32  # the bitmask width the matchers' tokenizer fills
        self._buf: torch.Tensor | None = None

    def _bitmask(self, rows: int, words: int) -> torch.Tensor:
        if self._buf is None or self._buf.shape[0] < rows or self._buf.shape[1] != words:
            self._buf = torch.zeros((max(rows, 8), words), dtype=torch.int32)
        return self._buf[:rows]

    def allowed(self, states: list[GrammarState], vocab: int) -> torch.Tensor:
        """A (rows, vocab) bool tensor: which tokens each grammar allows next (ids past the
        tokenizer's vocabulary, a padded logits row, are never allowed)."""
        start = time.perf_counter()
        words = self.words
        mask = self._bitmask(len(states), words)
        if len(states) == 1:
            llt.fill_next_token_bitmask(states[0].matcher, mask, 0)
        else:
            llt.fill_next_token_bitmask_par(self.executor, [(s.matcher, i) for i, s in enumerate(states)], mask)
        allowed = ((mask.unsqueeze(-1) >> _BITS) & 1).bool().view(len(states), words * 32)[:, :vocab]
        if allowed.shape[1] < vocab:  # logits padded past the tokenizer: those ids are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        per_row = (time.perf_counter() - start) / len(states)
        for s in states:
            s.mask_seconds += per_row
            s.masked_steps += 1
        return allowed


def apply_grammar_masks(builder: MaskBuilder, logits: torch.Tensor, raw: torch.Tensor,
                        rows: list[int], states: list[GrammarState]) -> torch.Tensor:
    """`logits` with each constrained row's disallowed tokens at -inf. A row that penalties and
    the grammar together leave empty (min_tokens banning the EOS the grammar requires) takes the
    grammar's mask over the raw logits: the grammar is what the client asked to be guaranteed."""
    allowed = builder.allowed(states, logits.shape[-1])
    idx = torch.tensor(rows)
    sub = logits[idx].masked_fill(~allowed, -float("inf"))
    empty = torch.isinf(sub).all(dim=-1)
    if bool(empty.any()):
        sub[empty] = raw[idx][empty].masked_fill(~allowed[empty], -float("inf"))
    if logits is raw:
        logits = logits.clone()
    logits[idx] = sub
    return logits
