"""Speculative decoding (n-gram / prompt lookup) on SmolLM2-135M: one stream, greedy, off vs on.

Workloads: `edit` (a ~400-token Python file in the prompt, reproduced with one rename), `quote`
(a passage in the prompt, and a question asking to quote two of its sentences: SmolLM2-135M
answers it with a paraphrase that reuses fragments, 82 tokens, not a quote), `quote_copy` (the
same passage, asked to copy those sentences "exactly as written, in quotation marks": SmolLM2
then quotes the passage nearly word for word, 144 tokens), `free` (a story: nothing to copy), and two under
a grammar: `json` (a record in the prompt copied under its JSON schema) and `tool` (a `required`
call of a write_file tool whose arguments are in the prompt, under the tool-call grammar), and
`edit_penalties`: the `edit` prompt with a repetition penalty of 1.1 and a presence penalty of 0.3
(what agent and chat clients send; the sampler rewrites each verification row at its own
position, `Sampler.draft_rows`), and `edit_lora`: the `edit` prompt with a LoRA adapter (rank 16 on
every target of every layer, random A and B of std 0.05, written by hand into a temporary folder
the same way in every run: tests/engine/lora_adapters.py `random_adapter`; it changes SmolLM2's
greedy tokens while it still copies), and three of repeated traffic for the suffix proposer's
global trie (`repeat`, `repeat_edit`, `repeat_tool`: a priming request first, untimed; see
PRIMES). `--workloads` picks some of them, `--out` names the results. Each
mode runs in its own subprocess (so peak RSS is per engine), in interleaved rounds off, on, off,
on, ...: the machine is shared, and interleaving spreads the other load over both modes. Decode
tok/s is (output tokens - 1) / (finish - first token) of the request, so prefill is left out.

`--cpu-time`: each engine runs ONE thread (TOKENPATH_NUM_THREADS=1) and the figure is (output
tokens - 1) / the process CPU time of the steps after the first token (`time.process_time` around
each `engine.step`). On a loaded machine the wall clock mostly measures the other work: a step
waits for a core however few rows it has, so fewer steps look better than they would on a quiet
machine. One thread's CPU time counts only this engine's own cycles (cache sharing aside), which
is what a quiet single-stream run is bound by.

    nice -n 10 .venv/bin/python benchmarks/spec_decode.py [--rounds 2] [--spec JSON] [--workloads edit,edit_penalties]
        [--out spec_decode] [--cpu-time] [--off-spec JSON]

`--off-spec JSON`: the `off` side speculates too, with that config: one draft policy against
another in the same run (e.g. the SPEC with `"draft_policy": "cost"` against the default
`"adaptive"`; engine/spec/state.py).

Writes benchmarks/results/{out}.{md,json} (default spec_decode).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SPEC = {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 3, "prompt_lookup_min": 2}

# The copy-heavy workload edits a real file of the project (~400 tokens), renaming one function.
FILE = (HERE.parent / "src" / "tokenpath" / "engine" / "block_hash.py").read_text()

PASSAGE = (
    "The lighthouse at Kerrow Point was built in 1871 from granite quarried on the island itself. Its lamp, "
    "first fuelled by colza oil and later by paraffin, was electrified in 1952, when the keepers' cottages "
    "were connected to the mainland grid by a cable laid along the causeway. The last keeper, Agnes Morrow, "
    "left in 1989, after which the light was automated and monitored from the harbour office in Dunmore. "
    "Today the tower is open to visitors on summer weekends, and the old oil store houses a small museum "
    "of lenses, logbooks and the brass fog bell that once sounded every thirty seconds in poor visibility."
)

WORKLOADS = {
    "edit": ("Here is a Python file:\n\n" + FILE + "\nRewrite the whole file with the function hash_block_tokens "
             "renamed to block_key everywhere. Output only the code.", 400),
    "quote": ("Read this passage:\n\n" + PASSAGE + "\n\nQuote, word for word, the sentences of the passage that "
              "say when the lamp was electrified and when the last keeper left.", 160),
    "quote_copy": ("Read this passage:\n\n" + PASSAGE + "\n\nCopy the two sentences about the lamp being "
                   "electrified and the last keeper leaving, exactly as written, in quotation marks.", 160),
    "free": ("Write a short story about a fox who learns to play the violin.", 240),
    "json": ("", 160),  # (the messages and the grammar: `constrained`)
    "tool": ("", 160),
}
WORKLOADS["edit_penalties"] = WORKLOADS["edit_lora"] = WORKLOADS["edit"]
# Repeated traffic (the suffix proposer's global trie, engine/spec/suffix.py): a priming request
# runs first, untimed, then the measured one. `repeat`: the `free` story asked twice; `repeat_edit`:
# the same file edited before with another rename; `repeat_tool`: the same tool called before
# with other arguments (the same JSON shape). Each workload starts from an empty global trie.
WORKLOADS["repeat"] = WORKLOADS["free"]
WORKLOADS["repeat_edit"] = WORKLOADS["edit"]
WORKLOADS["repeat_tool"] = WORKLOADS["tool"]
PRIMES = {"repeat": WORKLOADS["free"][0],
          "repeat_edit": "Here is a Python file:\n\n" + FILE + "\nRewrite the whole file with the function "
                         "block_hashes renamed to hashes_of_blocks everywhere. Output only the code.",
          "repeat_tool": "tool_prime"}
TOOL_CALL = 'Call write_file with path "geometry.py" and content "def area(r): return 3.14159 * r * r".'
TOOL_PRIME = 'Call write_file with path "notes.txt" and content "buy milk, eggs and flour".'
# Sampling parameters a workload adds to greedy decoding.
PARAMS: dict[str, dict] = {"edit_penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.3}}
RECORD = {"name": "Ada Lovelace", "born": "10 December 1815, London", "field": "mathematics",
          "known_for": "the first published computer program, for Babbage's Analytical Engine"}
TOOL = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"], "additionalProperties": False}}}


def constrained(name: str):  # noqa: ANN201 - (messages, StructuredOutput) of a grammar workload, else None
    """The grammar workloads, as the API builds them: a json_schema response format, and a
    `tool_choice: required` call (the tool-call grammar and the system prompt that lists the tool)."""
    from tokenpath.api.tools import constraint, parse_tools, tagged_system_prompt
    from tokenpath.protocol.sampling_params import StructuredOutput

    if name == "json":
        schema = {"type": "object", "properties": {k: {"type": "string"} for k in RECORD}, "required": list(RECORD),
                  "additionalProperties": False}
        return ([{"role": "user", "content": "Copy this record as JSON exactly:\n" + json.dumps(RECORD)}],
                StructuredOutput("json", json.dumps(schema)))
    if name in ("tool", "repeat_tool", "tool_prime"):
        plan = parse_tools([TOOL], "required", None, None)
        if plan is None:  # (a required tool choice always plans)
            raise RuntimeError("parse_tools planned nothing for a required tool choice")
        return ([{"role": "system", "content": tagged_system_prompt(plan)},
                 {"role": "user", "content": TOOL_PRIME if name == "tool_prime" else TOOL_CALL}], constraint(plan))
    return None


def adapter(llm, name: str):  # noqa: ANN001, ANN201 - the workload's LoraRef, or None
    """`edit_lora`'s adapter, written (seeded: the same every run) into a temporary folder and
    loaded by a warm-up request, so its load is not timed."""
    if name != "edit_lora":
        return None
    import tempfile

    from tokenpath import SamplingParams
    from tokenpath.protocol.lora import LoraRef

    if str(HERE.parent) not in sys.path:  # (the tests' adapter writer, from the repository root)
        sys.path.insert(0, str(HERE.parent))
    from tests.engine.lora_adapters import random_adapter

    folder = Path(tempfile.mkdtemp(prefix="spec_lora_")) / "adapter"
    ref = LoraRef("edit", str(random_adapter(folder, llm.engine.model_config, std=0.05, seed=1)))
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2), lora=ref)
    return ref


def timed_steps(engine) -> list[tuple[float, float]]:  # noqa: ANN001 - the engine whose steps to time
    """Wrap `engine.step` to record each step's (wall start, process CPU seconds): `--cpu-time`."""
    steps: list[tuple[float, float]] = []
    step = engine.step

    def timed():  # noqa: ANN202
        wall, cpu = time.monotonic(), time.process_time()
        out = step()
        steps.append((wall, time.process_time() - cpu))
        return out

    engine.step = timed
    return steps


