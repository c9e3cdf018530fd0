"""`tokenpath status --ray ADDRESS`: the engine actors on a Ray cluster, one line each.

For each named `EngineActor` in the namespace: its node, Ray's view of it (ALIVE, RESTARTING,
DEAD; restarts so far, pid) and the engine's own (queue, batch, KV usage, requests this
incarnation has served). Ray's view comes from its control store (GCS), so a restarting actor is
listed as such instead of timing out; the engine's view is a `state` call with a short timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any

from tokenpath.replica.ray_replica import NAMESPACE, connect


@dataclass
class ActorRow:
    name: str
    state: str  # Ray's: ALIVE, RESTARTING, DEAD, PENDING_CREATION, DEPENDENCIES_UNREADY
    restarts: int
    node_id: str
    node_ip: str
    pid: int
    model: str | None = None
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    served: int | None = None
    detail: str | None = None  # why the engine's own state is missing


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="list engine replicas on a Ray cluster: node, state, KV usage, restarts")
    p.add_argument("--ray", required=True, metavar="auto|ADDRESS", help="the Ray cluster (as for serve --ray)")
    p.add_argument("--namespace", default=NAMESPACE, help=f"the actors' Ray namespace (default {NAMESPACE})")
    p.add_argument("--json", action="store_true", help="one JSON object per replica")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each engine's state")
    p.set_defaults(func=run_status)


def _gcs_row(ray: Any, handle: Any) -> dict:
    """Ray's record of the actor (state, restarts, pid, node), from the GCS actor table."""
    from ray._private.state import state as gcs  # the state API proper needs the dashboard running

    return gcs.actor_table(handle._actor_id.hex()) or {}


async def collect(ray: Any, namespace: str, timeout: float) -> list[ActorRow]:
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    rows: list[ActorRow] = []
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)
    for name in names:
        handle = ray.get_actor(name, namespace=namespace)
        info = _gcs_row(ray, handle)
        if info.get("ActorClassName", "EngineActor") != "EngineActor":
            continue
        node_id = (info.get("Address") or {}).get("NodeID", "")
        row = ActorRow(name=name, state=str(info.get("State", "UNKNOWN")), restarts=int(info.get("NumRestarts", 0)),
                       node_id=node_id, node_ip=nodes.get(node_id, "?"), pid=int(info.get("Pid") or 0))
        if row.state == "ALIVE":
            try:
                s = await asyncio.wait_for(handle.state.remote(), timeout)
                row.model, row.waiting, row.running = s.model, s.waiting, s.running
                row.kv_usage, row.served = round(s.kv_usage, 4), s.served
            except Exception as exc:  # noqa: BLE001 - reported in the row, never a crash of the listing
                row.detail = f"state: {type(exc).__name__}"
        rows.append(row)
    return rows


def run_status(args: argparse.Namespace) -> int:
    try:
        ray = connect(args.ray, args.namespace)
    except Exception as exc:  # noqa: BLE001 - any failure to join the cluster is the answer
        print(f"tokenpath: cannot reach the Ray cluster at {args.ray}: {exc}", file=sys.stderr)
        return 1
    try:
        rows = asyncio.run(collect(ray, args.namespace, args.timeout))
    finally:
        ray.shutdown()
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    if not rows:
        print(f"no tokenpath engine actors in namespace {args.namespace!r}")
        return 0
    table = [("REPLICA", "NODE", "STATE", "RESTARTS", "PID", "MODEL", "WAITING", "RUNNING", "KV", "SERVED")]
    for r in rows:
        kv = "-" if r.kv_usage is None else f"{100 * r.kv_usage:.1f}%"
        table.append((r.name, r.node_ip, r.state + (f" ({r.detail})" if r.detail else ""), str(r.restarts),
                      str(r.pid), r.model or "-", _opt(r.waiting), _opt(r.running), kv, _opt(r.served)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
