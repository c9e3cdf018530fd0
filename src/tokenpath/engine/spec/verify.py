"""Verification of one sequence's draft tokens from the logits of its K + 1 rows.

Row j's logits are the target model's distribution for the token after draft j - 1 (row 0: after
the last known token). Greedy: drafts are accepted while each equals the row's argmax, then the
argmax of the first mismatching row (or of the last row, the bonus token) follows, so the output
is token for token what plain greedy decoding gives. Sampled: rejection sampling (Leviathan et
al. 2023; Chen et al. 2023) with the proposer's one-hot proposal q (n-gram, suffix, a greedy draft
model): draft x is accepted with probability p(x); on rejection the token is drawn from
max(0, p - q) renormalised, which is p with x removed; after K acceptances a bonus token is drawn
from the last row. Each emitted token is thus distributed exactly as p, the filtered (temperature,
top-k, top-p, min-p) distribution the plain sampler draws from.
"""

from __future__ import annotations

import numpy as np

from tokenpath.engine.rng import Generator
from tokenpath.engine.sampler import _argmax, _filter, draw, softmax
from tokenpath.engine.sequence import Sequence
from tokenpath.protocol.sampling_params import SAMPLING_EPS


def verify(logits: np.ndarray, seq: Sequence, generator: Generator) -> list[int]:
    """The tokens `seq` gains this step: its accepted drafts, then one token of the target model
    (1 to K + 1 tokens). `logits`: [1 + len(seq.draft_ids), vocab], float32."""
    drafts, p = seq.draft_ids, seq.params
    if p.greedy:
        target = _argmax(logits)
        a = 0
        while a < len(drafts) and drafts[a] == target[a]:
            a += 1
        return [*drafts[:a], target[a]]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        probs = softmax(np.asarray(logits, dtype=np.float32) / np.float32(max(p.temperature, SAMPLING_EPS)))
    probs = _filter(probs, [p] * probs.shape[0])
    gen = seq.generator or generator
    vocab = probs.shape[-1]
    for j, x in enumerate(drafts):
        row = probs[j]
        total = float(row.sum(dtype=np.float32))
        px = float(row[x]) / total if 0 <= x < vocab and total > 0 else 0.0
        if gen.uniform() < px:
            continue
        residual = row.copy()
        if 0 <= x < vocab:
            residual[x] = 0.0
        picked, ok = draw(residual[None, :], np.array([gen.uniform()]))
        return [*drafts[:j], picked[0] if ok[0] else int(np.argmax(row))]
    picked, ok = draw(probs[-1:], np.array([gen.uniform()]))
    return [*drafts, picked[0] if ok[0] else int(np.argmax(probs[-1]))]
