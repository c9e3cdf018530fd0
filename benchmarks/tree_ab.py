"""Shared by the two-tree A/B scripts (prefill_cpu_ab.py, step_overhead_ab.py): each round runs one
child process per source tree (PYTHONPATH=TREE, so each loads its own kernel objects), in A, B then
B, A order (the second child of a pair ran slower on a loaded host whichever tree it was), and the
children build the same warmed-up engine on the same prompt ids as engine_vs_llamacpp.py's child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator


def run_tree(tree: str, script: str, argv: list[str]) -> dict:
    """`script argv` in a child whose package is TREE's; its last stdout line, as JSON."""
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, script, *argv], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def alternating(rounds: int) -> Iterator[tuple[int, str]]:
    """(round, "a" or "b") in A, B, B, A, ... order."""
    for r in range(rounds):
        for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
            yield r, name


def warm_llm(model: str, longest: int):
    """The engine both children time (default precision, no prefix cache, room for `longest`
    prompt tokens in one step) after a short warm-up, and its prompt ids."""
    from tokenpath import LLM, SamplingParams

    llm = LLM(model, quantization="auto", dtype="float32", num_kv_blocks=(longest + 16) // 16 + 2,
              max_num_batched_tokens=longest, enable_prefix_caching=False)
    ids = [1000 + (i * 7919) % 40000 for i in range(longest)]  # as engine_vs_llamacpp.py's
    llm.generate([ids[:16]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return llm, ids
