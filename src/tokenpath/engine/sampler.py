"""The sampler: logits of one step -> one token per sequence, plus logprobs when asked.

Rows share batched tensor work (penalties, temperature, top-k/top-p/min-p filtering); the random
draw of a seeded request uses its own `torch.Generator`, so the same seed gives the same tokens
whatever else shares the batch. Logprobs are those of the model's raw distribution (before
temperature, penalties and grammar masks), as OpenAI and vLLM report them.

Rows with a grammar (structured output, tool calls) get their disallowed tokens masked after the
penalties, row by row, and their matcher advances past the token drawn; rows without one are
untouched, so both kinds share one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenpath.engine.sequence import Sequence
from tokenpath.engine.structured.masking import MaskBuilder, apply_grammar_masks
from tokenpath.protocol.sampling_params import SAMPLING_EPS


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (sampled token logprob, [(token_id, logprob), ...]) or None when not asked
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, eos_token_id: int, seed: int = 0, grammar_vocab: int | None = None) -> None:
        self.eos_token_id = eos_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar_vocab = grammar_vocab
        self._masks: MaskBuilder | None = None

    def prefetch_masks(self, seqs: list[Sequence]) -> None:
        """Start the grammar masks of the rows about to sample (see structured/masking.py)."""
        states = [s.grammar for s in seqs if s.grammar is not None]
        if states and self.grammar_vocab:
            if self._masks is None:
                self._masks = MaskBuilder(self.grammar_vocab)
            self._masks.prefetch(states)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw = logits
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self._apply_penalties(logits, seqs)
        grammars = [(i, g) for i, s in enumerate(seqs) if (g := s.grammar) is not None]
        constrained = [i for i, _ in grammars]
        if constrained:
            if self._masks is None:
                self._masks = MaskBuilder(self.grammar_vocab or logits.shape[-1])
            may_empty = [j for j, i in enumerate(constrained) if seqs[i].num_output_tokens < seqs[i].params.min_tokens]
            logits = apply_grammar_masks(self._masks, logits, raw, constrained, [g for _, g in grammars], may_empty)
        tokens = self._sample(logits, seqs)
        for i, g in grammars:
            g.accept(tokens[i])
        lp: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            for i, seq in enumerate(seqs):
                if not want_logprobs[i]:
                    continue
                row = raw_logprobs[i]
                top: list[tuple[int, float]] = []
                if seq.params.logprobs:
                    vals, idx = row.topk(seq.params.logprobs)
                    top = list(zip(idx.tolist(), vals.tolist(), strict=True))
                lp[i] = (row[tokens[i]].item(), top)
        return SampleResult(tokens, lp)

    # ------------------------------------------------------------ logits processing
    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if _needs_processing(s)]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in rows:
            seq, p = seqs[i], seqs[i].params
            row = logits[i]
            out_ids = seq.output_token_ids
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
                seen = seen[seen < vocab]
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if out_ids and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=vocab)[:vocab]
                row -= p.frequency_penalty * counts.to(row.dtype)
                row -= p.presence_penalty * (counts > 0).to(row.dtype)
            if p.logit_bias:
                _add_logit_bias(row, p.logit_bias)
            if seq.num_output_tokens < p.min_tokens:
                banned = [t for t in [*p.stop_token_ids, *([] if p.ignore_eos else [self.eos_token_id])]
                          if 0 <= t < vocab]
                if banned:
                    row[banned] = -float("inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        greedy_rows = [i for i, s in enumerate(seqs) if s.params.greedy]
        tokens = [0] * len(seqs)
        # argmax only where it is the answer: over a 262k vocabulary it is 0.2 ms a row.
        if len(greedy_rows) == len(seqs):
            return logits.argmax(dim=-1).tolist()
        if greedy_rows:
            for i, tok in zip(greedy_rows, logits[greedy_rows].argmax(dim=-1).tolist(), strict=True):
                tokens[i] = tok
        # float32 whatever the model's dtype, and a floor under the temperature: a value that passed
        # validation must still never turn a row into inf/NaN (1e-320 in bf16 or fp16 is 0).
        sub = logits.float() if not greedy_rows else logits[random_rows].float()
        temps = torch.tensor([max(seqs[i].params.temperature, SAMPLING_EPS) for i in random_rows],
                             dtype=torch.float32).unsqueeze(1)
        probs = torch.softmax(sub / temps, dim=-1)
        probs = _filter(probs, [seqs[i].params for i in random_rows])
        u = torch.empty(len(random_rows), dtype=torch.float64)
        for j, i in enumerate(random_rows):
            u[j] = float(torch.rand(1, dtype=torch.float64, generator=seqs[i].generator or self.generator))
        picked, ok = draw(probs, u)
        # The class of bug, not one case: any row that is still not a distribution (non-finite
        # logits from the model or a penalty, everything filtered out) falls back to greedy for
        # that row alone instead of failing the whole batch.
        bad = [j for j, good in enumerate(ok) if not good]
        fallback = dict(zip(bad, sub[bad].argmax(dim=-1).tolist(), strict=True)) if bad else {}
        for j, i in enumerate(random_rows):
            tokens[i] = picked[j] if ok[j] else fallback[j]
        return tokens


DRAW_BLOCK = 1024  # vocabulary entries per first-level interval of the draw


def draw(probs: torch.Tensor, u: torch.Tensor) -> tuple[list[int], list[bool]]:
    """One token per row of `probs` (non-negative weights, rows need not sum to 1) for the uniform
    u[row] in [0, 1): the inverse CDF, in two levels. Returns (tokens, whether the row was a
    distribution: its total finite and positive; the token of a row that was not is meaningless).

    Why two levels: `torch.multinomial` fills the vocabulary with exponentials on every draw (1.3 ms
    a row for 49k tokens here), and a float64 cumulative sum over the whole row costs 2 ms a row
    for Gemma's 262k vocabulary (the widening copy and the sequential scan), more than the rest
    of a c=32 decode step's sampling together. Here the row is cut into blocks of DRAW_BLOCK
    entries: their float32 sums (one vectorised reduction) give a float64 CDF of a few hundred
    entries, u picks the block, and u's remainder within that block, (u * total - before) /
    block sum, which is again uniform, picks the entry from that block's own float64 CDF. The
    same distribution as one CDF over the row, and an entry of probability 0 is never drawn (its
    interval is empty at either level)."""
    rows, vocab = probs.shape
    full = vocab // DRAW_BLOCK * DRAW_BLOCK
    sums = [probs[:, :full].reshape(rows, -1, DRAW_BLOCK).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(probs[:, full:].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=-1).double().cumsum_(dim=-1)
    total = block_cdf[:, -1]
    ok = (torch.isfinite(total) & (total > 0)).tolist()
    target = (u * total).unsqueeze(1)
    block = _search(block_cdf, target)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0).unsqueeze(1)).squeeze(1),
                         torch.zeros_like(total))
    width = block_cdf.gather(1, block.unsqueeze(1)).squeeze(1) - before
    rest = ((target.squeeze(1) - before) / width).clamp_(0.0, 1.0).nan_to_num_(0.0)
    starts = block * DRAW_BLOCK
    tokens = []
    for j in range(rows):
        if not ok[j]:
            tokens.append(0)
            continue
        start = int(starts[j])
        cdf = probs[j, start:start + DRAW_BLOCK].double().cumsum_(dim=0).unsqueeze(0)
        tokens.append(start + int(_search(cdf, (rest[j] * cdf[0, -1]).reshape(1, 1))[0]))
    return tokens, ok


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds target (right-continuous inverse
    CDF). A target at (or, by rounding, past) the row's total takes the first index that reaches
    the total: the last entry of positive weight, never a zero-weight entry after it."""
    found = torch.searchsorted(cdf, target, right=True)[:, 0]
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)[:, 0]
    return torch.minimum(found, last).clamp_(max=cdf.shape[-1] - 1)  # (NaN rows: any index, unused)


def _needs_processing(seq: Sequence) -> bool:
    p = seq.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or seq.num_output_tokens < p.min_tokens or bool(p.logit_bias))


def _add_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    """OpenAI's logit_bias: added to the logits before sampling (greedy included); ids beyond this
    row (a padded vocabulary) are ignored rather than trusted."""
    ids = [t for t in bias if 0 <= t < row.shape[-1]]
    if ids:
        row[ids] += torch.tensor([bias[t] for t in ids], dtype=row.dtype)


def _filter(probs: torch.Tensor, params: list) -> torch.Tensor:
    """top-k, top-p and min-p on probabilities (rows renormalised by the draw itself: it scales
    its uniform by the row's total)."""
    need_sort = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    if not need_sort:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    cum = sorted_p.cumsum(dim=-1)
    drop = (ranks >= top_k) | ((cum - sorted_p) >= top_p)  # keep the token that crosses top_p
    drop[:, 0] = False  # the most likely token always survives (a top_p that underflows to 0)
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
