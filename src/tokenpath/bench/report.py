"""Reports: the readable tables, the `--json` file (every record plus summaries), and reading it back.

One JSON file holds a whole invocation; `--merge` reads several back so runs made one peer at a
time (as the peers script does, to give each server the machine alone) become one side-by-side table.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from tokenpath.bench.metrics import Stats, Summary
from tokenpath.bench.records import LoadPoint, RequestRecord, Target
from tokenpath.bench.runner import RunResult
from tokenpath.telemetry.timeline import PATH_STAGES as SERVER_STAGES

SCHEMA = "tokenpath.bench/1"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


_KEY_FIELD = re.compile(r"(\bkey=)([^,]*)")  # a --target's key=KEY field


def _redact(value: str) -> str:
    return value if value.startswith("env:") else "***"


def portable_argv(argv: Sequence[str]) -> list[str]:
    """The command line as it can be shared: absolute paths under the working directory made
    relative, other absolute paths (temporary files, the installed model) cut to their file name.
    Result files are committed; they should not carry one machine's folders."""
    cwd = Path.cwd()
    out = []
    secret_next = False
    for arg in argv:
        # A key given on the command line never reaches a result file (env:VAR names are kept).
        if secret_next:
            out.append(_redact(arg))
            secret_next = False
            continue
        if arg.startswith("--api-key="):
            out.append("--api-key=" + _redact(arg.removeprefix("--api-key=")))
            continue
        secret_next = arg == "--api-key"
        arg = _KEY_FIELD.sub(lambda m: m.group(1) + _redact(m.group(2)), arg)
        p = Path(arg)
        if p.is_absolute():
            arg = str(p.relative_to(cwd)) if p.is_relative_to(cwd) else p.name
        out.append(arg)
    return out


def machine_meta(argv: Sequence[str] | None = None, **extra: Any) -> dict[str, Any]:
    """Where and with what a run was made: enough to judge whether two tables are comparable."""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("tokenpath", "httpx", "numpy", "transformers", "torch")},
        "argv": portable_argv(argv if argv is not None else sys.argv),
        **extra,
    }


def to_json(results: Sequence[RunResult], meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "meta": meta,
        "runs": [
            {
                "target": r.target.public(),
                "load": r.load.to_json(),
                "duration_s": r.duration_s,
                "warmup_failed": r.warmup_failed,
                "warnings": r.warnings,
                "summary": r.summary.to_json(),
                "records": [rec.to_json() for rec in r.records],
            }
            for r in results
        ],
    }


