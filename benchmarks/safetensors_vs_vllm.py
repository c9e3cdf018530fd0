"""The same bf16 safetensors checkpoint served by vLLM's CPU build and by `tokenpath serve` (issue 42).

    python benchmarks/safetensors_vs_vllm.py [--concurrency 1,32] [--num-requests 32]
        [--peers vllm,tokenpath] [--model-dir DIR]

Each server is started alone on loopback (two cores: a peer idling beside the one measured would
skew it), waited for until /health answers (the seconds to ready are recorded), then measured by
`tokenpath bench` on one seeded request list (256 prompt tokens, 128 forced output tokens; vLLM's
`ignore_eos`/`min_tokens`), and stopped. The load generator runs pinned to the second core
(`taskset -c 1`), the same for every server. Peak RSS is VmHWM summed over the server's process
group, read just before it is stopped (an upper bound: shared pages count once per process); the
RSS at ready is VmRSS summed the same way just after /health first answers, before any request.
The difference is mostly the KV cache's pages as requests touch them: each server's KV budget is
its own (vLLM: `VLLM_CPU_KVCACHE_SPACE=2` GiB, reserved at start; tokenpath: `--kv-cache-memory`,
512 MiB by default, touched as blocks are first used: distinct prompts fill it, since freed blocks
stay in the prefix cache until the pool wraps around).

The model: SmolLM2-135M-Instruct as bf16 safetensors (benchmarks/make_smollm2_hf.py, made from the
installed GGUF). vLLM: `vllm-cpu` 0.32 in benchmarks/.venv-vllm with the three mends of
../shared/PEERS.md. tokenpath serves only that model (no embedding model beside it).

Writes benchmarks/results/safetensors_vs_vllm.md and .json.
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
sys.path.insert(0, str(ROOT))
from benchmarks.procs import free_port, group_status_kib, stop_group, wait_healthy  # noqa: E402
from benchmarks.vllm_peer import venv  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
VLLM = venv() / "bin" / "vllm"
NAME = "smollm2-135m-instruct"


def peak_rss_mib(pgid: int) -> float:
    return group_status_kib(pgid, "VmHWM") / 1024


def command(peer: str, model_dir: Path, port: int, name: str = NAME) -> tuple[list[str], dict[str, str]]:
    """The server's argv: `vllm` (--dtype bfloat16, the file's), `vllm:DTYPE` (e.g. vllm:float32,
    vLLM's faster choice on a CPU without AVX-512 BF16, where its bf16 matmuls fall back from
    oneDNN to emulated torch ones), or `tokenpath`; both serve the model as `name`."""
    env = dict(os.environ)
    if peer.startswith("vllm"):
        vllm_dtype = peer.partition(":")[2] or "bfloat16"
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        return [str(VLLM), "serve", str(model_dir), "--served-model-name", name, "--host", "127.0.0.1", "--port",
                str(port), "--dtype", vllm_dtype, "--max-model-len", "4096"], env
    return [sys.executable, "-m", "tokenpath.cli", "serve", "--model", str(model_dir), "--served-model-name", name,
            "--port", str(port), "--host", "127.0.0.1"], env


def run_peer(peer: str, args: argparse.Namespace, out: Path) -> dict:
    port = free_port()
    argv, env = command(peer, args.model_dir, port)
    label = peer.replace(":", "-")  # (a file name and a bench target name)
    t0 = time.monotonic()
    with open(out / f"{label}.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(port, proc, out / f"{label}.log", 900)
        ready = time.monotonic() - t0
        ready_rss = group_status_kib(proc.pid) / 1024
        bench = [sys.executable, "-m", "tokenpath.cli", "bench", "--target",
                 f"{label}=http://127.0.0.1:{port}/v1,model={NAME},exact=vllm", "--concurrency", args.concurrency,
                 "--num-requests", str(args.num_requests), "--input-len", "256", "--output-len", "128", "--seed", "7",
                 "--warmup", "2", "--no-progress", "--json", str(out / f"{label}.json")]
        subprocess.run(["taskset", "-c", "1", *bench], check=True, cwd=ROOT)
        rss = peak_rss_mib(proc.pid)
    finally:
        stop_group(proc)
    return {"ready_s": ready, "ready_rss_mib": ready_rss, "peak_rss_mib": rss, "json": out / f"{label}.json"}


def levels(path: str) -> dict[int, dict]:
    """concurrency -> the run's summary, from `tokenpath bench --json`."""
    data = json.loads(Path(path).read_text())
    return {int(run["load"]["concurrency"]): run["summary"] for run in data["runs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--peers", default="vllm,tokenpath")
    ap.add_argument("--model-dir", type=Path, default=ROOT / ".cache" / "peers" / "smollm2-135m-bfloat16")
    ap.add_argument("--out", type=Path, default=ROOT / ".cache" / "bench" / "safetensors_vs_vllm")
    args = ap.parse_args()
    if not (args.model_dir / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_smollm2_hf.py"), "--out", str(args.model_dir)],
                       check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    peers = args.peers.split(",")
    found = {p: run_peer(p, args, args.out) for p in peers}
    subprocess.run([sys.executable, "-m", "tokenpath.cli", "bench", "--merge", *(found[p]["json"] for p in peers),
                    "--baseline", peers[0].replace(":", "-"), "--markdown", str(args.out / "merged.md")], check=True, cwd=ROOT)
    file_mib = sum(f.stat().st_size for f in args.model_dir.glob("*.safetensors")) / 2**20
    rows = []
    for p in peers:
        for c, run in sorted(levels(found[p]["json"]).items()):
            rows.append({"peer": p, "concurrency": c, "out_tok_s": run["output_throughput"],
                         "ttft_p99_ms": run["ttft_ms"]["p99"], "tpot_p50_ms": run["tpot_ms"]["median"],
                         "failed": run["failed"]})
    # Paths relative to the repo: the results file is committed and must not name this machine's folders.
    peers_out = {p: {**v, "json": os.path.relpath(v["json"], ROOT)} for p, v in found.items()}
    summary = {"peers": peers_out, "rows": rows, "file_mib": file_mib, "machine": os.uname().nodename}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "safetensors_vs_vllm.json").write_text(json.dumps(summary, indent=2))
    lines = ["# The same bf16 safetensors (SmolLM2-135M) served by vLLM CPU and tokenpath", "",
             f"`python benchmarks/safetensors_vs_vllm.py --num-requests {args.num_requests} --concurrency {args.concurrency}` "
             f"(256 in / 128 out, seed 7, "
             "load generator on core 1).", "",
             "| server | concurrency | out tok/s | ratio to " + peers[0] + " | TTFT p99 (ms) | TPOT p50 (ms) | failed |",
             "|---|---|---|---|---|---|---|"]
    base = {r["concurrency"]: r["out_tok_s"] for r in rows if r["peer"] == peers[0]}
    for r in rows:
        lines.append(f"| {r['peer']} | {r['concurrency']} | {r['out_tok_s']:.1f} | "
                     f"{r['out_tok_s'] / base[r['concurrency']]:.2f}x | {r['ttft_p99_ms']:.0f} | "
                     f"{r['tpot_p50_ms']:.1f} | {r['failed']} |")
    lines += ["", "| server | ready (s) | RSS at ready (MiB) | ready / file | peak RSS (MiB) | peak / file |",
              "|---|---|---|---|---|---|"]
    for p in peers:
        f = found[p]
        lines.append(f"| {p} | {f['ready_s']:.1f} | {f['ready_rss_mib']:.0f} | {f['ready_rss_mib'] / file_mib:.2f}x | "
                     f"{f['peak_rss_mib']:.0f} | {f['peak_rss_mib'] / file_mib:.2f}x |")
    (RESULTS / "safetensors_vs_vllm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
