"""guidellm, aiperf and `tokenpath bench` against one `tokenpath serve`, under the same load.

    python benchmarks/load_generators.py [--concurrency 4] [--num-requests 40] [--input-len 128]
        [--output-len 64] [--server-cpus 0] [--client-cpus 1] [--rounds 1]

One server (SmolLM2 chat only) for the whole run, pinned with `taskset` to `--server-cpus`; each
load generator in turn, pinned to `--client-cpus` (another core: a generator on the server's
cores slows the server, and the three generators differ most in their own CPU cost). The same
load for all three: closed loop at `--concurrency`, `--num-requests` measured streamed chat
requests after one warm-up, synthetic prompts of `--input-len` tokens of user text (each tool's
own prompt generator, counted with SmolLM2's tokenizer, saved as a HF directory for the two
others), and exactly `--output-len` tokens out (`ignore_eos`, which all three send).

The metrics mean what each tool means by them; the table lines them up as:
- output tok/s: output tokens over the measured run's wall time;
- TTFT: request start to the first streamed token (mean and p50);
- ITL: guidellm and aiperf report (e2e - TTFT) / (output tokens - 1) per request, which
  `tokenpath bench` calls TPOT; its own ITL (gaps between streamed chunks) is shown beside it.

Writes `benchmarks/results/load_generators.md` and `.json`. guidellm and aiperf are found next to
this interpreter, in `.cache/loadgen-venv` (`benchmarks/loadgen_venv.sh` installs them there) or on
PATH; `--guidellm` and `--aiperf` name other binaries.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "smollm2-135m-instruct"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.procs import serve  # noqa: E402


def tool(name: str, given: str | None) -> str:
    own = HERE.parent / ".cache" / "loadgen-venv" / "bin" / name  # benchmarks/loadgen_venv.sh puts them here
    found = given or next((str(p) for p in (BIN / name, own) if p.exists()), None) or shutil.which(name)
    if not found:
        raise SystemExit(f"load_generators: {name} not found; run benchmarks/loadgen_venv.sh (or pass --{name})")
    return found


def pinned(cpus: str | None, argv: list[str]) -> list[str]:
    return ["taskset", "-c", cpus, *argv] if cpus and shutil.which("taskset") else argv


def hf_tokenizer_dir(dest: Path) -> Path:
    """SmolLM2's tokenizer (read out of its GGUF) as a HF directory, which guidellm and aiperf load."""
    if not (dest / "tokenizer_config.json").exists():
        from tokenpath.bench.tokens import load_tokens

        load_tokens("smollm2").tok.save_pretrained(dest)  # type: ignore[attr-defined]
    return dest


def start_server(work: Path, cpus: str | None) -> tuple[subprocess.Popen, str, Path]:
    log = work / "serve.log"
    env = {**os.environ, "TOKENPATH_DATA_DIR": str(work / "data")}
    proc, url = serve(pinned(cpus, [str(BIN / "tokenpath"), "serve", "--port", "0", "--model", MODEL,
                                    "--log-level", "warning"]), log, env=env)
    return proc, url, log


def run(argv: list[str], log: Path, timeout: float = 1800) -> float:
    """Run one generator to completion; its wall time. Its output goes to `log`."""
    t0 = time.monotonic()
    with log.open("wb") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code != 0:
        raise SystemExit(f"{argv[0] if argv[0] != 'taskset' else argv[3]} failed ({code}):\n"
                         f"{log.read_text(errors='replace')[-4000:]}")
    return time.monotonic() - t0


def audit_high_water(work: Path) -> int:
    """The last audit row's id so far (the server's own record of every request it served)."""
    db = sqlite3.connect(work / "data" / "gateway.sqlite3")
    try:
        return int(db.execute("SELECT COALESCE(MAX(id), 0) FROM audit_log").fetchone()[0])
    finally:
        db.close()


