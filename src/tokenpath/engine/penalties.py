"""The sampler's per-token rewrites of a sequence's logits: repetition, presence and frequency
penalties, logit_bias and min_tokens (the EOS and stop tokens banned until min_tokens are out).

Why a history object rather than a function of the sequence: the rewrite of a row depends on
the tokens before that row's position (every token seen, the output tokens' counts, the output
length). Plain decoding has one row per sequence, at the end of what it knows. Speculative
verification has 1 + K rows, row j at the position after the first j drafts; plain decoding would
have rewritten that row with those drafts already in the sequence, so the history takes them one
at a time (`advance`) and row j is rewritten exactly as plain decoding would have rewritten it
had it emitted those drafts (`Sampler.draft_rows`). The same code rewrites both, so the two paths
give the same float32 values bit for bit.
"""

from __future__ import annotations

import numpy as np

from tokenpath.engine.sequence import Sequence
from tokenpath.protocol.sampling_params import SamplingParams


def rewrites(seq: Sequence) -> bool:
    """Does the sampler rewrite this sequence's logits at all (at its current position; a later
    position may need less: min_tokens ends)?"""
    p = seq.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or seq.num_output_tokens < p.min_tokens or bool(p.logit_bias))


class TokenHistory:
    """What one sequence's rewrite depends on, at one position: the tokens seen (prompt and
    output), the output tokens, and their number. Built from the sequence, advanced past drafts."""

    def __init__(self, seq: Sequence, eos_token_id: int) -> None:
        self.params: SamplingParams = seq.params
        self.eos_token_id = eos_token_id
        self.seen: set[int] | None = set(seq.token_ids) if seq.params.repetition_penalty != 1.0 else None
        self.output: list[int] = seq.output_token_ids
        self.num_output = seq.num_output_tokens

    def advance(self, token: int) -> None:
        """The history one position later, `token` emitted."""
        if self.seen is not None:
            self.seen.add(token)
        self.output.append(token)
        self.num_output += 1

    def rewrite(self, row: np.ndarray) -> None:
        """Rewrite one logits row (float32, 1-D) in place, as the sampler does at this position:
        repetition penalty over every token seen, frequency and presence penalties over the output
        tokens' counts, logit_bias, then min_tokens' bans."""
        p, vocab = self.params, row.shape[-1]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if self.seen is not None:
                seen = np.array(sorted(self.seen), dtype=np.int64)
                seen = seen[(seen >= 0) & (seen < vocab)]
                vals = row[seen]
                row[seen] = np.where(vals > 0, vals / np.float32(p.repetition_penalty),
                                     vals * np.float32(p.repetition_penalty))
            if self.output and (p.presence_penalty or p.frequency_penalty):
                ids = np.asarray(self.output, dtype=np.int64)
                counts = np.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)[:vocab].astype(np.float32)
                row -= np.float32(p.frequency_penalty) * counts
                row -= np.float32(p.presence_penalty) * (counts > 0).astype(np.float32)
        if p.logit_bias:
            add_logit_bias(row, p.logit_bias)
        if self.bans():
            banned = [t for t in [*p.stop_token_ids, *([] if p.ignore_eos else [self.eos_token_id])]
                      if 0 <= t < vocab]
            if banned:
                row[banned] = -np.inf

    def bans(self) -> bool:
        """Does min_tokens ban EOS and the stop tokens at this position (the row may come out all
        -inf under a grammar that allows only those: the sampler's fallback then)?"""
        return self.num_output < self.params.min_tokens


def add_logit_bias(row: np.ndarray, bias: dict[int, float]) -> None:
    """OpenAI's logit_bias: added to the logits before sampling (greedy included); ids beyond this
    row (a padded vocabulary) are ignored rather than trusted."""
    ids = [t for t in bias if 0 <= t < row.shape[-1]]
    if ids:
        row[ids] += np.array([bias[t] for t in ids], dtype=row.dtype)
