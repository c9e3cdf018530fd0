"""Issue 42 over HTTP at real sizes: the ~1B and ~4B dense Qwen3 shapes, c=1/8/32, four servers.

    python benchmarks/sizes_http.py --size 1b|4b [--parts gguf,bf16] [--concurrency 1,8,32]
        [--per-client 1] [--min-requests 4] [--input-len 128] [--output-len N] [--kv-gib G]

Two pairs, each server started alone (two cores: an idle peer beside the measured one would skew
it), waited for until /health answers (seconds to ready recorded), measured by `tokenpath bench`
at each concurrency c on max(min-requests, per-client x c) seeded requests (plus 2 warm-up
requests per level), then stopped:

- gguf: `tokenpath serve` on the Q4_K_M GGUF at its default precision (native kernels on the
  file's blocks) vs llama.cpp's `llama-server` on the same file (`--parallel` = the largest c).
- bf16: vLLM CPU (benchmarks/.venv-vllm, `--dtype bfloat16`) vs `tokenpath serve` on the same
  weights as bf16 safetensors (vLLM does not run GGUF K-quants). `--vllm-dtype float32`: vLLM
  computes them in float32, its faster choice on a CPU without AVX-512 BF16, where its bf16
  matmuls fall back to emulated ones (results/safetensors_vs_vllm.md); tokenpath keeps the file's bf16.

The models: 1b = benchmarks/make_qwen3_1b.py (GGUF quantized by llama-quantize from float weights;
`--bf16` is those float weights in bf16); 4b = make_moe_gguf.py --qwen3-4b (random Q4_K_M blocks)
and benchmarks/gguf_to_bf16.py (the values those blocks decode to, in bf16). All are made and
cached under .cache/peers/ when missing. Each server's KV budget is `--kv-gib` (vLLM:
VLLM_CPU_KVCACHE_SPACE; tokenpath: --kv-cache-memory; llama-server: --parallel x a context of
input + output + 64 tokens per slot, its f16 cache sized by that). The load generator runs on
core 1 (`taskset -c 1`), the same for every server; the completions API (no chat template), the
SmolLM2 tokenizer every one of these files carries; ignore_eos/min_tokens force the output length.

Writes benchmarks/results/sizes_http-<size>.md and .json (per-level bench JSON and server logs
under .cache/bench/sizes_http-<size>/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
from benchmarks.procs import LLAMA_SERVER, free_port, gauge_sum, group_status_kib, stop_group, wait_healthy  # noqa: E402
from benchmarks.safetensors_vs_vllm import command, levels  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
NAME = "qwen3-random"
# Level c's prompts are seeded SEED + c: the same for every server, new at each level (one seed for
# all levels sent c=8 the prompts c=1 had cached, and tokenpath and vLLM answered from their prefix caches).
SEED = 7
PAIRS = {"gguf": ("tokenpath", "llamacpp"), "bf16": ("vllm", "tokenpath")}  # (first: the ratio's baseline side)
OUTPUT_LEN = {"1b": 64, "4b": 32}  # a 4B decodes ~4x slower: fewer tokens keep its set near 20 min
# Each server's KV budget (GiB): c=32 x (128 + 64) tokens need ~0.4 GiB on the 1B and c=32 x (128 + 32) ~0.75 GiB
# on the 4B; vLLM reserves all of it at start, and its 4B worker held 10.9 GB with 2 GiB (7.1 GiB of weights).
KV_GIB = {"1b": 2, "4b": 1}


def model_files(size: str) -> tuple[Path, Path]:
    """(the Q4_K_M GGUF, the bf16 safetensors dir) of `size`, made when missing."""
    if size == "1b":
        from benchmarks.make_qwen3_1b import SHAPE, make_bf16, make_q4_k_m

        return make_q4_k_m("qwen3", "qwen3-1b-random", SHAPE, tie=False), make_bf16("qwen3", "qwen3-1b-random", SHAPE,
                                                                                     tie=False)
    from benchmarks.gguf_to_bf16 import convert
    from benchmarks.make_moe_gguf import QWEN3_4B, make

    gguf = make(QWEN3_4B["layers"], shape=QWEN3_4B)
    return gguf, convert(gguf, gguf.with_name("qwen3-4b-shape-random-bf16"))


def server_argv(peer: str, model: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The server's argv and environment; safetensors_vs_vllm.command() for vLLM and for tokenpath
    on a directory, with this run's KV budget."""
    if peer == "llamacpp":
        slots = max(args.levels)
        ctx = slots * (args.input_len + args.output_len + 64)
        env = {**os.environ, "LD_LIBRARY_PATH": str(LLAMA_SERVER.parent)}
        return [str(LLAMA_SERVER), "-m", str(model), "--alias", NAME, "--host", "127.0.0.1", "--port", str(port),
                "-t", str(os.cpu_count()), "--parallel", str(slots), "-c", str(ctx), "--cont-batching",
                "--no-webui"], env
    argv, env = command(f"vllm:{args.vllm_dtype}" if peer == "vllm" else peer, model, port, NAME)
    if peer == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
        return argv, env
    return argv + ["--kv-cache-memory", f"{args.kv_gib}GiB"], env


