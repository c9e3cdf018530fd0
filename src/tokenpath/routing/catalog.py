"""The model catalog: models served on demand, under a memory budget, unloaded when idle.

Every entry is a model a client may name (a GGUF file or HF directory in `--models-dir`, a
packaged model, or a `--model`): `loaded`, `loading`, `unloaded` or `failed`. The first request
for an unloaded entry starts its load (the loader runs the blocking work in a thread: the event
loop never waits on it); requests arriving meanwhile share that one load, each waiting under its
own deadline. A failed load is a 503 naming the model and the reason, with Retry-After: the next
try waits out a back-off. Loads run one at a time, so the budget is decided on settled figures.

The budget (`memory_bytes`, `max_loaded`): before a load, the least recently used idle model (no
request in flight, not pinned) is unloaded until the new one fits; when nothing can go, the
request is a 503 + Retry-After, never an out-of-memory. A model's size is its footprint measured
after its last load (the loader's figure), or its size on disk before its first. A model larger
than the whole budget is refused with both sizes.

Idle unload: a loaded model unused for its `keep_alive` (the catalog's default, or what the last
request asked for, as Ollama's `keep_alive`; negative: never) is unloaded by a reaper task.

A request that waited for a load gets the `awaiting_model` and `model_loaded` stamps on its
Timeline (the `model_load` stage) and a `model_load` attribute saying why: a cold start, or an
eviction N seconds ago to make room for another model (telemetry.causes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenpath.errors import (
    ConflictError,
    DeadlineExceededError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
)
from tokenpath.routing.models import Deployment, Task
from tokenpath.telemetry.timeline import Timeline

log = logging.getLogger("tokenpath.routing")

State = Literal["loaded", "loading", "unloaded", "failed"]
MIB = 1024 * 1024


@dataclass(frozen=True)
class CatalogEntry:
    id: str  # the name clients send
    source: str  # what the loader loads: a packaged model's name, or a path
    task: Task
    size_hint: int = 0  # bytes on disk: the first load's estimate (later loads use the measured footprint)
    pinned: bool = False  # never evicted nor unloaded when idle
    problem: str | None = None  # not a model (found when the catalog was built): failed for good


LATE_HOLDER_WAIT_S = 5.0  # how long an unload waits for a finishing request to let go of the model
LATE_HOLDER_POLL_S = 0.1


@dataclass
class Loaded:
    """What a loader hands back: the deployment, what stops it (and frees its memory), and its
    measured footprint in bytes."""

    deployment: Deployment[Any, Any]
    close: Callable[[], Awaitable[None]]
    footprint: int
    # Run once the catalog holds no reference to this load (nor `close`, whose closure may): what
    # hands the unloaded engine's memory back (a garbage collection and a heap trim). Inside
    # `close` it could not: the unload still held the deployment, so a collection found it alive
    # and the engine's cycles stayed until some later collection (one engine's RSS after unload).
    free: Callable[[], Awaitable[None]] | None = None
    # What else holds the model's memory besides the deployment (its replicas' engines): the unload
    # waits for these to be collected too. The deployment can go while an engine is still held a
    # moment longer by something that never held the deployment (seen in CI and here, 1 unload in
    # 5: the deployment collected, the engine alive, RSS as loaded). Each must take weak references.
    parts: tuple[Any, ...] = ()


Loader = Callable[[CatalogEntry], Awaitable[Loaded]]


@dataclass(frozen=True)
class CatalogConfig:
    memory_bytes: int | None = None  # the budget for the models' footprints together
    max_loaded: int | None = None  # at most this many loaded at once
    keep_alive_s: float = 300.0  # idle this long -> unloaded (negative: never)
    backoff_s: float = 10.0  # after a failed load, the next try waits this long
    busy_retry_s: float = 5.0  # Retry-After when nothing can be evicted
    reap_interval_s: float = 1.0


@dataclass
class _Slot:
    entry: CatalogEntry
    state: State = "unloaded"
    loaded: Loaded | None = None
    loading: asyncio.Task[Loaded] | None = None
    inflight: int = 0
    holders: dict[int, Callable[[str], None]] = field(default_factory=dict)  # each request's stop, by token
    last_used: float = field(default_factory=time.monotonic)
    keep_alive_s: float | None = None  # what the last request asked for (None: the catalog's default)
    failure: str | None = None
    retry_at: float = 0.0
    footprint: int | None = None  # the largest measured at a load
    # The last unload: (when, how: "evicted" / "idle" / "unloaded", the model it made room for)
    unloaded: tuple[float, str, str | None] | None = None
    loads: int = 0
    load_seconds: float = 0.0  # every load's, from its start (making room included) to loaded


class ModelCatalog:
    def __init__(self, entries: Iterable[CatalogEntry], loader: Loader, config: CatalogConfig | None = None) -> None:
        self.config = config or CatalogConfig()
        self._loader = loader
        self._slots: dict[str, _Slot] = {}
        for entry in entries:
            if entry.id in self._slots:
                raise ValueError(f"two catalog entries have the id '{entry.id}': {self._slots[entry.id].entry.source} "
                                 f"and {entry.source} (rename one, or give it a served_model_name)")
            self._slots[entry.id] = _Slot(entry, state="failed" if entry.problem else "unloaded",
                                          failure=entry.problem)
        self.deployments: dict[str, Deployment[Any, Any]] = {}  # the router's (attached by ModelRouter)
        self._lock = asyncio.Lock()  # one load (and its evictions) at a time
        self._reaper: asyncio.Task[None] | None = None
        self._asleep: set[str] = set()  # put to sleep (vLLM's /sleep) and not loaded since

    # -- what is in it ------------------------------------------------------------------------------
    def __contains__(self, model: str) -> bool:
        return model in self._slots

    def ids(self) -> list[str]:
        return list(self._slots)

    def entry(self, model: str) -> CatalogEntry:
        return self._slot(model).entry

    def state(self, model: str) -> State:
        return self._slot(model).state

    def describe(self, model: str) -> dict[str, Any]:
        """The catalog's extra fields of a /v1/models card."""
        s = self._slot(model)
        out: dict[str, Any] = {"state": s.state, "pinned": s.entry.pinned, "loads": s.loads,
                               "load_seconds": round(s.load_seconds, 4)}
        if s.footprint is not None:
            out["memory_bytes"] = s.footprint
        if s.state == "failed" and s.failure:
            out["failure"] = s.failure
        return out

    def used_bytes(self) -> int:
        return sum(s.footprint or 0 for s in self._slots.values() if s.state == "loaded")

    def _slot(self, model: str) -> _Slot:
        slot = self._slots.get(model)
        if slot is None:
            raise NotFoundError(f"The model '{model}' does not exist", param="model", code="model_not_found")
        return slot

    # -- a request's use ----------------------------------------------------------------------------
    async def acquire(self, model: str, timeline: Timeline | None = None, deadline: float | None = None,
                      keep_alive_s: float | None = None,
                      stop: Callable[[str], None] | None = None) -> tuple[Deployment[Any, Any], Callable[[], None]]:
        """The model's deployment, loaded first if need be, and the release to call when the
        request ends: while held, the model is not evicted nor unloaded when idle. `stop`: how a
        forced unload ends this request (its stream ends with finish_reason `abort`)."""
        slot = self._slot(model)
        token = id(stop) if stop is not None else 0
        if stop is not None:
            slot.holders[token] = stop
        if keep_alive_s is not None:
            slot.keep_alive_s = keep_alive_s
        slot.inflight += 1  # held while it waits too: nothing evicts what a request is waiting for
        try:
            if slot.state != "loaded":
                await self._wait_loaded(slot, timeline, deadline)
        except BaseException:
            slot.holders.pop(token, None)
            self._release(slot)
            raise
        assert slot.loaded is not None
        slot.last_used = time.monotonic()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                slot.holders.pop(token, None)
                self._release(slot)

        return slot.loaded.deployment, release

    def _release(self, slot: _Slot) -> None:
        slot.inflight = max(0, slot.inflight - 1)
        slot.last_used = time.monotonic()

    async def _wait_loaded(self, slot: _Slot, timeline: Timeline | None, deadline: float | None) -> None:
        task = self._start_load(slot)
        if timeline is not None:
            timeline.stamp("awaiting_model")
            timeline.attrs["model_load"] = self._why(slot)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(task), remaining)
        except TimeoutError:
            raise DeadlineExceededError(f"request passed its deadline while model '{slot.entry.id}' was loading",
                                        code="deadline_exceeded") from None
        if timeline is not None:
            timeline.stamp("model_loaded")

    def _why(self, slot: _Slot) -> dict[str, Any]:
        """Why this load: cold, evicted (for whom), unloaded when idle or by an operator; with the
        load's number (requests sharing one load carry the same) and the sizes `tokenpath
        diagnose` needs to say which budget would have kept the model (telemetry.thrash)."""
        why: dict[str, Any] = {"model": slot.entry.id, "cause": "cold", "load": slot.loads + 1}
        if slot.unloaded is not None:
            at, how, by = slot.unloaded
            ago = round(time.monotonic() - at, 1)
            if how == "evicted":
                why.update(cause="evicted", evicted_ago_s=ago, evicted_for=by)
            elif how == "idle":
                why.update(cause="idle_unloaded", unloaded_ago_s=ago)
            else:
                why.update(cause="unloaded", unloaded_ago_s=ago)
        if slot.footprint is not None:
            why["memory_bytes"] = slot.footprint
        if self.config.memory_bytes is not None:
            why["budget_bytes"] = self.config.memory_bytes
        if self.config.max_loaded is not None:
            why["max_loaded"] = self.config.max_loaded
        return why

    # -- loading ------------------------------------------------------------------------------------
    def _start_load(self, slot: _Slot) -> asyncio.Task[Loaded]:
        """The load in progress, or a new one; a failed model within its back-off is refused here."""
        if slot.loading is not None:
            return slot.loading
        now = time.monotonic()
        if slot.state == "failed" and (slot.entry.problem or now < slot.retry_at):
            raise self._failed(slot, now)
        slot.state = "loading"
        slot.loading = asyncio.create_task(self._load(slot), name=f"load:{slot.entry.id}")
        slot.loading.add_done_callback(lambda t: t.cancelled() or t.exception())  # (read: no "never retrieved")
        return slot.loading

    def _failed(self, slot: _Slot, now: float) -> ServiceUnavailableError:
        wait = 3600.0 if slot.entry.problem else max(1.0, slot.retry_at - now)
        return ServiceUnavailableError(f"model '{slot.entry.id}' failed to load: {slot.failure}",
                                       param="model", code="model_load_failed",
                                       headers={"Retry-After": str(int(-(-wait // 1)))})

    async def _load(self, slot: _Slot) -> Loaded:
        entry = slot.entry
        try:
            async with self._lock:
                began = time.monotonic()  # (making room is part of the load a request waits for)
                await self._make_room(slot)
                log.info("loading model %s from %s", entry.id, entry.source,
                         extra={"event": "model_loading", "model": entry.id})
                loaded = await self._loader(entry)
                took = time.monotonic() - began
                budget = self.config.memory_bytes
                if budget is not None and loaded.footprint > budget:
                    await loaded.close()
                    raise InvalidRequestError(self._too_large(entry, loaded.footprint, budget))
                if loaded.deployment.name != entry.id:
                    loaded.deployment.name = entry.id
                # The largest footprint measured: a reload into memory the process kept from an
                # earlier load measures less than the model needs where that memory is gone.
                footprint = max(loaded.footprint, slot.footprint or 0)
                slot.loaded, slot.footprint, slot.state, slot.failure = loaded, footprint, "loaded", None
                await self._settle(slot)
                slot.loads += 1
                self._asleep.discard(entry.id)  # (woken: by /wake_up, a warm-up or a request)
                slot.load_seconds += took
                slot.last_used = time.monotonic()
                self.deployments[entry.id] = loaded.deployment
                log.info("loaded model %s in %.2fs (%.0f MiB)", entry.id, took, loaded.footprint / MIB,
                         extra={"event": "model_loaded", "model": entry.id, "load_s": round(took, 3),
                                "memory_bytes": loaded.footprint})
                return loaded
        except ServiceUnavailableError as exc:  # nothing could be evicted: not the model's fault
            slot.state = "unloaded"
            raise exc
        except Exception as exc:
            slot.state, slot.failure = "failed", _reason(exc)
            slot.retry_at = time.monotonic() + self.config.backoff_s
            log.error("model %s failed to load: %s", entry.id, slot.failure,
                      extra={"event": "model_load_failed", "model": entry.id})
            raise self._failed(slot, time.monotonic()) from exc
        finally:
            slot.loading = None

    def _too_large(self, entry: CatalogEntry, size: int, budget: int) -> str:
        return (f"model '{entry.id}' needs {size / MIB:.0f} MiB, more than the whole --models-memory budget of "
                f"{budget / MIB:.0f} MiB")

    async def _make_room(self, slot: _Slot) -> None:
        """Unload least recently used idle models until this one fits the budget (under the lock)."""
        need = slot.footprint if slot.footprint is not None else slot.entry.size_hint
        budget, most = self.config.memory_bytes, self.config.max_loaded
        if budget is not None and need > budget:
            raise InvalidRequestError(self._too_large(slot.entry, need, budget))

        def fits() -> bool:
            loaded = [s for s in self._slots.values() if s.state == "loaded"]
            return ((budget is None or sum(s.footprint or 0 for s in loaded) + need <= budget)
                    and (most is None or len(loaded) + 1 <= most))

        while not fits():
            if not await self._evict_lru(slot):
                busy = [s.entry.id for s in self._slots.values() if s.state == "loaded"]
                raise ServiceUnavailableError(
                    f"model '{slot.entry.id}' cannot be loaded now: the loaded models ({', '.join(busy)}) are all "
                    f"serving requests or pinned ({self.used_bytes() / MIB:.0f} MiB of "
                    f"{'unbounded' if budget is None else f'{budget / MIB:.0f} MiB'}, {len(busy)} loaded of "
                    f"{most if most is not None else 'unbounded'}); retry shortly", param="model",
                    code="model_memory_exhausted",
                    headers={"Retry-After": str(int(-(-self.config.busy_retry_s // 1)))})

    async def _settle(self, slot: _Slot) -> None:
        """After a load measured larger than its estimate (a first load is estimated by its size
        on disk): unload least recently used idle models until the budget holds again."""
        budget = self.config.memory_bytes
        while budget is not None and self.used_bytes() > budget:
            if not await self._evict_lru(slot):
                log.warning("models use %.0f MiB, over the %.0f MiB budget, and none is idle to unload",
                            self.used_bytes() / MIB, budget / MIB)
                return

    async def _evict_lru(self, slot: _Slot) -> bool:
        """Unload the least recently used idle model (no request in flight, not pinned, not `slot`)
        to make room for `slot`; False when there is none."""
        idle = [s for s in self._slots.values()
                if s.state == "loaded" and s.inflight == 0 and not s.entry.pinned and s is not slot]
        if not idle:
            return False
        victim = min(idle, key=lambda s: s.last_used)
        await self._unload(victim, why=f"to make room for {slot.entry.id}")
        victim.unloaded = (time.monotonic(), "evicted", slot.entry.id)
        return True

    # -- unloading ----------------------------------------------------------------------------------
    async def _unload(self, slot: _Slot, why: str) -> None:
        loaded, slot.loaded = slot.loaded, None
        slot.state = "unloaded"
        if loaded is None:
            return
        self.deployments.pop(slot.entry.id, None)  # new requests now wait for a new load
        log.info("unloading model %s (%s)", slot.entry.id, why,
                 extra={"event": "model_unloaded", "model": slot.entry.id, "reason": why})
        free = loaded.free
        # (a comprehension, whose variable is its own: a loop variable of this frame would hold the
        # last part for the whole wait below)
        held = [weakref.ref(x) for x in (loaded.deployment, *loaded.parts)]
        try:
            await loaded.deployment.close_flow()
            await loaded.close()
        except Exception:
            log.exception("error while unloading model %s", slot.entry.id)
        del loaded  # (the last reference this catalog held: `free` can collect it now)
        if free is not None:
            await self._free(slot.entry.id, held, free)

    @staticmethod
    async def _free(model: str, held: list[weakref.ref[Any]], free: Callable[[], Awaitable[None]]) -> None:
        """Collect the unloaded deployment, waiting a moment for its last holders: a request whose
        reply was sent still holds it while its end runs (the audit write, the token reconcile),
        and an unload that arrives then freed nothing (seen in CI: 327 MiB before a load, 440 after
        its unload). Collected again every `LATE_HOLDER_POLL_S` until it and the load's `parts` are
        gone, for at most `LATE_HOLDER_WAIT_S`; one still held then is logged with what holds it."""
        await free()
        deadline = time.monotonic() + LATE_HOLDER_WAIT_S
        while any(r() is not None for r in held) and time.monotonic() < deadline:
            await asyncio.sleep(LATE_HOLDER_POLL_S)
            await free()
        first = next((x for x in (r() for r in held) if x is not None), None)
        if first is not None:
            import gc

            holders = sorted({type(r).__name__ for r in gc.get_referrers(first)} - {"frame"})
            log.warning("model %s unloaded, but its %s is still held (by %s): its memory goes back when "
                        "that lets go", model, type(first).__name__, ", ".join(holders) or "nothing found",
                        extra={"event": "model_memory_held", "model": model})

    async def load(self, model: str) -> State:
        """`POST /v1/models/{id}/load`: load now (a warm-up), and wait for it."""
        slot = self._slot(model)
        if slot.state == "failed" and not slot.entry.problem:
            slot.retry_at = 0.0  # an operator asking again is the retry
        if slot.state != "loaded":
            slot.inflight += 1
            try:
                await asyncio.shield(self._start_load(slot))
            finally:
                self._release(slot)
        return slot.state

    async def unload(self, model: str, force: bool = False) -> State:
        """`POST /v1/models/{id}/unload`: a model still serving requests is a 409 unless `force`."""
        slot = self._slot(model)
        if slot.loading is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(slot.loading)
        if slot.inflight and not force:
            raise ConflictError(f"model '{model}' has {slot.inflight} request(s) in flight; unload it with "
                                "?force=true to end them", param="model", code="model_busy")
        for stop in list(slot.holders.values()):
            stop("model_unloaded")  # each running request ends, with what it has so far
        async with self._lock:
            await self._unload(slot, why="forced unload" if slot.inflight else "unload requested")
        slot.unloaded = (time.monotonic(), "unloaded", None)
        return slot.state

    # -- vLLM's sleep mode ---------------------------------------------------------------------------
    async def sleep(self, model: str | None = None, force: bool = False) -> list[str]:
        """`POST /sleep`: unload every loaded model (or `model`) and remember them, so that
        `/wake_up` loads the same ones. Why an unload: on a CPU the weights already live in host
        memory, so vLLM's level 1 (weights to host memory, KV dropped) and level 2 (both dropped)
        both come down to freeing the engine; its file's pages stay in the OS cache, which is what
        makes the wake-up quick. Busy models are checked first, so a 409 puts none to sleep."""
        slots = [self._slot(model)] if model is not None else list(self._slots.values())
        awake = [s for s in slots if s.state in ("loaded", "loading")]
        busy = [f"'{s.entry.id}' ({s.inflight})" for s in awake if s.inflight]
        if busy and not force:
            raise ConflictError(f"model(s) with requests in flight: {', '.join(busy)}; put them to sleep with "
                                "?force=true to end those requests", param="model", code="model_busy")
        for slot in awake:
            await self.unload(slot.entry.id, force=True)
            self._asleep.add(slot.entry.id)
        return [s.entry.id for s in awake]

    async def wake_up(self) -> list[str]:
        """`POST /wake_up`: load what `/sleep` unloaded (one after another, as the budget allows)."""
        woken = sorted(self._asleep)
        for model in woken:
            await self.load(model)
        return woken

    def sleeping(self) -> list[str]:
        """The models put to sleep and not loaded since (by `/wake_up` or by a request)."""
        return sorted(m for m in self._asleep if self._slots[m].state != "loaded")

    # -- idle unload --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the idle reaper (on the running loop)."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap(), name="catalog-reaper")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            now = time.monotonic()
            for slot in list(self._slots.values()):
                keep = slot.keep_alive_s if slot.keep_alive_s is not None else self.config.keep_alive_s
                if (slot.state == "loaded" and slot.inflight == 0 and not slot.entry.pinned and keep >= 0
                        and now - slot.last_used >= keep and not self._lock.locked()):
                    async with self._lock:
                        if slot.state == "loaded" and slot.inflight == 0:
                            await self._unload(slot, why=f"idle for {keep:g}s (keep_alive)")
                            slot.unloaded = (time.monotonic(), "idle", None)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(BaseException):
                await self._reaper
        for slot in self._slots.values():
            if slot.loading is not None:
                with contextlib.suppress(BaseException):
                    await slot.loading
            await self._unload(slot, why="shutdown")

    def stats(self) -> dict[str, dict[str, Any]]:
        """Loads and their measured seconds per model (benchmarks, /v1/models)."""
        return {s.entry.id: {"loads": s.loads, "load_seconds": round(s.load_seconds, 4), "state": s.state,
                             "memory_bytes": s.footprint} for s in self._slots.values()}


def _reason(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return text if len(text) <= 500 else text[:500] + "..."
