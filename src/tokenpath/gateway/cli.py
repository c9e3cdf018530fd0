"""`tokenpath keys | audit | usage`: operate the gateway's store from the command line.

Every command takes `--data-dir` (else TOKENPATH_DATA_DIR, else the per-user default) and
`--database-url` (else TOKENPATH_DATABASE_URL, else SQLite in the data dir). A new key is printed
once, alone on stdout (so `KEY=$(tokenpath keys create ...)` works); nothing prints it again.
Text output escapes control characters, so a hostile model name or client string in an audit row
cannot forge lines in a terminal or a log file; `--json` output is escaped by JSON itself.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import asdict, replace
from typing import TypeVar

from tokenpath.config import resolve_data_dir
from tokenpath.gateway.admin import create_key, set_tenant
from tokenpath.gateway.base import OPEN_STATUS, AuditRecord, Limits
from tokenpath.gateway.store import GatewayStore, KeyRecord, UsageRow, resolve_store_location
from tokenpath.protocol.limits import PRIORITY
from tokenpath.protocol.names import MODEL, TENANT, NameKind, name_problem

_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
R = TypeVar("R")  # the record type of one listing (keys, audit rows, usage rows)


def _priority(text: str) -> int:
    """A key's priority: a 32-bit signed integer, as every request's is (a larger one could not
    cross the engine link, so each of the key's requests would be refused)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not PRIORITY.least <= value <= PRIORITY.value:
        raise argparse.ArgumentTypeError(f"{value} is outside [{PRIORITY.least}, {PRIORITY.value}]")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="create, list and revoke API keys; set tenant defaults")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")

    create = keys_sub.add_parser("create", help="create a key and print it once")
    _store_args(create)
    create.add_argument("--tenant", required=True, type=_tenant_name)
    _limit_args(create)
    create.add_argument("--priority", type=_priority, default=0,
                        help=f"scheduling priority (lower runs first; {PRIORITY.least}..{PRIORITY.value})")
    create.add_argument("--expires", type=lambda t: parse_time(t, future=True),
                        help="ISO 8601 time (UTC if no offset), or a duration from now such as 30d")
    create.add_argument("--name", help="a label for the key")
    create.add_argument("--admin", action="store_true",
                        help="may also call /metrics and /reset_prefix_cache (operator endpoints)")
    create.set_defaults(func=cmd_keys_create)

    listing = keys_sub.add_parser("list", help="list keys (prefixes only, never the key)")
    _store_args(listing)
    listing.add_argument("--tenant")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_keys_list)

    revoke = keys_sub.add_parser("revoke", help="revoke a key by its prefix; effective on the next request")
    _store_args(revoke)
    revoke.add_argument("prefix")
    revoke.set_defaults(func=cmd_keys_revoke)

    tenant = keys_sub.add_parser(
        "tenant", help="show, create or update a tenant's default limits and models",
        description="Flags given are changed, others kept; 'none' removes a limit or the model list.")
    _store_args(tenant)
    tenant.add_argument("name", type=_tenant_name)
    _limit_args(tenant, clearable=True)
    tenant.set_defaults(func=cmd_keys_tenant)

    audit = subparsers.add_parser("audit", help="query the audit log")
    _store_args(audit)
    audit.add_argument("--tenant")
    audit.add_argument("--since", type=parse_time, help="ISO 8601 time, or a duration back from now: 1h, 7d")
    audit.add_argument("--until", type=parse_time)
    audit.add_argument("--request-id", help="the server's id (the response's x-request-id)")
    audit.add_argument("--client-request-id", help="the client's own id (the x-request-id it sent)")
    audit.add_argument("--limit", type=int, default=1000)
    audit.add_argument("--json", action="store_true", help="one JSON object per line")
    audit.set_defaults(func=cmd_audit)

    usage = subparsers.add_parser("usage", help="tokens by day and model, from the audit log")
    _store_args(usage)
    usage.add_argument("--tenant", required=True)
    usage.add_argument("--since", type=parse_time)
    usage.add_argument("--until", type=parse_time)
    usage.add_argument("--json", action="store_true")
    usage.set_defaults(func=cmd_usage)


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", help="state directory (default: TOKENPATH_DATA_DIR or the per-user default)")
    p.add_argument("--database-url", help="postgresql://... (default: TOKENPATH_DATABASE_URL, else SQLite)")


