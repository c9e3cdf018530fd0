"""Speculative decoding (engine/spec/): the config is checked at start-up, the n-gram proposer
finds earlier occurrences, greedy output is token for token the plain engine's (with drafts
actually accepted), sampled output keeps the target distribution (rejection sampling), and the
KV cache never hashes a block holding a rejected draft."""

from __future__ import annotations

import json
from typing import cast

import numpy as np
import pytest

from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.cli import build_parser
from tokenpath.config import EngineConfig, SpeculativeConfig
from tokenpath.engine.block_hash import block_hashes
from tokenpath.engine.rng import Generator
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.decoder import SpecDecoder
from tokenpath.engine.spec.ngram import NgramIndex
from tokenpath.engine.spec.state import DraftState
from tokenpath.engine.spec.verify import verify
from tokenpath.server.config import build_config

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CODE = '''def hash_block_tokens(parent_hash, token_ids):
    """The identity of a full KV block: a hash chained over its parent's hash and its tokens."""
    return hash((ROOT_HASH if parent_hash is None else parent_hash, tuple(token_ids)))


def block_hashes(token_ids, block_size, limit=None, root=None):
    n_full = len(token_ids) // block_size
    if limit is not None:
        n_full = min(n_full, limit)
    out = []
    parent = root
    for i in range(n_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
'''
COPY = [{"role": "user", "content": "Repeat this code exactly, renaming hash_block_tokens to block_key:\n\n" + CODE}]


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("bad, field", [
    ({**SPEC, "method": "eagle"}, "method"),
    ({**SPEC, "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({**SPEC, "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({**SPEC, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({**SPEC, "lookahead": 2}, "lookahead"),
])
def test_a_bad_speculative_config_is_a_start_up_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=json.dumps(bad))
    with pytest.raises(ValueError, match=field):
        build_config(build_parser().parse_args(["engine", "--speculative-config", json.dumps(bad)]))


def test_the_flag_takes_vllms_json_and_llama_cpp_names():
    got = build_config(build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])).engine
    assert got.speculative_config == SpeculativeConfig(**SPEC)
    assert SpeculativeConfig(method="ngram-simple", num_speculative_tokens=2).method == "ngram"
    assert SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=2).method == "ngram"
    assert EngineConfig().speculative_config is None


# ---------------------------------------------------------------- the proposer
def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert index.propose(tokens, 3) == [2, 3, 5]  # 5 6 7 last seen before position 9
    tokens += [2]
    assert index.propose(tokens, 2) == [3, 5]  # incremental: only the new n-grams were indexed
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 4) == []  # (3, 4) never occurred before
    assert NgramIndex(1, 1).propose([4, 1, 2, 4], 5) == [1, 2, 4]  # runs up to the end


def test_a_copy_in_progress_continues_from_its_source_not_the_latest_short_ngram():
    index = NgramIndex(2, 3)
    #         the source ............  a distractor repeating (5, 6, 7)  the copy starts
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 5, 6, 7, 20, 21, 50, 1, 2]
    assert index.propose(tokens, 4) == [3, 4, 5, 6]
    tokens += [3, 4, 5, 6, 7]  # all four accepted, and the target's own token followed the source too
    assert index.propose(tokens, 2) == [8, 9]  # the lookup of (5, 6, 7) alone would say [20, 21]
    tokens += [8, 30]  # the copy broke off: back to the lookup
    assert index.propose(tokens, 2) == []
    assert NgramIndex(2, 3).propose([1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 5, 6, 7, 20, 21, 50, 1, 2, 3, 4, 5, 6, 7], 2) \
        == [20, 21]  # (without the copy's history, the latest occurrence wins as before)


def test_the_proposer_costs_microseconds_per_step():
    import time

    tokens = list(range(2000)) + list(range(50))
    index = NgramIndex(1, 3)
    index.propose(tokens, 4)  # the prompt, indexed once
    started = time.perf_counter()
    for i in range(200):
        tokens.append(50 + i)
        index.propose(tokens, 4)
    per_step = (time.perf_counter() - started) / 200
    assert per_step < 2e-3  # generous under load; ~10 us when quiet


def test_a_sequence_drafts_one_more_than_it_had_accepted_and_pauses_after_misses():
    state = DraftState(NgramIndex(1, 2), k=4)
    state.settle(accepted=1, max_k=4, proposed=4)
    assert (state.k, state.pause) == (2, 0)
    state.settle(accepted=0, max_k=4, proposed=2)
    state.settle(accepted=0, max_k=4, proposed=1)
    assert (state.k, state.pause) == (1, 2)  # paused 1, then 2 steps: backing off
    state.settle(accepted=1, max_k=4, proposed=2)
    state.settle(accepted=2, max_k=4, proposed=3)
    assert (state.k, state.backoff) == (3, 0)


