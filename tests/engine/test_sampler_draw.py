"""The sampler's draw and the grammar mask's arithmetic, against their definitions: the inverse-CDF
draw samples the filtered distribution (zero-probability tokens never), the additive mask equals
masking with booleans, and a prefetched mask is the one the matcher would compute on the spot.
The sampler is numpy (no torch in a GGUF engine): its seeded uniforms are torch's, bit for bit,
and its logprobs and filters are torch's to float32 rounding (checked against torch here)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tokenpath import SamplingParams
from tokenpath.engine.rng import Generator
from tokenpath.engine.sampler import Sampler, _filter, log_softmax, softmax, topk
from tokenpath.engine.structured import GrammarCache
from tokenpath.engine.structured.masking import GrammarState, MaskBuilder, additive_mask
from tokenpath.protocol.sampling_params import StructuredOutput


class _Seq:
    """What the sampler reads of a sequence (the real Sequence needs a whole request)."""

    def __init__(self, params: SamplingParams, generator: Generator | None = None) -> None:
        self.params, self.generator, self.grammar = params, generator, None
        self.num_output_tokens, self.output_token_ids, self.token_ids = 0, [], []


def test_draw_follows_the_distribution_and_never_picks_a_zero():
    probs = np.array([0.1, 0.0, 0.6, 0.0, 0.3], dtype=np.float32)
    with np.errstate(divide="ignore"):
        logits = np.log(probs)[None, :]  # -inf where the probability is 0
    sampler = Sampler(eos_token_id=99, seed=3)
    seq = _Seq(SamplingParams(temperature=1.0))
    counts = np.zeros(5)
    for _ in range(4000):
        counts[sampler(logits.copy(), [seq]).token_ids[0]] += 1
    freq = counts / counts.sum()
    assert counts[1] == counts[3] == 0
    assert np.allclose(freq[[0, 2, 4]], [0.1, 0.6, 0.3], atol=0.03)


def test_seeded_rows_repeat_whatever_shares_the_batch():
    logits = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float32)
    alone = Sampler(0)(logits[1:2].copy(), [_Seq(SamplingParams(temperature=1.0), Generator(5))])
    shared = Sampler(0)(logits.copy(), [_Seq(SamplingParams(temperature=0.7)),
                                        _Seq(SamplingParams(temperature=1.0), Generator(5)),
                                        _Seq(SamplingParams(temperature=0.9))])
    assert alone.token_ids[0] == shared.token_ids[1]


def test_additive_mask_equals_boolean_masking():
    rng = np.random.default_rng(0)
    mask = rng.integers(-2**31, 2**31 - 1, size=(3, 4), dtype=np.int32)
    for vocab in (128, 100, 140):  # exact, logits narrower than the bitmask, padded past it
        logits = rng.standard_normal((3, vocab)).astype(np.float32)
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
        allowed = np.zeros((3, vocab), dtype=bool)
        allowed[:, :bits.shape[1]] = bits
        expect = np.where(allowed, logits, -np.inf)
        assert np.array_equal(logits + additive_mask(mask, vocab), expect)


def test_prefetched_mask_is_the_on_the_spot_mask(smol_llm):
    tok = smol_llm.tokenizer
    cache = GrammarCache(tok.llg_tokenizer())
    spec = StructuredOutput("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    states = [GrammarState(cache.get(spec).matcher) for _ in range(2)]
    states[1].accept(tok.backend.encode("{", add_special_tokens=False).ids[0])  # two different masks
    builder = MaskBuilder(tok.vocab_size)
    spot = builder.fill(2, states).copy()
    assert not np.array_equal(spot[0], spot[1])
    builder.prefetch(states)
    assert np.array_equal(builder.fill(2, states), spot)
    assert [s.masked_steps for s in states] == [2, 2]


def test_two_level_draw_is_the_one_level_inverse_cdf():
    """`draw` against the plain inverse CDF over the whole row, for the same uniforms: blocks of
    the vocabulary (a partial last one, empty blocks, trailing zeros) change no token."""
    from tokenpath.engine.sampler import DRAW_BLOCK, draw

    gen = torch.Generator().manual_seed(1)
    vocab = 3 * DRAW_BLOCK + 77
    probs = torch.rand(6, vocab, generator=gen) ** 8  # (torch: the draw's reference below is torch's CDF)
    probs[1, DRAW_BLOCK:2 * DRAW_BLOCK] = 0.0  # an empty block
    probs[2, -500:] = 0.0  # zeros at the end of the row
    probs[3, :] = 0.0
    probs[3, 5] = 1.0  # one possible token
    probs[4] = float("nan")  # not a distribution
    probs[5, :] = 0.0  # nothing left
    for k in range(200):
        u = torch.rand(6, dtype=torch.float64, generator=gen)
        if k == 0:
            u[:] = 1.0 - 2.0 ** -53  # the largest uniform
        tokens, ok = draw(probs.numpy(), u.numpy())
        assert ok == [True, True, True, True, False, False]
        cdf = probs[:4].double().cumsum(-1)
        expect = torch.searchsorted(cdf, (u[:4] * cdf[:, -1]).unsqueeze(1), right=True)[:, 0]
        for j in range(4):
            want = min(int(expect[j]), int((probs[j] > 0).nonzero().max()))
            assert tokens[j] == want
            assert probs[j, tokens[j]] > 0
        assert tokens[3] == 5


@pytest.mark.parametrize("seed", [0, 5, 2**32 + 9, 2**64 - 1])
def test_seeded_uniforms_are_torchs(seed):
    """A request's seed gives the tokens it gave when the sampler drew with torch.Generator."""
    gen, ref = Generator(seed), torch.Generator().manual_seed(seed)
    assert [gen.uniform() for _ in range(50)] == [float(torch.rand(1, dtype=torch.float64, generator=ref))
                                                   for _ in range(50)]
    assert [gen.uniform() for _ in range(7)] == torch.rand(7, dtype=torch.float64, generator=ref).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2**31 + 3, 2**32 - 1, 2**40 + 17])