def write_json(path: str | Path, results: Sequence[RunResult], meta: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # Compact: a full peers run holds ~100k ITL values; the tables are the human-readable view.
    Path(path).write_text(json.dumps(to_json(results, meta), separators=(",", ":")) + "\n")


def read_json(path: str | Path) -> tuple[list[RunResult], dict[str, Any]]:
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a tokenpath bench result ({doc.get('schema')!r})")
    runs = []
    for r in doc["runs"]:
        t = dict(r["target"])
        t["api_key"] = None
        runs.append(RunResult(
            target=Target(**t),
            load=LoadPoint.from_json(r["load"]),
            records=[RequestRecord.from_json(x) for x in r["records"]],
            duration_s=r["duration_s"],
            summary=Summary.from_json(r["summary"]),
            warmup_failed=r.get("warmup_failed", 0),
            warnings=list(r.get("warnings", [])),
        ))
    return runs, doc["meta"]


def _f(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def _ms(s: Stats, which: str) -> str:
    return _f(getattr(s, which), 0 if (getattr(s, which) or 0) >= 100 else 1)


MAIN_HEADERS = ["target", "load", "ok", "err(429)", "req/s", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p90",
                "TTFT p99", "TPOT mean", "TPOT p99", "ITL p50", "ITL p99", "E2EL p50", "E2EL p99", "goodput",
                "cache hits"]


def main_rows(results: Sequence[RunResult]) -> list[list[str]]:
    rows = []
    for r in results:
        s = r.summary
        rows.append([
            r.target.name, r.load.label(), str(s.completed), f"{s.failed}({s.errors.get('http_429', 0)})",
            _f(s.request_throughput, 2), _f(s.output_throughput), _ms(s.ttft_ms, "mean"), _ms(s.ttft_ms, "median"),
            _ms(s.ttft_ms, "p90"), _ms(s.ttft_ms, "p99"), _ms(s.tpot_ms, "mean"), _ms(s.tpot_ms, "p99"),
            _ms(s.itl_ms, "median"), _ms(s.itl_ms, "p99"), _ms(s.e2el_ms, "median"), _ms(s.e2el_ms, "p99"),
            "-" if s.goodput is None else f"{s.goodput:.2f} ({s.good_requests}/{s.completed})",
            "-" if s.prefix_cache_hit_rate is None else f"{s.prefix_cache_hit_rate:.0%}",
        ])
    return rows


STAGE_HEADERS = ["target", "load", "client TTFT mean",
                 *[f"{st} {k}" for st in SERVER_STAGES for k in ("mean", "p99")],
                 "server total mean", "client E2EL mean", "dominant"]


def stage_rows(results: Sequence[RunResult]) -> list[list[str]]:
    """Server-side breakdown (every stage the server reports) next to the client's view, for
    targets that report it."""
    rows = []
    for r in results:
        sm = r.summary.server_ms
        if not sm:
            continue

        def g(stage: str, k: str, sm: dict = sm) -> float | None:
            return (sm.get(stage) or {}).get(k)

        parts = {st: g(st, "mean") or 0.0 for st in SERVER_STAGES}
        rows.append([r.target.name, r.load.label(), _ms(r.summary.ttft_ms, "mean"),
                     *[_f(g(st, k)) for st in SERVER_STAGES for k in ("mean", "p99")],
                     _f(g("total", "mean")), _ms(r.summary.e2el_ms, "mean"), max(parts, key=parts.__getitem__)])
    return rows


RATIO_HEADERS = ["load", "vs peer", "out tok/s ratio", "req/s ratio", "TTFT p50 ratio", "TPOT p50 ratio",
                 "E2EL p50 ratio", "throughput verdict"]


def ratio_rows(results: Sequence[RunResult], baseline: str) -> list[list[str]]:
    """Baseline / peer for throughput (>1: baseline faster) and latency (<1: baseline faster)."""
    by_load: dict[str, dict[str, Summary]] = {}
    for r in results:
        by_load.setdefault(r.load.label(), {})[r.target.name] = r.summary
    rows = []
    for label, per in by_load.items():
        base = per.get(baseline)
        if base is None:
            continue
        for name, s in per.items():
            if name == baseline:
                continue
            tput = _ratio(base.output_throughput, s.output_throughput)
            verdict = "-" if tput is None else ("wins" if tput > 1.05 else "loses" if tput < 0.95 else "ties")
            rows.append([label, name, _x(tput), _x(_ratio(base.request_throughput, s.request_throughput)),
                         _x(_ratio(base.ttft_ms.median, s.ttft_ms.median)),
                         _x(_ratio(base.tpot_ms.median, s.tpot_ms.median)),
                         _x(_ratio(base.e2el_ms.median, s.e2el_ms.median)), verdict])
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


TARGET_HEADERS = ["target", "what it is", "endpoint", "model", "API", "exact lengths via"]


def target_rows(results: Sequence[RunResult]) -> list[list[str]]:
    seen: dict[str, Target] = {}
    for r in results:
        seen.setdefault(r.target.name, r.target)
    return [[t.name, t.note or "-", t.base_url, t.model, t.api, t.exact] for t in seen.values()]


def losses(results: Sequence[RunResult], baseline: str) -> list[str]:
    """Plain sentences for every load point where the baseline's output throughput is below a peer's."""
    return [f"- {baseline} loses to {row[1]} at {row[0]}: {row[2]} output throughput, {row[4]} TTFT p50, "
            f"{row[5]} TPOT p50" for row in ratio_rows(results, baseline) if row[-1] == "loses"]


def report(results: Sequence[RunResult], baseline: str | None = None, markdown: bool = False) -> str:
    """All tables of a run (latencies in ms), as text or markdown."""
    out = []
    if markdown:
        out.append("## Targets\n\n" + render(TARGET_HEADERS, target_rows(results), True))
    out.append(("## Client-side (ms; throughput per second)\n\n" if markdown else "")
               + render(MAIN_HEADERS, main_rows(results), markdown))
    if stages := stage_rows(results):
        out.append(("## Server-side stages (ms, from the target's own timing)\n\n" if markdown else
                    "server-side stages (ms):\n") + render(STAGE_HEADERS, stages, markdown))
    if baseline and (ratios := ratio_rows(results, baseline)):
        head = f"{baseline} / peer: throughput >1 means {baseline} is faster; latency <1 means {baseline} is faster"
        out.append((f"## Ratios\n\n{head}\n\n" if markdown else head + ":\n") + render(RATIO_HEADERS, ratios, markdown))
        lost = losses(results, baseline)
        out.append(("## Where " + baseline + " loses\n\n" if markdown else "")
                   + ("\n".join(lost) if lost else f"- {baseline} does not lose on output throughput at any load point"))
    notes = _notes(results, markdown)
    if notes:
        out.append(("## Notes\n\n" if markdown else "") + "\n".join(notes))
    return "\n\n".join(out)


def _notes(results: Sequence[RunResult], markdown: bool) -> list[str]:
    notes, seen = [], set()
    for r in results:
        t = r.target
        if t.name not in seen:
            seen.add(t.name)
            if markdown:
                continue  # the Targets table says it
            what = f" ({t.note})" if t.note else ""
            notes.append(f"- {t.name}: {t.base_url}, model {t.model}, {t.api} API, exact lengths via {t.exact}{what}")
        s = r.summary
        if s.exact_output_fraction is not None and s.exact_output_fraction < 1.0:
            how = ("" if all(x.output_tokens_source == "usage" for x in r.records if x.success)
                   else "; counted as content chunks, since the server sent no usage")
            notes.append(f"- {t.name} {r.load.label()}: only {s.exact_output_fraction:.0%} of outputs had the asked "
                         f"length (mean {s.mean_output_tokens:.1f} tokens{how}): throughput is not like for like")
        if s.errors.get("total"):
            notes.append(f"- {t.name} {r.load.label()}: errors {s.errors['by_status']}")
        notes += [f"- WARNING {t.name} {r.load.label()}: {w}" for w in r.warnings]
    return notes
