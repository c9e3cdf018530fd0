"""Speculative decoding over HTTP, side by side with llama-server's own (issue 39): the same GGUF
(SmolLM2-135M Q4_1), the same chat prompts (`spec_decode.py`'s `edit`, `quote` and `free`), one
stream, greedy, each server with speculation off and on.

- tokenpath: `tokenpath serve --model FILE`, on: `--speculative-config` with spec_decode.py's SPEC
  (n-gram, K = 16, n-grams of 2-3 tokens);
- llama-server (the build of engine_vs_llamacpp.py): on: `--spec-type ngram-simple
  --spec-draft-n-max 16` (its prompt-lookup proposer; the same K as ours).

Decode tok/s per request is (completion tokens - 1) / (last token - first token), from the stream,
so prefill is left out; a workload's figure is the median over `--rounds` requests (after one
warm-up request per server). Each server runs alone, with both cores (its affinity reset at
start); the client is pinned to core 0 (`taskset`, as every HTTP benchmark here: on 2 cores a client slows the server it measures)
and only reads a stream. Ratios are on/off within each server, then tokenpath against llama-server.

    .venv/bin/python benchmarks/spec_vs_llamaserver.py [--rounds 3] [--workloads edit,quote,free]

Writes benchmarks/results/spec_vs_llamaserver.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE.parent)]

from benchmarks.procs import LLAMA_SERVER, free_port, stop_group, wait_healthy  # noqa: E402
from benchmarks.spec_decode import SPEC, WORKLOADS  # noqa: E402


def model_file() -> str:
    from tokenpath.engine.loader import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct"))


def commands(name: str, spec: bool, port: int, model: str) -> list[str]:
    if name == "tokenpath":
        argv = [str(Path(sys.executable).with_name("tokenpath")), "serve", "--model", model, "--port", str(port)]
        return argv + (["--speculative-config", json.dumps(SPEC)] if spec else [])
    argv = [str(LLAMA_SERVER), "-m", model, "--port", str(port), "--host", "127.0.0.1", "-t", "2", "-np", "1",
            "-c", "4096"]
    return argv + (["--spec-type", "ngram-simple", "--spec-draft-n-max", str(SPEC["num_speculative_tokens"])]
                   if spec else [])


def decode_rate(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One streamed greedy chat request: (decode tok/s, completion tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    first = last = 0.0
    tokens = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    return ((tokens - 1) / (last - first) if last > first and tokens > 1 else 0.0), tokens


def run_server(name: str, spec: bool, workloads: list[str], rounds: int, model: str, tmp: Path) -> dict:
    port = free_port()
    log = tmp / f"{name}-{'on' if spec else 'off'}.log"
    with log.open("wb") as out:
        cores = set(range(os.cpu_count() or 1))  # (the client is pinned to core 0; its servers are not)
        proc = subprocess.Popen(commands(name, spec, port, model), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    try:
        wait_healthy(port, proc, log, 300)
        url = f"http://127.0.0.1:{port}"
        out_rows: dict = {}
        with httpx.Client(timeout=600) as client:
            served = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            decode_rate(client, url, served, WORKLOADS["free"][0], 16)  # warm-up
            for w in workloads:
                prompt, max_tokens = WORKLOADS[w]
                runs = [decode_rate(client, url, served, prompt, max_tokens) for _ in range(rounds)]
                out_rows[w] = {"tok_s": statistics.median(r[0] for r in runs), "tokens": [r[1] for r in runs]}
                print(f"{name} spec={'on' if spec else 'off'} {w}: {out_rows[w]['tok_s']:.1f} tok/s "
                      f"({out_rows[w]['tokens']} tokens)", flush=True)
        return out_rows
    finally:
        stop_group(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default="edit,quote,free")
    args = ap.parse_args()
    if not LLAMA_SERVER.is_file():
        sys.exit(f"no llama-server at {LLAMA_SERVER}: run benchmarks/engine_vs_llamacpp.py --build-only first")
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})  # the client on core 0 (each server gets both cores back: run_server)
    workloads = args.workloads.split(",")
    model = model_file()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tokenpath", "llama-server"):
            for spec in (False, True):
                res[(name, spec)] = run_server(name, spec, workloads, args.rounds, model, Path(tmp))
    lines = [
        "# Speculative decoding over HTTP: tokenpath and llama-server, off and on (issue 39)", "",
        f"`python benchmarks/spec_vs_llamaserver.py --rounds {args.rounds} --workloads {args.workloads}` "
        f"({started}, {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end). "
        f"SmolLM2-135M Q4_1, one stream, greedy; decode tok/s (prefill left out), median of {args.rounds}. "
        f"tokenpath on: `{json.dumps(SPEC)}`; llama-server on: `--spec-type ngram-simple --spec-draft-n-max "
        f"{SPEC['num_speculative_tokens']}`.", "",
        "| workload | tokenpath off | tokenpath on | on/off | llama-server off | llama-server on | on/off | "
        "tokenpath on / llama-server on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w in workloads:
        t0, t1 = res[("tokenpath", False)][w]["tok_s"], res[("tokenpath", True)][w]["tok_s"]
        l0, l1 = res[("llama-server", False)][w]["tok_s"], res[("llama-server", True)][w]["tok_s"]
        lines.append(f"| {w} | {t0:.1f} | {t1:.1f} | **{t1 / t0:.2f}x** | {l0:.1f} | {l1:.1f} | {l1 / l0:.2f}x | "
                     f"**{t1 / l1:.2f}x** |")
    (HERE / "results" / "spec_vs_llamaserver.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
