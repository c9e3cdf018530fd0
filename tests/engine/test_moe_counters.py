"""The sparse layers' expert counters (csrc/moe.h `tp_model_moe_counters`, engine/models/moe.py):
pairs routed, experts read, the busiest expert's rows and sparse layer-steps, cumulative since load.

Two independent counts, the native plan phase's and the torch path's `bincount`, must agree on the
same float32 checkpoint, whose routing the two paths compute to float32 rounding; the figures obey
what routing implies (rows = tokens x top-k per sparse layer, at least k and at most E experts read
per layer-step), a step of one token reads k experts for one row each, and a dense model reports none.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_moe_native import _checkpoint
from tests.engine.test_native_safetensors import runner
from tests.engine.test_quantized_quality import all_logits
from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.engine.loader import load_model

pytestmark = [pytest.mark.requires("kernels"), pytest.mark.slow]

E, K, SPARSE = 8, 2, 2  # tests/engine/tiny_models.py's qwen3moe: 8 experts top-2, layers 0 and 2 sparse


def test_native_and_torch_count_the_same_routing(tmp_path):
    loaded = load_model(_checkpoint("qwen3moe", torch.float32, tmp_path))
    native, ref = runner(loaded), runner(loaded, "none", "float32")
    assert native.native is not None and ref.native is None
    assert native.moe_counters() == [0, 0, 0, 0] == ref.moe_counters()
    n = 40
    ids = torch.randint(3, loaded.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    all_logits(native, ids)  # one step of 40 rows
    all_logits(ref, ids)
    got = native.moe_counters()
    assert got == ref.moe_counters()
    rows, reads, busiest, layer_steps = got
    assert layer_steps == SPARSE and rows == n * K * SPARSE
    assert K * SPARSE <= reads <= E * SPARSE
    assert rows / reads <= busiest / layer_steps <= n  # the busiest expert holds at least the mean of those read


def test_one_token_per_step_reads_k_experts_for_one_row_each(tmp_path):
    loaded = load_model(_checkpoint("qwen3moe", torch.float32, tmp_path))
    r = runner(loaded)
    steps = 6
    for t in range(steps):
        p = np.array([t], dtype=np.int32)
        r.native.forward(np.array([100 + t], dtype=np.int32), p, p.astype(np.int64), np.zeros(1, dtype=np.int32),
                         np.arange(r.num_blocks, dtype=np.int32), np.zeros(1, dtype=np.int32))
    assert r.moe_counters() == [steps * SPARSE * K, steps * SPARSE * K, steps * SPARSE, steps * SPARSE]


def test_the_engine_state_carries_them_and_a_dense_model_has_none():
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(cached_tiny("qwen3moe")), max_num_batched_tokens=64)
    before = llm.engine.state().moe_experts
    llm.generate([[5, 6, 7, 8, 9]], p)
    after = llm.engine.state().moe_experts
    # A 5-token prefill and 3 decode steps (the 4th token comes from the last step's logits).
    assert after[3] - before[3] == 4 * SPARSE and after[0] - before[0] == (5 + 3) * K * SPARSE
    dense = LLM(str(cached_tiny("llama")), max_num_batched_tokens=64)
    dense.generate([[5, 6, 7]], p)
    assert dense.engine.state().moe_experts == []
