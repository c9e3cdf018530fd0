"""LoRA adapters in the engine: PEFT adapters made by `peft` on a tiny Llama give transformers +
peft's greedy tokens (torch float32: all of them; native kernels: at least 3 of 4 prompts), a
step mixing adapters and the base model equals each request run alone, the prefix cache never
shares blocks across adapters, the slot and CPU LRUs evict and reload correctly."""

from __future__ import annotations

import pytest

from tests.engine.conftest import make_prompts
from tests.engine.lora_adapters import make_peft_adapter, peft_reference
from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.protocol.lora import LoraRef

TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS)


@pytest.fixture(scope="module")
def base():
    return cached_tiny("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Two adapters: every target at rank 8, and attention only at rank 4 with rsLoRA scaling."""
    root = tmp_path_factory.mktemp("loras")
    a = make_peft_adapter(base, root / "a", r=8, seed=1)
    b = make_peft_adapter(base, root / "b", r=4, alpha=8, seed=2, targets=["q_proj", "v_proj", "o_proj"],
                          rslora=True)
    return {"a": LoraRef("a", str(a)), "b": LoraRef("b", str(b))}


@pytest.fixture(scope="module")
def prompts(torch_llm):
    return make_prompts(torch_llm.tokenizer, [6, 19, 33, 52], seed=5)


@pytest.fixture(scope="module")
def references(base, adapters, prompts):
    from tokenpath.engine.tokenizer import Tokenizer

    eos = Tokenizer(base).eos_token_id
    out = {name: peft_reference(base, ref.path, prompts, TOKENS, eos) for name, ref in adapters.items()}
    out["base"] = peft_reference(base, None, prompts, TOKENS, eos)
    return out


@pytest.fixture(scope="module")
def torch_llm(base):
    return LLM(str(base), dtype="float32", quantization="none", num_kv_blocks=128, max_num_seqs=16)


def _tokens(llm: LLM, prompts, lora) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora=lora)]


def test_torch_path_equals_transformers_peft(torch_llm, adapters, prompts, references):
    for name, ref in adapters.items():
        assert _tokens(torch_llm, prompts, ref) == references[name], name
    assert _tokens(torch_llm, prompts, None) == references["base"]
    # The adapters matter: each changes what the base model says.
    for name in adapters:
        assert references[name] != references["base"], name


def test_mixed_batch_equals_each_alone(torch_llm, adapters, prompts):
    mix = [adapters["a"], None, adapters["b"], adapters["a"]]
    alone = [_tokens(torch_llm, [p], lora)[0] for p, lora in zip(prompts, mix, strict=True)]
    together = _tokens(torch_llm, prompts, mix)
    assert together == alone
    # Same prompts, every adapter at once (n > 1 choices too): each equals its own run.
    p = SamplingParams(temperature=0, max_tokens=TOKENS, n=2)
    outs = torch_llm.generate([prompts[1]] * 3, p, lora=[adapters["a"], adapters["b"], None])
    for out, lora in zip(outs, [adapters["a"], adapters["b"], None], strict=True):
        assert [c.token_ids for c in out.outputs] == [_tokens(torch_llm, [prompts[1]], lora)[0]] * 2


def test_prefix_cache_is_per_adapter(torch_llm, adapters):
    [long] = make_prompts(torch_llm.tokenizer, [52], seed=99)  # three full blocks of 16, new here
    first = torch_llm.generate([long], GREEDY, lora=adapters["a"])[0]
    base = torch_llm.generate([long], GREEDY)[0]
    other = torch_llm.generate([long], GREEDY, lora=adapters["b"])[0]
    again = torch_llm.generate([long], GREEDY, lora=adapters["a"])[0]
    assert first.num_cached_tokens == 0
    assert base.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_slot_and_cpu_lru(base, adapters, prompts, references):
    """One slot, one cached adapter: a mixed batch still finishes correctly (the adapters take
    turns), and an adapter evicted from the CPU LRU is read from disk again."""
    llm = LLM(str(base), dtype="float32", quantization="none", num_kv_blocks=128, max_loras=1, max_cpu_loras=1)
    mix = [adapters["a"], adapters["b"], None, adapters["a"]]
    got = _tokens(llm, prompts, mix)
    want = [references["a"][0], references["b"][1], references["base"][2], references["a"][3]]
    assert got == want
    assert llm.engine.loras.loads == 2
    assert _tokens(llm, prompts[:1], adapters["a"]) == references["a"][:1]
    assert llm.engine.loras.loads == 3  # a was evicted (CPU LRU of one) by b: read from disk again
    assert len(llm.engine.loras.resident) == 1 and len(llm.engine.loras.cpu) == 1
    assert llm.engine.blocks.check_consistency() == []


