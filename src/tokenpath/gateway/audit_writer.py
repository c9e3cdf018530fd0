"""The audit log's writer: group commits, a bounded in-memory spool when the store fails, progress.

Why a writer and not one INSERT per request: when the store cannot be written (disk full,
PostgreSQL down) the rows must outlive the failure, so every row goes through one queue, the
spool, which a single task writes in batches (one transaction each). While the store works, a
caller waits for the batch holding its row (so a row is durable before its request goes on: an
open row before the client gets a reply's first byte, the write running beside the dispatch
(`api/intake.py`), a close once the reply's last byte is sent, streamed or whole: `api/replies.py`
`WholeReply`); once it fails,
callers do not wait: their rows stay spooled, up to `max_rows`, and the task retries with a capped
backoff until the store takes them. A row that finds the spool full is dropped and counted; no
row is ever lost without a count.

The spool holds one entry per request (keyed by `audit_key`): a close that arrives while the
open is still spooled replaces it, since the close upsert writes everything the open would.

Progress: every `progress_s` the task writes the completion tokens of each open row whose count
moved (one transaction for all, none when nothing moved) and this instance's heartbeat. That count
is what a crash's row is closed with: the tokens the gateway had streamed as of the last progress
write, so a `gateway_crash` row under-counts by at most `progress_s` of tokens, never over-counts.
Nothing is written per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenpath.gateway.audit_store import AuditOp, Instance
from tokenpath.gateway.base import AuditHealth, AuditRecord

if TYPE_CHECKING:
    from tokenpath.gateway.store import GatewayStore

log = logging.getLogger("tokenpath.gateway.audit")

SPOOL_ROWS = 100_000  # rows held in memory while the store fails (~1 KiB each without text)
PROGRESS_S = 2.0  # completion-token progress of open rows, and the heartbeat
STALE_S = 60.0  # an instance of another host with no heartbeat for this long is gone
RECOVER_EVERY_S = 30.0  # how often rows of gone instances (other hosts) are looked for
BATCH_ROWS = 500
RETRY_MAX_S = 2.0  # the retry backoff's cap while the store fails
LOG_EVERY_S = 30.0  # while degraded, one summary line this often (the cause was logged once at first)
SLOW_WRITE_S = 1.0
WAIT_MAX_S = 2.0  # the longest a request waits for its row's write  # a write pending this long makes /health degraded before it fails


def describe_error(exc: BaseException) -> str:
    """`Class: first line of the message`: the cause (e.g. 'database or disk is full'), on one line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else 'no detail'}"


@dataclass
class _Entry:
    op: AuditOp
    spooled: bool = False  # counted in spooled_total already
    waiters: list[asyncio.Future[bool]] = field(default_factory=list)


