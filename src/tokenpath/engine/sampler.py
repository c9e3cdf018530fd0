"""The sampler: logits of one step -> one token per sequence, plus logprobs when asked.

Rows share batched array work (penalties, temperature, top-k/top-p/min-p filtering); the random
draw of a seeded request uses its own `Generator` (engine/rng.py), so the same seed gives the
same tokens whatever else shares the batch. Logprobs are those of the model's raw distribution
(before temperature, penalties and grammar masks), as OpenAI and vLLM report them.

Rows with a grammar (structured output, tool calls) get their disallowed tokens masked after the
penalties, row by row, and their matcher advances past the token drawn; rows without one are
untouched, so both kinds share one batch.

numpy, float32, on both paths: the native kernels write their logits into a numpy array and the
torch path hands its logits over as one (`ModelRunner.execute`), so serving a GGUF never imports
torch (issue 42: its import alone is ~218 MiB of RSS) and both paths sample with one code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenpath.engine.penalties import TokenHistory, rewrites
from tokenpath.engine.rng import Generator
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.structured.masking import MaskBuilder, additive_mask, apply_grammar_masks, draft_masks
from tokenpath.protocol.sampling_params import SAMPLING_EPS


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (sampled token logprob, [(token_id, logprob), ...]) or None when not asked
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-probabilities of each row (x - max - log sum exp(x - max), as torch computes them)."""
    x = np.asarray(logits, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        shifted = x - x.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def softmax(logits: np.ndarray) -> np.ndarray:
    """float32 probabilities of each row (non-finite rows stay non-finite: the draw reports them)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        e = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def topk(row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k largest entries of a 1-D row, largest first, as (index, value)."""
    k = min(k, row.shape[0])
    idx = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return [(int(i), float(row[i])) for i in idx]


class Sampler:
    def __init__(self, eos_token_id: int, seed: int = 0, grammar_vocab: int | None = None) -> None:
        self.eos_token_id = eos_token_id
        self.generator = Generator(seed)
        self.grammar_vocab = grammar_vocab
        self._masks: MaskBuilder | None = None

    def prefetch_masks(self, seqs: list[Sequence]) -> None:
        """Start the grammar masks of the rows about to sample (see structured/masking.py)."""
        states = [s.grammar for s in seqs if s.grammar is not None]
        if states and self.grammar_vocab:
            self._builder(self.grammar_vocab).prefetch(states)

    def _builder(self, vocab: int) -> MaskBuilder:
        """The one mask builder (its llguidance executor), made on first use; `vocab`: the logits'
        width, where the grammar's vocabulary size is not known."""
        if self._masks is None:
            self._masks = MaskBuilder(self.grammar_vocab or vocab)
        return self._masks

    def draft_rows(self, logits: np.ndarray, drafting: list[tuple[int, Sequence]]) -> np.ndarray:
        """Speculation: the 1 + K verification rows (from row `start`) of each drafting sequence,
        processed as plain decoding would process each of them: row j at the position after the
        sequence's first j drafts, so penalties, logit_bias and min_tokens see those drafts among
        the tokens (`penalties.TokenHistory`), and a grammar masks it by its state after them
        (engine/spec/grammar.py). Then greedy verification takes each row's argmax and rejection
        sampling draws against each row's distribution, both what plain decoding would have used.
        Returns `logits` itself when no drafting sequence needs any of this, else a processed copy
        (the raw rows stay for logprobs). The matchers are not advanced: the engine's output loop
        does that, token by token, as the tokens are emitted."""
        rewritten = [(start, s) for start, s in drafting if rewrites(s)]
        constrained = [(start, s) for start, s in drafting if s.grammar is not None]
        if not rewritten and not constrained:
            return logits
        raw, logits = logits, np.array(logits, dtype=np.float32)
        banned: set[int] = set()  # rows where min_tokens banned EOS / stop tokens
        for start, s in rewritten:
            history = TokenHistory(s, self.eos_token_id)
            for j in range(1 + len(s.draft_ids)):
                if j:
                    history.advance(s.draft_ids[j - 1])
                if history.bans():
                    banned.add(start + j)
                history.rewrite(logits[start + j])
        if constrained:
            items = [(s.grammar, s.draft_ids) for _, s in constrained if s.grammar is not None]
            add = additive_mask(draft_masks(self._builder(logits.shape[-1]), items), logits.shape[-1])
            row = 0
            for start, s in constrained:
                n = 1 + len(s.draft_ids)
                logits[start : start + n] += add[row : row + n]
                for j in range(n):  # (apply_grammar_masks' rule: the grammar wins over min_tokens)
                    if start + j in banned and bool(np.isinf(logits[start + j]).all()):
                        logits[start + j] = raw[start + j] + add[row + j]
                row += n
        return logits

    def __call__(self, logits: np.ndarray, seqs: list[Sequence]) -> SampleResult:
        """`logits`: [rows, vocab], one row per sequence (float32; other float dtypes are widened)."""
        logits = np.asarray(logits, dtype=np.float32)
        if all(s.grammar is None and s.params.logprobs is None and s.params.greedy and not rewrites(s) for s in seqs):
            # Plain greedy rows (a decode step's usual case): the argmax is the whole answer.
            return SampleResult(_argmax(logits), [None] * len(seqs))
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw = logits
        raw_logprobs = log_softmax(logits) if any(want_logprobs) else None
        logits = self._apply_penalties(logits, seqs)
        grammars = [(i, g) for i, s in enumerate(seqs) if (g := s.grammar) is not None]
        constrained = [i for i, _ in grammars]
        if constrained:
            may_empty = [j for j, i in enumerate(constrained) if seqs[i].num_output_tokens < seqs[i].params.min_tokens]
            logits = apply_grammar_masks(self._builder(logits.shape[-1]), logits, raw, constrained, [g for _, g in grammars], may_empty)
        tokens = self._sample(logits, seqs)
        for i, g in grammars:
            g.accept(tokens[i])
        lp: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                if not want_logprobs[i]:
                    continue
                row = raw_logprobs[i]
                top = topk(row, seq.params.logprobs) if seq.params.logprobs else []
                lp[i] = (float(row[tokens[i]]), top)
        return SampleResult(tokens, lp)

    # ------------------------------------------------------------ logits processing
    def _apply_penalties(self, logits: np.ndarray, seqs: list[Sequence]) -> np.ndarray:
        """Each row rewritten at its sequence's position (`penalties.TokenHistory`), on a copy."""
        rows = [i for i, s in enumerate(seqs) if rewrites(s)]
        if not rows:
            return logits
        logits = logits.copy()
        for i in rows:
            TokenHistory(seqs[i], self.eos_token_id).rewrite(logits[i])
        return logits

    def _sample(self, logits: np.ndarray, seqs: list[Sequence]) -> list[int]:
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        tokens = [0] * len(seqs)
        # argmax only where it is the answer: over a 262k vocabulary it is 0.2 ms a row.
        if len(greedy_rows) == len(seqs):
            return [int(t) for t in _argmax(logits)]
        if greedy_rows:
            for i, tok in zip(greedy_rows, _argmax(logits[greedy_rows]), strict=True):
                tokens[i] = int(tok)
        # float32, and a floor under the temperature: a value that passed validation must still
        # never turn a row into inf/NaN.
        sub = logits if not greedy_rows else logits[random_rows]
        temps = np.array([max(seqs[i].params.temperature, SAMPLING_EPS) for i in random_rows],
                         dtype=np.float32)[:, None]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            probs = softmax(sub / temps)
        probs = _filter(probs, [seqs[i].params for i in random_rows])
        u = np.array([(seqs[i].generator or self.generator).uniform() for i in random_rows], dtype=np.float64)
        picked, ok = draw(probs, u)
        # The class of bug, not one case: any row that is still not a distribution (non-finite
        # logits from the model or a penalty, everything filtered out) falls back to greedy for
        # that row alone instead of failing the whole batch.
        for j, i in enumerate(random_rows):
            tokens[i] = picked[j] if ok[j] else int(_argmax(sub[j : j + 1])[0])
        return tokens


def _argmax(logits: np.ndarray) -> list[int]:
    """Per row, the index of the largest value, the first of ties; a NaN counts as the largest
    (torch's argmax: a NaN row picks its first NaN)."""
    return logits.argmax(axis=-1).tolist()


DRAW_BLOCK = 1024  # vocabulary entries per first-level interval of the draw


def draw(probs: np.ndarray, u: np.ndarray) -> tuple[list[int], list[bool]]:
    """One token per row of `probs` (non-negative weights, rows need not sum to 1) for the uniform
    u[row] in [0, 1): the inverse CDF, in two levels. Returns (tokens, whether the row was a
    distribution: its total finite and positive; the token of a row that was not is meaningless).

    Why two levels: a multinomial draw fills the vocabulary with exponentials on every draw (1.3 ms
    a row for 49k tokens here), and a float64 cumulative sum over the whole row costs 2 ms a row
    for Gemma's 262k vocabulary (the widening copy and the sequential scan), more than the rest
    of a c=32 decode step's sampling together. Here the row is cut into blocks of DRAW_BLOCK
    entries: their float32 sums (one vectorised reduction) give a float64 CDF of a few hundred
    entries, u picks the block, and u's remainder within that block, (u * total - before) /
    block sum, which is again uniform, picks the entry from that block's own float64 CDF. The
    same distribution as one CDF over the row, and an entry of probability 0 is never drawn (its
    interval is empty at either level)."""
    probs = np.asarray(probs)
    u = np.asarray(u, dtype=np.float64)
    rows, vocab = probs.shape
    full = vocab // DRAW_BLOCK * DRAW_BLOCK
    sums = [probs[:, :full].reshape(rows, -1, DRAW_BLOCK).sum(axis=-1, dtype=np.float32)] if full else []
    if full < vocab:
        sums.append(probs[:, full:].sum(axis=-1, keepdims=True, dtype=np.float32))
    block_cdf = np.cumsum(np.concatenate(sums, axis=-1).astype(np.float64), axis=-1)
    total = block_cdf[:, -1]
    ok = (np.isfinite(total) & (total > 0)).tolist()
    tokens = []
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for j in range(rows):
            if not ok[j]:
                tokens.append(0)
                continue
            target = u[j] * total[j]
            block = _search(block_cdf[j], target)
            before = block_cdf[j, block - 1] if block > 0 else 0.0
            width = block_cdf[j, block] - before
            rest = float(np.nan_to_num(np.clip((target - before) / width, 0.0, 1.0), nan=0.0))
            start = block * DRAW_BLOCK
            cdf = np.cumsum(probs[j, start:start + DRAW_BLOCK].astype(np.float64))
            tokens.append(start + _search(cdf, rest * cdf[-1]))
    return tokens, ok


def _search(cdf: np.ndarray, target: float) -> int:
    """The first index whose cumulative weight exceeds target (right-continuous inverse CDF). A
    target at (or, by rounding, past) the row's total takes the first index that reaches the
    total: the last entry of positive weight, never a zero-weight entry after it."""
    found = int(np.searchsorted(cdf, target, side="right"))
    last = int(np.searchsorted(cdf, cdf[-1], side="left"))
    return min(found, last, cdf.shape[-1] - 1)


def _filter(probs: np.ndarray, params: list) -> np.ndarray:
    """top-k, top-p and min-p on probabilities (rows renormalised by the draw itself: it scales
    its uniform by the row's total)."""
    need_sort = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
    if any(p.min_p > 0 for p in params):
        min_p = np.array([p.min_p for p in params], dtype=probs.dtype)[:, None]
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            probs = np.where(probs < min_p * probs.max(axis=-1, keepdims=True), np.float32(0.0), probs)
    if not need_sort:
        return probs
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, axis=-1)
    vocab = probs.shape[-1]
    ranks = np.arange(vocab)[None, :]
    top_k = np.array([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])[:, None]
    top_p = np.array([p.top_p for p in params], dtype=probs.dtype)[:, None]
    cum = np.cumsum(sorted_p, axis=-1, dtype=probs.dtype)
    with np.errstate(invalid="ignore"):
        drop = (ranks >= top_k) | ((cum - sorted_p) >= top_p)  # keep the token that crosses top_p
    drop[:, 0] = False  # the most likely token always survives (a top_p that underflows to 0)
    sorted_p = np.where(drop, np.float32(0.0), sorted_p)
    out = np.zeros_like(probs)
    np.put_along_axis(out, order, sorted_p, axis=-1)
    return out
