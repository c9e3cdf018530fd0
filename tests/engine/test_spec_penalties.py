"""Speculative decoding for requests the sampler rewrites per token (penalties, logit_bias,
min_tokens) and for n > 1: each verification row is rewritten at its own position, so greedy
output is token for token the plain engine's, with drafts accepted, and sampled rows keep the
rewritten distribution (`Sampler.draft_rows`, `engine/penalties.py`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.engine.test_spec_decode import COPY
from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.engine.rng import Generator
from tokenpath.engine.sampler import Sampler
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.verify import verify

# "rule": draft lengths follow the text alone. Under the default "adaptive" policy they follow the
# host's measured step times, so whether drafts are accepted varied with load (the rewrites' exactness
# does not depend on the policy; tests/engine/test_spec_policy.py tests the policies).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "draft_policy": "rule"}
PENALTIES = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)


def _accepted(out) -> int:
    """Drafts accepted for one request (all its choices): its EngineEvents' spec counts."""
    return out.events.spec[2] if out.events.spec else 0


def _with_oracle(llm: LLM, want: list[list[int]], run):
    """`run()` with a proposer that drafts each choice's expected continuation, every third draft
    wrong: drafts are accepted and rejected whatever the model repeats (the n-gram proposer's
    acceptance depends on the text, which differs between ISAs' kernels)."""
    spec = llm.engine.spec

    def oracle(seq: Sequence, k: int) -> list[int]:  # (k: SpecDecoder.draft_len's)
        at, target = seq.num_output_tokens, want[seq.index]
        return [t if (at + i) % 3 else (t + 1) % 500 for i, t in enumerate(target[at : at + k])]

    spec.propose = oracle
    try:
        return run()
    finally:
        del spec.propose  # back to the class's method


# ---------------------------------------------------------------- the rows, one by one
def test_each_draft_row_is_rewritten_as_plain_decoding_would_at_that_position():
    """Row j of a drafting sequence comes out bit for bit as the plain sampler rewrites the one
    row of the same sequence after it emitted the first j drafts."""
    rng = np.random.default_rng(7)
    vocab, eos = 64, 2
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=4, logit_bias={5: 1.5, 9: -2.0}, **PENALTIES)
    prompt, output, drafts = [1, 5, 7, 9], [5, 11], [11, 9, 2, 30]
    logits = rng.normal(size=(1 + len(drafts), vocab)).astype(np.float32) * 3
    seq = Sequence("r", 0, prompt + output, len(prompt), params)
    seq.draft_ids = list(drafts)
    sampler = Sampler(eos)
    got = sampler.draft_rows(logits.copy(), [(0, seq)])
    for j in range(1 + len(drafts)):
        at = Sequence("r", 0, prompt + output + drafts[:j], len(prompt), params)
        want = sampler._apply_penalties(logits[j : j + 1].copy(), [at])
        np.testing.assert_array_equal(got[j], want[0])
    assert np.isneginf(got[0, eos]) and np.isneginf(got[1, eos])  # min_tokens: 2, 3 output tokens < 4
    assert np.isfinite(got[2, eos])  # 4 output tokens before row 2: EOS allowed from there


def _dense_rewrite(row: np.ndarray, seq: Sequence, eos: int) -> None:
    """The sampler's rewrite as it was written before it went sparse: vocabulary-wide counts."""
    p, vocab, out = seq.params, row.shape[-1], seq.output_token_ids
    seen = np.array(sorted(set(seq.token_ids)), dtype=np.int64)
    seen = seen[(seen >= 0) & (seen < vocab)]
    with np.errstate(over="ignore", invalid="ignore"):
        if p.repetition_penalty != 1.0:
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / np.float32(p.repetition_penalty), vals * np.float32(p.repetition_penalty))
        if out:
            ids = np.asarray(out, dtype=np.int64)
            counts = np.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)[:vocab].astype(np.float32)
            row -= np.float32(p.frequency_penalty) * counts
            row -= np.float32(p.presence_penalty) * (counts > 0).astype(np.float32)
    for t, b in p.logit_bias.items():
        if 0 <= t < vocab:
            row[t] += np.float32(b)
    if seq.num_output_tokens < p.min_tokens and not p.ignore_eos:
        row[eos] = -np.inf