def model_mib(model: Path) -> float:
    """The weights file's size (a GGUF, or a folder's *.safetensors), MiB."""
    files = [model] if model.is_file() else list(model.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) / 2**20


def run_server(part: str, peer: str, model: Path, tokenizer: Path, args: argparse.Namespace) -> dict:
    """Start one server, bench it at every level, stop it; its figures and per-level JSON files."""
    label = f"{peer}-{part}"
    port = free_port()
    argv, env = server_argv(peer, model, port, args)
    log_path = args.out / f"{label}.log"
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    found: dict = {"label": label, "jsons": [], "bench_s": {}}
    try:
        wait_healthy(port, proc, log_path, 1200)
        found["ready_s"] = time.monotonic() - t0
        found["ready_rss_mib"] = group_status_kib(proc.pid) / 1024
        for c in args.levels:
            n = max(args.min_requests, args.per_client * c)
            path = args.out / f"{label}-c{c}.json"
            bench = [sys.executable, "-m", "tokenpath.cli", "bench", "--target",
                     f"{label}=http://127.0.0.1:{port}/v1,model={NAME},api=completions,exact=vllm",
                     "--concurrency", str(c), "--num-requests", str(n), "--input-len", str(args.input_len),
                     "--output-len", str(args.output_len), "--seed", str(SEED + c), "--warmup", "2", "--tokenizer",
                     os.path.relpath(tokenizer, ROOT), "--request-timeout", "1200", "--no-progress", "--json", str(path)]
            t1 = time.monotonic()
            done = subprocess.run(["taskset", "-c", "1", *bench], cwd=ROOT)
            found["bench_s"][c] = time.monotonic() - t1
            print(f"{label} c={c}: {n} requests in {found['bench_s'][c]:.0f} s (exit {done.returncode})",
                  file=sys.stderr)
            if path.is_file():
                found["jsons"].append(path)
        found["peak_rss_mib"] = group_status_kib(proc.pid, "VmHWM") / 1024
        # The KV pool's pages (the blocks ever written: they stay resident, so this is the KV
        # share of the peak), from tokenpath's own gauge.
        found["kv_resident_mib"] = (gauge_sum(f"http://127.0.0.1:{port}", "kv_cache_resident_bytes") / 2**20
                                    if peer == "tokenpath" else None)
        found["model_mib"] = model_mib(model)
    finally:
        stop_group(proc)
    found["total_s"] = time.monotonic() - t0
    return found


