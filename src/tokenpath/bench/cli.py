"""`tokenpath bench`: argument parsing and wiring; the work happens in runner/report/plots."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from tokenpath.bench.metrics import parse_slo
from tokenpath.bench.records import EXACT_MODES, LoadPoint, Target
from tokenpath.bench.workload import INPUT_LEN_MODES, WORKLOAD_KINDS, LengthDist, Workload, WorkloadConfig
from tokenpath.config import env_bench_api_key

if TYPE_CHECKING:  # (the runner is imported by `bench` itself: it imports httpx, whose CLI imports rich and
    # pygments, ~16 MiB that every other subcommand, `serve` included, paid for building this parser)
    from tokenpath.bench.runner import RunResult

DEFAULT_MODEL = "smollm2-135m-instruct"
DESCRIPTION = """Load-test OpenAI-compatible servers and compare them side by side: TTFT, TPOT, ITL and E2EL
(as `vllm bench serve` defines them), throughput, goodput, errors, and the server's own stage
timing where it reports it (tokenpath does).

Examples:
  tokenpath bench --base-url http://127.0.0.1:8000/v1 --concurrency 1,8,32 --num-requests 64 \\
      --input-len 256 --output-len 128 --json out.json --plot plots/
  tokenpath bench --target ours=http://127.0.0.1:8000/v1 \\
      --target llamacpp=http://127.0.0.1:8001/v1,model=smollm2,exact=min_tokens --rate 1,2,4
  tokenpath bench --merge a.json b.json --baseline tokenpath --markdown table.md