def settled_high_water(work: Path, quiet_s: float = 0.3, limit_s: float = 5.0) -> int:
    """The last audit row's id once the audit writer has caught up (no new row for `quiet_s`),
    instead of sleeping a fixed time and hoping its batch is written."""
    last, since, deadline = audit_high_water(work), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = audit_high_water(work)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def server_side(work: Path, after_id: int, upto_id: int) -> dict:
    """The server's own figures for one generator's requests (audit rows after_id < id <= upto_id):
    mean TTFT (every stage before the first token) and TPOT (decode / (tokens - 1)), in ms. A
    generator's figure that disagrees with the client-side one measures the client; one that
    agrees while it differs from another generator's run means the server really ran slower."""
    db = sqlite3.connect(work / "data" / "gateway.sqlite3")
    try:
        rows = db.execute("SELECT completion_tokens, timing FROM audit_log WHERE id > ? AND id <= ? AND status = 200",
                          (after_id, upto_id)).fetchall()
    finally:
        db.close()
    ttft, tpot = [], []
    for tokens, timing in rows:
        stages = json.loads(timing or "{}").get("stages_ms") or {}
        if tokens and tokens > 1 and "decode" in stages:
            tpot.append(stages["decode"] / (tokens - 1))
            ttft.append(sum(stages.get(k, 0.0) for k in ("upload", "gateway", "queue", "engine_queue", "prefill")))
    return {"server_requests": len(tpot), "server_ttft_mean": sum(ttft) / len(ttft) if ttft else None,
            "server_tpot_mean": sum(tpot) / len(tpot) if tpot else None}


# -- the three generators -------------------------------------------------------------------------
def run_tokenpath(a: argparse.Namespace, url: str, tok: Path, out: Path) -> dict:
    path = out / "tokenpath.json"
    run(pinned(a.client_cpus, [str(BIN / "tokenpath"), "bench", "--target", f"tp={url}/v1,model={MODEL}",
                               "--api", "chat", "--concurrency", str(a.concurrency), "--num-requests",
                               str(a.num_requests), "--input-len", str(a.input_len), "--output-len",
                               str(a.output_len), "--input-len-mode", "user", "--tokenizer", str(tok),
                               "--warmup", "1", "--json", str(path), "--no-progress"]), out / "tokenpath.log")
    return parse_tokenpath(out)


def parse_tokenpath(out: Path) -> dict:
    s = json.loads((out / "tokenpath.json").read_text())["runs"][0]["summary"]
    return {"completed": s["completed"], "failed": s["failed"], "output_tps": s["output_throughput"],
            "ttft_mean": s["ttft_ms"]["mean"], "ttft_p50": s["ttft_ms"]["median"],
            "itl_mean": s["tpot_ms"]["mean"], "chunk_itl_mean": s["itl_ms"]["mean"],
            "in_tokens": s["mean_prompt_tokens"], "out_tokens": s["mean_output_tokens"]}


def run_guidellm(a: argparse.Namespace, url: str, tok: Path, out: Path) -> dict:
    """guidellm 0.8 takes its whole configuration as a scenario file (its `kind=...` flags cannot
    carry a warm-up phase); warm-up: the first request, as for the two others."""
    path = out / "guidellm.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": MODEL, "request_format": "/v1/chat/completions",
                    "stream": True},
        "profile": {"kind": "concurrent", "streams": [a.concurrency], "warmup": {"mode": "requests", "value": 1}},
        "data": [{"kind": "synthetic_text", "prompt_tokens": a.input_len, "output_tokens": a.output_len}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tok)},
        "constraints": [{"kind": "max_requests", "count": a.num_requests + 1}],
        "outputs": [{"kind": "json", "path": str(path)}]}}
    (out / "guidellm-scenario.json").write_text(json.dumps(scenario, indent=1))
    run(pinned(a.client_cpus, [tool("guidellm", a.guidellm), "run", "--scenario", str(out / "guidellm-scenario.json"),
                               "--disable-console-interactive"]), out / "guidellm.log")
    return parse_guidellm(out)