_CLEAR = "none"  # on `keys tenant`: remove this limit / the model list


def _limit_args(p: argparse.ArgumentParser, *, clearable: bool = False) -> None:
    number = _positive_or_none if clearable else _positive
    models = _model_set_or_none if clearable else _model_set
    p.add_argument("--models", type=models, help="comma-separated models this key/tenant may use")
    p.add_argument("--rpm", type=number, help="requests per minute")
    p.add_argument("--tpm", type=number, help="tokens per minute (prompt + max_tokens reserved)")
    p.add_argument("--daily-tokens", type=number, help="tokens per UTC day")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _positive_or_none(text: str) -> int | str:
    return _CLEAR if text.strip().lower() == _CLEAR else _positive(text)


def _model_set(text: str) -> frozenset[str]:
    models = frozenset(_safe_name(m.strip(), MODEL) for m in text.split(",") if m.strip())
    if not models:
        raise argparse.ArgumentTypeError("name at least one model")
    return models


def _safe_name(text: str, kind: NameKind) -> str:
    """A name as `protocol.names` allows it (printable, no control or bidi characters, bounded):
    the tenant shows up in every audit row, log line and dashboard."""
    problem = name_problem(text, kind)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


def _tenant_name(text: str) -> str:
    return _safe_name(text, TENANT)


def _model_set_or_none(text: str) -> frozenset[str] | str:
    return _CLEAR if text.strip().lower() == _CLEAR else _model_set(text)


