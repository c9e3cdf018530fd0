"""What one single-stream decode step of SmolLM2 costs, piece by piece, in CPU time (issue 42).

Why: decode on the tuned path regressed after wave 3 added work to the step loop (causes,
liveness, grammar-mask prefetch, LoRA checks, KV-cache groups). This prices each piece of the
loop around the kernels, with the kernels' own time beside them, so a feature that is off and
still costs something shows here. One thread, pinned to one CPU (TOKENPATH_NUM_THREADS=1 and
sched_setaffinity), timed by the thread's CPU clock: other jobs on the machine slow the wall
clock, not what this thread spends (memory stalls still count, so a busy box moves the kernels'
figure somewhat; the Python pieces hardly).

Two passes over the same decodes (128 tokens after a 1-token prompt, greedy, as tg128): one
uninstrumented (the step's whole CPU time), one with each piece's function wrapped in a CPU-clock
timer. Each wrapper's own cost is measured (an empty function wrapped alike) and taken off every
call; a piece's figure includes the pieces nested in it (the table says which). The async engine's
loop (liveness beat, run-queue wait reads, step pricing, handing outputs to the event loop) is
timed on its own step thread through that thread's CPU clock, less the steps it ran.

    PYTHONPATH=src python benchmarks/step_cost.py [--rounds 5] [--cpu 0] [--out benchmarks/results/step_cost.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

MODEL = "smollm2-135m-instruct"
PROMPT = [1000]  # one token, then TOKENS decode steps (llama-bench's tg128)
TOKENS = 128
clock = time.thread_time_ns

# (key, what it is, the feature's state in this run, the piece it is part of, whether the row
# shows the piece's own time: less the pieces nested in it)
PIECES = [
    ("step", "EngineCore.step: the whole step", "", "", False),
    ("runner_inputs", "ModelRunner._execute_native, less forward: ids, positions, tables, slots", "", "step", True),
    ("kv_tables", "  of which: KV-cache group tables (_tables: the torch path's; the native one builds them inline)",
     "1 group", "runner_inputs", False),
    ("lora_step", "  of which: LoRA arguments (native_step) with no adapter", "off", "runner_inputs", False),
    ("forward_py", "NativeLlama.forward less the C call: rope rows, logits array, arguments", "", "runner_inputs", True),
    ("kernels", "**tp_model_forward: the native forward (C++: 30 layers + LM head)**", "", "forward_py", False),
    ("schedule", "Scheduler.schedule (with the block manager's allocate)", "", "step", False),
    ("allocate", "  of which: BlockManager.allocate (and its window drop)", "no window", "schedule", False),
    ("expired", "Scheduler.expired: the deadline heap peek", "no deadline", "step", False),
    ("commit", "BlockManager.commit_computed (prefix-cache hashing; not called with caching off)", "caching off",
     "step", False),
    ("grammar_prefetch", "Sampler.prefetch_masks: grammar-mask prefetch", "off", "step", False),
    ("sampler", "Sampler.__call__: greedy argmax + logprob bookkeeping", "", "step", False),
    ("process_token", "OutputProcessor.process_token: detokenize, stop checks", "", "step", False),
    ("make_output", "OutputProcessor.make_output: the step's RequestOutput", "", "step", False),
    ("observers", "step observers (telemetry's StepStats.observe: the async engine registers it)", "none (offline)",
     "step", False),
]


def pin(cpu: int) -> None:
    os.environ["TOKENPATH_NUM_THREADS"] = "1"  # read by the kernels at each step
    os.sched_setaffinity(0, {cpu})


def timer_overhead(n: int = 20000) -> float:
    """ns one wrapper adds to a call (two clock reads, the closure, the dict update)."""
    acc: dict[str, int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)

    def empty() -> None:
        return None

    w = _wrap(empty, "x", acc, calls)
    t0 = clock()
    for _ in range(n):
        empty()
    bare = clock() - t0
    t0 = clock()
    for _ in range(n):
        w()
    return max(0.0, (clock() - t0 - bare) / n)


def _wrap(fn: Callable, key: str, acc: dict[str, int], calls: dict[str, int]) -> Callable:
    def timed(*args: object, **kwargs: object) -> object:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += clock() - t0
            calls[key] += 1

    return timed


def instrument(core, acc: dict[str, int], calls: dict[str, int]) -> None:  # noqa: ANN001 - an EngineCore
    """Wrap each piece of `core`'s step loop (instance attributes, so nothing else is touched)."""
    import tokenpath.engine.runner as runner_mod

    runner, native = core.runner, core.runner.native
    lib = native.lib.lib
    for obj, name, key in [(core, "step", "step"), (lib, "tp_model_forward", "kernels"),
                           (native, "forward", "forward_py"), (runner, "_execute_native", "runner_inputs"),
                           (runner, "_tables", "kv_tables"), (core.scheduler, "schedule", "schedule"),
                           (core.blocks, "allocate", "allocate"), (core.scheduler, "expired", "expired"),
                           (core.blocks, "commit_computed", "commit"), (core.sampler, "prefetch_masks", "grammar_prefetch"),
                           (core.outputs, "process_token", "process_token"), (core.outputs, "make_output", "make_output")]:
        setattr(obj, name, _wrap(getattr(obj, name), key, acc, calls))
    # The sampler is called as `self.sampler(...)`: a wrapper object in its place.
    sampler = core.sampler
    timed_call = _wrap(sampler.__call__, "sampler", acc, calls)

    class TimedSampler:
        def __call__(self, *a: object, **k: object) -> object:
            return timed_call(*a, **k)

        def __getattr__(self, name: str) -> object:
            return getattr(sampler, name)

    core.sampler = TimedSampler()
    runner_mod.native_step = _wrap(runner_mod.native_step, "lora_step", acc, calls)
    core.step_observers[:] = [_wrap(o, "observers", acc, calls) for o in core.step_observers]


