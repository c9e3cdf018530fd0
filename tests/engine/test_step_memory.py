"""A prefill step's own buffers (issue 42, peak RSS): the largest ones, the qkv, attention and
gate/up outputs, share memory where the step's phases leave them dead (csrc/forward.cpp
step_buffers), the sandwich-norm buffer exists only for models with sandwich norms, and a buffer
a longer step outgrows is given back rather than left in the heap, and a grown buffer's pages
become resident only where a step writes them (csrc/step_alloc.h)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = r"""
import json, sys
import numpy as np
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key)) / 1024
from tokenpath.config import EngineConfig
from tokenpath.engine.loader import load_model
from tokenpath.engine.runner import ModelRunner
T = 512
loaded = load_model(sys.argv[1])
runner = ModelRunner(loaded, EngineConfig(model=sys.argv[1], num_kv_blocks=T // 16 + 1, max_num_batched_tokens=T,
                                          disable_hybrid_kv_cache_manager=True), 1024)
for a in [*runner.cache.k, *runner.cache.v]:
    a.fill(0)  # the pool resident before the step: what grows is the step's own buffers
native = runner.native
assert native is not None
ids = (np.arange(T, dtype=np.int32) * 7919 + 1000) % 40000
pos = np.arange(T, dtype=np.int32)
table = np.arange(T // 16 + 1, dtype=np.int32)
native.forward(ids[:1], pos[:1], pos[:1].astype(np.int64), np.zeros(1, np.int32), table, np.zeros(1, np.int32))
base = status("VmRSS:")
for n in map(int, sys.argv[2:]):  # prefill steps of n rows, one after the other
    native.forward(ids[:n], pos[:n], pos[:n].astype(np.int64), np.zeros(n, np.int32), table,
                   np.array([n - 1], dtype=np.int32))
print(json.dumps([status("VmHWM:") - base, native.step_buffer_bytes() / 2**20, native.prompt_tiles]))
"""


@pytest.mark.requires("kernels", "smollm2_gguf")
def test_a_512_row_prefill_grows_by_its_shared_buffers():
    """SmolLM2, one 512-row prefill step with its KV pool already resident: the step's buffers
    grew RSS by 16.5 MiB when qkv (1.9 MiB), attention (1.1), gate/up (6.0) and the unused
    sandwich-norm output (1.1) each had their own; 12.3 MiB with gate/up over the other two and no
    sandwich buffer. RSS does not depend on the machine's load; the bound sits between the two."""
    growth = _growth("512")
    assert growth < 14.0, f"a 512-row step grew RSS by {growth:.1f} MiB"


def _growth(*steps: str) -> float:
    return _probe(*steps)[0]


def _probe(*steps: str) -> tuple[float, float, bool]:
    """(MiB the steps grew the peak RSS by, MiB of step buffers held after them, whether prompt
    rows took AMX tiles)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, "smollm2-135m-instruct", *steps], capture_output=True,
                         text=True, timeout=300, check=True)
    growth, held, tiles = json.loads(out.stdout.strip().splitlines()[-1])
    return float(growth), float(held), bool(tiles)


@pytest.mark.requires("kernels", "smollm2_gguf")
def test_buffers_a_step_does_not_write_stay_off_rss():
    """Where prompt rows take bf16 tiles (AMX-BF16), a 512-row prefill writes the bf16 copies of its
    activations, not the int8 rows and residual bytes its buffers are also sized for (generated rows
    take those). Value-initialized on growth, their pages were written all the same: RSS grew by
    what the buffers hold (12.5 MiB for 12.4, this AMX host); left as the kernel's zero pages until
    a step writes them, by 9.4. Without tiles every buffer is written (AVX2: 10.8 for 10.7, before
    and after), so there the step grows RSS by what it holds, as before."""
    growth, held, tiles = _probe("512")
    if tiles:
        assert growth < held - 1.5, f"a 512-row step grew RSS by {growth:.1f} MiB for {held:.1f} MiB of buffers"
    else:
        assert growth < held + 0.5, f"a 512-row step grew RSS by {growth:.1f} MiB for {held:.1f} MiB of buffers"


@pytest.mark.requires("kernels", "smollm2_gguf")
def test_outgrown_step_buffers_leave_nothing_resident():
    """A 256-row step, then a 512-row one: the buffers the longer step outgrows go back to the system
    before their successors are touched (csrc/step_alloc.h). From glibc's heap, grown by resize, the
    peak grew by 15.4 MiB (17.4 before the buffers were shared); now by what the 512-row step holds
    (12.7; the bound as above)."""
    growth = _growth("256", "512")
    assert growth < 14.0, f"a 256-row then a 512-row step grew RSS by {growth:.1f} MiB"
