"""The gateway's heap guard (`tokenpath.server.memory`) really returns fragmented free memory.

A fresh interpreter (so its heap is its own) allocates on four threads, frees nine chunks in ten
(the survivors pin the heaps, so glibc cannot shrink them on free), and then `trim_heap()` must
hand most of the freed pages back to the OS. Without the trim the RSS stays at its high-water
mark, which is how the gateway's RSS crept up in the soak (benchmarks/results/soak.md).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc malloc only")

SCRIPT = """
import json, threading
from tokenpath.server.memory import limit_arenas, rss_mib, trim_heap

limited = limit_arenas()
survivors = []

def churn():
    chunks = [bytearray(8192 + i % 1024) for i in range(4000)]  # ~35 MiB a thread, outside pymalloc
    survivors.extend(chunks[::10])  # one in ten stays alive: the heap cannot shrink from its top
    del chunks

threads = [threading.Thread(target=churn) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
high = rss_mib()
released = trim_heap()
print(json.dumps({"limited": limited, "high": high, "released": released, "after": rss_mib()}))
"""


def test_trim_returns_fragmented_free_memory_and_arenas_are_capped():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["limited"] is True
    assert res["released"] > 40, res  # of ~140 MiB allocated, ~125 MiB freed in holes
    assert res["after"] < res["high"] - 40, res


def test_an_operators_malloc_arena_max_is_left_alone():
    env = {**os.environ, "MALLOC_ARENA_MAX": "4"}
    code = "from tokenpath.server.memory import limit_arenas; print(limit_arenas())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
