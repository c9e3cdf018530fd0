"""Shared fixtures: the real SmolLM2 weights, loaded once per session, and HF references."""

from __future__ import annotations

import warnings

import pytest
import torch

from tokenpath import LLM
from tokenpath.engine.loader import SMOLLM2_GGUF, resolve_model_path

WORDS = ["river", "stone", "light", "garden", "music", "paper", "window", "silver", "morning", "engine", "quiet", "yellow", "market", "travel", "simple", "history", "forest", "number", "winter", "castle"]


def make_prompts(tokenizer, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Deterministic prompts of exactly the given token lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        words = [WORDS[int(i)] for i in torch.randint(len(WORDS), (n * 2,), generator=g)]
        ids = tokenizer.encode("Here is a list of words: " + " ".join(words))
        out.append(ids[:n])
    return out


@pytest.fixture(scope="session")
def smol_llm() -> LLM:
    """The default engine: the native kernels on the GGUF's blocks when built, else torch float32."""
    return LLM("smollm2-135m-instruct", dtype="float32", kv_cache_memory="256MiB", max_num_seqs=16)


@pytest.fixture(scope="session")
def smol_llm_fp32() -> LLM:
    """The torch float32 path on the dequantized weights: what transformers computes, exactly."""
    return LLM("smollm2-135m-instruct", dtype="float32", quantization="none", kv_cache_memory="256MiB",
               max_num_seqs=16)


@pytest.fixture(scope="session")
def hf_smol():
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("smollm2-135m-instruct")
    assert path.name == SMOLLM2_GGUF
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos: int | None) -> list[list[int]]:
    """HF transformers' greedy generate, one prompt at a time (no padding effects)."""
    outs = []
    for ids in prompts:
        with torch.inference_mode():
            res = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
        new = res[0, len(ids):].tolist()
        if eos is not None and eos in new:
            new = new[: new.index(eos) + 1]
        outs.append(new)
    return outs
