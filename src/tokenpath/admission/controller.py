"""Admission control and dispatch for one deployment: admit now, queue, or reject at once.

The decision uses a capacity estimate built from replica state: dispatch slots (per healthy
replica, how many requests it takes at once), the requests already in flight and queued, and the
recent service time (dispatch to finish, an EWMA). Predicted wait for a new request is
`requests ahead / drain rate`, with drain rate = slots / service time (`capacity.py`). From that:

- no healthy replica: 503 at once (with Retry-After until the next probe);
- room on a replica, nobody of equal or better priority waiting, and the tenant under its share of
  the slots while other tenants want them (`share.py`): dispatch immediately; and if no running
  slot is free there while another tenant holds more than its share, one of that tenant's running
  requests is paused in the engine for it (`preempt.py`);
- queue (or the tenant's share of it) full, or the predicted wait already past the request's
  deadline: 429 at once, `Retry-After` = predicted drain time. Waiting in line for a request that
  cannot make its deadline only burns capacity the others need;
- otherwise queue it. A queued request leaves when a replica has room, when its deadline passes
  (504, removed at once), when its client goes away (removed at once), or with the same 503 as a
  new request when every replica reports itself down (stalled, dead). A tenant at its share
  of the slots is passed over in the queue while another tenant's request can go; the head of the
  queue, under its share, takes an over-share tenant's running slot by preemption rather than wait
  for one of its requests to end.

Rejections are pure bookkeeping (no I/O, no awaits), so they answer in microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenpath.admission import preempt
from tokenpath.admission.capacity import CapacityEstimator
from tokenpath.admission.picker import Pick, ReplicaPicker
from tokenpath.admission.queue import FairQueue, Ticket
from tokenpath.admission.share import SlotShare
from tokenpath.errors import DeadlineExceededError, RateLimitError, ServiceUnavailableError
from tokenpath.protocol import EmbeddingRequest, GenerateRequest, ReplicaState, Submission
from tokenpath.replica.pool import PoolView, ReplicaHandle, ReplicaPool
from tokenpath.telemetry import series as metrics
from tokenpath.telemetry.timeline import Timeline

log = logging.getLogger("tokenpath.admission")
# What a deployment admits: the gateway's submission of a generation, or of an embedding down the
# same queue and picker. Admission reads the request's priority, tenant, deadline and size, stamps
# the submission's Timeline, and hands the submission itself to the picker.
Request = Submission[GenerateRequest | EmbeddingRequest]


@dataclass
class AdmissionConfig:
    max_queue: int = 256  # per deployment, all bands and tenants together
    max_queue_per_tenant: int | None = None  # None: no per-tenant cap beyond max_queue
    # Default deadline (seconds from arrival) by priority band when the request sets none.
    default_deadline_s: dict[int, float] = field(default_factory=lambda: {0: 120.0, 1: 300.0})
    fallback_deadline_s: float = 600.0
    tenant_weights: dict[str, float] = field(default_factory=dict)
    initial_service_s: float = 2.0  # prior for the service-time EWMA before anything has finished
    ewma_alpha: float = 0.2
    pump_interval_s: float = 0.05  # re-check room while requests wait (remote state is polled)
    reject_unreachable_deadline: bool = True
    # While more than one tenant wants slots, each holds at most its weighted max-min share of the
    # running slots (share.py); off: the fair queue only orders what waits. A tenant stays active
    # (its recent demand reserved) for `tenant_active_s` after its demand last stood at its peak,
    # so a client's next request, a moment after its last one ended, finds its slot free.
    tenant_share: bool = True
    tenant_active_s: float = 5.0
    # With the share on: a request under its tenant's share that finds no running slot free takes
    # one from a tenant over its share, whose request is paused in the engine by recompute and
    # resumes later, nothing lost (preempt.py); off: it waits for one of theirs to end.
    tenant_preempt: bool = True


@dataclass
class Admission:
    """A dispatch slot on one replica, held from dispatch until `release`."""

    handle: ReplicaHandle
    pick: Pick
    queued_s: float
    dispatched_at: float = field(default_factory=time.monotonic)
    prefill_tokens: int = 0  # counted in the replica's prefill backlog until the first token
    first_token_seen: bool = False
    request_id: str = ""
    tenant: str = "anonymous"
    max_tokens: int | None = None
    priority: int = 0
    timeline: Timeline | None = None
    preemptible: bool = False  # a generation: its engine can pause it (preempt.py)
    paused_by: str | None = None  # the request it yielded its running slot to, until it resumes
    paused_at: float = 0.0

    @property
    def replica(self) -> str:
        return self.handle.name


class FlowController:
    def __init__(self, deployment: str, pool: ReplicaPool, picker: ReplicaPicker,
                 config: AdmissionConfig | None = None) -> None:
        self.deployment = deployment
        self.pool = pool
        self.picker = picker
        self.config = config or AdmissionConfig()
        self.queue = FairQueue(self.config.tenant_weights)
        self.share = SlotShare(self.queue.weight, self.config.tenant_active_s)
        self.capacity = CapacityEstimator(self.config.initial_service_s, self.config.ewma_alpha)
        self._ticker: asyncio.Task | None = None
        self._depth_seen: set[tuple[int, str]] = set()
        metrics.publish_queue_depth(deployment, {}, self._depth_seen)  # the total's series exists at 0
        # Who holds a slot now, and whose release gave the last one back: what a queued request
        # waited behind (its queued_behind cause). One dict insert and delete per request.
        self._holding: dict[int, Admission] = {}
        self._last_freed: str | None = None

    # -- the decision ------------------------------------------------------------------------
    def queue_deadline(self, priority: int, received: float, deadline: float | None) -> float:
        """The client's own deadline, else its band's default: until when it may wait in the queue.
        (Only a client's deadline also holds after dispatch, see `Deployment._started_by`.)"""
        if deadline is not None:
            return deadline
        return received + self.config.default_deadline_s.get(priority, self.config.fallback_deadline_s)

    def deadline_for(self, submission: Request) -> float:
        request = submission.request
        return self.queue_deadline(request.priority, submission.timeline.stamps["received"], request.deadline)

    def predicted_wait(self, band: int, tenant: str | None = None) -> float:
        """The queue wait of a new request in `band` (of `tenant`: the fair queue's own order)."""
        ahead = self.queue.ahead_of(band, tenant) + 1
        return self.capacity.predicted_wait(ahead, self.pool.slots())

    def _reject(self, reason: str, exc: Exception, record: bool = True) -> Exception:
        if record:
            metrics.REJECTIONS.labels(self.deployment, reason).inc()
        return exc

    def check(self, priority: int, tenant: str, deadline: float, now: float | None = None,
              record: bool = True, first_token_by: float | None = None, view: PoolView | None = None) -> None:
        """Raise the 503/429 a request would get right now; return if it would be admitted.

        It needs no prompt, so the API layer calls it (`record=False`) before tokenizing or
        charging rate limits: a request that will be refused is refused before any work.
        `first_token_by` is the client's own deadline (its `timeout`), which holds until the first
        token: the predicted queue wait plus the replicas' recent dispatch-to-first-token time
        must fit in it, else 429 now rather than 504 after the whole timeout. `view`: the pool's
        states as the caller read them just now (`acquire` reads them once for both)."""
        now = time.monotonic() if now is None else now
        view = self.pool.view() if view is None else view
        if not view.healthy:
            raise self._reject("no_healthy_replica", self._no_replica(now), record)
        if self.queue.ahead_of(priority) == 0 and view.room:
            self._check_first_token(0.0, first_token_by, now, record)
            return
        drain = self.capacity.predicted_wait(len(self.queue) + 1, self.pool.slots())
        if len(self.queue) >= self.config.max_queue:
            raise self._reject("queue_full", RateLimitError(
                f"model '{self.deployment}' is saturated: the queue is full ({len(self.queue)} waiting)",
                retry_after=drain, code="queue_full"), record)
        cap = self.config.max_queue_per_tenant
        if cap is not None and self.queue.tenant_depth(tenant) >= cap:
            raise self._reject("tenant_queue_full", RateLimitError(
                f"too many queued requests for tenant '{tenant}' on model '{self.deployment}'",
                retry_after=drain, code="tenant_queue_full"), record)
        wait = self.predicted_wait(priority, tenant)
        left = deadline - now
        if self.config.reject_unreachable_deadline and wait > left:
            raise self._reject("deadline_unreachable", RateLimitError(
                f"model '{self.deployment}' cannot start this request before its deadline "
                f"(predicted wait {wait:.1f}s, {max(left, 0):.1f}s left)",
                retry_after=wait, code="deadline_unreachable"), record)
        cautious = self.capacity.cautious_wait(self.queue.ahead_of(priority, tenant) + 1, self.pool.slots())
        self._check_first_token(cautious, first_token_by, now, record)

    def _no_replica(self, now: float) -> ServiceUnavailableError:
        retry = max([h.ejected_until - now for h in self.pool.handles.values()] + [1.0])
        return ServiceUnavailableError(f"no healthy replica for model '{self.deployment}'",
                                       code="no_healthy_replica",
                                       headers={"Retry-After": str(max(1, int(retry + 0.999)))})

    def _check_first_token(self, queue_wait: float, first_token_by: float | None, now: float,
                           record: bool) -> None:
        if first_token_by is None or not self.config.reject_unreachable_deadline:
            return
        expected = queue_wait + self.capacity.first_token_estimate()
        left = first_token_by - now
        if expected > left:
            raise self._reject("deadline_unreachable", RateLimitError(
                f"model '{self.deployment}' cannot produce a first token before this request's timeout "
                f"(predicted {expected:.1f}s, {max(left, 0):.1f}s left)",
                retry_after=expected, code="deadline_unreachable"), record)

    async def acquire(self, submission: Request, exclude: frozenset[str] = frozenset()) -> Admission:
        """Admit and wait for a dispatch slot; raises 503/429 at once, 504 at the deadline."""
        now = time.monotonic()
        request, timeline = submission.request, submission.timeline
        deadline = self.deadline_for(submission)
        view = self.pool.view()
        self.check(request.priority, request.tenant, deadline, now, first_token_by=request.deadline, view=view)
        if self.queue.ahead_of(request.priority) == 0:
            room = self._room(exclude, view)
            if room and not self._allowance(now, asking=request.tenant)(request.tenant):
                timeline.attrs["admission_share"] = self._share_of(request.tenant, now)
                room = []
            if room:
                timeline.stamp("admitted", deployment=self.deployment, admission="immediate")
                metrics.ADMISSIONS.labels(self.deployment, "immediate").inc()
                return self._dispatch(submission, room, 0.0, victim=self._victim_for(submission, room, exclude, now))
        ticket = Ticket(request.request_id, request.tenant, request.priority,
                        cost=_cost(request), deadline=deadline, payload=(submission, exclude))
        ticket.future = asyncio.get_running_loop().create_future()
        ahead = self.queue.ahead_of(request.priority)
        self.queue.push(ticket)
        self.share.note(request.tenant, self.queue.tenant_depth(request.tenant), now)
        timeline.stamp("admitted", deployment=self.deployment, admission="queued",
                       predicted_wait_s=round(self.predicted_wait(request.priority), 3),
                       admission_ahead=ahead, admission_behind=self._holders())
        metrics.ADMISSIONS.labels(self.deployment, "queued").inc()
        self._changed(self._last_freed, arrived=ticket)
        return await self._wait(ticket)

    async def _wait(self, ticket: Ticket) -> Admission:
        assert ticket.future is not None and ticket.deadline is not None
        try:
            timeout = max(0.0, ticket.deadline - time.monotonic())
            done, _ = await asyncio.wait({ticket.future}, timeout=timeout)
        except BaseException:  # client gone (task cancelled / generator closed) while queued
            if self.queue.remove(ticket):
                metrics.REJECTIONS.labels(self.deployment, "client_gone").inc()
                self._changed()
            elif ticket.future.done() and not ticket.future.cancelled() and ticket.future.exception() is None:
                self.release(ticket.future.result(), ok=False)  # dispatched in the same instant
            ticket.future.cancel()
            raise
        if not done and self.queue.remove(ticket):
            ticket.future.cancel()
            self._changed()
            raise self._reject("deadline", DeadlineExceededError(
                f"request waited {time.monotonic() - ticket.enqueued_at:.1f}s in the queue for model "
                f"'{self.deployment}' and passed its deadline before a replica had room",
                code="deadline_exceeded"))
        return ticket.future.result()

    def _holders(self, limit: int = 8) -> list[list]:
        """The requests holding slots as one more queues: [id, tenant, max_tokens, replica]."""
        held = sorted(self._holding.values(), key=lambda a: a.dispatched_at)[:limit]
        return [[a.request_id, a.tenant, a.max_tokens, a.handle.name] for a in held]

    # -- dispatch ----------------------------------------------------------------------------
    def _allowance(self, now: float, asking: str | None = None) -> Callable[[str], bool]:
        """Which tenants may take a slot now (all, with the share off or one tenant active)."""
        if not self.config.tenant_share:
            return lambda tenant: True
        return self.share.allowance(self.pool.run_slots, self.queue.tenant_depths(), now, asking)

    def _share_of(self, tenant: str, now: float) -> dict[str, float]:
        """This tenant's held slots and share, for its Timeline when the share held it back."""
        queued = self.queue.tenant_depths()
        queued[tenant] += 1
        return self.share.snapshot(self.pool.run_slots(), queued, now).get(tenant, {})

    def _room(self, exclude: frozenset[str], view: PoolView | None = None) -> list:
        room = self.pool.with_room() if view is None else view.room
        return [s for s in room if s.name not in exclude] or room

    def _victim_for(self, submission: Request, room: list[ReplicaState], exclude: frozenset[str],
                    now: float, queued: bool = False) -> Admission | None:
        """The running request this one should take the slot of (`preempt.py`), or None: the
        share or preemption is off, it is not a generation, a running slot is free in `room`, or
        no other tenant holds a whole slot beyond its share on a replica that can pause one.
        `queued`: its ticket is in the queue (its demand counted there), else it is asking."""
        if not (self.config.tenant_share and self.config.tenant_preempt) or \
                not isinstance(submission.request, GenerateRequest):
            return None
        holders: list[Admission] | None = None  # (built only where every slot is held: not per dispatch)
        for s in room:
            inflight = self.pool.handles[s.name].inflight
            if not s.max_num_seqs or inflight < s.max_num_seqs:
                return None  # it runs at once there (or the replica does not say how many run)
            holders = list(self._holding.values()) if holders is None else holders
            if inflight - preempt.paused_on(holders, s.name) < s.max_num_seqs:
                return None  # a paused request's slot is free there
        holders = list(self._holding.values()) if holders is None else holders
        tenant = submission.request.tenant
        over = self.share.over(self.pool.run_slots, self.queue.tenant_depths(), now,
                               asking=None if queued else tenant, paused=preempt.paused(holders))
        over.pop(tenant, None)
        if not over:
            return None
        replicas = {s.name for s in self.pool.healthy() if s.can_preempt}
        victim = preempt.choose_victim(holders, over, replicas - exclude or replicas)
        return victim if isinstance(victim, Admission) else None

    def _pause(self, victim: Admission, taker: Request) -> None:
        """Record on both Timelines that `victim` yields its running slot to `taker` (the engine
        pauses it when `taker` arrives there with `preempts` set): why the one was slow, and
        what dispatched the other."""
        now = time.monotonic()
        victim.paused_by, victim.paused_at = taker.request_id, now
        tenant = taker.request.tenant
        if victim.timeline is not None:
            pauses = victim.timeline.attrs.get("admission_paused")
            victim.timeline.attrs["admission_paused"] = [*(pauses if isinstance(pauses, list) else []), {
                "by": taker.request_id, "tenant": tenant, "replica": victim.replica}]
        taker.timeline.attrs["admission_preempted"] = {"request_id": victim.request_id, "tenant": victim.tenant,
                                                       "replica": victim.replica}
        metrics.SHARE_PREEMPTIONS.labels(self.deployment).inc()
        log.info("request %s (tenant %s) yields its running slot to %s (tenant %s): over its tenant's share",
                 victim.request_id, victim.tenant, taker.request_id, tenant,
                 extra={"event": "share_preemption", "deployment": self.deployment, "replica": victim.replica})

    def resumed(self, admission: Admission) -> None:
        """Called while `admission` is paused, on each of its outputs: once the engine says it
        runs again, it counts as running (and may be chosen again) for the shares."""
        timeline = admission.timeline
        if timeline is not None and preempt.resumed(admission, timeline.attrs.get("engine_preempted")):
            admission.paused_by = None

    def _dispatch(self, submission: Request, room: list, queued_s: float,
                  freed_by: str | None = None, victim: Admission | None = None) -> Admission:
        request, timeline = submission.request, submission.timeline
        if isinstance(request, GenerateRequest):
            request.preempts = None if victim is None else victim.request_id
        if victim is not None:  # it goes where the slot it takes is, past the room check
            room = [self.pool.handles[victim.replica].state()]
            self._pause(victim, submission)
        pick = self.picker.pick(submission, room)
        handle = self.pool.handles[pick.name]
        handle.inflight += 1
        prefill = max(1, len(request.prompt_token_ids) - pick.matched_blocks * pick.state.block_size)
        handle.pending_prefill += prefill
        metrics.ROUTING_DECISIONS.labels(self.deployment, self.picker.policy, pick.reason).inc()
        metrics.QUEUE_TIME.labels(self.deployment).observe(queued_s)
        timeline.stamp("dequeued", queued_s=round(queued_s, 4))
        timeline.stamp("dispatched", replica=pick.name, policy=self.picker.policy,
                       reason=pick.reason, matched_blocks=pick.matched_blocks)
        if queued_s > 0 and freed_by is not None and victim is None:
            timeline.attrs.setdefault("admission_freed_by", freed_by)
        if pick.elsewhere is not None:  # with the requests that held the replica it passed over
            other = pick.elsewhere.get("replica")
            holders = [a.request_id for a in self._holding.values() if a.handle.name == other][:8]
            timeline.attrs["prefix_elsewhere"] = {**pick.elsewhere, "holders": holders}
        max_tokens = request.params.max_tokens if isinstance(request, GenerateRequest) else None
        admission = Admission(handle, pick, queued_s, prefill_tokens=prefill, request_id=request.request_id,
                              tenant=request.tenant, max_tokens=max_tokens, priority=request.priority,
                              timeline=timeline, preemptible=isinstance(request, GenerateRequest))
        self._holding[id(admission)] = admission
        self.share.take(request.tenant, self.queue.tenant_depth(request.tenant), admission.dispatched_at)
        return admission

    def _pump(self, freed_by: str | None, arrived: Ticket | None = None) -> None:
        """Hand queued tickets to replicas while any has room, in the queue's order, passing over
        a tenant at its share of the slots (the shares hold within one pump: a dispatch moves a
        request from queued to held, the same demand). `freed_by`: the request whose release (the
        last one, when room came back later) gave the slots; none for the ticket that `arrived`
        now and found room at once. With no room, the head (under its share) may still take an
        over-share tenant's running slot (`preempt.py`), rather than wait for one to end."""
        now = time.monotonic()
        allowed = self._allowance(now)
        while len(self.queue):
            head = self.queue.peek_where(allowed)
            if head is None:
                break
            submission, exclude = head.payload
            room = self._room(exclude)
            victim = self._victim_for(submission, room, exclude, now, queued=True)
            if not room and victim is None:
                break
            self.queue.take(head)
            if head.future is None or head.future.done():  # (its client left in the same instant)
                continue
            head.future.set_result(self._dispatch(submission, room, time.monotonic() - head.enqueued_at,
                                                  None if head is arrived else freed_by, victim))

    def _changed(self, freed_by: str | None = None, arrived: Ticket | None = None) -> None:
        self._pump(freed_by, arrived)
        metrics.publish_queue_depth(self.deployment, self.queue.depth(), self._depth_seen)
        if len(self.queue) and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        """While anything waits: re-check room (replica state changes on its own), expire deadlines."""
        while len(self.queue):
            await asyncio.sleep(self.config.pump_interval_s)
            for t in self.queue.expired():
                if t.future is not None and not t.future.done():
                    t.future.set_exception(DeadlineExceededError(
                        f"request passed its deadline in the queue for model '{self.deployment}'",
                        code="deadline_exceeded"))
                    metrics.REJECTIONS.labels(self.deployment, "deadline").inc()
            self._pump(self._last_freed)
            if len(self.queue) and not any(h.raw_state().healthy for h in self.pool.handles.values()):
                self._refuse_queued()
            metrics.publish_queue_depth(self.deployment, self.queue.depth(), self._depth_seen)

    def _refuse_queued(self) -> None:
        """Every replica says it is down (stalled, dead, restarting): what waits in the queue gets
        the 503 a new request gets, now, not a 504 at its deadline (issue 23: a stalled engine
        refuses fast rather than queueing for as long as it hangs). A replica only in the pool's
        ejection backoff is not enough: it is probed again within seconds, and the queue waits."""
        now = time.monotonic()
        while (t := self.queue.pop()) is not None:
            if t.future is not None and not t.future.done():
                t.future.set_exception(self._no_replica(now))
                metrics.REJECTIONS.labels(self.deployment, "no_healthy_replica").inc()

    def started(self, admission: Admission) -> None:
        """The first token came: this request no longer adds to its replica's prefill backlog."""
        self._clear_backlog(admission)
        if not admission.first_token_seen:
            admission.first_token_seen = True
            self.capacity.observe_first_token(time.monotonic() - admission.dispatched_at)

    @staticmethod
    def _clear_backlog(admission: Admission) -> None:
        handle = admission.handle
        handle.pending_prefill = max(0, handle.pending_prefill - admission.prefill_tokens)
        admission.prefill_tokens = 0

    def release(self, admission: Admission, ok: bool, failure: str | None = None) -> None:
        """Give the slot back; learn the service time; eject the replica on failure."""
        self._clear_backlog(admission)
        if self._holding.pop(id(admission), None) is not None:
            self._last_freed = admission.request_id
            self.share.give_back(admission.tenant, self.queue.tenant_depth(admission.tenant), time.monotonic())
        handle = admission.handle
        handle.inflight = max(0, handle.inflight - 1)
        if ok:
            if handle.failures:
                log.info("replica %s recovered", handle.name, extra={"event": "replica_recovered",
                                                                      "deployment": self.deployment,
                                                                      "replica": handle.name})
            handle.succeeded()
            self.capacity.observe(time.monotonic() - admission.dispatched_at)
        elif failure is not None:
            handle.eject(failure)
            log.warning("replica %s ejected: %s", handle.name, failure, extra={
                "event": "replica_ejected", "deployment": self.deployment, "replica": handle.name,
                "reason": failure, "ejected_for_s": round(max(0.0, handle.ejected_until - time.monotonic()), 3)})
            self.picker.forget(handle.name)
            metrics.REPLICA_EJECTIONS.labels(self.deployment, handle.name).inc()
        if len(self.queue):
            self._changed(admission.request_id)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(BaseException):
                await self._ticker

    def snapshot(self) -> dict[str, float | int]:
        """The capacity estimate, for logs, /health and benchmarks."""
        slots = self.pool.slots()
        return {"slots": slots, "inflight": self.pool.inflight(), "queued": len(self.queue),
                "service_s": round(self.capacity.service_s, 4),
                "throughput_rps": round(self.capacity.throughput(), 3),
                "predicted_wait_s": round(self.capacity.predicted_wait(len(self.queue) + 1, slots), 3)}


def _cost(request: GenerateRequest | EmbeddingRequest) -> float:
    """Work estimate for fair queueing: prompt tokens plus the most it may generate."""
    if isinstance(request, EmbeddingRequest):
        return float(request.num_tokens)
    return float(len(request.prompt_token_ids) + (request.params.max_tokens or 256))
