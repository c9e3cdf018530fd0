"""Draft policies compared without noise: replay the greedy outputs of spec_decode.py's workloads
through the engine's own speculation policy (`SpecDecoder`, engine/spec/) at a table of step prices.

Why: greedy output does not depend on the drafts, so which tokens each step drafts, and how many
of them are accepted, follow from the output alone; what a policy then costs is the sum of its
steps' prices. On this shared 2-core machine the wall clock of one benchmark run moves by +-15%
between processes (benchmarks/results/spec_adaptive_quiet.md: `off` 129-168 tok/s on `edit` in
one quiet hour), more than the policies differ; the replay leaves only the price model to argue
about, and it is stated: a T-row step's price relative to a 1-row step, measured by
benchmarks/step_rows.py (default: the quiet 2-thread table of stop 58,
benchmarks/results/step_rows_quiet.md), scaled per extra row (`--row-scales`) and with a fixed
extra price per drafting step (`--overheads`, in 1-row steps: Python verification, more logits),
the scenarios where real rows cost more than the table says. The decoder is fed these prices as
its step timings (10 ms a 1-row step), as the engine feeds it its measured ones.

    PYTHONPATH=src python benchmarks/spec_policy_replay.py [--workloads edit,quote_copy,quote,free]
        [--policies adaptive,rule,cost] [--row-scales 1,1.5,2] [--overheads 0,0.1,0.3,0.5] [--out NAME]

The greedy outputs come from one engine run with speculation off (SmolLM2-135M-Instruct GGUF).
Figures are tokens per unit of time against plain decoding (1.00x: as fast as off) and steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

# Stop 58, quiet, 2 threads, wall clock, context 400 (benchmarks/results/step_rows_quiet.md).
MEASURED = {1: 1.0, 2: 1.24, 3: 1.50, 4: 1.72, 5: 1.79, 8: 2.65, 9: 2.99, 17: 5.35}
SPEC = {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def price(table: dict[int, float], rows: int) -> float:
    """A `rows`-row step's price: the table's, linear between its sizes and past its last."""
    keys = sorted(table)
    if rows in table:
        return table[rows]
    for lo, hi in zip(keys, keys[1:], strict=False):
        if lo < rows < hi:
            return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
    lo, hi = keys[-2], keys[-1]
    return table[hi] + (table[hi] - table[lo]) / (hi - lo) * (rows - hi)


class Replayed:
    """What `SpecDecoder` reads of a sequence, for a sequence replayed by hand."""

    def __init__(self, prompt: list[int], max_tokens: int) -> None:
        from tokenpath import SamplingParams

        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens)
        self.spec = None
        self.grammar = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def replay(prompt: list[int], output: list[int], max_tokens: int, policy: str, table: dict[int, float],
           overhead: float) -> tuple[float, int, int]:
    """(tokens per unit of time against plain decoding, steps, drafting steps) of `policy`."""
    from tokenpath.config import SpeculativeConfig
    from tokenpath.engine.spec.decoder import SpecDecoder

    spec = SpecDecoder(SpeculativeConfig(**SPEC, draft_policy=policy), max_model_len=1 << 16)
    seq = Replayed(prompt, max_tokens)
    pos = steps = drafting = 0
    spent = 0.0
    while pos < len(output):
        drafts = spec.propose(seq, spec.draft_len(seq, 1 << 16))  # type: ignore[arg-type]
        accepted = 0
        while accepted < len(drafts) and pos + accepted < len(output) and drafts[accepted] == output[pos + accepted]:
            accepted += 1
        cost = price(table, 1 + len(drafts)) + (overhead if drafts else 0.0)
        spent += cost
        steps += 1
        if spec.keeps_prices:
            spec.observe_step(1 + len(drafts), 0.010 * cost)
        emitted = min(accepted + 1, len(output) - pos)
        seq.token_ids += output[pos : pos + emitted]
        pos += emitted
        if drafts:
            drafting += 1
            spec.settle(seq, len(drafts), accepted)  # type: ignore[arg-type]
    return len(output) / spent, steps, drafting


def greedy_outputs(names: list[str]) -> dict[str, tuple[list[int], list[int], int]]:
    """(prompt ids, greedy output ids, max_tokens) of each workload, speculation off."""
    import spec_decode

    from tokenpath import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", kv_cache_memory="128MiB")
    out = {}
    for name in names:
        prompt, max_tokens = spec_decode.WORKLOADS[name]
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        r = llm.generate(text, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
        out[name] = (list(r.prompt_token_ids), list(r.outputs[0].token_ids), max_tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="edit,quote_copy,quote,free",
                    help="spec_decode.py workloads without a grammar or adapter")
    ap.add_argument("--policies", default="adaptive,rule,cost")
    ap.add_argument("--row-scales", default="1,1.5,2", help="each extra row's price times these")
    ap.add_argument("--overheads", default="0,0.1,0.3,0.5", help="extra price of a drafting step, in 1-row steps")
    ap.add_argument("--out", help="write benchmarks/results/{out}.md")
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    policies = [p for p in args.policies.split(",") if p]
    outputs = greedy_outputs(names)
    lines = [f"Replayed {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python benchmarks/spec_policy_replay.py "
             f"--workloads {args.workloads} --policies {args.policies} --row-scales {args.row_scales} "
             f"--overheads {args.overheads}`; speculative config {SPEC} with each draft_policy; prices: "
             f"{MEASURED} (T rows: x a 1-row step), extra rows scaled, plus the overhead per drafting step. "
             "Each cell: tokens per unit of time against plain decoding, steps (greedy output "
             f"{', '.join(f'{n} {len(o[1])} tokens' for n, o in outputs.items())}).", "",
             "| row scale | drafting overhead | policy | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for scale in (float(x) for x in args.row_scales.split(",")):
        table = {r: 1.0 + (p - 1.0) * scale for r, p in MEASURED.items()}
        for overhead in (float(x) for x in args.overheads.split(",")):
            for policy in policies:
                cells = []
                for name in names:
                    gain, steps, _ = replay(*outputs[name][:2], outputs[name][2], policy, table, overhead)
                    cells.append(f"{gain:.2f}x, {steps}")
                lines.append(f"| {scale:g} | {overhead:g} | {policy} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        (HERE / "results" / f"{args.out}.md").write_text(
            "# Draft policies replayed at stated step prices (SmolLM2-135M-Instruct, greedy, one stream)\n\n"
            + text + "\n")


if __name__ == "__main__":
    main()
