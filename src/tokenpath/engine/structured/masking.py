"""Per-sequence grammar state and the per-row logits mask of one sampling step.

Only the rows that carry a grammar are computed: their bitmasks are filled in one parallel call
(llguidance's executor drops the GIL), and only those rows of the logits are masked. The mask is
applied without a branch per token: the bits become float32 bit patterns (+0.0 where allowed,
-inf where not) that are added to the logits. Measured on this CPU (49k vocabulary, 32 rows):
0.9 ms, where `masked_fill` with the unpacked booleans took 3.7 ms (a branch per token,
mispredicted on mixed masks) and llguidance's `apply_token_bitmask_inplace` is a torch.compile
kernel (a C++ compiler at first use, inductor threads beside the engine's, 0.7 ms a call).

The masks of a step depend only on the tokens already accepted, so the engine starts computing
them (`prefetch`) before the step's forward pass and collects them at sampling: llguidance and the
native forward both run without the GIL, so the grammar's work fills the cores' idle moments
instead of adding to the step. Nothing else touches the matchers between the two calls (the step
loop is one thread), and a mask that was not prefetched is computed on the spot.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported by the first MaskBuilder: an engine that masks nothing never loads it
    import llguidance

# float32 -inf as an int32 bit pattern: (bit - 1) & NEG_INF is 0 (+0.0) for 1 and -inf for 0.
NEG_INF_BITS = int(np.array([-np.inf], dtype=np.float32).view(np.int32)[0])


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
    """Owns the executor (a thread pool), the reusable bitmask buffer and the prefetch thread."""

    def __init__(self, grammar_vocab: int) -> None:
        import llguidance  # (built by the first structured request's step: engine/sampler.py)

        self.executor = llguidance.LLExecutor()
        self.words = (grammar_vocab + 31) // 32  # the bitmask width the matchers' tokenizer fills
        self._buf: np.ndarray | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._pending: tuple[list[GrammarState], np.ndarray, Future[float]] | None = None

    def _bitmask(self, rows: int) -> np.ndarray:
        if self._buf is None or self._buf.shape[0] < rows:
            self._buf = np.empty((max(rows, 8), self.words), dtype=np.int32)
        return self._buf[:rows]

    def _compute(self, states: list[GrammarState], mask: np.ndarray, rows: list[int]) -> float:
        """Fill `mask`'s `rows` from `states`; returns the seconds it took per row."""
        # What llguidance.torch's fill_next_token_bitmask(_par) do, called directly: importing that
        # module imports torch.compile's machinery (dynamo, inductor: seconds in every process
        # that imports this one, the gateway and the CLI included) for its unused mask kernel.
        # The matchers write whole rows through the pointer: `mask` is one of this class's
        # buffers, int32, on the CPU, its rows contiguous.
        start = time.perf_counter()
        if len(states) == 1:
            row = mask[rows[0]]
            states[0].matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        else:
            self.executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in zip(rows, states, strict=True)],
                                                  mask.ctypes.data, mask.shape[1] * mask.itemsize, mask.shape[0])
        return (time.perf_counter() - start) / len(states)

    def prefetch(self, states: list[GrammarState]) -> None:
        """Start computing these states' next masks in the background (see the module's docstring)."""
        self._collect()
        if states:
            buf: np.ndarray = np.empty((len(states), self.words), dtype=np.int32)
            self._pending = (states, buf, self._thread.submit(self._compute, states, buf, list(range(len(states)))))

    def _collect(self) -> dict[int, tuple[np.ndarray, float]]:
        """The prefetched masks by state identity (waiting for them); empty if none or it failed."""
        if self._pending is None:
            return {}
        states, buf, fut = self._pending
        self._pending = None
        try:
            per_row = fut.result()
        except Exception:  # noqa: BLE001 - computed again on the spot, where an error surfaces
            return {}
        return {id(s): (buf[k], per_row) for k, s in enumerate(states)}

    def fill(self, rows: int, states: list[GrammarState]) -> np.ndarray:
        """A (rows, words) int32 bitmask: row j as states[j]'s grammar allows next."""
        ready = self._collect()
        mask = self._bitmask(rows)
        todo_rows, todo = [], []
        for row, s in enumerate(states):
            hit = ready.get(id(s))
            if hit is None:
                todo_rows.append(row)
                todo.append(s)
                continue
            mask[row] = hit[0]
            s.mask_seconds += hit[1]
            s.masked_steps += 1
        if todo:
            per_row = self._compute(todo, mask, todo_rows)
            for s in todo:
                s.mask_seconds += per_row
                s.masked_steps += 1
        return mask


def draft_masks(builder: MaskBuilder, items: list[tuple[GrammarState, list[int]]]) -> np.ndarray:
    """Speculation (engine/spec/grammar.py): for each (state, drafts), 1 + len(drafts) bitmask rows
    in order, row j as the grammar allows after the first j drafts (grammar-valid by then). One
    parallel llguidance call, which walks each matcher through its drafts and rolls it back."""
    rows = sum(1 + len(d) for _, d in items)
    mask: np.ndarray = np.zeros((rows, builder.words), dtype=np.int32)
    start = time.perf_counter()
    jobs, row = [], 0
    for s, d in items:
        jobs.append((s.matcher, row, d))
        row += 1 + len(d)
    builder.executor.unsafe_compute_mask_ptr_with_draft_token(jobs, mask.ctypes.data, mask.shape[1] * mask.itemsize,
                                                              rows)
    per_row = (time.perf_counter() - start) / rows
    for s, d in items:
        s.mask_seconds += per_row * (1 + len(d))
        s.masked_steps += 1 + len(d)
    return mask


def additive_mask(mask: np.ndarray, vocab: int) -> np.ndarray:
    """(rows, vocab) float32: +0.0 where the bitmask allows the token, -inf where it does not;
    ids past the bitmask (a logits row padded past the tokenizer) are never allowed."""
    bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), axis=1, bitorder="little")
    bits = bits[:, :vocab] if bits.shape[1] >= vocab else np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return ((bits.astype(np.int32) - 1) & NEG_INF_BITS).view(np.float32)


def apply_grammar_masks(builder: MaskBuilder, logits: np.ndarray, raw: np.ndarray, rows: list[int],
                        states: list[GrammarState], may_empty: list[int]) -> np.ndarray:
    """`logits` with each constrained row's forbidden tokens at -inf, in place (the sampler owns
    the step's logits; logprobs were taken from the raw ones before). `may_empty` are the
    positions in `rows` whose penalties put -inf somewhere (min_tokens banning EOS): if that and
    the grammar together leave nothing, the row takes the grammar's mask over its raw logits,
    since the grammar is what the client asked to be guaranteed."""
    add = additive_mask(builder.fill(len(rows), states), logits.shape[-1])
    if may_empty and logits is raw:
        logits = logits.copy()
    if len(rows) == logits.shape[0]:
        logits += add
    else:
        logits[rows] += add
    for j in may_empty:
        i = rows[j]
        if bool(np.isinf(logits[i]).all()):
            logits[i] = raw[i] + add[j]
    return logits