def test_a_sequence_that_accepts_every_draft_doubles_its_draft_length_up_to_k():
    # (the cap rule alone: the default adaptive policy prices the lengths under this cap, test_spec_policy.py)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=16, draft_policy="rule"), max_model_len=4096)
    seq = Sequence("r", 0, [1, 2, 3, 1, 2], 5, SamplingParams(temperature=0, max_tokens=100))
    lengths = []
    for _ in range(6):
        k = spec.draft_len(seq, budget=64)
        lengths.append(k)
        spec.settle(seq, proposed=k, accepted=k)  # a copy: every draft accepted
    assert lengths == [16, 16, 16, 16, 16, 16]
    spec.settle(seq, proposed=16, accepted=0)  # a miss: one token, after a pause of one step
    assert spec.draft_len(seq, budget=64) == 0
    lengths = []
    for _ in range(6):
        k = spec.draft_len(seq, budget=64)
        lengths.append(k)
        spec.settle(seq, proposed=k, accepted=k)
    assert lengths == [1, 2, 4, 8, 16, 16]  # (one more a step would be 1, 2, 3, 4, 5, 6)
    spec.settle(seq, proposed=16, accepted=5)  # a partial acceptance: one more than accepted
    assert spec.draft_len(seq, budget=64) == 6


def test_by_default_a_step_with_more_than_four_decoding_sequences_drafts_nothing():
    # benchmarks/spec_batch.py: on/off 1.31x at c = 2, 0.99x at c = 4, 0.88x at c = 8 (K = 16)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=16), max_model_len=4096)
    assert [spec.allowed(d) for d in (1, 4, 5, 8)] == [True, True, False, False]
    wide = SpecDecoder(SpeculativeConfig(num_speculative_tokens=16, max_batch=8), max_model_len=4096)
    assert wide.allowed(8) and not wide.allowed(9)


# ---------------------------------------------------------------- exactness
def _greedy_pair(model: str, messages, max_tokens: int, **kw) -> tuple[list[int], list[int], LLM]:
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM(model, **kw)
    prompt = plain.tokenizer.apply_chat_template(messages)
    want = plain.generate(prompt, p)[0].outputs[0].token_ids
    spec = LLM(model, speculative_config=json.dumps(SPEC), **kw)
    got = spec.generate(prompt, p)[0].outputs[0].token_ids
    return want, got, spec


@pytest.mark.slow  # (loads SmolLM2: not the fast tier)
@pytest.mark.requires("kernels")
def test_greedy_is_token_for_token_the_plain_engines_on_smollm2():
    want, got, llm = _greedy_pair("smollm2-135m-instruct", COPY, 96, kv_cache_memory="64MiB")
    stats = llm.engine.spec.stats
    assert got == want
    assert len(got) == 96
    assert stats.num_accepted_tokens > 0, stats  # drafts were accepted: the test can fail
    assert llm.engine.steps < len(got), "speculation saved no step"
    assert llm.engine.blocks.check_consistency() == []


@pytest.mark.parametrize("quantization", ["none", pytest.param("q8_0", marks=pytest.mark.requires("kernels"))])
def test_greedy_is_exact_on_a_tiny_checkpoint_on_either_path(quantization):
    """A random tiny model repeats nothing, so n-grams never match: an oracle proposer drafts
    the plain engine's own continuation, every third draft wrong, so steps accept some drafts and
    reject others, through the torch path (none) and the native one (q8_0)."""
    model = str(cached_tiny("llama"))
    kw = dict(num_kv_blocks=64, block_size=4, dtype="float32", quantization=quantization)
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model, **kw)
    prompt = plain.tokenizer.encode("a b c d e f a b c d e f a b c")
    want = plain.generate(prompt, p)[0].outputs[0].token_ids
    llm = LLM(model, speculative_config=json.dumps(SPEC), **kw)
    spec = llm.engine.spec

    def oracle(seq: Sequence, k: int) -> list[int]:  # (k: SpecDecoder.draft_len's, within max_tokens)
        at = seq.num_output_tokens
        return [t if (at + i) % 3 else (t + 1) % 500 for i, t in enumerate(want[at : at + k])]

    spec.propose = oracle
    got = llm.generate(prompt, p)[0].outputs[0].token_ids
    assert got == want
    assert spec.stats.num_draft_tokens > spec.stats.num_accepted_tokens > 0
    assert llm.engine.steps < len(want)
    assert llm.engine.blocks.check_consistency() == []