def parse_time(text: str, now: float | None = None, *, future: bool = False) -> float:
    """ISO 8601 (a naive time is UTC) or a duration from now ('90m', '7d': back from now, or ahead
    of it with `future`, as for an expiry); epoch seconds."""
    now = time.time() if now is None else now
    m = _RELATIVE.fullmatch(text.strip())
    if m:
        return now + (1 if future else -1) * float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time or a duration like 7d: {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _open(args: argparse.Namespace) -> GatewayStore:
    return GatewayStore(resolve_store_location(resolve_data_dir(args.data_dir), args.database_url))


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(args.rpm, args.tpm, args.daily_tokens)


def cmd_keys_create(args: argparse.Namespace) -> int:
    with closing(_open(args)) as store:
        secret, record = create_key(store, args.tenant, models=args.models, limits=_limits(args),
                                    priority=args.priority, expires_at=args.expires, name=args.name,
                                    admin=args.admin)
    print(secret)
    print(f"created key {record.prefix}... for tenant {record.tenant!r}; it is shown only this once",
          file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    with closing(_open(args)) as store:
        records = store.list_keys(args.tenant)
    header = ("PREFIX", "TENANT", "MODELS", "RPM", "TPM", "DAILY", "PRIO", "ADMIN", "CREATED", "LAST USED",
              "STATUS")
    return _print_records(args.json, records, _key_view, header, _key_row)


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    with closing(_open(args)) as store:
        found = store.find_key(args.prefix)
        revoked = store.revoke_key(args.prefix, time.time()) if found else False
    if not found:
        print(f"no key with prefix {_safe(args.prefix)}", file=sys.stderr)
        return 1
    print(f"revoked {found.prefix}" if revoked else f"{found.prefix} was already revoked", file=sys.stderr)
    return 0


def cmd_keys_tenant(args: argparse.Namespace) -> int:
    """Change the flags given, keep the others; with no flag, just show the tenant."""
    with closing(_open(args)) as store:
        current = store.get_tenant(args.name)
        limits = current.limits if current else Limits()
        models = current.models if current else None
        changes = {k: getattr(args, k) for k in ("rpm", "tpm", "daily_tokens") if getattr(args, k) is not None}
        if changes or args.models is not None or current is None:
            limits = replace(limits, **{k: None if v == _CLEAR else v for k, v in changes.items()})
            if args.models is not None:
                models = None if args.models == _CLEAR else args.models
            set_tenant(store, args.name, limits=limits, models=models)
    print(f"tenant {_safe(args.name)}: {_limit_text(limits)} models={_models_text(models)}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    with closing(_open(args)) as store:
        records = store.query_audit(tenant=args.tenant, since=args.since, until=args.until,
                                    request_id=args.request_id, client_request_id=args.client_request_id,
                                    limit=args.limit)
    header = ("TIME", "REQUEST", "TENANT", "KEY", "MODEL", "ENDPOINT", "STATUS", "FINISH", "PROMPT", "CACHED",
              "COMPLETION", "TOTAL_S", "CLIENT", "ERROR")
    return _print_records(args.json, records, asdict, header, _audit_row)


def _audit_row(r: AuditRecord) -> Sequence[object]:
    return (_iso(r.time), r.request_id, r.tenant, r.key_prefix, r.model, r.endpoint, r.status,
            r.finish_reason or ("(open)" if r.status == OPEN_STATUS else None), r.prompt_tokens, r.cached_tokens,
            r.completion_tokens, None if r.total_s is None else f"{r.total_s:.3f}", r.client, r.error_type)


def cmd_usage(args: argparse.Namespace) -> int:
    with closing(_open(args)) as store:
        rows = store.usage(tenant=args.tenant, since=args.since, until=args.until)
    header = ("DAY", "MODEL", "REQUESTS", "PROMPT", "CACHED", "COMPLETION", "TOTAL")
    return _print_records(args.json, rows, _usage_view, header, _usage_row)


def _usage_view(u: UsageRow) -> dict[str, object]:
    return {**asdict(u), "total_tokens": u.total_tokens}


def _usage_row(u: UsageRow) -> Sequence[object]:
    return (u.day, u.model, u.requests, u.prompt_tokens, u.cached_tokens, u.completion_tokens, u.total_tokens)


def _key_view(r: KeyRecord) -> dict[str, object]:
    return {
        "prefix": r.prefix, "tenant": r.tenant, "name": r.name,
        "models": None if r.models is None else sorted(r.models),
        "rpm": r.limits.rpm, "tpm": r.limits.tpm, "daily_tokens": r.limits.daily_tokens,
        "priority": r.priority, "admin": r.admin, "created": _iso(r.created_at), "last_used": _iso(r.last_used_at),
        "expires": _iso(r.expires_at), "revoked": _iso(r.revoked_at),
    }


def _key_row(r: KeyRecord) -> Sequence[object]:
    status = "revoked" if r.revoked_at else "expired" if r.expires_at and r.expires_at <= time.time() else "active"
    return (r.prefix, r.tenant, _models_text(r.models), r.limits.rpm, r.limits.tpm, r.limits.daily_tokens,
            r.priority, "yes" if r.admin else "no", _iso(r.created_at), _iso(r.last_used_at), status)


def _models_text(models: frozenset[str] | None) -> str:
    return "*" if models is None else ",".join(sorted(models))


def _limit_text(limits: Limits) -> str:
    return f"rpm={limits.rpm or '-'} tpm={limits.tpm or '-'} daily_tokens={limits.daily_tokens or '-'}"


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _safe(value: object) -> str:
    """Printable text only: control characters (newlines, ANSI escapes) are shown escaped."""
    text = "-" if value is None else str(value)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _print_records(as_json: bool, records: Sequence[R], view: Callable[[R], object], header: Sequence[str],
                   row: Callable[[R], Sequence[object]]) -> int:
    """A listing's output, the same for every listing: one JSON object a line (`view`) under
    `--json`, else a table of `header` and one `row` a record. Returns the command's exit code."""
    if as_json:
        for r in records:
            print(json.dumps(view(r)))
    else:
        _print_table([header, *(row(r) for r in records)])
    return 0


def _print_table(rows: Sequence[Sequence[object]]) -> None:
    cells = [[_safe(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
