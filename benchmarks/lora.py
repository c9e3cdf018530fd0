"""LoRA adapters on SmolLM2-135M (native kernels on the GGUF's blocks): what mixing adapters costs.

1. Throughput at c=16 (max_num_seqs 16, the offline `LLM`, all prompts submitted at once): the
   base model alone against 4 adapters + the base mixed, request by request in rotation (target:
   mixed >= 0.8x base-only output tok/s). Adapters: rank 16 on all seven targets, random weights
   in the PEFT format (hand-written: SmolLM2 is a GGUF, so no HF model for `peft` to wrap).
2. Adapter load time: cold (parsed from disk, the page cache warm) and from the CPU LRU (made
   resident: the native pointer table), median of repeats.
3. TTFT p50 for a skewed adapter mix (8 adapters, Zipf 1.2, + base) over `tokenpath serve
   --replicas 2 --max-loras 2`, with the default picker (adapter affinity) against round robin.

    PYTHONPATH=src .venv/bin/python benchmarks/lora.py [--rounds 2] [--skip-serve]

Writes benchmarks/results/lora.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(root: Path, n: int, rank: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    from tokenpath.engine.loader import load_model
    from tokenpath.engine.lora import target_shapes

    cfg = load_model("smollm2-135m-instruct").config
    shapes = target_shapes(cfg)
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        d = root / f"adapter{k}"
        d.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(cfg.num_layers):
            for t in TARGETS:
                n_in, n_out = shapes[t]
                part = "self_attn" if t in TARGETS[:4] else "mlp"
                pre = f"base_model.model.model.layers.{layer}.{part}.{t}"
                tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.02
                tensors[f"{pre}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                           "target_modules": TARGETS, "bias": "none"}))
        out.append(d)
    return out


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    from tokenpath.engine.loader import resolve_model_path
    from tokenpath.engine.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_path("smollm2-135m-instruct"))
    rng = random.Random(seed)
    words = ["the", "river", "stone", "light", "garden", "music", "paper", "window", "silver", "engine", "market"]
    return [tok.encode(" ".join(rng.choice(words) for _ in range(length * 2)))[:length] for _ in range(n)]


def throughput(adapters: list[Path], rounds: int, n: int, out_len: int) -> dict:
    from tokenpath import LLM, SamplingParams
    from tokenpath.protocol.lora import LoraRef

    llm = LLM("smollm2-135m-instruct", max_num_seqs=16, kv_cache_memory="256MiB")
    refs = [LoraRef(f"a{k}", str(p)) for k, p in enumerate(adapters[:4])]
    ps = prompts(n, 128, seed=1)
    p = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    mixed = [None if i % 5 == 4 else refs[i % 5] for i in range(n)]  # 4 adapters + base, in rotation
    llm.generate(ps[:5], SamplingParams(temperature=0, max_tokens=2), lora=mixed[:5])  # warm-up, loads all four
    rows: dict[str, list[float]] = {"base": [], "mixed": []}
    for r in range(rounds):
        order = ["base", "mixed"] if r % 2 == 0 else ["mixed", "base"]
        for kind in order:
            llm.engine.blocks.reset_prefix_cache()
            t = time.perf_counter()
            outs = llm.generate(ps, p, lora=None if kind == "base" else mixed)
            dt = time.perf_counter() - t
            rows[kind].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    base, mix = statistics.median(rows["base"]), statistics.median(rows["mixed"])
    return {"base_tok_s": round(base, 1), "mixed_tok_s": round(mix, 1), "ratio": round(mix / base, 3),
            "runs": rows, "requests": n, "output_len": out_len, "prompt_len": 128}


def load_times(adapters: list[Path], repeats: int = 5) -> dict:
    from tokenpath.engine.loader import load_model
    from tokenpath.engine.lora import native_table, read_adapter

    cfg = load_model("smollm2-135m-instruct").config
    cold, warm = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        w = read_adapter("x", adapters[0], cfg, 64)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        native_table(w)
        warm.append(time.perf_counter() - t)
    return {"cold_ms": round(1e3 * statistics.median(cold), 2), "cpu_lru_ms": round(1e3 * statistics.median(warm), 2),
            "adapter_mib": round(w.nbytes / 2**20, 2), "rank": w.rank}


def _serve(tmp: Path, policy: str, modules: list[str]) -> tuple[subprocess.Popen, int]:
    log = tmp / f"serve-{policy}.log"
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(tmp / "data")}
    cmd = [sys.executable, "-m", "tokenpath.cli", "serve", "--port", "0", "--model", "smollm2-135m-instruct",
           "--replicas", "2", "--routing-policy", policy, "--max-loras", "2", "--max-cpu-loras", "2",
           "--kv-cache-memory", "128MiB"]
    for m in modules:
        cmd += ["--lora-modules", m]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", log.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


async def _ttft_run(port: int, models: list[str], ps: list[list[int]], concurrency: int) -> list[float]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    out: list[float] = []

    async def one(client: httpx.AsyncClient, model: str, prompt: list[int]) -> None:
        async with sem:
            t = time.perf_counter()
            body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                async for line in lines:
                    if line.startswith("data: {"):
                        out.append(time.perf_counter() - t)
                        break
                async for _ in lines:
                    pass

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
        await asyncio.gather(*(one(client, m, p) for m, p in zip(models, ps, strict=True)))
    return out


def ttft_affinity(adapters: list[Path], n: int, concurrency: int) -> dict:
    names = [f"a{k}" for k in range(len(adapters))]
    weights = [1 / (k + 1) ** 1.2 for k in range(len(names))] + [0.3]
    rng = random.Random(7)
    models = rng.choices(names + ["smollm2-135m-instruct"], weights=weights, k=n)
    ps = prompts(n, 96, seed=3)
    modules = [f"{name}={path}" for name, path in zip(names, adapters, strict=True)]
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("prefix_aware", "round_robin"):
            proc, port = _serve(Path(tmp), policy, modules)
            try:
                asyncio.run(_ttft_run(port, models[:8], ps[:8], concurrency))  # warm-up
                ttfts = asyncio.run(_ttft_run(port, models, ps, concurrency))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
            result[policy] = {"ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1),
                              "ttft_p90_ms": round(1e3 * sorted(ttfts)[int(0.9 * len(ttfts))], 1)}
    result["requests"], result["concurrency"] = n, concurrency
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--skip-serve", action="store_true", help="skip the 2-replica TTFT comparison")
    args = ap.parse_args()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(Path(tmp), 8, 16)
        res = {"loadavg_before": [round(x, 2) for x in load], "nproc": os.cpu_count(),
               "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        res["load_time"] = load_times(adapters)
        print(res["load_time"], flush=True)
        res["throughput"] = throughput(adapters, args.rounds, args.requests, args.output_len)
        print(res["throughput"], flush=True)
        if not args.skip_serve:
            res["ttft"] = ttft_affinity(adapters, 64, 8)
    res["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(res, indent=2))
    th, lt = res["throughput"], res["load_time"]
    lines = [f"# LoRA adapters (SmolLM2-135M Q4_1, native kernels), {res['started']}", "",
             f"Load average before/after: {res['loadavg_before']} / {res['loadavg_after']} on {res['nproc']} cores"
             + (" (a loaded machine: figures are indicative, not quiet-machine numbers)."
                if max(res['loadavg_before'] + res['loadavg_after']) > 2.5 else
                " (the run's own processes count 1-2)."), "",
             "| figure | value | target |", "|---|---|---|",
             f"| base-only, c=16, out tok/s | {th['base_tok_s']} | |",
             f"| 4 adapters + base mixed, c=16, out tok/s | {th['mixed_tok_s']} | |",
             f"| mixed / base-only (rounds: base {', '.join(f'{x:.1f}' for x in th['runs']['base'])}; "
             f"mixed {', '.join(f'{x:.1f}' for x in th['runs']['mixed'])}) | **{th['ratio']}x** | >= 0.8x |",
             f"| adapter load, cold (disk, page cache warm), rank {lt['rank']}, {lt['adapter_mib']} MiB | "
             f"{lt['cold_ms']} ms | |",
             f"| adapter load from the CPU LRU (made resident) | {lt['cpu_lru_ms']} ms | |"]
    if "ttft" in res:
        t = res["ttft"]
        lines += [f"| TTFT p50, skewed mix over 2 replicas, affinity (prefix_aware) | "
                  f"{t['prefix_aware']['ttft_p50_ms']} ms | |",
                  f"| TTFT p50, same, round_robin | {t['round_robin']['ttft_p50_ms']} ms | |"]
    (RESULTS / "lora.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