class AuditWriter:
    def __init__(self, store: GatewayStore, instance: Instance, *, max_rows: int = SPOOL_ROWS,
                 progress_s: float = PROGRESS_S, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.instance = instance
        self.max_rows = max_rows
        self.progress_s = progress_s
        self.clock = clock
        self._pending: OrderedDict[str, _Entry] = OrderedDict()
        self._live: dict[str, tuple[Callable[[], int], int]] = {}  # open rows: progress fn, last written
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._failed_at: float | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._last_log = 0.0
        self._writing_since: float | None = None
        self._spooled_total = self._dropped_total = self._written_total = 0
        self._closing = False
        self._spent_by: str | None = None  # the error that made the store give its reserve back

    # -- callers ------------------------------------------------------------------------------------
    async def open(self, record: AuditRecord, progress: Callable[[], int]) -> None:
        assert record.audit_key is not None
        self._live[record.audit_key] = (progress, record.completion_tokens)
        await self._put(AuditOp("open", record))

    async def close(self, record: AuditRecord) -> None:
        if record.audit_key is not None:
            self._live.pop(record.audit_key, None)
        await self._put(AuditOp("close", record))

    def health(self) -> AuditHealth:
        reason = self._error
        if reason is None and self.store.reserve_spent:  # rows are written, into the last room held back
            reason = f"disk full: the audit store's reserve is spent ({self._spent_by or 'no room'})"
        since = self._writing_since
        if reason is None and since is not None and time.monotonic() - since > SLOW_WRITE_S:
            reason = f"audit store write pending for {time.monotonic() - since:.1f} s"
        return AuditHealth(degraded=reason is not None, reason=reason, spool_rows=len(self._pending),
                           spooled_total=self._spooled_total, dropped_total=self._dropped_total,
                           written_total=self._written_total)

    async def _put(self, op: AuditOp) -> None:
        key = op.record.audit_key or f"once-{id(op)}-{time.monotonic_ns()}"
        entry = self._pending.get(key)
        if entry is not None:  # the close of a request whose open is still spooled: it supersedes it
            if op.kind == "close":  # a new entry (same place in the queue): a batch may be writing the old one
                entry = self._pending[key] = _Entry(op, spooled=entry.spooled, waiters=list(entry.waiters))
        elif len(self._pending) >= self.max_rows:
            self._dropped_total += 1
            if self._dropped_total == 1 or time.monotonic() - self._last_log >= LOG_EVERY_S:
                self._log_state(f"audit spool full ({self.max_rows} rows): dropping rows")
            return
        else:
            entry = self._pending[key] = _Entry(op, spooled=self._error is not None)
            self._spooled_total += entry.spooled
        self._ensure_task()
        self._wake.set()
        if self._error is not None or self._closing:
            return  # the store is failing: the row waits in the spool, the request does not
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry.waiters.append(fut)
        # A write that hangs (a partitioned database) holds the request no longer than this: the row
        # stays spooled, and /health is already degraded (SLOW_WRITE_S).
        await asyncio.wait({fut}, timeout=WAIT_MAX_S)

    def _ensure_task(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and self._task.get_loop() is not loop:  # a new event loop (tests)
            self._task, self._wake = None, asyncio.Event()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="audit-writer")

    # -- the task -----------------------------------------------------------------------------------
    async def _run(self) -> None:
        next_progress = time.monotonic() + self.progress_s
        next_recover = time.monotonic() + RECOVER_EVERY_S
        while True:
            self._wake.clear()  # first: a row put while this pass awaits wakes the next wait at once
            now = time.monotonic()
            if self._error is not None and time.monotonic() - self._last_log >= LOG_EVERY_S:
                self._log_state("audit store still failing")
            if self._pending and now >= self._retry_at:
                await self._write_batch()
                continue
            if self._error is not None and not self._pending and now >= self._retry_at:
                await self._write_progress()  # a probe: a failed progress write left nothing spooled to retry
                continue
            if now >= next_progress:
                next_progress = now + self.progress_s
                if self._error is None:
                    await self._write_progress()
                if self.store.reserve_spent:  # (off the event loop: it writes a file)
                    with contextlib.suppress(Exception):
                        await asyncio.to_thread(self.store.keep_reserve)
            if now >= next_recover and self._error is None:
                next_recover = now + RECOVER_EVERY_S
                await self._recover_others()
            wait = next_progress - time.monotonic()
            if self._pending or self._error is not None:
                wait = min(wait, self._retry_at - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, wait))

    async def _write_batch(self) -> None:
        batch = [(k, e, e.op) for k, e in itertools.islice(self._pending.items(), BATCH_ROWS)]
        ops = [op for _, _, op in batch]
        self._writing_since = time.monotonic()
        try:
            await asyncio.to_thread(self.store.write_audit_batch, ops, self.instance, self.clock())
        except Exception as exc:  # noqa: BLE001 - every store error is a reason to spool, not to lose rows
            self._failed(exc)
            if await asyncio.to_thread(self.store.reclaim_space):  # room made: try again now, not later
                self._retry_at = time.monotonic()
                self._spent_by = describe_error(exc)
            return
        finally:
            self._writing_since = None
        for key, entry, _op in batch:
            if self._pending.get(key) is entry:  # not superseded by a close while the batch was being written
                del self._pending[key]
            for fut in entry.waiters:
                if not fut.done():
                    fut.set_result(True)
            entry.waiters.clear()
        self._written_total += len(batch)
        if self._error is not None and not self._pending:
            self._recovered()

    def _failed(self, exc: Exception) -> None:
        reason = describe_error(exc)
        first = self._error is None
        self._error = reason
        self._failures += 1
        self._retry_at = time.monotonic() + min(RETRY_MAX_S, 0.1 * 2 ** min(self._failures, 8))
        for entry in self._pending.values():
            if not entry.spooled:
                entry.spooled = True
                self._spooled_total += 1
            for fut in entry.waiters:  # the requests go on; their rows stay spooled
                if not fut.done():
                    fut.set_result(False)
            entry.waiters.clear()
        if first:
            self._failed_at = time.monotonic()
            self._last_log = time.monotonic()
            log.error("audit store cannot be written (%s): spooling audit rows in memory (up to %d) and "
                      "retrying; /health reports degraded", reason, self.max_rows)

    def _recovered(self) -> None:
        down = time.monotonic() - (self._failed_at or time.monotonic())
        log.warning("audit store writable again after %.1f s (%s); %d rows were spooled, %d dropped in all",
                    down, self._error, self._spooled_total, self._dropped_total)
        self._error, self._failed_at, self._failures = None, None, 0

    def _log_state(self, what: str) -> None:
        self._last_log = time.monotonic()
        log.error("%s (%s): %d rows spooled now, %d spooled and %d dropped since start", what, self._error,
                  len(self._pending), self._spooled_total, self._dropped_total)

    async def _write_progress(self) -> None:
        updates: list[tuple[str, int]] = []
        for key, (fn, last) in list(self._live.items()):
            try:
                tokens = int(fn())
            except Exception:  # noqa: BLE001 - a progress read must never stop the writer
                continue
            if tokens != last and key not in self._pending:  # a spooled open is not in the store yet
                updates.append((key, tokens))
        try:
            await asyncio.to_thread(self.store.write_audit_progress, updates, self.instance, self.clock())
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return
        for key, tokens in updates:
            if key in self._live:
                self._live[key] = (self._live[key][0], tokens)
        if self._error is not None and not self._pending:
            self._recovered()

    async def _recover_others(self) -> None:
        try:
            n = await asyncio.to_thread(self.store.close_crashed_audit, self.instance, self.clock(), STALE_S)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return
        if n:
            log.warning("closed %d audit rows of a gone gateway instance as gateway_crash", n)

    async def aclose(self, timeout: float = 5.0) -> None:
        """Write what is spooled (for up to `timeout`; 1 s while the store fails, so a dead store does
        not hold the shutdown), then stop; what is left is counted as dropped and logged."""
        self._closing = True
        if self._error is not None and self._pending:  # a last chance: whatever room can be made
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.reclaim_space)
            self._retry_at = time.monotonic()
        deadline = time.monotonic() + (min(timeout, 1.0) if self._error is not None else timeout)
        while self._pending and time.monotonic() < deadline and self._task is not None and not self._task.done():
            self._retry_at = min(self._retry_at, time.monotonic() + 0.05)
            self._wake.set()
            await asyncio.sleep(0.05)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._pending:
            self._dropped_total += len(self._pending)
            log.error("shutdown: %d audit rows could not be written (%s) and are lost", len(self._pending),
                      self._error)
            self._pending.clear()
