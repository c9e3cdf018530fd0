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
import numpy as np
import torch


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

    def disallowed(self, states: list[GrammarState], vocab: int) -> torch.Tensor:
        """A (rows, vocab) bool tensor, True where a grammar forbids the token next (ids past the
        tokenizer's vocabulary, a padded logits row, are always forbidden). Unpacked with numpy's
        `unpackbits` from the inverted bitmask: torch shifts over rows x vocab cost as much as a
        softmax on a busy CPU."""
        start = time.perf_counter()
        mask = self._bitmask(len(states), self.words)
        if len(states) == 1:
            llt.fill_next_token_bitmask(states[0].matcher, mask, 0)
        else:
            llt.fill_next_token_bitmask_par(self.executor, [(s.matcher, i) for i, s in enumerate(states)], mask)
        bits = np.unpackbits(np.bitwise_not(mask.numpy()).view(np.uint8), axis=1, bitorder="little")
        out = torch.from_numpy(bits).view(torch.bool)
        if out.shape[1] >= vocab:
            out = out[:, :vocab]
        else:  # logits padded past the tokenizer: those ids are never allowed
            out = torch.nn.functional.pad(out, (0, vocab - out.shape[1]), value=True)
        per_row = (time.perf_counter() - start) / len(states)
        for s in states:
            s.mask_seconds += per_row
            s.masked_steps += 1
        return out


def apply_grammar_masks(builder: MaskBuilder, logits: torch.Tensor, raw: torch.Tensor, rows: list[int],
                        states: list[GrammarState], may_empty: list[int]) -> torch.Tensor:
    """`logits` with each constrained row's forbidden tokens at -inf (in place on a copy; the raw
    logits stay as they were, for logprobs). `may_empty` are the positions in `rows` whose
    penalties put -inf somewhere (min_tokens banning EOS): if that and the grammar together leave
    nothing, the row takes the grammar's mask over its raw logits, since the grammar is what the
    client asked to be guaranteed."""
    forbidden = builder.disallowed(states, logits.shape[-1])
    if logits is raw:
        logits = logits.clone()
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(forbidden, -float("inf"))
        sub, write_back = logits, False
    else:
        idx = torch.tensor(rows)
        sub, write_back = logits[idx].masked_fill_(forbidden, -float("inf")), True
    for j in may_empty:
        if bool(torch.isinf(sub[j]).all()):
            sub[j] = raw[rows[j]].masked_fill(forbidden[j], -float("inf"))
    if write_back:
        logits[torch.tensor(rows)] = sub
    return logits
