"""A replica whose state comes from polling (a remote server, a Ray actor), not from memory.

Routers and admission call `state()` synchronously on every decision, so the poll runs in a
background task and `state()` returns its latest result. The task starts lazily, on the first
`state()` or `start()` inside a running loop, so replicas can be built before the loop exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from tokenpath.protocol import ReplicaState

log = logging.getLogger("tokenpath.replica")


class PollSettings(Protocol):
    """What the poll loop reads of a replica's settings."""

    poll_interval_s: float


class PolledState:
    """Mixin: subclasses set `self._state`, `self._poller = None` and `self.config.poll_interval_s`,
    and implement `poll()`, which stores and returns the replica's fresh state."""

    _state: ReplicaState
    _poller: asyncio.Task | None
    config: PollSettings

    async def poll(self) -> ReplicaState:
        raise NotImplementedError

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            with contextlib.suppress(RuntimeError):  # no running loop yet: start() will do it
                self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        """Poll forever; a change of health is logged (the poll requests themselves are not news),
        so an operator sees a replica die and come back in the gateway's log."""
        was_healthy = self._state.healthy
        while True:
            state = await self.poll()
            if state.healthy != was_healthy:
                name = getattr(self, "name", "?")
                if was_healthy:
                    log.warning("replica %s: unhealthy: %s", name, state.detail or "no detail",
                                extra={"event": "replica_unhealthy", "replica": name})
                else:
                    log.info("replica %s: healthy again", name, extra={"event": "replica_healthy", "replica": name})
                was_healthy = state.healthy
            await asyncio.sleep(self.config.poll_interval_s)

    def state(self) -> ReplicaState:
        self._ensure_poller()
        return self._state

    async def _stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(BaseException):
                await self._poller