def decode_rounds(core, rounds: int, tag: str) -> list[int]:  # noqa: ANN001
    """`rounds` decodes of TOKENS tokens; each round's step-thread CPU ns per step."""
    from tokenpath.protocol import GenerateRequest
    from tokenpath.protocol.sampling_params import SamplingParams

    out = []
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS + 1, ignore_eos=True)
    for r in range(rounds):
        core.add_request(GenerateRequest(f"{tag}-{r}", list(PROMPT), params))
        core.step()  # the prompt's step (its first token): not a decode step
        t0, steps = clock(), 0
        while core.has_work():
            core.step()
            steps += 1
        out.append((clock() - t0) // steps)
    return out


def async_loop_cost(config, rounds: int) -> dict[str, float]:  # noqa: ANN001
    """The async engine's loop around its steps: step thread CPU per step less the steps' own, and
    the event loop's CPU per step taking the outputs (deliver + the request's stream)."""
    from tokenpath.engine.async_engine import AsyncEngine
    from tokenpath.protocol import GenerateRequest
    from tokenpath.protocol.sampling_params import SamplingParams

    eng = AsyncEngine(config)
    step_ns = [0]
    core_step = eng.core.step

    def timed_step() -> list:
        t0 = clock()
        try:
            return core_step()
        finally:
            step_ns[0] += clock() - t0

    eng.core.step = timed_step  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS + 1, ignore_eos=True)
    res: dict[str, list[float]] = defaultdict(list)

    async def run() -> None:
        await eng.start()
        thread = eng._thread  # noqa: SLF001 - the step thread, for its CPU clock
        if thread is None or thread.ident is None:
            raise RuntimeError("the async engine's step thread did not start")
        thread_clock = time.pthread_getcpuclockid(thread.ident)
        for r in range(rounds + 1):
            step_ns[0] = 0
            before = time.clock_gettime_ns(thread_clock)
            loop_before = clock()
            n = 0
            async for _ in eng.generate(GenerateRequest(f"async-{r}", list(PROMPT), params)):
                n += 1
            loop_ns = clock() - loop_before
            await asyncio.sleep(0.05)  # the step thread back to waiting for work
            thread_ns = time.clock_gettime_ns(thread_clock) - before
            if r:  # (the first round warms up)
                res["loop_minus_steps"].append((thread_ns - step_ns[0]) / n)
                res["event_loop"].append(loop_ns / n)
        await eng.shutdown()

    asyncio.run(run())
    return {k: statistics.median(v) for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", type=int, default=0, help="the CPU to pin to")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_cost.md"))
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    pin(args.cpu)
    from tokenpath.config import EngineConfig
    from tokenpath.engine.core import EngineCore

    # As engine_vs_llamacpp.py's tokenpath child configures it (the served defaults otherwise).
    config = EngineConfig(model=MODEL, dtype="float32", num_kv_blocks=(512 + 16) // 16 + 2,
                          max_num_batched_tokens=512, enable_prefix_caching=False)
    core = EngineCore(config)
    decode_rounds(core, 1, "warm")
    loads = [os.getloadavg()[0]]
    whole = decode_rounds(core, args.rounds, "bare")  # uninstrumented
    acc: dict[str, int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)
    over = timer_overhead()
    instrument(core, acc, calls)
    per: dict[str, list[float]] = defaultdict(list)
    steps_per: dict[str, float] = {}
    for r in range(args.rounds):
        acc.clear()
        calls.clear()
        decode_rounds(core, 1, f"timed{r}")
        n = calls["step"]
        for key, _, _, _, own in PIECES:
            inner = [k for k, _, _, parent, _ in PIECES if parent == key]
            ns = acc[key] - over * (calls[key] + sum(calls[k] for k in inner))
            if own:  # (the nested pieces' own timers are inside acc[key] too: taken off above)
                ns -= sum(acc[k] for k in inner if k not in ("kv_tables", "lora_step"))
            per[key].append(ns / n)
            steps_per[key] = calls[key] / n
    loads.append(os.getloadavg()[0])
    async_cost = async_loop_cost(config, args.rounds)
    loads.append(os.getloadavg()[0])
    write(Path(args.out), args, whole, {k: statistics.median(v) for k, v in per.items()}, steps_per, over,
          async_cost, loads)