def parse_guidellm(out: Path) -> dict:
    bench = json.loads((out / "guidellm.json").read_text())["benchmarks"][0]
    m = bench["metrics"]

    def stat(name: str, key: str = "mean") -> float:
        return m[name]["successful"][key]

    totals = m["request_totals"]  # (after the warm-up)
    return {"completed": totals["successful"], "failed": totals["errored"] + totals["incomplete"],
            "output_tps": stat("output_tokens_per_second"), "ttft_mean": stat("time_to_first_token_ms"),
            "ttft_p50": stat("time_to_first_token_ms", "median"), "itl_mean": stat("inter_token_latency_ms"),
            "chunk_itl_mean": None, "in_tokens": stat("prompt_token_count"), "out_tokens": stat("output_token_count")}


def run_aiperf(a: argparse.Namespace, url: str, tok: Path, out: Path) -> dict:
    art = out / "aiperf"
    run(pinned(a.client_cpus, [tool("aiperf", a.aiperf), "profile", "--model", MODEL, "--url", url,
                               "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tok),
                               "--concurrency", str(a.concurrency), "--request-count", str(a.num_requests),
                               "--warmup-request-count", "1",
                               "--isl", str(a.input_len), "--isl-stddev", "0",
                               "--osl", str(a.output_len), "--osl-stddev", "0",
                               # the server's token counts (usage), as the two others use: aiperf's
                               # own count re-tokenizes the streamed text, which is not one-to-one
                               "--use-server-token-count",
                               "--extra-inputs", "ignore_eos:true", "--artifact-dir", str(art),
                               "--ui-type", "none"]), out / "aiperf.log")
    return parse_aiperf(out)


def parse_aiperf(out: Path) -> dict:
    # (phases/warmup and phases/profiling hold each phase's export; the top one is the measured run)
    d = json.loads((out / "aiperf" / "profile_export_aiperf.json").read_text())

    def stat(name: str, key: str = "avg") -> float | None:
        v = d.get(name)
        return v.get(key) if isinstance(v, dict) else None

    return {"completed": stat("request_count"), "failed": stat("error_request_count") or 0,  # (absent: none)
            "output_tps": stat("output_token_throughput"), "ttft_mean": stat("time_to_first_token"),
            "ttft_p50": stat("time_to_first_token", "p50"), "itl_mean": stat("inter_token_latency"),
            "chunk_itl_mean": None, "in_tokens": stat("input_sequence_length"),
            "out_tokens": stat("output_sequence_length")}


GENERATORS = {"tokenpath bench": run_tokenpath, "guidellm": run_guidellm, "aiperf": run_aiperf}
PARSERS = {"tokenpath bench": parse_tokenpath, "guidellm": parse_guidellm, "aiperf": parse_aiperf}


# -- report ---------------------------------------------------------------------------------------
def fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def ratio(v: float | None, ref: float | None) -> str:
    if v is None or not ref:
        return "-"
    r = v / ref
    return f"{r:.2f}" + ("" if abs(r - 1) <= 0.10 else " (!)")