"""
TARGET_KEYS = ("model", "api", "exact", "key")


def normalize_url(url: str) -> str:
    """Accept `http://host:port` as well as `http://host:port/v1` (a bare root means /v1)."""
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(f"not an http(s) URL: {url!r}")
    return url.rstrip("/") + "/v1" if u.path in ("", "/") else url.rstrip("/")


def parse_target(text: str, defaults: argparse.Namespace, notes: dict[str, str]) -> Target:
    """`NAME=URL[,model=M][,api=chat|completions][,exact=MODE][,key=KEY|env:VAR]` or a bare URL."""
    head, *rest = text.split(",")
    name, sep, url = head.partition("=")
    if not sep or "://" in name:
        name, url = "", head
    fields: dict[str, str] = {}
    for item in rest:
        k, _, v = item.partition("=")
        if k not in TARGET_KEYS or not v:
            raise ValueError(f"bad target field {item!r}: use {', '.join(TARGET_KEYS)}")
        fields[k] = v
    url = normalize_url(url)
    name = name or (urlparse(url).netloc or "target")
    key = fields.get("key", defaults.api_key)
    if key and key.startswith("env:"):
        if not os.environ.get(key[4:]):
            raise ValueError(f"target {name}: key={key} names an environment variable that is not set")
        key = os.environ[key[4:]]
    api = fields.get("api", defaults.api)
    exact = fields.get("exact", defaults.exact)
    if api not in ("chat", "completions") or exact not in EXACT_MODES:
        raise ValueError(f"target {name}: api must be chat|completions, exact one of {EXACT_MODES}")
    return Target(name=name, base_url=url, model=fields.get("model", defaults.model), api=api,  # type: ignore[arg-type]
                  api_key=key, exact=exact, note=notes.get(name, ""))  # type: ignore[arg-type]


def _floats(text: str) -> list[float]:
    return [float("inf") if x.strip() in ("inf", "burst") else float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if any(v < 1 for v in vals):
        raise ValueError("concurrency must be >= 1")
    return vals


def load_points(rates: list[float], concurrencies: list[int], burst: bool) -> list[LoadPoint]:
    """Rates (open loop) x concurrency caps; concurrencies alone are closed loops."""
    rates = rates + ([float("inf")] if burst else [])
    if any(r <= 0 for r in rates):
        raise ValueError("rates must be > 0")
    if not rates:
        return [LoadPoint(concurrency=c) for c in (concurrencies or [1])]
    caps: list[int | None] = list(concurrencies) or [None]
    return [LoadPoint(rate=r, concurrency=c) for r, c in itertools.product(rates, caps)]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("bench", help="load-test OpenAI-compatible servers side by side",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("targets")
    g.add_argument("--target", action="append", default=[], metavar="NAME=URL[,model=M,api=A,exact=E,key=K]",
                   help="repeatable; all targets run the same request list, one after another")
    g.add_argument("--base-url", help="a single target (same as --target URL)")
    g.add_argument("--model", default=DEFAULT_MODEL, help="model for targets that do not name one")
    g.add_argument("--api", choices=("chat", "completions"), default="chat")
    g.add_argument("--api-key", default=env_bench_api_key(), help="or env:VAR")
    g.add_argument("--exact", choices=EXACT_MODES, default="vllm",
                   help="how targets are made to emit exactly --output-len tokens (see records.ExactMode)")
    g.add_argument("--note", action="append", default=[], metavar="NAME=TEXT",
                   help="what a target is (engine, dtype, batching); printed under the table")
    w = p.add_argument_group("workload (generated locally, seeded)")
    w.add_argument("--workload", choices=WORKLOAD_KINDS, default="random")
    w.add_argument("--input-len", default="256", help="N | uniform:LO:HI | normal:MEAN:STD (tokens)")
    w.add_argument("--output-len", default="128", help="N | uniform:LO:HI | normal:MEAN:STD (tokens)")
    w.add_argument("--prefix-groups", type=int, default=4, help="shared-prefix: number of groups")
    w.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of each common prefix")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    w.add_argument("--sessions", type=int, default=8, help="multi-turn: sessions open side by side")
    w.add_argument("--seed", type=int, default=None,
                   help="prompt seed (default: a fresh one each invocation, printed and saved in --json; "
                        "give it to send the same prompts again)")
    w.add_argument("--input-len-mode", choices=INPUT_LEN_MODES, default="template",
                   help="what --input-len counts: template (default: the whole prompt, chat template included, "
                        "as usage.prompt_tokens) or user (the user text only, as aiperf's ISL)")
    w.add_argument("--reset-cache", action="store_true",
                   help="POST /reset_prefix_cache on each target before each load point (vLLM and tokenpath)")
    w.add_argument("--tokenizer", default="auto", help="auto | approx | smollm2 | PATH.gguf | HF tokenizer dir")
    a = p.add_argument_group("arrivals and bounds")
    a.add_argument("--rate", default="", help="Poisson req/s, comma list for a sweep (inf: burst)")
    a.add_argument("--concurrency", default="", help="closed-loop clients (comma list), or the cap with --rate")
    a.add_argument("--burst", action="store_true", help="all requests at once (rate=inf)")
    a.add_argument("--num-requests", type=int, default=None, help="measured requests per load point (default 100)")
    a.add_argument("--duration", type=float, default=None, help="seconds after which no new request is issued")
    a.add_argument("--warmup", type=int, default=1, help="requests sent first, excluded from results")
    a.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds one request may take in all before it counts as a timeout error")
    a.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft=500ms,tpot=100ms (also itl, e2el)")
    o = p.add_argument_group("output")
    o.add_argument("--json", dest="json_path", help="write every per-request record and the summaries")
    o.add_argument("--plot", dest="plot_dir", help="write PNGs (CDFs, sweep, stage bars) into this folder")
    o.add_argument("--markdown", dest="markdown_path", help="write the tables as markdown")
    o.add_argument("--baseline", help="target name to state ratios against every other target")
    o.add_argument("--merge", nargs="+", metavar="JSON", help="no run: report earlier --json files together")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        if args.merge:
            return _merge(args)
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"tokenpath bench: error: {exc}", file=sys.stderr)
        return 2


def _targets(args: argparse.Namespace) -> list[Target]:
    notes = dict(n.split("=", 1) for n in args.note if "=" in n)
    specs = list(args.target) + ([args.base_url] if args.base_url else [])
    if not specs:
        raise ValueError("give --target NAME=URL (repeatable) or --base-url URL")
    targets = [parse_target(t, args, notes) for t in specs]
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("target names must be unique")
    return targets


def _run(args: argparse.Namespace) -> int:
    from tokenpath.bench.runner import Bounds, run_all
    from tokenpath.bench.tokens import load_tokens

    targets = _targets(args)
    loads = load_points(_floats(args.rate), _ints(args.concurrency), args.burst)
    num = args.num_requests if args.num_requests is not None else (None if args.duration else 100)
    bounds = Bounds(num_requests=num, duration=args.duration, warmup=args.warmup,
                    request_timeout=args.request_timeout)
    slo = parse_slo(args.slo)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"prompt seed: {seed}" + ("" if args.seed is not None else f" (fresh; --seed {seed} sends these prompts "
                                                                       "again)"), file=sys.stderr)
    config = WorkloadConfig(kind=args.workload, input_len=LengthDist.parse(args.input_len),
                            output_len=LengthDist.parse(args.output_len), seed=seed,
                            prefix_groups=args.prefix_groups, prefix_len=args.prefix_len,
                            turns=args.turns, sessions=args.sessions, input_len_mode=args.input_len_mode)
    tokens = load_tokens(args.tokenizer)
    print(f"tokenizer for prompt lengths: {tokens.name}", file=sys.stderr)
    results = asyncio.run(run_all(targets, loads, lambda t: Workload(config, tokens, t.api), bounds, slo,
                                  progress=not args.no_progress, reset_cache=args.reset_cache))
    for r in results:
        for w in r.warnings:
            print(f"tokenpath bench: warning: {r.target.name} {r.load.label()}: {w}", file=sys.stderr)
    from tokenpath.bench.report import machine_meta

    meta = machine_meta(sys.argv, seed=seed, workload=config.to_json(), tokenizer=tokens.name,
                        bounds={"num_requests": num, "duration": args.duration, "warmup": args.warmup,
                                "request_timeout": args.request_timeout}, slo=slo,
                        targets=[t.public() for t in targets])
    _emit(args, results, meta)
    return 0 if all(r.summary.completed for r in results) else 1


def _merge(args: argparse.Namespace) -> int:
    from tokenpath.bench.report import read_json

    results: list[RunResult] = []
    metas = []
    for path in args.merge:
        runs, meta = read_json(path)
        results += runs
        metas.append(meta)
    from tokenpath.bench.report import machine_meta

    _emit(args, results, machine_meta(sys.argv, merged_from=metas))
    return 0


def _emit(args: argparse.Namespace, results: list[RunResult], meta: dict[str, Any]) -> None:
    from tokenpath.bench.report import report, write_json

    print(report(results, baseline=args.baseline))
    if args.json_path:
        write_json(args.json_path, results, meta)
    if args.markdown_path:
        from pathlib import Path

        header = _md_header(meta)
        Path(args.markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_path).write_text(header + report(results, baseline=args.baseline, markdown=True) + "\n")
    if args.plot_dir:
        from tokenpath.bench.plots import plot_all

        for path in plot_all(results, args.plot_dir):
            print(f"wrote {path}", file=sys.stderr)


def _md_header(meta: dict[str, Any]) -> str:
    src = meta.get("merged_from") or [meta]
    first = src[0]
    lines = [f"- date: {meta['date']} (runs: {', '.join(m.get('date', '?') for m in src)})",
             f"- machine: {first.get('cpu_model')}, {first.get('cores')} cores, {first.get('platform')}",
             f"- client versions: python {first.get('python')}, "
             + ", ".join(f"{k} {v}" for k, v in (first.get("versions") or {}).items() if v)]
    if "workload" in first:
        lines.append(f"- workload: {first['workload']}; tokenizer {first.get('tokenizer')}; bounds {first.get('bounds')}")
    return "\n".join(lines) + "\n\n"
