"""The audit log's rows in the store: opened at admission, closed at the end, and what a crash left.

A request's row is written twice under one `audit_key`: at admission (`open_by` = the gateway
instance that serves it, status 0) and at its end (every column, `open_by` cleared). Both writes are
idempotent upserts, so the writer's spool may retry a batch, write a close whose open never reached
the store, or meet an open after its close, and still leave exactly one row per request.

A gateway instance is one process: a row in `gateway_instances` with its host, pid and the pid's
start time, and a heartbeat (`seen_at`) refreshed with every batch and every progress write. A row
still open under an instance that is gone is closed as `gateway_crash` with what is known: the
admission facts and the completion tokens of the last progress write. An instance is gone when it is
on this host and its pid is dead or now belongs to another process (the restart after `kill -9`
notices at once), or, from any host, when its heartbeat is older than `stale_s`.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, fields
from operator import attrgetter

from tokenpath.gateway import limiter
from tokenpath.gateway.base import CRASH_STATUS, GATEWAY_CRASH, AuditRecord
from tokenpath.gateway.db import Tx

AUDIT_COLUMNS = tuple(f.name for f in fields(AuditRecord))
# A row's values in column order. Not `dataclasses.asdict`: it deep-copies field by field (~0.2 ms a
# row, twice per request, holding the GIL in the writer's thread while the event loop dispatches);
# the fields are scalars, so reading them is the whole job (~2 us).
_VALUES = attrgetter(*AUDIT_COLUMNS)
_WRITE_COLUMNS = (*AUDIT_COLUMNS, "day", "open_by")
_INSERT = (f"INSERT INTO audit_log ({', '.join(_WRITE_COLUMNS)}) "
           f"VALUES ({', '.join('?' * len(_WRITE_COLUMNS))})")
# The close replaces everything the open wrote (and clears `open_by`); the open never overwrites.
_CLOSE = _INSERT + " ON CONFLICT (audit_key) DO UPDATE SET " + ", ".join(
    f"{c} = excluded.{c}" for c in _WRITE_COLUMNS if c != "audit_key")
_OPEN = _INSERT + " ON CONFLICT (audit_key) DO NOTHING"


@dataclass(frozen=True)
class Instance:
    """This gateway process, as its open rows name it."""

    id: str
    host: str
    pid: int
    pid_start: str | None

    @classmethod
    def current(cls) -> Instance:
        host, pid = socket.gethostname(), os.getpid()
        return cls(f"{host}:{pid}:{uuid.uuid4().hex[:12]}", host, pid, pid_start_time(pid))


@dataclass(frozen=True)
class AuditOp:
    """One row to write: `open` (admission facts) or `close` (the whole row)."""

    kind: str  # "open" | "close"
    record: AuditRecord


def pid_start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so a reused pid is told apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22 (starttime), counted after the comm


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_batch(tx: Tx, ops: Sequence[AuditOp], instance: Instance | None, now: float) -> None:
    """Every op of the batch and this instance's heartbeat, in the caller's single transaction.
    `instance` None: closes only, written outside a gateway (tests, imports)."""
    for op in ops:
        params = [*_VALUES(op.record), limiter.day_of(op.record.time)]
        if op.kind == "open" and instance is not None:
            tx.q(_OPEN, [*params, instance.id])
        elif op.kind == "close":
            tx.q(_CLOSE if op.record.audit_key else _INSERT, [*params, None])
    if instance is not None:
        heartbeat(tx, instance, now)


def write_progress(tx: Tx, updates: Sequence[tuple[str, int]], instance: Instance, now: float) -> None:
    """The completion tokens of open rows so far (what a crash will be closed with), and a heartbeat."""
    for key, tokens in updates:
        tx.q("UPDATE audit_log SET completion_tokens = ? WHERE audit_key = ? AND open_by = ?",
             (tokens, key, instance.id))
    heartbeat(tx, instance, now)


def heartbeat(tx: Tx, instance: Instance, now: float) -> None:
    tx.q("INSERT INTO gateway_instances (id, host, pid, pid_start, started_at, seen_at) VALUES (?, ?, ?, ?, ?, ?) "
         "ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at",
         (instance.id, instance.host, instance.pid, instance.pid_start, now, now))


def forget_instance(tx: Tx, instance: Instance) -> None:
    """A clean shutdown: the instance goes, unless rows are still open under it (then a later start
    must still find it, and close them as `gateway_crash`)."""
    if not tx.q("SELECT 1 FROM audit_log WHERE open_by = ? LIMIT 1", (instance.id,)):
        tx.q("DELETE FROM gateway_instances WHERE id = ?", (instance.id,))


def close_crashed(tx: Tx, me: Instance, now: float, stale_s: float) -> int:
    """Close the rows of every gone instance as `gateway_crash`; returns how many were closed."""
    owners = [r[0] for r in tx.q("SELECT DISTINCT open_by FROM audit_log WHERE open_by IS NOT NULL")]
    known = {r[0]: r[1:] for r in tx.q("SELECT id, host, pid, pid_start, seen_at FROM gateway_instances")}
    closed = 0
    for owner in owners:
        if owner == me.id:
            continue
        info = known.get(owner)
        if info is not None and not _gone(info, me, now, stale_s):
            continue
        closed += len(tx.q(
            "UPDATE audit_log SET open_by = NULL, status = ?, finish_reason = ?, error_type = ? "
            "WHERE open_by = ? RETURNING id", (CRASH_STATUS, GATEWAY_CRASH, GATEWAY_CRASH, owner)))
    for iid, info in known.items():
        if iid != me.id and _gone(info, me, now, stale_s):
            tx.q("DELETE FROM gateway_instances WHERE id = ?", (iid,))
    return closed


def _gone(info: tuple, me: Instance, now: float, stale_s: float) -> bool:
    host, pid, pid_start, seen_at = info
    if host == me.host:  # a dead pid, or one reused by another process (a container restart's pid 1)
        if not _pid_alive(int(pid)):
            return True
        return pid_start is not None and pid_start_time(int(pid)) not in (None, pid_start)
    return now - float(seen_at) > stale_s
