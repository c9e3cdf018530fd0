"""The native read-bandwidth kernel (csrc/stream_read.h, read_bw.h) that
benchmarks/engine_vs_llamacpp.py measures decode against: it must read every byte it claims to
(the XOR of the buffer's 64-bit words, whatever the thread split and kernel set) and report a
plausible figure. numpy's float sum, the bound before it, reported less than the engine's own
GEMVs read on some hosts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenpath.engine import kernels as K

lib = K.native_library()
pytestmark = pytest.mark.requires("kernels")
ISAS = [] if lib is None else lib.available_isas()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_stream_read_reads_every_word(isa, threads):
    rng = np.random.default_rng(threads)
    words = rng.integers(0, 2**63, size=3 * 2**20 // 8, dtype=np.uint64)  # 3 MiB: uneven slices for 2
    want = int(np.bitwise_xor.reduce(words))
    gbps, checksum = K.stream_read(lib, words.view(np.uint8), threads, reps=3, isa=isa)
    assert checksum == want
    assert math.isfinite(gbps) and 0.1 < gbps < 10_000
    # A flipped bit in the last word (the last thread's slice end) or the first shows.
    for i in (0, words.size - 1):
        words[i] ^= np.uint64(1 << 40)
        assert K.stream_read(lib, words.view(np.uint8), threads, reps=1, isa=isa)[1] == want ^ (1 << 40)
        words[i] ^= np.uint64(1 << 40)


def test_stream_read_refuses_a_partial_mib():
    with pytest.raises(ValueError, match="whole MiB"):
        K.stream_read(lib, np.zeros(2**20 + 64, dtype=np.uint8), 1)
