"""Speculation with several streams at once: c sequences of spec_decode.py's workloads (edit,
quote, quote_copy, free, in turn) decoded together, greedy, speculation off against on at two K.

Why: the issue's single-stream target drives K up (K = 16 pays on copies), but every sequence of a
batch drafts on its own, so at c = 8 a step can carry 8 x 17 rows. This measures what that costs
(it set the batch rule's default: above `max_batch` = 4 decoding sequences a step drafts nothing,
so c = 8 and c = 32 run the plain engine; `--max-batch` overrides it to measure above).

Figures are by CPU time (one engine thread, the process CPU time of every step after the first
request's first token, as spec_decode.py's `--cpu-time`): the machine is shared and the wall
clock measures the other work. Modes run in their own processes, interleaved per round.

    PYTHONPATH=src nice -n 10 python benchmarks/spec_batch.py [--concurrency 8,32] [--rounds 2]
        [--max-tokens 160] [--ks 4,16] [--max-batch 8]

Writes benchmarks/results/spec_batch.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE.parent)]

from benchmarks.spec_decode import SPEC, WORKLOADS, timed_steps  # noqa: E402

MIX = ["edit", "quote", "quote_copy", "free"]


def worker(spec: str | None, c: int, max_tokens: int) -> dict[str, Any]:
    from tokenpath import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", kv_cache_memory="256MiB", speculative_config=spec)
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4))  # warm-up
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": WORKLOADS[MIX[i % len(MIX)]][0]}])
               for i in range(c)]
    steps = timed_steps(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    started = time.monotonic()
    outs = llm.generate(prompts, params)
    first = min(o.events.first_token for o in outs)
    cpu = sum(t for wall, t in steps if wall >= first)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return {"tokens": tokens, "cpu_tok_s": round(tokens / cpu, 1), "wall_s": round(time.monotonic() - started, 2),
            "steps": len(steps), "token_ids": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ks", default="4,16", help="K values of the speculating modes")
    ap.add_argument("--max-batch", type=int, help="the speculative config's max_batch (default: the config's)")
    ap.add_argument("--worker", help="off, or a speculative config's JSON")
    ap.add_argument("--c", type=int, default=8)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(None if args.worker == "off" else args.worker, args.c, args.max_tokens)))
        return
    extra = {} if args.max_batch is None else {"max_batch": args.max_batch}
    modes = {"off": "off", **{f"K={k}": json.dumps({**SPEC, "num_speculative_tokens": int(k), **extra})
                              for k in args.ks.split(",")}}
    env = {**os.environ, "TOKENPATH_NUM_THREADS": "1"}
    rows, loads = [], []
    for c in (int(x) for x in args.concurrency.split(",")):
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                loads.append(round(os.getloadavg()[0], 2))
                proc = subprocess.run([sys.executable, __file__, "--worker", modes[m], "--c", str(c),
                                       "--max-tokens", str(args.max_tokens)],
                                      capture_output=True, text=True, check=True, env=env)
                runs[m].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(c, m, runs[m][-1]["cpu_tok_s"], file=sys.stderr)
        off = statistics.median(x["cpu_tok_s"] for x in runs["off"])
        for m in modes:
            med = statistics.median(x["cpu_tok_s"] for x in runs[m])
            same = all(x["token_ids"] == runs["off"][0]["token_ids"] for x in runs[m])
            rows.append({"c": c, "mode": m, "cpu_tok_s": [x["cpu_tok_s"] for x in runs[m]], "median": med,
                         "ratio": round(med / off, 2), "steps": runs[m][0]["steps"], "identical": same})
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = ["# Speculation with several streams (SmolLM2-135M Q4_1, greedy, CPU time, one engine thread)", "",
             f"Run {date}. Command: `PYTHONPATH=src nice -n 10 python benchmarks/spec_batch.py --concurrency "
             f"{args.concurrency} --rounds {args.rounds} --max-tokens {args.max_tokens} --ks {args.ks}"
             f"{'' if args.max_batch is None else f' --max-batch {args.max_batch}'}`; on: "
             f"`{json.dumps(SPEC)}` with K as in the mode column. 1-min load average before each run: {loads}.", "",
             "| c | mode | decode tok/s by CPU time (runs) | median | on/off | steps | greedy output = off |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['c']} | {r['mode']} | {', '.join(map(str, r['cpu_tok_s']))} | {r['median']} | "
              f"**{r['ratio']:.2f}x** | {r['steps']} | {'yes' if r['identical'] else 'NO'} |" for r in rows]
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "spec_batch.json").write_text(json.dumps({"date": date, "rows": rows, "loads": loads}, indent=1))
    (HERE / "results" / "spec_batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
