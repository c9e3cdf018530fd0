"""The gateway's own CPU per output token on the engine link, at c=32: 32 concurrent
`Deployment.generate` streams over one `tokenpath engine` process (SmolLM2, 64-token random
prompts, 32 tokens each), `time.process_time()` of this process per token received, median over
rounds. No HTTP, no in-process engine beside it: what decoding the link's frames and carrying
each output to its consumer costs the gateway. The start-up heap is frozen first, as a gateway does.

    PYTHONPATH=src .venv/bin/python benchmarks/link_cpu.py [--rounds 12]

To compare two versions, run it from each checkout (its own `src` on PYTHONPATH, its own built
kernels) in the same quiet window; benchmarks/README.md (engine_link) has such a pair.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_link import one  # noqa: E402
from routing_common import rand_tokens  # noqa: E402


async def main(rounds: int) -> None:
    from tokenpath.replica.processes import spawn_engines
    from tokenpath.routing.models import Deployment

    (proc,) = await spawn_engines(1, engine_args=["--max-num-seqs", "32", "--num-kv-blocks", "512"],
                                  max_num_seqs=32, nice=0)
    dep = Deployment("m", "chat", [proc.replica], tokenizer=None, max_model_len=2048)
    gc.collect()
    gc.freeze()
    rng = random.Random(1)
    per_token = []
    try:
        for r in range(rounds + 1):  # the first round warms up
            prompts = [rand_tokens(rng, 64) for _ in range(32)]
            c0 = time.process_time()
            outs = await asyncio.gather(*(one(dep, p, 32, f"r{r}", i) for i, p in enumerate(prompts)))
            used = time.process_time() - c0
            if r:
                per_token.append(1000 * used / sum(o["tokens"] for o in outs))
    finally:
        await proc.stop()
    print(f"gateway CPU per token on the link at c=32: median {statistics.median(per_token):.4f} ms "
          f"(min {min(per_token):.4f}, max {max(per_token):.4f}, {rounds} rounds)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    asyncio.run(main(p.parse_args().rounds))