@pytest.mark.slow  # (loads SmolLM2: not the fast tier)
@pytest.mark.requires("kernels")
def test_no_block_of_a_rejected_draft_is_ever_hashed_into_the_prefix_cache():
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB", block_size=4, speculative_config=json.dumps(SPEC))
    out = llm.chat(COPY, SamplingParams(temperature=0, max_tokens=64))[0]
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # some drafts rejected, some kept
    accepted = block_hashes(out.prompt_token_ids + out.outputs[0].token_ids, 4)
    cached = set(llm.engine.blocks.cached)
    assert cached and cached <= set(accepted)  # every cached block: accepted tokens only
    assert llm.engine.blocks.check_consistency() == []
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    assert out.events.spec is not None and out.events.spec[2] == stats.num_accepted_tokens
    _check_observability(llm, out)


def _check_observability(llm: LLM, out) -> None:
    """The request's counts reach its Timeline (so the audit row and trace), the engine's reach
    /metrics under vLLM's names."""
    from types import SimpleNamespace

    from tokenpath.replica.events import stamp_events
    from tokenpath.telemetry.metrics import _StateCollector
    from tokenpath.telemetry.timeline import Timeline

    stats = llm.engine.spec.stats
    timeline = Timeline(out.request_id)
    timeline.stamps["received"] = out.events.queued
    stamp_events(timeline, out)
    spec = cast(dict, timeline.attrs["spec_decode"])  # (attrs hold any JSON value)
    assert (spec["proposed"], spec["accepted"]) == (stats.num_draft_tokens, stats.num_accepted_tokens)
    dep = SimpleNamespace(name="smol", replicas=[SimpleNamespace(state=llm.engine.state)])
    fams = {f.name: f for f in _StateCollector(lambda: [dep]).collect()}
    accepted = fams["tokenpath:spec_decode_num_accepted_tokens"].samples[0].value
    assert accepted == stats.num_accepted_tokens
    assert fams["tokenpath:spec_decode_num_drafts"].samples[0].value == stats.num_drafts
    per_pos = [smp.value for smp in fams["tokenpath:spec_decode_num_accepted_tokens_per_pos"].samples]
    assert sum(per_pos) == accepted and len(per_pos) == SPEC["num_speculative_tokens"]


@pytest.mark.slow  # (loads SmolLM2: not the fast tier)
@pytest.mark.requires("kernels")
def test_max_tokens_and_stop_strings_hold_mid_draft():
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB", speculative_config=json.dumps(SPEC))
    plain = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB")
    for p in (SamplingParams(temperature=0, max_tokens=37), SamplingParams(temperature=0, max_tokens=80, stop=["n_full"])):
        got, want = llm.chat(COPY, p)[0].outputs[0], plain.chat(COPY, p)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    # (penalties, logit_bias, min_tokens and n > 1 draft too: tests/engine/test_spec_penalties.py)


# ---------------------------------------------------------------- the distribution
def test_rejection_sampling_keeps_the_target_distribution():
    """Vocabulary of 5, two draft tokens: the first emitted token must be distributed as row 0's
    p whatever the draft, and given it equals the draft, the second as row 1's."""
    logits = np.array([[1.0, 2.0, 0.5, 0.0, 1.5], [0.2, 0.1, 2.5, 1.0, 0.0], [0.0, 0.0, 0.0, 3.0, 0.0]],
                      dtype=np.float32)
    p = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    seq = Sequence("r", 0, [0], 1, SamplingParams(temperature=1.0, max_tokens=8))
    gen = Generator(1234)
    n = 6000  # (seeded: deterministic; 0.03 is over 3 standard errors of every frequency here)
    first = np.zeros(5)
    second_given_draft = np.zeros(5)
    lengths = np.zeros(4)
    for _ in range(n):
        seq.draft_ids = [1, 2]
        out = verify(logits, seq, gen)
        first[out[0]] += 1
        lengths[len(out)] += 1
        if out[0] == 1:
            second_given_draft[out[1]] += 1
    for got, want in ((first / n, p[0]), (second_given_draft / second_given_draft.sum(), p[1])):
        assert np.allclose(got, want, atol=0.03), (got, want)
    assert lengths[3] / n == pytest.approx(float(p[0, 1] * p[1, 2]), abs=0.03)  # both accepted
