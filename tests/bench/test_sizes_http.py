"""benchmarks/sizes_http.py gives the three servers one KV budget and llama-server a slot per client.

The comparison is fair only if vLLM's reserved KV space, tokenpath's `--kv-cache-memory` and
llama-server's context (slots x the longest request) hold the same workload; the 4B's budget is
smaller so that vLLM's worker stays near 10 GB on a 24 GB machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.sizes_http import KV_GIB, NAME, server_argv  # noqa: E402


def _args(size: str) -> argparse.Namespace:
    return argparse.Namespace(levels=[1, 8, 32], input_len=128, output_len=32, kv_gib=KV_GIB[size],
                              vllm_dtype="bfloat16")


def test_each_server_gets_the_runs_kv_budget() -> None:
    args = _args("4b")
    argv, env = server_argv("vllm", Path("m"), 5000, args)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and argv[argv.index("--served-model-name") + 1] == NAME
    argv, _ = server_argv("tokenpath", Path("m"), 5000, args)
    assert argv[argv.index("--kv-cache-memory") + 1] == "1GiB"
    argv, env = server_argv("llamacpp", Path("m.gguf"), 5000, args)
    assert argv[argv.index("--parallel") + 1] == "32"
    assert argv[argv.index("-c") + 1] == str(32 * (128 + 32 + 64))
    assert "LD_LIBRARY_PATH" in env
    assert KV_GIB["1b"] == 2


def test_vllm_computes_the_bf16_folder_in_the_dtype_asked() -> None:
    """bf16 (the file's) by default; --vllm-dtype float32 on a CPU without AVX-512 BF16, with the same KV budget."""
    args = _args("1b")
    argv, _ = server_argv("vllm", Path("m"), 5000, args)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    args.vllm_dtype = "float32"
    argv, env = server_argv("vllm", Path("m"), 5000, args)
    assert argv[argv.index("--dtype") + 1] == "float32" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    argv, _ = server_argv("tokenpath", Path("m"), 5000, args)
    assert "--dtype" not in argv