def test_the_sparse_rewrite_gives_the_dense_formulas_values():
    """Ids past the row (a padded vocabulary), inf and NaN logits, negative penalties included."""
    rng = np.random.default_rng(3)
    sampler = Sampler(eos_token_id=2)
    for _ in range(100):
        vocab = int(rng.integers(5, 2000))
        params = SamplingParams(temperature=0, max_tokens=50, repetition_penalty=float(rng.choice([1.0, 0.5, 1.3])),
                                presence_penalty=float(rng.choice([0.0, -1.0, 0.7])),
                                frequency_penalty=float(rng.choice([0.0, -0.5, 1.1])), min_tokens=int(rng.integers(0, 5)),
                                logit_bias={int(rng.integers(0, vocab)): 2.0})
        tokens = rng.integers(0, vocab + 20, int(rng.integers(1, 300))).tolist()
        seq = Sequence("r", 0, tokens, int(rng.integers(0, len(tokens))), params)
        logits = (rng.normal(size=(1, vocab)) * 3).astype(np.float32)
        logits[0, rng.integers(0, vocab, 3)] = rng.choice([np.inf, -np.inf, np.nan])
        want = logits[0].copy()
        _dense_rewrite(want, seq, 2)
        np.testing.assert_array_equal(sampler._apply_penalties(logits, [seq])[0], want)