def report(a: argparse.Namespace, rows: list[dict], meta: dict) -> str:
    lines = ["# Load generators against one `tokenpath serve`", "",
             f"{meta['when']} UTC; `python benchmarks/load_generators.py --concurrency {a.concurrency} "
             f"--num-requests {a.num_requests} --input-len {a.input_len} --output-len {a.output_len} "
             f"--rounds {a.rounds}`.", "",
             f"- server: `tokenpath serve --model {MODEL}` pinned to CPU(s) {a.server_cpus}; each generator "
             f"pinned to CPU(s) {a.client_cpus}; {meta['nproc']} CPUs on the machine.",
             f"- machine load (1-minute load average) before/after each run: {meta['load']}.",
             f"- versions: {meta['versions']}.", "",
             "| round | generator | done/failed | in tok | out tok | output tok/s | ratio | TTFT mean ms | ratio | "
             "TTFT p50 ms | ITL ms (TPOT) | ratio | chunk ITL ms | server TTFT ms | server TPOT ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ref = next(r for r in rows if r["round"] == row["round"] and r["generator"] == "tokenpath bench")
        lines.append(
            f"| {row['round']} | {row['generator']} | {fmt(row['completed'], 0)}/{fmt(row['failed'], 0)} | "
            f"{fmt(row['in_tokens'])} | {fmt(row['out_tokens'])} | {fmt(row['output_tps'])} | "
            f"{ratio(row['output_tps'], ref['output_tps'])} | {fmt(row['ttft_mean'])} | "
            f"{ratio(row['ttft_mean'], ref['ttft_mean'])} | {fmt(row['ttft_p50'])} | {fmt(row['itl_mean'], 2)} | "
            f"{ratio(row['itl_mean'], ref['itl_mean'])} | {fmt(row['chunk_itl_mean'], 2)} | "
            f"{fmt(row.get('server_ttft_mean'))} | {fmt(row.get('server_tpot_mean'), 2)} |")
    lines += ["", "Ratios are against `tokenpath bench` in the same round; (!) marks one more than 10% off. "
              "Server TTFT / TPOT: the server's own record of the same requests (its audit rows: every stage "
              "before the first token; decode / (tokens - 1)), the reference each generator's figures are "
              "checked against."]
    return "\n".join(lines) + "\n"


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("tokenpath", "guidellm", "aiperf"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} (separate venv)")
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--server-cpus", default="0", help="taskset CPU list for the server ('' for none)")
    ap.add_argument("--client-cpus", default="1", help="taskset CPU list for each generator ('' for none)")
    ap.add_argument("--rounds", type=int, default=1, help="each generator this many times, interleaved")
    ap.add_argument("--only", nargs="+", choices=list(GENERATORS), default=list(GENERATORS))
    ap.add_argument("--guidellm", help="the guidellm command (default: next to this Python, else PATH)")
    ap.add_argument("--aiperf", help="the aiperf command (default: next to this Python, else PATH)")
    ap.add_argument("--out", default=str(HERE / "results" / "load_generators"), help="report path (no suffix)")
    ap.add_argument("--reparse", metavar="WORKDIR", help="no run: rebuild the report from a run's kept raw outputs "
                    "(the folder it printed), e.g. after a parser fix")
    ap.add_argument("--load-note", default="", help="with --reparse: the machine load to state")
    a = ap.parse_args()
    if a.reparse:
        rows = [{"round": int(d.name[1:]), "generator": name, **PARSERS[name](d)}
                for d in sorted(Path(a.reparse).glob("r*")) for name in a.only]
        write(a, rows, {"when": time.strftime("%Y-%m-%d %H:%M", time.gmtime(Path(a.reparse).stat().st_mtime)),
                        "nproc": os.cpu_count(), "load": a.load_note, "versions": versions()})
        return

    work = Path(tempfile.mkdtemp(prefix="tp-loadgen-"))
    tok = hf_tokenizer_dir(work / "tokenizer")
    proc, url, log = start_server(work, a.server_cpus or None)
    rows, load = [], []
    try:
        for rnd in range(1, a.rounds + 1):
            for name in a.only:
                before = os.getloadavg()[0]
                out = work / f"r{rnd}"
                out.mkdir(exist_ok=True)
                print(f"round {rnd}: {name} ...", flush=True)
                first = audit_high_water(work)
                row = {"round": rnd, "generator": name, **GENERATORS[name](a, url, tok, out)}
                row.update(server_side(work, first, settled_high_water(work)))
                load.append(f"{name} r{rnd} {before:.2f}/{os.getloadavg()[0]:.2f}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    write(a, rows, {"when": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "nproc": os.cpu_count(),
                    "load": "; ".join(load), "versions": versions()})
    print(f"(raw outputs kept in {work})")


def write(a: argparse.Namespace, rows: list[dict], meta: dict) -> None:
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    args = {**vars(a), "out": os.path.relpath(a.out, HERE.parent)}  # (no path of this machine in the results)
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "args": args, "rows": rows}, indent=1) + "\n")
    Path(a.out + ".md").write_text(report(a, rows, meta))
    print(Path(a.out + ".md").read_text())


if __name__ == "__main__":
    main()