def worker(spec: str | None, names: list[str]) -> dict:
    from tokenpath import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", kv_cache_memory="128MiB", speculative_config=spec)
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4))  # warm-up
    steps = timed_steps(llm.engine)
    out: dict[str, Any] = {}
    for name in names:
        lora = adapter(llm, name)
        prompt, max_tokens = WORKLOADS[name]
        if llm.engine.spec is not None and llm.engine.spec.suffix is not None:
            llm.engine.spec.suffix.clear()  # (each workload on its own: no earlier workload's output)
        if name in PRIMES:
            prime = constrained(PRIMES[name])
            msgs, st = prime if prime else ([{"role": "user", "content": PRIMES[name]}], None)
            llm.generate(llm.tokenizer.apply_chat_template(msgs), SamplingParams(
                temperature=0, max_tokens=max_tokens, structured=st))
        before = llm.engine.spec.stats if llm.engine.spec else None
        drafted = (before.num_draft_tokens, before.num_accepted_tokens) if before else (0, 0)
        grammar = constrained(name)
        messages, structured = grammar if grammar else ([{"role": "user", "content": prompt}], None)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured, **PARAMS.get(name, {}))
        steps.clear()
        r = llm.generate(llm.tokenizer.apply_chat_template(messages), params, lora=lora)[0]
        n = len(r.outputs[0].token_ids)
        ev = r.events
        dt = ev.finished - ev.first_token
        cpu = sum(c for wall, c in steps if wall >= ev.first_token)
        stats = llm.engine.spec.stats if llm.engine.spec else None
        proposed = stats.num_draft_tokens - drafted[0] if stats else 0
        accepted = stats.num_accepted_tokens - drafted[1] if stats else 0
        out[name] = {"tokens": n, "decode_s": round(dt, 3), "decode_tok_s": round((n - 1) / dt, 1),
                     "decode_cpu_tok_s": round((n - 1) / cpu, 1) if cpu > 0 else None, "steps": len(steps),
                     "proposed": proposed, "accepted": accepted,
                     "acceptance": round(accepted / proposed, 3) if proposed else None,
                     "token_ids": r.outputs[0].token_ids}
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", default=json.dumps(SPEC))
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    ap.add_argument("--out", default="spec_decode", help="results file stem under benchmarks/results")
    ap.add_argument("--worker", choices=["off", "on"])
    ap.add_argument("--off-spec", help="run the `off` side with this speculative config instead of none: one "
                                       "policy against another, e.g. '{..., \"draft_policy\": \"adaptive\"}'")
    ap.add_argument("--cpu-time", action="store_true",
                    help="one engine thread; also report decode tok/s by the process CPU time (see the docstring)")
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        ap.error(f"--workloads: unknown {unknown}; known: {list(WORKLOADS)}")
    if args.worker:
        print(json.dumps(worker(args.spec if args.worker == "on" else args.off_spec, names)))
        return
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    loads = []
    env = {**os.environ, "TOKENPATH_NUM_THREADS": "1"} if args.cpu_time else None
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            loads.append(os.getloadavg()[0])
            proc = subprocess.run([sys.executable, __file__, "--worker", mode, "--spec", args.spec,
                                   "--workloads", ",".join(names)]
                                  + (["--off-spec", args.off_spec] if args.off_spec else []),
                                  capture_output=True, text=True, check=True, env=env)
            runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(mode, {k: v.get("decode_tok_s") if isinstance(v, dict) else v for k, v in runs[mode][-1].items()},
                  file=sys.stderr)
    rows = []
    for name in names:
        off = [r[name] for r in runs["off"]]
        on = [r[name] for r in runs["on"]]
        same = all(a["token_ids"] == b["token_ids"] for a in off for b in on)
        m_off = statistics.median(r["decode_tok_s"] for r in off)
        m_on = statistics.median(r["decode_tok_s"] for r in on)
        c_off = statistics.median(r["decode_cpu_tok_s"] or 0.0 for r in off)
        c_on = statistics.median(r["decode_cpu_tok_s"] or 0.0 for r in on)
        prop = sum(r["proposed"] for r in on)
        rows.append({"workload": name, "tokens": on[0]["tokens"], "off_tok_s": [r["decode_tok_s"] for r in off],
                     "on_tok_s": [r["decode_tok_s"] for r in on], "ratio": round(m_on / m_off, 2),
                     "round_ratios": [round(b["decode_tok_s"] / a["decode_tok_s"], 2) for a, b in zip(off, on, strict=True)],
                     "acceptance": round(sum(r["accepted"] for r in on) / prop, 3) if prop else None,
                     "accepted_per_step": round(sum(r["accepted"] for r in on) / len(on) / max(1, on[0]["tokens"]), 3),
                     "identical_output": same, "steps_off": off[0]["steps"], "steps_on": on[0]["steps"],
                     "cpu_off_tok_s": c_off, "cpu_on_tok_s": c_on,
                     "cpu_ratio": round(c_on / c_off, 2) if c_off else None})
    # The adapter matters: edit_lora's tokens are not edit's (when both ran).
    lora_changes = (runs["off"][0]["edit_lora"]["token_ids"] != runs["off"][0]["edit"]["token_ids"]
                    if {"edit", "edit_lora"} <= set(names) else None)
    for mode in runs:
        for r in runs[mode]:
            for name in names:
                r[name].pop("token_ids")
    rss = {m: max(r["peak_rss_mib"] for r in runs[m]) for m in runs}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
            "cpus": os.cpu_count(), "spec": json.loads(args.spec), "rounds": args.rounds,
            "workload_params": {n: PARAMS[n] for n in names if n in PARAMS}, "lora_changes_output": lora_changes,
            "load_avg_before_each_run": [round(x, 2) for x in loads], "peak_rss_mib": rss,
            "cpu_time": args.cpu_time, "off_spec": json.loads(args.off_spec) if args.off_spec else None}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1))
    lines = [
        f"# Speculative decoding ({meta['spec'].get('method', 'ngram')}): SmolLM2-135M-Instruct GGUF, one stream, greedy",
        "",
        f"Run {meta['date']} on {meta['cpus']} shared cores (Python {meta['python']}). Command: "
        f"`nice -n 10 python benchmarks/spec_decode.py --rounds {args.rounds} --workloads {','.join(names)} "
        f"--out {args.out}{' --cpu-time' if args.cpu_time else ''}`; speculative config `{args.spec}`"
        + (f"; `off` is NOT plain decoding but speculation with `{args.off_spec}`" if args.off_spec else "")
        + "; sampling parameters added to greedy: "
        f"{json.dumps(meta['workload_params']) if meta['workload_params'] else 'none'}."
        + (" `edit_lora`: the `edit` prompt through a LoRA adapter (rank 16 on every target, random A and B "
           "of std 0.05, seed 1: tests/engine/lora_adapters.py `random_adapter`)"
           + ("" if lora_changes is None else f"; its output {'differs from' if lora_changes else 'EQUALS'} "
              "`edit`'s") + "." if "edit_lora" in names else ""),
        "",
        f"Interleaved runs (off, on, off, on, ...), each its own process: the machine was shared with other "
        f"work, not quiet (1-min load average before each run: {meta['load_avg_before_each_run']}), so the "
        "absolute figures move; the ratio of medians is what to read. Decode tok/s excludes prefill.",
        "",
        "| workload | output tokens | off decode tok/s (runs) | on decode tok/s (runs) | on/off per round "
        "| on/off (medians) | acceptance | steps off / on | identical output |"
        + (" CPU-time tok/s off / on (medians) | on/off by CPU time |" if args.cpu_time else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.cpu_time else ""),
    ]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        lines.append(f"| {r['workload']} | {r['tokens']} | {', '.join(map(str, r['off_tok_s']))} | "
                     f"{', '.join(map(str, r['on_tok_s']))} | {', '.join(f'{x:.2f}x' for x in r['round_ratios'])} | "
                     f"**{r['ratio']:.2f}x** | {acc} | {r['steps_off']} / {r['steps_on']} | "
                     f"{'yes' if r['identical_output'] else 'NO'} |"
                     + (f" {r['cpu_off_tok_s']} / {r['cpu_on_tok_s']} | **{r['cpu_ratio']:.2f}x** |"
                        if args.cpu_time else ""))
    lines += ["", f"Peak RSS: off {rss['off']} MiB, on {rss['on']} MiB.", "",
              "Reading it: a verification row is not free on these 2 cores (benchmarks/step_rows.py, CPU time, "
              "context 400: a 5-row step 1.62x a 1-row step, 17 rows 3.74x, ~0.16 of a step a row), so the "
              "gain is capped well below K + 1, and the draft length (engine/spec/state.py: capped at one more "
              "than accepted, doubling after a step that accepted every draft, pauses after misses, and under "
              "that cap the length whose expected tokens per unit of the engine's measured step time is best) is "
              "what keeps rejected rows from making steps slower. SmolLM2's greedy "
              "`free` story repeats its own phrases, so the n-gram proposer finds matches there too (its acceptance "
              "column): it is not a workload with nothing to copy for this model. Greedy output was identical with "
              "speculation on and off in every run (the last column).", ""]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
