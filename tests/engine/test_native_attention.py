"""The native kernels' tiled attention (csrc/attention.h): the rows of a prefill chunk go through
attention in tiles of up to 8 rows that share each K/V read, a decode row on its own. A row's
context is positions 0..its own, whatever tile it lands in, so its logits must be exactly those
it gets when the same tokens arrive one per step (decode style) or beside other sequences' rows:
the native path is batch-invariant by design (rows are computed independently), which greedy
decoding relies on. Equality is asserted bit for bit; any masking or tiling slip (a row seeing a
key past its position, missing one, or reading another row's queries) changes logits by far more.

Every KV pool dtype (float32, float16, fp8 e5m2 and e4m3, q8_0), block tables out of order, contexts past
one 32-key block, tiles cut short by the chunk's end; SmolLM2 (head_dim 64, 3 query heads per KV
head) and a tiny Llama with head_dim 20 and 4 query heads per KV head (the kernels' scalar tails
and their 3 + 1 head grouping).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.native_steps import NativeSteps
from tests.engine.tiny_models import save_tiny
from tokenpath.engine.kernels import native_library
from tokenpath.engine.loader import load_model, resolve_model_path
from tokenpath.engine.tokenizer import Tokenizer

lib = native_library()
pytestmark = pytest.mark.requires("f16c")
TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"
KV_DTYPES = ["float32", "float16", "fp8_e5m2", "fp8_e4m3", "q8_0"]
# Every model with every pool dtype, but q8_0 on the head_dim-20 model: q8_0 needs head_dim a
# multiple of 32, and the load refuses it (tests/engine/test_kv_fp8.py checks that refusal).
CASES = [(m, kv) for m in ("smollm2", "head_dim_20") for kv in KV_DTYPES if (m, kv) != ("head_dim_20", "q8_0")]


class Steps(NativeSteps):
    """Room for 24 blocks of context (the tests' block tables reach block 23)."""

    def __init__(self, loaded, kv: str) -> None:
        super().__init__(loaded, kv, num_blocks=24, max_len=384)
        assert self.runner.kv_dtype == kv


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    return Tokenizer(resolve_model_path("smollm2-135m-instruct")).encode(TEXT.read_text())  # (the GGUF)


@pytest.fixture(scope="module")
def head_dim_20(tmp_path_factory):
    # 8 x 20 = 160 query features, wider than hidden and intermediate (the step's activation
    # buffers once covered only those two, and quantizing the attention output overran them).
    path = save_tiny("llama", tmp_path_factory.mktemp("hd20"), head_dim=20, num_attention_heads=8,
                     num_key_value_heads=2)
    model = load_model(str(path))
    assert (model.config.head_dim, model.config.num_heads // model.config.num_kv_heads) == (20, 4)
    return model


@pytest.fixture
def loaded(request):
    """The model of a case (indirect): SmolLM2's GGUF, or the head_dim-20 checkpoint."""
    return request.getfixturevalue("smol_loaded" if request.param == "smollm2" else "head_dim_20")


@pytest.mark.parametrize(("loaded", "kv"), CASES, indirect=["loaded"])
def test_prefill_chunk_matches_token_by_token(loaded, text_ids, kv):
    """A 70-token prompt as one chunk (tiles of 8 rows, the last of 6; keys in blocks of 32, the
    last partial) against the same 70 tokens one per step, then a decode after each."""
    table = [9, 3, 14, 0, 6]  # out of order: 80 positions
    ids = text_ids[:71]
    chunked, alone = Steps(loaded, kv), Steps(loaded, kv)
    whole = chunked.step([(table, ids[:70], 0)])
    one_by_one = torch.cat([alone.step([(table, ids[i : i + 1], i)]) for i in range(70)])
    assert whole.shape == one_by_one.shape == (70, loaded.config.vocab_size)
    assert torch.equal(whole, one_by_one), f"max |diff| {(whole - one_by_one).abs().max():.3e}"
    # The K/V both wrote are the same too: the next decode reads them.
    assert torch.equal(chunked.step([(table, ids[70:71], 70)]), alone.step([(table, ids[70:71], 70)]))


@pytest.mark.parametrize(("loaded", "kv"), CASES, indirect=["loaded"])
def test_mixed_step_rows_match_their_own_steps(loaded, text_ids, kv):
    """One step holding two decodes and two later prefill chunks gives each row exactly what its
    sequence gets from a step of its own. c's decode at position 21 sits right before d's chunk at
    22..48: consecutive positions, but another sequence's table, so not one tile."""
    a, b, c, d = text_ids[:40], text_ids[100:180], text_ids[300:340], text_ids[400:450]
    ta, tb, tc, td = [4, 17, 21], [11, 2, 20, 7, 1], [5, 23], [13, 19, 8, 0]
    mixed, own = Steps(loaded, kv), Steps(loaded, kv)
    for s in (mixed, own):  # the cached parts: a 33, b 45, c 21 and d 22 tokens
        s.step([(ta, a[:33], 0), (tb, b[:45], 0)])
        s.step([(tc, c[:21], 0), (td, d[:22], 0)])
    parts = [(ta, a[33:34], 33), (tb, b[45:78], 45), (tc, c[21:22], 21), (td, d[22:49], 22)]
    got = mixed.step(parts)
    want = torch.cat([own.step([part]) for part in parts])
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max():.3e}"


@pytest.mark.parametrize(("loaded", "kv"), CASES, indirect=["loaded"])
def test_a_wide_decode_batch_matches_each_rows_own_step(loaded, text_ids, kv):
    """With many decode rows (at least 4 per thread), each row's item covers all its KV heads and reads
    every cache slot whole; its logits equal what the row gets alone, where each head is its own item.
    24 sequences of 1 block each (context 3..16 tokens), block tables in reverse order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 6))  # whole-row items need at least 4 decode rows per thread
    try:
        _wide_decode_batch(loaded, text_ids, kv)
    finally:
        torch.set_num_threads(threads)


def _wide_decode_batch(loaded, text_ids, kv: str) -> None:
    seqs = [(text_ids[50 * i : 50 * i + 16], [23 - i], 2 + i % 14) for i in range(24)]  # (ids, table, cached)
    batch, own = Steps(loaded, kv), Steps(loaded, kv)
    for s in (batch, own):
        for toks, table, cached in seqs:
            s.step([(table, toks[:cached], 0)])
    parts = [(table, toks[cached : cached + 1], cached) for toks, table, cached in seqs]
    got = batch.step(parts)
    want = torch.cat([own.step([part]) for part in parts])
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max():.3e}"


@pytest.mark.parametrize(("loaded", "kv"), [("smollm2", "float16"), ("head_dim_20", "float32")], indirect=["loaded"])
def test_a_lone_decode_row_split_across_threads_keeps_its_bits(loaded, text_ids, kv):
    """One decode row has one attention item per KV head (3 on SmolLM2, 2 here), fewer than two per
    thread: with 2 threads each KV head's query heads are split across items (csrc/forward.cpp,
    hsplit), with 1 they are not. A query's arithmetic does not depend on its neighbours, so the
    logits are the same bits, at a context past one key block."""
    table = [9, 3, 14, 0, 6]
    ids = text_ids[:71]
    one, two = Steps(loaded, kv), Steps(loaded, kv)
    one.runner.native.threads, two.runner.native.threads = 1, 2
    for s in (one, two):
        s.step([(table, ids[:70], 0)])
    got, want = two.step([(table, ids[70:71], 70)]), one.step([(table, ids[70:71], 70)])
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max():.3e}"
