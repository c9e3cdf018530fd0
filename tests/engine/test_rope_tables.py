"""The native kernels' rope tables are computed as far as the steps' positions reach, not for the
whole context at load (engine/rope_tables.py RopeTables; issue 42's peak RSS: Gemma 3's two ropes
at 8192 positions were 32 MiB resident from the start).

Rows computed by ranges must be the rows of the whole table, bit for bit; the rows past what was
computed must not be resident; and an engine whose prompt runs past the first rows must compute
what an engine with full tables computes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from tests.engine.tiny_models import save_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.engine.model_config import RopeScaling
from tokenpath.engine.rope_tables import ROPE_FIRST_ROWS, RopeTables, rope_tables

YARN = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=512)


@pytest.mark.parametrize("scaling", [None, YARN], ids=["plain", "yarn"])
def test_rows_filled_by_ranges_are_the_whole_tables_rows(scaling):
    whole_cos, whole_sin = rope_tables(64, 10000.0, 3000, scaling)
    t = RopeTables(64, 10000.0, 3000, scaling)
    assert t.filled == ROPE_FIRST_ROWS
    for n, filled in ((ROPE_FIRST_ROWS + 1, 2 * ROPE_FIRST_ROWS), (700, 1024), (5000, 3000)):  # doubling, clipped
        t.ensure(n)
        assert t.filled == filled
        assert np.array_equal(t.cos[:t.filled], whole_cos[:t.filled])
        assert np.array_equal(t.sin[:t.filled], whole_sin[:t.filled])
    assert t.filled == 3000


def _rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the table")


def test_rows_not_computed_are_not_resident():
    t = RopeTables(256, 1e6, 65536)  # 64 MiB per table, computed whole
    assert _rss_kib(t.cos.ctypes.data) <= 2 * ROPE_FIRST_ROWS * 256 * 4 // 1024
    t.ensure(65536)
    assert _rss_kib(t.cos.ctypes.data) >= 65536 * 256 * 4 // 1024


@pytest.mark.requires("kernels")
def test_a_long_prompt_computes_what_full_tables_compute(tmp_path):
    tiny = save_tiny("llama", tmp_path / "llama", max_position_embeddings=2048)
    prompt = [10 + (7 * i) % 1000 for i in range(700)]
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    runs = []
    for fill in (False, True):
        llm = LLM(str(tiny), dtype="float32", max_model_len=2048, num_kv_blocks=64, enable_prefix_caching=False)
        native = llm.engine.runner.native
        assert native is not None
        if fill:
            for rope in native.ropes:
                rope.ensure(rope.max_pos)
        else:
            assert all(rope.filled < len(prompt) for rope in native.ropes)  # the load computed the first rows
        out = llm.generate([prompt], params)[0]
        assert all(rope.filled >= len(prompt) + 3 for rope in native.ropes)
        runs.append(out)
    lazy, full = runs
    assert lazy.outputs[0].token_ids == full.outputs[0].token_ids
    got = [p.logprob for p in lazy.prompt_logprobs or [] if p is not None]
    want = [p.logprob for p in full.prompt_logprobs or [] if p is not None]
    assert len(got) == len(prompt) - 1
    assert np.allclose(got, want, rtol=0, atol=1e-6)