def test_rejection_sampling_with_penalties_keeps_each_rows_rewritten_distribution():
    """Vocabulary of 5, two drafts, repetition/presence/frequency penalties: the first emitted
    token is distributed as row 0 rewritten with the output so far, and given it is the first
    draft, the second as row 1 rewritten with that draft counted (a repeated token loses mass)."""
    logits = np.array([[1.0, 2.0, 0.5, 2.2, 1.5], [0.2, 2.4, 1.0, 2.5, 0.0], [0.0, 0.0, 0.0, 3.0, 0.0]],
                      dtype=np.float32)
    params = SamplingParams(temperature=1.0, max_tokens=8, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.7)
    prompt, output, drafts = [0], [3, 3], [1, 3]

    def rewritten(row: np.ndarray, tokens: list[int], out: list[int]) -> np.ndarray:
        r = row.astype(np.float64).copy()
        for t in set(tokens):
            r[t] = r[t] / 2.0 if r[t] > 0 else r[t] * 2.0
        counts = np.bincount(out, minlength=5)
        r -= 0.7 * counts + 0.5 * (counts > 0)
        e = np.exp(r - r.max())
        return e / e.sum()

    p0 = rewritten(logits[0], prompt + output, output)
    p1 = rewritten(logits[1], prompt + output + drafts[:1], output + drafts[:1])
    seq = Sequence("r", 0, prompt + output, len(prompt), params)
    sampler = Sampler(eos_token_id=4)
    gen = Generator(99)
    n = 6000  # (seeded: deterministic; 0.03 is over 3 standard errors of every frequency here)
    first, second, both = np.zeros(5), np.zeros(5), 0
    for _ in range(n):
        seq.draft_ids = list(drafts)
        out = verify(sampler.draft_rows(logits, [(0, seq)]), seq, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
        both += len(out) == 3
    assert np.abs(p1 - np.exp(logits[1]) / np.exp(logits[1]).sum()).max() > 0.15  # the penalties matter here
    for got, want in ((first / n, p0), (second / second.sum(), p1)):
        assert np.allclose(got, want, atol=0.03), (got, want)
    assert both / n == pytest.approx(float(p0[1] * p1[3]), abs=0.03)


# ---------------------------------------------------------------- tiny checkpoint, both paths
# The random model never repeats a token by itself, so the penalties here pull towards seen tokens
# (repetition < 1, presence < 0) while frequency pushes back: the output repeats, and each row's
# rewrite depends on the counts the drafts before it changed.
TINY_PENALTIES = dict(repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=0.5)
CASES = {
    "penalties": dict(**TINY_PENALTIES),
    "logit_bias": dict(logit_bias={7: 6.0, 11: 5.0, 42: 4.0}),
    "min_tokens": dict(min_tokens=12, ignore_eos=False),  # (with EOS biased up: it ends right at 12)
    "n2_penalties": dict(n=2, **TINY_PENALTIES),
}


@pytest.fixture(scope="module", params=["none", pytest.param("q8_0", marks=pytest.mark.requires("kernels"))])
def tiny_pair(request) -> tuple[LLM, LLM]:
    model = str(cached_tiny("llama"))
    kw = dict(num_kv_blocks=64, block_size=4, dtype="float32", quantization=request.param)
    return LLM(model, **kw), LLM(model, speculative_config=json.dumps(SPEC), **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_with_per_token_rewrites_is_exact_on_a_tiny_checkpoint(tiny_pair, case):
    """A random tiny model repeats nothing, so an oracle proposer drafts the plain engine's own
    continuation, every third draft wrong, through the torch path (none) and the native one."""
    plain, llm = tiny_pair
    kw = dict(CASES[case])
    eos = plain.engine.tokenizer.eos_token_id
    if case == "min_tokens":
        kw["logit_bias"] = {eos: 50.0}
    p = SamplingParams(temperature=0, max_tokens=40, **{"ignore_eos": True, **kw})
    prompt = plain.tokenizer.encode("a b c d e f a b c d e f a b c")
    want = [o.token_ids for o in plain.generate(prompt, p)[0].outputs]
    unrewritten = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert want[0] != unrewritten.outputs[0].token_ids  # the rewrite changes the output: the test tests it
    if case == "min_tokens":
        assert len(want[0]) <= 13  # ends at the first position EOS is allowed
    out = _with_oracle(llm, want, lambda: llm.generate(prompt, p)[0])
    assert [o.token_ids for o in out.outputs] == want
    assert _accepted(out) > 0, out.events.spec  # drafts were accepted: speculation ran
    assert llm.engine.blocks.check_consistency() == []


# ---------------------------------------------------------------- SmolLM2, native path
@pytest.fixture(scope="module")
def smol_pair() -> tuple[LLM, LLM]:
    kw = dict(kv_cache_memory="64MiB")
    return LLM("smollm2-135m-instruct", **kw), LLM("smollm2-135m-instruct", speculative_config=json.dumps(SPEC), **kw)


@pytest.mark.slow  # (loads SmolLM2: not the fast tier)
@pytest.mark.requires("kernels")
@pytest.mark.parametrize("case", ["penalties", "logit_bias", "min_tokens", "n2_penalties"])
def test_greedy_with_per_token_rewrites_is_the_plain_engines_on_smollm2(smol_pair, case):
    plain, llm = smol_pair
    tok = plain.engine.tokenizer
    kw: dict = {"penalties": dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.1),
                "logit_bias": dict(logit_bias={tok.encode(" parent")[0]: -4.0, tok.encode(" return")[0]: 2.0}),
                "min_tokens": dict(min_tokens=40, logit_bias={tok.eos_token_id: 30.0}),  # (EOS first from 40 on)
                "n2_penalties": dict(n=2, repetition_penalty=1.1, presence_penalty=0.3)}[case]
    p = SamplingParams(temperature=0, max_tokens=96, **kw)
    stats = llm.engine.spec.stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    want, got = plain.chat(COPY, p)[0], llm.chat(COPY, p)[0]
    # The request's counters are its choices' sum: the engine-wide ones moved by exactly them
    # (n = 2: each choice drafts and verifies on its own; the Timeline's `spec_decode` reads these).
    after = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert [a - b for a, b in zip(after, before, strict=True)] == list(got.events.spec)
    unrewritten = plain.chat(COPY, SamplingParams(temperature=0, max_tokens=96))[0].outputs[0]
    assert want.outputs[0].token_ids != unrewritten.token_ids  # the rewrite matters here
    assert len(got.outputs) == len(want.outputs) == p.n
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    if case == "min_tokens":
        assert len(want.outputs[0].token_ids) <= 41 and want.outputs[0].finish_reason == "stop"
    assert got.events.spec and got.events.spec[1] > 0, got.events.spec  # the n-gram proposer drafted
    # Penalties steer away from repeats, so whether its drafts are accepted depends on the text,
    # which the ISA's kernels change: an oracle's drafts make acceptance and rejection certain.
    oracle = _with_oracle(llm, [w.token_ids for w in want.outputs], lambda: llm.chat(COPY, p)[0])
    assert [o.token_ids for o in oracle.outputs] == [w.token_ids for w in want.outputs]
    assert _accepted(oracle) > 0 and oracle.events.spec[1] > _accepted(oracle), oracle.events.spec
    assert llm.engine.blocks.check_consistency() == []


@pytest.mark.slow  # (loads SmolLM2: not the fast tier)
@pytest.mark.requires("kernels")
def test_seeded_sampled_choices_with_penalties_speculate_and_reproduce(smol_pair):
    """n = 2, sampled, seeded, with penalties: both choices draft and accept, each draws from its
    own stream (seed + i: the choices differ), and the same request gives the same tokens again."""
    _, llm = smol_pair
    p = SamplingParams(temperature=0.5, max_tokens=64, seed=11, n=2, frequency_penalty=0.2)
    first, again = llm.chat(COPY, p)[0], llm.chat(COPY, p)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids
    assert _accepted(first) > 0, first.events.spec
    assert llm.engine.blocks.check_consistency() == []


@pytest.mark.slow  # (loads SmolLM2: not the fast tier)
@pytest.mark.requires("kernels")
def test_penalties_and_min_tokens_under_a_grammar_are_the_plain_engines(smol_pair):
    """Rewrites first, then the grammar's masks, row by row, as the plain sampler orders them."""
    from tests.engine.test_spec_grammar import COPY as RECORD_COPY
    from tests.engine.test_spec_grammar import SCHEMA

    plain, llm = smol_pair
    p = SamplingParams(temperature=0, max_tokens=120, structured=SCHEMA, min_tokens=30, repetition_penalty=1.05,
                       presence_penalty=0.2)
    want, got = plain.chat(RECORD_COPY, p)[0].outputs[0], llm.chat(RECORD_COPY, p)[0]
    g = got.outputs[0]
    assert (g.token_ids, g.text, g.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert _accepted(got) > 0, got.events.spec
    assert llm.engine.blocks.check_consistency() == []