def write(path: Path, args: argparse.Namespace, whole: list[int], med: dict[str, float], steps_per: dict[str, float],
          over: float, async_cost: dict[str, float], loads: list[float]) -> None:
    step = statistics.median(whole)
    # The step's own lines: the step less its top-level pieces and the forward chain's.
    other = med["step"] - sum(med[k] for k, _, _, parent, _ in PIECES if parent == "step") \
        - med["forward_py"] - med["kernels"]
    us = lambda ns: f"{ns / 1e3:.1f}"  # noqa: E731
    share = lambda ns: f"{100 * ns / med['step']:.1f}%"  # noqa: E731
    lines = [
        "# SmolLM2 single-stream decode: what each piece of a step costs (CPU time)",
        "",
        f"`python benchmarks/step_cost.py --rounds {args.rounds}` on {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} CPUs), Python {platform.python_version()}, model {MODEL} (Q4_1 GGUF, native kernels, "
        f"the engine as benchmarks/engine_vs_llamacpp.py configures it). {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"1-min load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores. {args.note}".rstrip(),
        "",
        "One kernel thread pinned to one CPU (TOKENPATH_NUM_THREADS=1), the step thread's CPU clock: "
        f"{TOKENS} decode steps after a 1-token prompt, greedy, medians of {args.rounds} rounds. Per step, "
        f"uninstrumented: **{us(step)} µs** (rounds: {', '.join(us(w) for w in whole)}). Instrumented: each piece's "
        f"function wrapped in a CPU-clock timer, its own cost ({over:.0f} ns a call, measured) taken off; an "
        "indented row is part of the row above it.",
        "",
        "| piece | feature in this run | calls / step | CPU µs / step | share of the step |",
        "|---|---|---|---|---|",
    ]
    for key, what, state, _, _ in PIECES:
        lines.append(f"| {what} | {state or 'on'} | {steps_per.get(key, 0):.2f} | {us(med[key])} | {share(med[key])} |")
    lines += [
        f"| the rest of EngineCore.step (its own lines: token append, events, counters) | | 1.00 | {us(other)} | "
        f"{share(other)} |",
        f"| **everything but the kernels** (step less tp_model_forward) | | | **{us(med['step'] - med['kernels'])}** | "
        f"**{share(med['step'] - med['kernels'])}** |",
        "",
        "The async engine's loop (the server's step thread), per step, beside the table's step:",
        "",
        "| piece | CPU µs / step |",
        "|---|---|",
        f"| step thread, less its steps: inbox drain, liveness beat (two run-queue wait reads, the clock), step "
        f"pricing, handing outputs to the event loop | {us(async_cost['loop_minus_steps'])} |",
        f"| event loop: delivering the step's output to the request's stream (asyncio queue, the generator) | "
        f"{us(async_cost['event_loop'])} |",
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
