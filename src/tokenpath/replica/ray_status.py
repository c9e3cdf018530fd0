"""`tokenpath status --ray ADDRESS`: the engine actors on a Ray cluster, one line each.

For each named `EngineActor` in the namespace: its node, Ray's view of it (ALIVE, RESTARTING,
DEAD; restarts so far, pid) and the engine's own (queue, batch, KV usage, requests this
incarnation has served, gateways routing to it). Ray's view comes from its public state API
(`ray.util.state.list_actors`, served by the head's dashboard process), so a restarting actor is
listed as such instead of timing out; nodes come from `ray.nodes()`; the engine's view is a
`state` call with a short timeout. A head started without the dashboard has no state API: then
the engines' own answers are all there is, and the listing says that restarts are unknown.
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
    restarts: int | None  # None: Ray's state API is not reachable
    node_id: str
    node_ip: str
    pid: int
    model: str | None = None
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    served: int | None = None
    gateways: int | None = None  # gateways routing to it (their leases on the actor)
    detail: str | None = None  # why the engine's own state is missing


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="list engine replicas on a Ray cluster: node, state, KV usage, restarts")
    p.add_argument("--ray", required=True, metavar="auto|ADDRESS", help="the Ray cluster (as for serve --ray)")
    p.add_argument("--namespace", default=NAMESPACE, help=f"the actors' Ray namespace (default {NAMESPACE})")
    p.add_argument("--json", action="store_true", help="one JSON object per replica")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each engine's state")
    p.set_defaults(func=run_status)


def _ray_actors(address: str, namespace: str, timeout: float) -> dict[str, Any] | None:
    """Ray's record of each engine actor (state, restarts, pid, node) by name, from the public state
    API; None when it is not reachable (no dashboard on the head, or an older cluster)."""
    try:
        from ray.util.state import list_actors

        actors = list_actors(address=address, filters=[("class_name", "=", "EngineActor"), ("ray_namespace", "=", namespace)],
                             detail=True, limit=10_000, timeout=max(1, int(timeout)), raise_on_missing_output=False)
    except Exception:  # noqa: BLE001 - ImportError (no ray[default]) or the API server is not there
        return None
    by_name: dict[str, Any] = {}
    for a in actors:  # a name freed by a killed actor may be taken again: the live one wins
        if a.name and (a.name not in by_name or by_name[a.name].state == "DEAD"):
            by_name[a.name] = a
    return by_name


async def collect(ray: Any, namespace: str, timeout: float) -> list[ActorRow]:
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    # The connected cluster's own address: left to itself, the state API picks the latest cluster
    # on this machine, which need not be this one.
    address = ray.get_runtime_context().gcs_address
    known = await asyncio.to_thread(_ray_actors, address, namespace, timeout)
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}
    if known is not None:
        names = (names & set(known)) | {n for n, a in known.items() if a.state != "DEAD"}
    rows: list[ActorRow] = []
    for name in sorted(names):
        info = (known or {}).get(name)
        row = ActorRow(name=name, state=info.state if info else "UNKNOWN",
                       restarts=int(info.num_restarts or 0) if info else None, node_id=(info and info.node_id) or "",
                       node_ip=nodes.get((info and info.node_id) or "", "?"), pid=(info and info.pid) or 0)
        if row.state in ("ALIVE", "UNKNOWN"):
            try:
                s = await asyncio.wait_for(ray.get_actor(name, namespace=namespace).state.remote(), timeout)
            except Exception as exc:  # noqa: BLE001 - reported in the row, never a crash of the listing
                row.detail = f"state: {type(exc).__name__}"
            else:
                row.model, row.waiting, row.running = s.model, s.waiting, s.running
                row.kv_usage, row.served, row.gateways = round(s.kv_usage, 4), s.served, s.gateways
                row.node_id, row.node_ip, row.pid = s.node_id, s.node_ip, s.pid
                row.state = "ALIVE"
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
    if any(r.restarts is None for r in rows):
        print("tokenpath: Ray's state API is not reachable (a head started without its dashboard, or no "
              "ray[default]): restarts are unknown and only engines that answer are listed", file=sys.stderr)
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    if not rows:
        print(f"no tokenpath engine actors in namespace {args.namespace!r}")
        return 0
    table = [("REPLICA", "NODE", "STATE", "RESTARTS", "PID", "MODEL", "WAITING", "RUNNING", "KV", "SERVED",
              "GATEWAYS")]
    for r in rows:
        kv = "-" if r.kv_usage is None else f"{100 * r.kv_usage:.1f}%"
        node = f"{r.node_ip} ({r.node_id[:8]})" if r.node_id else r.node_ip  # nodes may share an IP
        table.append((r.name, node, r.state + (f" ({r.detail})" if r.detail else ""), _opt(r.restarts),
                      str(r.pid), r.model or "-", _opt(r.waiting), _opt(r.running), kv, _opt(r.served),
                      _opt(r.gateways)))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)
