"""The engine link's messages have one codec (`protocol.wire`): every message round-trips through
it, a malformed frame is a `FrameError` (the link closes), a frame type this version does not
know is ignored, and no module outside the codec builds a frame as a dict of its own."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgpack
import pytest

from tokenpath.config import EngineConfig
from tokenpath.errors import (
    DeadlineExceededError,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
    ServiceUnavailableError,
)
from tokenpath.protocol import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequest,
    EngineEvents,
    EngineState,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    Submission,
)
from tokenpath.protocol.link import (
    Abort,
    Denied,
    Hello,
    LinkError,
    LinkInfo,
    Ping,
    Pong,
    Reset,
    ResetDone,
    StallBound,
    Welcome,
)
from tokenpath.protocol.wire import (
    FIELD_MESSAGES,
    FrameError,
    OutputFrames,
    decode,
    decode_output,
    decode_request,
    encode,
    encode_request,
    frame,
    pack,
)
from tokenpath.telemetry.timeline import Timeline

SRC = Path(__file__).resolve().parents[2] / "src" / "tokenpath"

MESSAGES = [
    Hello("s3cret"), Welcome(12.5, LinkInfo("m", 4096, 16, 100, 8, 42, "embedding", 384)), Denied("no"),
    Welcome(1.0, LinkInfo("m", engine=EngineConfig(model="m", max_num_seqs=3, max_lora_rank=8, chat_template="t.jinja",
                                                   kv_cache_dtype="float16"))),
    Ping(3), Pong(3, 1.25), Reset(4), ResetDone(4, 17), Abort("r1"), StallBound(2.5),
    LinkError("r1", 400, "bad", "invalid_request_error", "top_p", "c", "SamplingParamsError"),
    EngineState(2, 3, 0.5, 100, 16, 10, 4, 1, 99, 7, True, 12, {"time": [[1, 2], 0.5]}),
]


def over_the_wire(msg: object) -> object:
    """Encoded, packed, unpacked as the reader does, decoded."""
    body = frame(msg)[4:]
    return decode(msgpack.unpackb(body, raw=False, strict_map_key=False))


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert over_the_wire(msg) == msg


def test_the_step_threads_liveness_fields_cross_the_link():
    """Not compared by `==` (they move with the clock), so checked one by one."""
    back = over_the_wire(EngineState(running=1, step_age_s=3.25, step_allowance_s=0.5))
    assert (back.step_age_s, back.step_allowance_s) == (3.25, 0.5)
    idle = over_the_wire(EngineState(step_age_s=0.0, step_allowance_s=None))  # before a first step ended
    assert (idle.step_age_s, idle.step_allowance_s) == (0.0, None)
    assert over_the_wire(EngineState()).step_age_s is None  # an engine that does not report its step loop


def test_every_field_message_is_covered_here():
    assert {type(m) for m in MESSAGES} == set(FIELD_MESSAGES.values())


def test_requests_and_embedding_outputs_round_trip():
    req = GenerateRequest("g1", [1, 2, 3], SamplingParams(max_tokens=5), tenant="t", deadline=None, operation="chat")
    back = over_the_wire(req)
    assert (back.request_id, back.prompt_token_ids, back.params, back.tenant, back.operation) == \
        ("g1", [1, 2, 3], req.params, "t", "chat")
    emb = over_the_wire(EmbeddingRequest("e1", [[1, 2], [3]], tenant="t"))
    assert (emb.request_id, emb.inputs, emb.tenant) == ("e1", [[1, 2], [3]], "t")
    out = EmbeddingOutput("e1", [[0.5, -1.0]], 3, EngineEvents(1.0, 2.0, 3.0, 4.0))
    assert over_the_wire(out) == out


def test_the_deadline_crosses_as_seconds_left_into_the_engines_clock():
    """Two processes' monotonic clocks share no origin: the engine rebuilds the deadline as its
    own now plus what was left when the gateway sent it."""
    req = GenerateRequest("g3", [1, 2], SamplingParams(), deadline=100.5)
    sent = encode_request(req, now=100.0)
    assert decode_request(sent, now=7000.0).deadline == 7000.5
    assert decode_request(encode_request(GenerateRequest("g4", [1], SamplingParams()), now=1.0)).deadline is None
    # The engine's deadline error comes back as the same error, code and status (a 504).
    back = over_the_wire(LinkError.of("g3", DeadlineExceededError("late", code="deadline_exceeded"))).exception("r")
    assert isinstance(back, DeadlineExceededError) and (back.code, back.status_code) == ("deadline_exceeded", 504)


def test_gateway_only_fields_stay_off_the_link():
    """The engine never reads the Timeline, the prompt text or the session id: they are the
    gateway's `Submission`'s, not the request's, so the `add` frame cannot carry them (and a
    submission itself is no message of the link). The client puts the prompt back on outputs."""
    sub = Submission(GenerateRequest("g2", [1, 2], SamplingParams()), Timeline("g2"), session_id="alice",
                     prompt="a prompt")
    assert not {"timeline", "prompt", "session_id"} & {f.name for f in dataclasses.fields(GenerateRequest)}
    sent = encode(sub.request)["req"]
    assert not {"timeline", "prompt", "session", "session_id"} & set(sent), sorted(sent)
    assert "alice" not in repr(sent) and "a prompt" not in repr(sent)
    with pytest.raises(TypeError):
        encode(sub)
    out = RequestOutput("g2", [CompletionOutput(0, "x", [7])], [1, 2], 0, True, events=EngineEvents(1.0))
    back = decode_output(encode(out), sub.request, prompt=sub.prompt)
    assert back.prompt == "a prompt" and decode_output(encode(out), sub.request).prompt is None


def test_an_older_or_newer_peer_is_understood():
    """Keys a peer adds are ignored; fields it leaves out keep their defaults; new frame types are skipped."""
    d = encode(EngineState(running=1))
    d["adapter_slots"] = 4  # a field of a newer version
    del d["step_stats"]
    assert decode(d) == EngineState(running=1)
    assert decode({"t": "something_new", "x": 1}) is None


@pytest.mark.parametrize("d", [{"t": "pong", "id": 1}, {"t": "welcome", "now": 1.0, "info": "x"},
                               {"t": "welcome", "now": 1.0, "info": {"engine": {"max_num_seqs": "many"}}},
                               {"t": "ping"}, {"t": "add", "req": {}}])
def test_a_malformed_frame_is_a_frame_error(d):
    with pytest.raises(FrameError):
        decode(d)


def test_a_link_error_becomes_the_same_error_type_on_the_gateway():
    err = LinkError.of("r", RequestFailedError("the step raised"))
    assert isinstance(over_the_wire(err).exception("rep"), RequestFailedError)
    assert isinstance(LinkError.of("r", EngineDeadError("gone")).exception("rep"), EngineDeadError)
    unknown = LinkError.of("r", RuntimeError("boom"))
    assert (unknown.status, unknown.cls) == (503, None)
    assert isinstance(unknown.exception("rep"), ServiceUnavailableError)
    assert "rep" in str(unknown.exception("rep"))
    assert isinstance(LinkError.malformed("r", KeyError("ids")).exception("rep"), InvalidRequestError)


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(TypeError):
        encode({"t": "ping", "id": 1})


def test_no_frame_is_built_as_a_dict_outside_the_codec():
    """A `{"t": ...}` literal anywhere in src but protocol/wire.py is a second codec."""
    offenders = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py") if p.name != "wire.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\{\s*\"t\"\s*:", line)]
    assert not offenders, offenders


def test_an_outputs_engine_events_go_out_only_when_they_change():
    """Every decode step's frame carried the request's whole events (at c=32 its `behind` list of
    up to 32 holders and its stalls), which doubled the gateway's CPU per token on the link. Now
    an unchanged `ev` is None and the receiver keeps the events it decoded last."""
    req = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4))
    events = EngineEvents(queued=1.0, scheduled=2.0, first_token=3.0)
    events.behind = [["r0", "t", 5, "running"]] * 32
    frames = OutputFrames()

    def step(token: int, finished: bool = False) -> dict:
        out = RequestOutput("r1", [CompletionOutput(0, "x", [token])], [1, 2, 3], 0, finished, events=events)
        return msgpack.unpackb(pack(frames.encode(out))[4:], raw=False)

    first, second = step(7), step(8)
    assert first["ev"] is not None and second["ev"] is None
    kept = decode_output(first, req)
    assert decode_output(second, req, kept.events).events is kept.events
    with pytest.raises(FrameError):
        decode_output(second, req)  # no events, and none before it
    events.stalls.append([4.0, 0.02, [["r9", 64]]])  # appended in place by the engine: sent again
    third = step(9)
    assert decode_output(third, req).events.stalls == [[4.0, 0.02, [["r9", 64]]]]
    events.preempted.append([4.5, "r8", 16, None])
    assert decode_output(step(10), req).events.preempted == [[4.5, "r8", 16, None]]
    events.preempted[-1][3] = 4.8  # its record closed in place when it has recomputed what it lost
    assert decode_output(step(11), req).events.preempted == [[4.5, "r8", 16, 4.8]]
    events.finished = 5.0
    last = step(10, finished=True)
    assert decode_output(last, req).events.finished == 5.0
    assert len(pack(frames.encode(RequestOutput("r1", [], [1], 0, True, events=events)))) < len(pack(encode(
        RequestOutput("r1", [], [1], 0, True, events=events)))) / 4  # (the 32 holders are not resent)
