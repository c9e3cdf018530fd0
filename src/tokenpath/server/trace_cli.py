"""`tokenpath trace REQUEST_ID` and `tokenpath trace --slowest N --since 10m`.

REQUEST_ID is the server's id (the response's `x-request-id`) or the client's own (the
`x-request-id` it sent, kept as `client_request_id`). A server id is unique; a client id may name
several requests (two tenants sending the same one, or a client reusing it): then each is listed
with its tenant and server id, or, with `--json`, each one's summary.

Reads the audit rows of the gateway's store (the same `--data-dir` / `--database-url` as
`tokenpath audit`) and prints where each request's time went: the stages as a waterfall, the
replica, cached tokens and the routing reason. `--json` prints the same as JSON. This command
wires the gateway's store to telemetry's formatting, so it sits at the top with the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from tokenpath.config import env_api_key, resolve_data_dir
from tokenpath.gateway.cli import parse_time
from tokenpath.gateway.store import GatewayStore, resolve_store_location
from tokenpath.telemetry.diagnose import diagnose
from tokenpath.telemetry.diagnose import render as render_findings
from tokenpath.telemetry.waterfall import render, render_matches, render_slowest, summary

_MATCHES = 100  # the most requests one client id lists


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("trace", help="one request's stages as a waterfall, or the slowest recent requests")
    p.add_argument("request_id", nargs="?", help="a request id: the server's (x-request-id of the response) "
                   "or the client's own (the x-request-id it sent)")
    p.add_argument("--slowest", type=int, metavar="N", help="list the N slowest requests instead")
    p.add_argument("--since", type=parse_time, default=None, help="with --slowest: ISO time or duration (10m)")
    p.add_argument("--json", action="store_true", help="JSON instead of text")
    p.add_argument("--data-dir", help="store location (default: $TOKENPATH_DATA_DIR or XDG)")
    p.add_argument("--database-url", help="PostgreSQL URL instead of SQLite in the data dir")
    p.set_defaults(func=cmd_trace)

    d = subparsers.add_parser("diagnose", help="why requests were slow over a window: findings, evidence, levers")
    d.add_argument("--since", type=parse_time, default="10m", help="ISO time or duration (default 10m)")
    d.add_argument("--model", help="only this model's requests")
    d.add_argument("--json", action="store_true", help="JSON instead of text")
    d.add_argument("--url", help="ask a running server's GET /diagnose instead (adds its engines' figures: "
                   "batch size, busy fraction, KV pressure)")
    d.add_argument("--api-key", default=env_api_key(),
                   help="with --url: an admin key (default $TOKENPATH_API_KEY)")
    d.add_argument("--data-dir", help="store location (default: $TOKENPATH_DATA_DIR or XDG)")
    d.add_argument("--database-url", help="PostgreSQL URL instead of SQLite in the data dir")
    d.set_defaults(func=cmd_diagnose)


def cmd_trace(args: argparse.Namespace) -> int:
    if (args.request_id is None) == (args.slowest is None):
        print("tokenpath trace: give a REQUEST_ID or --slowest N", file=sys.stderr)
        return 2
    store = GatewayStore(resolve_store_location(resolve_data_dir(args.data_dir), args.database_url))
    try:
        if args.request_id is not None:
            return _trace_one(store, args.request_id, args.json)
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


def _trace_one(store: GatewayStore, rid: str, as_json: bool) -> int:
    """The request with this server id; else those the client named so (one: its waterfall)."""
    rows = store.query_audit(request_id=rid, limit=_MATCHES)  # (rows from before server ids were
    if not rows:  # always minted may share one: then they are listed like a client id's)
        rows = store.query_audit(client_request_id=rid, limit=_MATCHES)
    if not rows:
        print(f"tokenpath trace: no request {rid!r} in the audit log (by server or client id)", file=sys.stderr)
        return 1
    found = [summary(asdict(r)) for r in rows]
    if len(found) == 1:
        print(json.dumps(found[0], indent=2) if as_json else render(found[0]))
    else:
        print(json.dumps(found, indent=2) if as_json else render_matches(rid, found))
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    since = float(args.since)
    window = f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(since))} UTC" + \
        (f", model {args.model}" if args.model else "")
    if args.url:
        return _diagnose_remote(args, since, window)
    store = GatewayStore(resolve_store_location(resolve_data_dir(args.data_dir), args.database_url))
    try:
        rows = [summary(asdict(r)) for r in store.query_audit(since=since, limit=None)]
    finally:
        store.close()
    if args.model:
        rows = [r for r in rows if r.get("model") == args.model]
    findings = diagnose(rows)
    if args.json:
        print(json.dumps({"window": window, "requests": len(rows), "findings": [f.as_dict() for f in findings]},
                         indent=2))
    else:
        print(render_findings(findings, f"{window}, {len(rows)} requests; engine figures need --url"))
    return 0


def _diagnose_remote(args: argparse.Namespace, since: float, window: str) -> int:
    import httpx

    params = {"since": str(since), **({"model": args.model} if args.model else {})}
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        resp = httpx.get(args.url.rstrip("/") + "/diagnose", params=params, headers=headers, timeout=60)
    except httpx.HTTPError as exc:
        print(f"tokenpath diagnose: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        print(f"tokenpath diagnose: {args.url} answered {resp.status_code}: {resp.text[:300]}", file=sys.stderr)
        return 1
    body = resp.json()
    if args.json:
        print(json.dumps(body, indent=2))
    else:
        from tokenpath.telemetry.diagnose import Finding

        findings = [Finding(**f) for f in body["findings"]]
        print(render_findings(findings, f"{window}, {body['requests']} requests"))
    return 0