def table(part: str, runs: list[dict], args: argparse.Namespace) -> list[str]:
    """Markdown rows of one pair: per level, then per server (ready, RSS)."""
    base_label, peer_label = (r["label"] for r in runs)
    per = {r["label"]: {c: s for j in r["jsons"] for c, s in levels(str(j)).items()} for r in runs}
    title = ("GGUF Q4_K_M: tokenpath vs llama-server" if part == "gguf"
             else f"bf16 safetensors: vLLM CPU (--dtype {args.vllm_dtype}) vs tokenpath")
    tp = "tokenpath-" + part
    other = peer_label if base_label == tp else base_label
    lines = [f"## {title}", "", f"| c | requests | server | out tok/s | tokenpath / {other.split('-')[0]} "
             "| TTFT p99 (ms) | TPOT p50 (ms) | failed |", "|---|---|---|---|---|---|---|---|"]
    for c in args.levels:
        n = max(args.min_requests, args.per_client * c)
        ours = per[tp].get(c)
        for r in runs:
            s = per[r["label"]].get(c)
            if s is None:
                lines.append(f"| {c} | {n} | {r['label']} | (no result) | | | | |")
                continue
            ratio = (f"{ours['output_throughput'] / s['output_throughput']:.2f}x"
                     if ours and s["output_throughput"] and r["label"] != tp else "")
            lines.append(f"| {c} | {n} | {r['label']} | {s['output_throughput']:.1f} | {ratio} | "
                         f"{s['ttft_ms']['p99']:.0f} | {s['tpot_ms']['median']:.1f} | {s['failed']} |")
    lines += ["", "| server | ready (s) | RSS at ready (MiB) | peak RSS (MiB) | KV pool resident (MiB) "
              "| peak less KV / model file | bench s per level | whole run (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        bench = ", ".join(f"c={c}: {s:.0f}" for c, s in r["bench_s"].items())
        kv, peak, file_mib = r.get("kv_resident_mib"), r.get("peak_rss_mib", 0), r.get("model_mib", 0)
        less = f"{(peak - kv) / file_mib:.2f}x ({peak - kv:.0f} / {file_mib:.0f})" if kv is not None and file_mib else "-"
        lines.append(f"| {r['label']} | {r.get('ready_s', float('nan')):.1f} | {r.get('ready_rss_mib', 0):.0f} | "
                     f"{peak:.0f} | {'-' if kv is None else f'{kv:.0f}'} | {less} | {bench} | {r['total_s']:.0f} |")
    return lines + ["", "KV pool resident: tokenpath's `tokenpath:kv_cache_resident_bytes` after the last level (the "
                    "blocks ever written; their pages stay resident, so it is the KV share of the peak). vLLM "
                    "allocates its whole KV budget at start, inside both of its RSS figures.", ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("1b", "4b"), required=True)
    ap.add_argument("--parts", default="gguf,bf16", help="gguf (tokenpath vs llama-server), bf16 (vLLM vs tokenpath)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--per-client", type=int, default=1, help="requests per client at each level")
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, help="default: 64 (1b), 32 (4b)")
    ap.add_argument("--kv-gib", type=int, help="each server's KV budget in GiB (default: 2 for 1b, 1 for 4b)")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="vLLM's --dtype on the bf16 folder (float32: its faster choice without AVX-512 BF16)")
    ap.add_argument("--label", default="", help="a note for the results file's title, e.g. 'loaded smoke run'")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.output_len = args.output_len or OUTPUT_LEN[args.size]
    args.kv_gib = args.kv_gib or KV_GIB[args.size]
    args.out = ROOT / ".cache" / "bench" / f"sizes_http-{args.size}"
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    gguf, bf16 = model_files(args.size)
    made_s = time.monotonic() - t0
    parts = args.parts.split(",")
    found = {part: [run_server(part, peer, gguf if part == "gguf" else bf16, gguf, args) for peer in PAIRS[part]]
             for part in parts}
    jsons = [str(j) for runs in found.values() for r in runs for j in r["jsons"]]
    merged = args.out / "merged.md"
    if jsons:
        subprocess.run([sys.executable, "-m", "tokenpath.cli", "bench", "--merge", *jsons, "--markdown", str(merged)],
                       cwd=ROOT, check=False, stdout=subprocess.DEVNULL)
    cmd = (f"python benchmarks/sizes_http.py --size {args.size} --parts {args.parts} --concurrency {args.concurrency} "
           f"--per-client {args.per_client} --min-requests {args.min_requests} --input-len {args.input_len} "
           f"--output-len {args.output_len} --kv-gib {args.kv_gib} --vllm-dtype {args.vllm_dtype}")
    lines = [f"# Issue 42 over HTTP, the ~{args.size.upper()} Qwen3 shape{': ' + args.label if args.label else ''}", "",
             f"`{cmd}`: {args.input_len} prompt / {args.output_len} output tokens (forced), seed {SEED} + c, completions API, "
             f"requests per level max({args.min_requests}, {args.per_client} x c) + 2 warm-up; each server alone, "
             f"load generator on core 1, KV budget {args.kv_gib} GiB each. Models: {gguf.name} and {bf16.name}/ "
             f"(.cache/peers; made or found in {made_s:.0f} s). Ratios: tokenpath's out tok/s over the peer's "
             "(>1: tokenpath faster). Peak RSS: VmHWM summed over the server's process group after the last level.",
             ""]
    for part in parts:
        lines += table(part, found[part], args)
    if merged.is_file():
        lines += ["## Every figure (tokenpath bench --merge)", "", merged.read_text()]
    lines += ["## Machine", "", "```", f"{os.cpu_count()} CPUs; " + " ".join(
        line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name"))[:80], "```"]
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"sizes_http-{args.size}.md"
    out.write_text("\n".join(lines) + "\n")
    summary = {part: [{k: v for k, v in r.items() if k != "jsons"} for r in runs] for part, runs in found.items()}
    out.with_suffix(".json").write_text(json.dumps({"command": cmd, "runs": summary}, indent=2, default=str))
    print(out.read_text())


if __name__ == "__main__":
    main()
