"""Thrash: models of a catalog evicting each other (`tokenpath diagnose`'s `model_thrash`).

A model unloaded (evicted to make room for another, or unloaded when idle) and asked for again
soon after pays its whole load again: under a budget that fits fewer models than the traffic
alternates between, every request can pay one. The window's audit rows hold each such load in
their `model_load` cause (routing.catalog writes it): the model, the load's number (requests
sharing one load carry the same, so a shared load counts once), why (cold, `evicted` with
`evicted_for` and `evicted_ago_s`, `idle_unloaded` with `unloaded_ago_s`), the model's measured
`memory_bytes` and the catalog's `budget_bytes` / `max_loaded`.

A window thrashes when at least `MIN_RELOADS` loads were of a model unloaded under `REASK_S`
seconds before. The finding names who evicted whom and how often, the loads and the seconds they
took, and the remedy: the budget (`--models-memory` big enough for the models that evicted each
other, or `--max-loaded-models`), pinning the hottest one, or `--keep-alive` when idle unloads
were the reloads' cause.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

MIN_RELOADS = 3  # reloads within REASK_S of their unload, over the window, that make thrash
REASK_S = 300.0  # asked for again this soon after its unload: the unload was a mistake
MIB = 1024 * 1024


def _loads(rows: list[dict[str, Any]]) -> dict[tuple[str, Any], dict[str, Any]]:
    """Each distinct load in the rows: its facts and its longest wait (the load's own time)."""
    out: dict[tuple[str, Any], dict[str, Any]] = {}
    for r in rows:
        for c in r.get("causes") or ():
            if c.get("kind") != "model_load":
                continue
            d = c.get("detail") or {}
            key = (str(d.get("model") or r.get("model")), d.get("load", r.get("request_id")))
            load = out.setdefault(key, {**d, "ms": 0.0, "requests": 0, "time": r.get("time") or 0.0})
            load["ms"] = max(load["ms"], float(c.get("ms") or 0.0))
            load["requests"] += 1
    return out


def thrash(rows: list[dict[str, Any]], total_ms: float) -> dict[str, Any] | None:
    """The thrash finding's fields (kind, figure, share, evidence, lever), or None."""
    loads = list(_loads(rows).values())
    reloads = [ld for ld in loads if _ago(ld) is not None and _ago(ld) <= REASK_S]  # type: ignore[operator]
    if len(reloads) < MIN_RELOADS:
        return None
    pairs: Counter[tuple[str, str]] = Counter((str(ld["evicted_for"]), str(ld["model"]))
                                              for ld in reloads if ld.get("cause") == "evicted")
    idle = [ld for ld in reloads if ld.get("cause") == "idle_unloaded"]
    load_s = sum(ld["ms"] for ld in loads) / 1000
    reload_ms = sum(ld["ms"] for ld in reloads)
    models = sorted({m for pair in pairs for m in pair} | {str(ld["model"]) for ld in idle})
    times = [float(ld["time"]) for ld in loads]
    span = max(times) - min(times) if times else 0.0
    culprits = [f"{by} evicted {m} x{n}" for (by, m), n in pairs.most_common()]
    figure = (f"models thrash: {len(reloads)} of {len(loads)} loads in {span:.0f} s were of a model unloaded "
              f"under {REASK_S:.0f} s before; {load_s:.1f} s spent loading"
              + (f" ({', '.join(culprits[:3])})" if culprits else "")
              + (f", {len(idle)} after an idle unload" if idle else ""))
    return {"kind": "model_thrash", "figure": figure,
            "share": round(reload_ms / total_ms, 3) if total_ms else 0.0,
            "evidence": {"loads": len(loads), "reloads": len(reloads), "load_seconds": round(load_s, 3),
                         "reload_seconds": round(reload_ms / 1000, 3), "window_s": round(span, 1),
                         "evicted_by": [{"model": m, "evicted_for": by, "times": n}
                                        for (by, m), n in pairs.most_common()],
                         "idle_reloads": len(idle), "models": models, "culprits": culprits},
            "lever": _lever(reloads, pairs, idle, models)}


def _ago(load: dict[str, Any]) -> float | None:
    ago = load.get("evicted_ago_s", load.get("unloaded_ago_s"))
    return float(ago) if ago is not None and load.get("cause") in ("evicted", "idle_unloaded") else None


def _lever(reloads: list[dict[str, Any]], pairs: Counter[tuple[str, str]], idle: list[dict[str, Any]],
           models: list[str]) -> str:
    out = []
    if pairs:
        evicting = sorted({m for pair in pairs for m in pair})
        sizes = {str(ld["model"]): int(ld["memory_bytes"]) for ld in reloads if ld.get("memory_bytes")}
        need = sum(sizes.get(m, 0) for m in evicting)
        budget = next((int(ld["budget_bytes"]) for ld in reloads if ld.get("budget_bytes")), None)
        most = next((int(ld["max_loaded"]) for ld in reloads if ld.get("max_loaded")), None)
        if budget is not None and need > budget and len(sizes) == len(evicting):
            out.append(f"the budget: --models-memory {-(-need // MIB)}MiB holds {', '.join(evicting)} together "
                       f"(now {budget // MIB} MiB)")
        elif budget is not None:
            out.append(f"the budget: raise --models-memory (now {budget // MIB} MiB) to hold "
                       f"{', '.join(evicting)} together")
        if most is not None and len(evicting) > most:
            out.append(f"--max-loaded-models {len(evicting)} (now {most})")
        hot = Counter(m for (_, m), n in pairs.items() for _ in range(n)).most_common(1)[0][0]
        out.append(f"or pin the most reloaded model ({hot}: `pinned: true` in its sidecar)")
    if idle:
        longest = max(float(ld.get("unloaded_ago_s") or 0.0) for ld in idle)
        out.append(f"the keep-alive: {len(idle)} reloads came under {longest:.0f} s after an idle unload: raise "
                   "--keep-alive (or the requests' keep_alive) above that")
    return "; ".join(out) or f"keep {', '.join(models)} loaded"
