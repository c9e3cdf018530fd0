"""Shared fixtures: the real SmolLM2 and Gemma 3 270M engines, loaded once per session, and HF
references."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tokenpath import LLM
from tokenpath.engine import loader
from tokenpath.engine.loader import SMOLLM2_GGUF, LoadedModel, resolve_model_path

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
def smol_loaded() -> LoadedModel:
    """SmolLM2's GGUF as `load_model` reads it (seconds under load), once per session: the runners
    built on it only read it (its weights are the file's, dequantized on access)."""
    return loader.load_model("smollm2-135m-instruct")


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


@dataclass
class LoadedLLM:
    """An engine and what its load logged (INFO and up of `tokenpath.engine.kernels`): a
    session-scoped engine is built before any one test's caplog could see that."""

    llm: LLM
    load_log: str


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _load_logged(**kwargs: object) -> LoadedLLM:
    logger = logging.getLogger("tokenpath.engine.kernels")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        llm = LLM(**kwargs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return LoadedLLM(llm, "\n".join(handler.lines))


# Gemma 3 270M as tests/engine/test_gemma3_270m.py, test_gemma3_native.py and test_kv_window.py
# run it: loading it takes tens of seconds under load, so each form is loaded once per session.
# 256-token steps: a 560-token prompt (past the 512 window) is prefilled in three chunks.
GEMMA3_270M = dict(model="gemma-3-270m", dtype="float32", kv_cache_memory="64MiB", max_model_len=1024,
                   max_num_batched_tokens=256)


def _fresh(loaded: LoadedLLM) -> Iterator[LoadedLLM]:
    """Each test starts from an idle engine with no cached prefix (an earlier test's prefixes, or
    its blocks written by hand, must not reach it), and leaves every block free."""
    blocks = loaded.llm.engine.blocks
    blocks.reset_prefix_cache()
    assert blocks.num_free_blocks == blocks.num_blocks and not loaded.llm.engine.has_work()
    yield loaded
    blocks.reset_prefix_cache()


@pytest.fixture(scope="session")
def _gemma3_270m_hybrid() -> LoadedLLM:
    return _load_logged(**GEMMA3_270M)


@pytest.fixture(scope="session")
def _gemma3_270m_flat() -> LoadedLLM:
    return _load_logged(**GEMMA3_270M, disable_hybrid_kv_cache_manager=True)


@pytest.fixture
def gemma3_270m(_gemma3_270m_hybrid: LoadedLLM) -> Iterator[LoadedLLM]:
    """The default engine: native kernels on the GGUF's blocks, window layers in their own KV
    group (only their window's blocks kept)."""
    yield from _fresh(_gemma3_270m_hybrid)


@pytest.fixture
def gemma3_270m_flat(_gemma3_270m_flat: LoadedLLM) -> Iterator[LoadedLLM]:
    """The same with one block table for every layer (--disable-hybrid-kv-cache-manager)."""
    yield from _fresh(_gemma3_270m_flat)


def hf_float32(path):
    """transformers' model of a checkpoint folder, float32, in eval mode: the tiny-model tests' reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def random_ids(vocab: int, n: int = 40) -> list[int]:
    return np.random.default_rng(0).integers(3, vocab, n).tolist()


def assert_greedy_as_transformers(llm, path, alone: int) -> None:
    """Six prompts (5-90 tokens) batched, chunked and mixed with decodes, then prompt `alone` by
    itself: each gives transformers' greedy tokens (16) on the checkpoint at `path`."""
    from tokenpath.protocol import SamplingParams

    prompts = make_prompts(llm.tokenizer, [5, 17, 40, 90, 8, 61], seed=3)
    ref = hf_greedy(hf_float32(path), prompts, 16, None)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p)] == ref
    assert llm.generate([prompts[alone]], p)[0].outputs[0].token_ids == ref[alone]


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


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama checkpoint (2 layers, vocab 512; safetensors: it runs natively under q8_0)."""
    from tests.engine.test_native_families import save_family
    from tokenpath.engine.loader import load_model

    return load_model(save_family("llama3-rope", tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture
def tiny_native(tiny_llama):
    """Engine steps by hand on `tiny_llama` on the native kernels (float32 KV cache)."""
    from tests.engine.native_steps import NativeSteps

    return NativeSteps(tiny_llama, "float32", num_blocks=4, max_len=64)