def test_seeded_uniforms_are_numpys_legacy_mt19937(seed):
    """The reference generator the engine drew from before (numpy's MT19937, init_genrand seeding
    of the low 32 bits), past several regenerations of its 624 words."""
    bits = np.random.MT19937()
    bits._legacy_seeding(seed & 0xFFFFFFFF)
    raw = [int(v) for v in bits.random_raw(2 * 2000)]
    want = [((raw[2 * i] << 32 | raw[2 * i + 1]) & ((1 << 53) - 1)) * 2.0**-53 for i in range(2000)]
    gen = Generator(seed)
    assert [gen.uniform() for _ in range(2000)] == want


def test_logprobs_and_filters_match_torch():
    """log_softmax, softmax, topk and the top-k/top-p/min-p filter against torch's float32 ops."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 5000)) * 4).astype(np.float32)
    assert np.allclose(log_softmax(x), torch.log_softmax(torch.from_numpy(x), -1).numpy(), rtol=0, atol=2e-5)
    probs = softmax(x)
    assert np.allclose(probs, torch.softmax(torch.from_numpy(x), -1).numpy(), rtol=1e-5, atol=1e-9)
    vals, idx = torch.from_numpy(x[0]).topk(5)
    assert topk(x[0], 5) == list(zip(idx.tolist(), vals.tolist(), strict=True))
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m)
              for k, p, m in ((-1, 1.0, 0.05), (40, 1.0, 0.0), (-1, 0.9, 0.0), (10, 0.5, 0.01))]
    kept = _filter(probs, params) > 0
    for row, p in enumerate(params):
        order = np.argsort(-probs[row], kind="stable")
        cum = np.cumsum(probs[row][order]) - probs[row][order]
        keep = np.ones(len(order), dtype=bool)
        if p.top_k > 0:
            keep[p.top_k:] = False
        keep &= cum < p.top_p
        keep &= probs[row][order] >= p.min_p * probs[row].max()
        keep[0] = True
        assert np.array_equal(np.sort(order[keep]), np.flatnonzero(kept[row]))
