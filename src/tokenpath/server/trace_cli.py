"""`tokenpath trace REQUEST_ID` and `tokenpath trace --slowest N --since 10m`.

Reads the audit rows of the gateway's store (the same `--data-dir` / `--database-url` as
`tokenpath audit`) and prints where each request's time went: the stages as a waterfall, the
replica, cached tokens and the routing reason. `--json` prints the same as JSON. This command
wires the gateway's store to telemetry's formatting, so it sits at the top with the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tokenpath.config import resolve_data_dir
from tokenpath.gateway.cli import parse_time
from tokenpath.gateway.store import GatewayStore, resolve_store_location
from tokenpath.telemetry.waterfall import render, render_slowest, summary


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("trace", help="one request's stages as a waterfall, or the slowest recent requests")
    p.add_argument("request_id", nargs="?", help="a request id (x-request-id of the response)")
    p.add_argument("--slowest", type=int, metavar="N", help="list the N slowest requests instead")
    p.add_argument("--since", type=parse_time, default=None, help="with --slowest: ISO time or duration (10m)")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.add_argument("--data-dir", help="store location (default: $TOKENPATH_DATA_DIR or XDG)")
    p.add_argument("--database-url", help="PostgreSQL URL instead of SQLite in the data dir")
    p.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    if (args.request_id is None) == (args.slowest is None):
        print("tokenpath trace: give a REQUEST_ID or --slowest N", file=sys.stderr)
        return 2
    store = GatewayStore(resolve_store_location(resolve_data_dir(args.data_dir), args.database_url))
    try:
        if args.request_id is not None:
            rows = store.query_audit(request_id=args.request_id, limit=10)
            if not rows:
                print(f"tokenpath trace: no request {args.request_id!r} in the audit log", file=sys.stderr)
                return 1
            s = summary(asdict(rows[-1]))
            print(json.dumps(s, indent=2) if args.json else render(s))
            return 0
        if args.slowest < 1:
            print("tokenpath trace: --slowest must be at least 1", file=sys.stderr)
            return 2
        found = [summary(asdict(r)) for r in store.query_audit(since=args.since, limit=None)]
        found.sort(key=lambda s: s["total_ms"] or 0.0, reverse=True)
        top = found[: args.slowest]
        print(json.dumps(top, indent=2) if args.json else render_slowest(top))
        return 0
    finally:
        store.close()
