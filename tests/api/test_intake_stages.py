"""The intake's typed stages (api/intake.py), driven without a server: a real router over a
simulated replica, the open guard (recording what it is asked) and a real RequestRun. Each stage
takes the previous stage's value and returns an immutable one; the documented order is the order
the signatures force; the record keeps each stage once, and the ending reads it. Fast tier."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

import pytest
from starlette.requests import Request
from tests.simulated_replica import SimulatedReplica

from tokenpath.api import intake
from tokenpath.api.formatting import Accumulator
from tokenpath.api.run import RequestRun
from tokenpath.api.settings import ApiSettings
from tokenpath.api.state import AppState
from tokenpath.errors import InvalidRequestError
from tokenpath.gateway.base import AuditRecord, OpenGuard, Principal, Reservation
from tokenpath.protocol import SamplingParams
from tokenpath.routing.models import Deployment, ModelRouter
from tokenpath.telemetry.metrics import ServerMetrics

STAGES = [intake.authenticate, intake.route, intake.price, intake.tokenize, intake.submit]


class RecordingGuard(OpenGuard):
    """The open guard, keeping the order of what it was asked and the audit rows it was given."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.rows: list[AuditRecord] = []

    async def authenticate(self, headers: typing.Mapping[str, str]) -> Principal:
        self.calls.append("authenticate")
        return Principal(tenant="acme", priority=3, max_priority=1)

    def check_model(self, principal: Principal, model: str) -> None:
        self.calls.append("check_model")

    async def reserve(self, principal: Principal, model: str, tokens: int) -> Reservation:
        self.calls.append(f"reserve {tokens}")
        return Reservation(principal=principal, model=model, tokens=tokens, headers={"x-ratelimit-limit-tokens": "9"})

    async def check_policy(self, principal: Principal, texts: list[str]) -> None:
        self.calls.append("check_policy")

    async def adjust(self, reservation: Reservation, tokens: int) -> None:
        self.calls.append(f"adjust {tokens}")
        reservation.tokens = tokens

    async def audit_open(self, record: AuditRecord, progress: typing.Callable[[], int]) -> None:
        self.calls.append("audit_open")
        self.rows.append(record)

    async def reconcile(self, reservation: Reservation, used_tokens: int) -> None:
        self.calls.append(f"reconcile {used_tokens}")

    async def audit(self, record: AuditRecord) -> None:
        self.calls.append("audit")
        self.rows.append(record)


def _state(guard: RecordingGuard) -> AppState:
    router = ModelRouter([Deployment("chat-model", "chat", [SimulatedReplica("chat-model-0")], max_model_len=64)])
    return AppState(router=router, guard=guard, config=ApiSettings(),
                    metrics=ServerMetrics(lambda: router.deployments.values()))


def _request(headers: dict[str, str] | None = None) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": raw,
                    "query_string": b"", "scheme": "http", "server": ("testserver", 80), "client": ("127.0.0.1", 1)})


def _run(guard: RecordingGuard, headers: dict[str, str] | None = None) -> RequestRun:
    return RequestRun(_state(guard), _request(headers), "/v1/chat/completions", "chatcmpl")


