"""Speculative decoding for LoRA requests: a drafting sequence's 1 + K verification rows all run
with its adapter (the runners map adapters per scheduled sequence, whose row count includes its
drafts), so greedy output is token for token the plain engine's, with drafts accepted, in a step
that mixes two adapters and the base model, on the torch path and the native one."""

from __future__ import annotations

import json

import pytest

from tests.engine.conftest import make_prompts
from tests.engine.lora_adapters import make_peft_adapter
from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.config import SpeculativeConfig
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec import decoder
from tokenpath.protocol.lora import LoraRef

# The rule draft policy (no prices): these tests need sequences drafting side by side in a step, which
# the priced policies decide by the host's step timings (tests/engine/test_spec_policy.py tests those).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "draft_policy": "rule"}
TOKENS = 24


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, LoraRef]:
    """test_lora.py's two: every target at rank 8, and attention only at rank 4 with rsLoRA."""
    base, root = cached_tiny("llama"), tmp_path_factory.mktemp("spec_loras")
    a = make_peft_adapter(base, root / "a", r=8, seed=1)
    b = make_peft_adapter(base, root / "b", r=4, alpha=8, seed=2, targets=["q_proj", "v_proj", "o_proj"], rslora=True)
    return {"a": LoraRef("a", str(a)), "b": LoraRef("b", str(b))}


@pytest.fixture(scope="module", params=["none", pytest.param("q8_0", marks=pytest.mark.requires("kernels"))])
def tiny_pair(request) -> tuple[LLM, LLM]:
    """The plain engine and the speculating one on the tiny checkpoint, torch path (none) or native (q8_0)."""
    model = str(cached_tiny("llama"))
    kw = dict(num_kv_blocks=128, block_size=4, dtype="float32", quantization=request.param, max_num_seqs=8)
    return LLM(model, **kw), LLM(model, speculative_config=json.dumps(SPEC), **kw)


class OracleProposer:
    """The n-gram proposer's stand-in: a random tiny model repeats nothing, so n-grams never
    match. It drafts the plain engine's own continuation of whichever prompt the tokens start
    with, every third draft wrong, so steps accept some drafts and reject others. The engine's
    own `SpecDecoder.drafts` still decides who drafts and how many."""

    def __init__(self, table: list[tuple[list[int], list[int]]]) -> None:
        self.table = table

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for prompt, want in self.table:
            if tokens[: len(prompt)] == prompt:
                at = len(tokens) - len(prompt)
                return [t if (at + i) % 3 else (t + 1) % 500 for i, t in enumerate(want[at : at + k])]
        return []


def test_every_request_drafts_whatever_it_asks_lora_included():
    """The real proposer, straight from `SpecDecoder.drafts`: a LoRA request drafts as a base
    one does (there is no list of requests that decode plainly any more)."""
    spec = decoder.SpecDecoder(SpeculativeConfig(**SPEC), max_model_len=256)
    tokens = [5, 6, 7, 8, 9, 5, 6, 7]
    for params, lora in ((SamplingParams(temperature=0, max_tokens=16), LoraRef("a", "adapters/a")),
                         (SamplingParams(temperature=0.8, seed=3, n=2, presence_penalty=0.5), LoraRef("b", "adapters/b")),
                         (SamplingParams(temperature=0, max_tokens=16), None)):
        seq = Sequence("r", 0, list(tokens), 5, params)
        seq.lora = lora
        assert spec.drafts(seq, budget=8) == [8, 9, 5, 6], (params, lora)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_lora_requests_speculate_exactly_in_a_step_mixing_two_adapters_and_the_base(
        tiny_pair, adapters, monkeypatch):
    """Four requests decode together: adapter a, adapter b, the base model, a again (so a's rows
    are not contiguous in the step). Each gives the plain engine's tokens and accepts drafts."""
    plain, llm = tiny_pair
    prompts = [make_prompts(plain.tokenizer, [n], seed=s)[0] for n, s in ((14, 1), (17, 2), (20, 3), (23, 4))]
    mix = [adapters["a"], adapters["b"], None, adapters["a"]]
    p = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    want = _tokens(plain.generate(prompts, p, lora=mix))
    base = _tokens(plain.generate(prompts, p))
    for i in (0, 1, 3):
        assert want[i] != base[i], i  # the adapter changes the output: losing it on any row shows
    table = list(zip(prompts, want, strict=True))
    # Adapters load on a background thread: on a loaded host the base request would decode alone
    # while they load, and never draft beside them. One token each loads them first.
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=1), lora=mix[:2])
    monkeypatch.setattr(decoder, "NgramIndex", lambda lo, hi: OracleProposer(table))
    runner, execute = llm.engine.runner, llm.engine.runner.execute
    steps: list[set[str | None]] = []  # per step: the adapters (None: base) of the drafting sequences

    def recording(scheduled):  # noqa: ANN001, ANN202 - the runner's own execute, its steps noted
        steps.append({seq.lora.name if seq.lora else None for seq, _ in scheduled if seq.draft_ids})
        return execute(scheduled)

    monkeypatch.setattr(runner, "execute", recording)
    outs = llm.generate(prompts, p, lora=mix)
    assert _tokens(outs) == want
    for out, lora in zip(outs, mix, strict=True):
        assert out.events.spec is not None and out.events.spec[2] > 0, (lora, out.events.spec)  # drafts accepted
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # and some rejected
    assert any({"a", "b", None} <= step for step in steps), steps  # drafting side by side in one step
    assert llm.engine.blocks.check_consistency() == []


@pytest.mark.slow  # (loads SmolLM2 twice: not the fast tier)
@pytest.mark.requires("kernels")
def test_lora_requests_copying_code_speculate_with_the_ngram_proposer_on_smollm2(tmp_path):
    """The real proposer on a copy-heavy prompt, native kernels, two hand-made adapters (small
    enough that the model still copies, so drafts are accepted; large enough to change its greedy
    tokens, so that drafts verified without the adapter would change them: checked by breaking the
    runner's mapping) and the base model in one batch: each gives the plain engine's tokens."""
    from tests.engine.lora_adapters import random_adapter
    from tests.engine.test_spec_decode import COPY

    kw = dict(kv_cache_memory="64MiB")
    plain = LLM("smollm2-135m-instruct", **kw)
    llm = LLM("smollm2-135m-instruct", speculative_config=json.dumps(SPEC), **kw)
    cfg = plain.engine.model_config
    mix = [LoraRef("x", str(random_adapter(tmp_path / "x", cfg, std=0.05, seed=1))), None,
           LoraRef("y", str(random_adapter(tmp_path / "y", cfg, std=0.05, seed=5)))]
    prompt = plain.tokenizer.apply_chat_template(COPY)
    p = SamplingParams(temperature=0, max_tokens=96)
    want = plain.generate([prompt] * 3, p, lora=mix)
    tokens = [o.outputs[0].token_ids for o in want]
    assert tokens[0] != tokens[1] != tokens[2]  # each adapter changes the base model's output
    got = llm.generate([prompt] * 3, p, lora=mix)
    for g, w, lora in zip(got, want, mix, strict=True):
        assert (g.outputs[0].token_ids, g.outputs[0].text) == (w.outputs[0].token_ids, w.outputs[0].text), lora
        assert g.events.spec is not None and g.events.spec[2] > 0, (lora, g.events.spec)
    assert llm.engine.blocks.check_consistency() == []