def test_adapter_that_fails_to_load_fails_its_request(torch_llm, tmp_path, prompts):
    from tokenpath.engine.lora import LoraError

    with pytest.raises(LoraError, match="does not exist"):
        torch_llm.generate(prompts[:1], GREEDY, lora=LoraRef("gone", str(tmp_path / "gone")))
    assert not torch_llm.engine.has_work()  # nothing left behind; the engine keeps serving
    assert _tokens(torch_llm, prompts[:1], None)


def _first_logprobs(llm: LLM, prompts, lora) -> list[dict[int, float]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5), lora=lora)
    return [{t: lp for t, _, lp in o.outputs[0].logprobs[0].top} for o in outs]


@pytest.mark.requires("kernels")
def test_native_path_matches_peft(base, adapters, prompts, references, torch_llm):
    """The delta in float32 beside the quantized (Q8_0) base GEMMs. The tiny random model's logits
    are flat (top-two gaps of 0.001-0.2 nats), where even the Q8_0 base model alone keeps
    transformers' greedy tokens for only 3-6 steps; so the native path is held to: the first
    three tokens of transformers + peft on at least 3 of 4 prompts, next-token log-probabilities
    within 0.25 nats of the float32 torch path's (the Q8_0 base alone is up to 0.15 off here) while
    the adapter moves them by far more, and a mixed step equal to each request alone."""
    llm = LLM(str(base), quantization="q8_0", num_kv_blocks=128, max_num_seqs=16)
    assert llm.engine.runner.native is not None
    base_lp = _first_logprobs(torch_llm, prompts, None)
    for name, ref in adapters.items():
        got = _tokens(llm, prompts, ref)
        assert sum(g[:3] == w[:3] for g, w in zip(got, references[name], strict=True)) >= 3, name
        want_lp, got_lp = _first_logprobs(torch_llm, prompts, ref), _first_logprobs(llm, prompts, ref)
        for want, have, plain in zip(want_lp, got_lp, base_lp, strict=True):
            shared = set(want) & set(have)
            assert len(shared) >= 4, name
            assert max(abs(want[t] - have[t]) for t in shared) < 0.25, name
            moved = [abs(want[t] - plain[t]) for t in set(want) & set(plain)] or [float("inf")]
            assert max(moved) > 1.0, name  # the adapter matters here
    mix = [adapters["a"], None, adapters["b"], adapters["a"]]
    alone = [_tokens(llm, [p], lora)[0] for p, lora in zip(prompts, mix, strict=True)]
    assert _tokens(llm, prompts, mix) == alone


@pytest.mark.requires("kernels")
def test_native_steps_without_adapters_build_no_lora_arguments(base, adapters, prompts, monkeypatch):
    """LoRA off costs nothing per step (issue 42's step-cost table): a step with no adapter in it
    does not build the kernels' LoRA arguments at all; one with an adapter still does."""
    import tokenpath.engine.runner as runner_mod

    calls: list[int] = []
    real = runner_mod.native_step

    def counted(row_adapters):  # noqa: ANN001, ANN202 - the real function, counted
        calls.append(len(row_adapters))
        return real(row_adapters)

    monkeypatch.setattr(runner_mod, "native_step", counted)
    llm = LLM(str(base), quantization="q8_0", num_kv_blocks=64, max_num_seqs=4)
    llm.generate(prompts[:2], GREEDY)
    assert calls == []
    llm.generate(prompts[:2], GREEDY, lora=adapters["a"])
    assert calls