async def test_the_stages_chain_into_frozen_values_and_the_ending_reads_them():
    guard = RecordingGuard()
    run = _run(guard, {"x-priority": "2"})
    who = await intake.authenticate(run)
    routed = await intake.route(run, who, "chat-model", "chat", timeout=30)
    priced = await intake.price(run, routed, 40, deadline=run.timeline.stamps["received"] + 30)
    params = SamplingParams(max_tokens=5, n=2)
    tokenized = await intake.tokenize(run, priced, [[1, 2, 3]], ["hi there"], 13, 3, params)
    submitted = intake.submit(run, tokenized, params, Accumulator(n=2), "s-1")

    for value in (who, routed, priced, tokenized, submitted):
        field = dataclasses.fields(value)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
    # Each stage holds the one before it, and the record holds each (the same objects).
    assert submitted.routed is routed and tokenized.priced is priced and priced.routed is routed
    assert (run.authenticated, run.routed, run.priced, run.tokenized, run.submitted) == (
        who, routed, priced, tokenized, submitted)
    assert priced.priority == 2  # asked for 2: worse than the key's best (1), so granted
    # The audit row's open write runs beside the dispatch: started by `tokenize`, awaited (`recorded`)
    # before a reply's first byte.
    assert guard.calls == ["authenticate", "check_model", "reserve 40", "check_policy", "adjust 13"]
    await intake.recorded(run)
    assert guard.calls[-1] == "audit_open"
    stamps = [s for s in run.timeline.stamps if s in ("authenticated", "routed", "tokenized")]
    assert stamps == ["authenticated", "routed", "tokenized"]
    attrs = run.timeline.attrs
    assert (attrs["tenant"], attrs["priority"], attrs["deployment"]) == ("acme", 2, "chat-model")
    (sub,) = submitted.requests
    assert (sub.request.request_id, sub.request.tenant, sub.request.priority) == (run.id, "acme", 2)
    assert sub.request.prompt_token_ids == [1, 2, 3] and sub.prompt == "hi there" and sub.session_id == "s-1"
    assert sub.request.deadline == priced.deadline and sub.timeline is run.timeline
    assert run.state.inflight[run.id] is run.stop
    assert run.headers()["x-ratelimit-limit-tokens"] == "9"  # the reservation's headers, through the record

    await run.finish()
    assert guard.calls[-2:] == ["reconcile 0", "audit"]  # (nothing came back from the engine)
    opened, closed = guard.rows
    assert opened.prompt_tokens == 3 and opened.model == "chat-model" and opened.tenant == "acme"
    assert closed.prompt_text == "hi there" and closed.status == 200


async def test_an_embedding_runs_four_stages_and_asks_the_engine_by_its_tokenized_value():
    guard = RecordingGuard()
    run = _run(guard)
    routed = await intake.route(run, await intake.authenticate(run), "chat-model", "chat")
    priced = await intake.price(run, routed, 4)
    tokenized = await intake.tokenize(run, priced, [[5, 6], [7]], ["a", "b"], 3, 3)
    sub = intake.embedding_request(run, tokenized)
    assert sub.request.inputs == [[5, 6], [7]] and sub.request.priority == 3 and sub.request.tenant == "acme"
    assert run.submitted is None and tokenized.params is None
    await run.finish()


async def test_a_refused_stage_is_not_reached_and_a_stage_is_reached_once():
    guard = RecordingGuard()
    run = _run(guard, {"x-priority": "high"})
    routed = await intake.route(run, await intake.authenticate(run), "chat-model", "chat")
    with pytest.raises(InvalidRequestError) as info:
        await intake.price(run, routed, 4)
    assert info.value.param == "x-priority"
    assert run.priced is None and "reserve 4" not in guard.calls and "x-ratelimit-limit-tokens" not in run.headers()
    with pytest.raises(RuntimeError, match="routed stage was reached twice"):
        run.reached(routed)
    await run.finish()
    assert guard.rows[-1].model == "chat-model" and not any(c.startswith("reconcile") for c in guard.calls)


async def test_a_refused_model_name_is_recorded_but_not_routed():
    guard = RecordingGuard()
    run = _run(guard)
    with pytest.raises(InvalidRequestError):
        await intake.route(run, await intake.authenticate(run), "bad\x00name", "chat")
    assert run.model == "bad\x00name" and run.routed is None
    await run.finish()


def test_each_stage_takes_the_previous_stages_value_in_the_documented_order():
    """The order is the signatures': stage k's value parameter is stage k-1's type (what mypy
    holds every caller to), and stage k returns stage k's type; the module's docstring lists them
    in this order."""
    for k, stage in enumerate(STAGES):
        hints = typing.get_type_hints(stage, {**vars(intake), "RequestRun": RequestRun})
        assert hints["return"] is intake.ORDER[k], stage.__name__
        params = list(inspect.signature(stage).parameters)
        assert params[0] == "run"
        if k:
            assert hints[params[1]] is intake.ORDER[k - 1], stage.__name__
    documented = re.findall(r"^\d\. `(\w+)` -> `(\w+)`", intake.__doc__ or "", re.M)
    assert documented == [(s.__name__, t.__name__) for s, t in zip(STAGES, intake.ORDER, strict=True)]
    assert all(dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen for t in intake.ORDER)


def test_session_affinity_prefers_the_header_then_the_cache_key_then_the_user():
    run = _run(RecordingGuard(), {"x-session-id": "hdr"})
    assert intake.session_id(run, "key", "user") == "hdr"
    run = _run(RecordingGuard())
    assert intake.session_id(run, "key", "user") == "key"
    assert intake.session_id(run, None, "user") == "user"
    assert intake.session_id(run, None, None) is None
