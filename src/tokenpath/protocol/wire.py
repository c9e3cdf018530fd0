"""The engine link's wire format and its one codec: length-prefixed msgpack frames.

msgpack is compact, fast and safe to decode (no pickle: a frame can only ever become dicts,
lists, strings and numbers). Each frame is a 4-byte big-endian length and one msgpack map with a
`t` (type) key. `encode` turns any message of the link into that map and `decode` turns a map
back into its message (`protocol.link` lists them); no other module flattens a protocol type.

Two kinds have layouts of their own, because they are most of the link's traffic (a frame per
request per engine step): `out` (`RequestOutput`: its parts as positional rows in their
dataclasses' field order, `protocol.rows`) and the requests. The rest
(`protocol.link`'s messages and `EngineState`) are encoded field by field under their own
names, so adding a field to one of those classes is the whole change: the peer of an older
version ignores a key it does not know, and a key it does not send keeps the field's default.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import sys
import time
import typing
from array import array
from dataclasses import asdict
from typing import Any

import msgpack

from tokenpath.knobs import Settings, is_settings
from tokenpath.protocol.embeddings import EmbeddingOutput, EmbeddingRequest
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
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.outputs import (
    CompletionOutput,
    EngineEvents,
    EngineState,
    GrammarStats,
    RequestOutput,
    TokenLogprob,
)
from tokenpath.protocol.requests import GenerateRequest
from tokenpath.protocol.rows import from_row, to_row
from tokenpath.protocol.sampling_params import SamplingParams

MAX_FRAME = 64 * 1024 * 1024  # a prompt of a million token ids is ~5 MB; anything bigger is garbage
_LEN = struct.Struct(">I")


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def pack(msg: dict) -> bytes:
    """One frame of an encoded message (`pack(encode(msg))`)."""
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def frame(msg: object) -> bytes:
    """One frame of any message of the link."""
    return pack(encode(msg))


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> dict:
    """The next frame; raises `asyncio.IncompleteReadError` at EOF, `FrameError` on garbage or on a
    frame over `limit` bytes (refused from its length prefix, before its body is read)."""
    (n,) = _LEN.unpack(await reader.readexactly(4))
    if n > limit:
        raise FrameError(f"frame of {n} bytes is over the {limit} byte limit")
    return _unpack(await reader.readexactly(n))


def _unpack(body: bytes | memoryview) -> dict:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise FrameError(f"undecodable frame: {exc}") from None
    if not isinstance(msg, dict) or "t" not in msg:
        raise FrameError("a frame must be a map with a 't' key")
    return msg


class FrameReader:
    """Every whole frame that has arrived, per read: an engine step's deltas for 32 requests come
    in one write, and are taken in one `read` and one pass here instead of 64 `readexactly` awaits."""

    def __init__(self, reader: asyncio.StreamReader, chunk: int = 1 << 18) -> None:
        self.reader = reader
        self.chunk = chunk
        self._buf = bytearray()

    async def read_frames(self) -> list[dict]:
        """At least one frame; raises `asyncio.IncompleteReadError` at EOF, `FrameError` on garbage."""
        while True:
            data = await self.reader.read(self.chunk)
            if not data:
                raise asyncio.IncompleteReadError(bytes(self._buf), None)
            self._buf += data
            frames, pos, buf = [], 0, self._buf
            with memoryview(buf) as view:
                while len(buf) - pos >= 4:
                    (n,) = _LEN.unpack_from(buf, pos)
                    if n > MAX_FRAME:
                        raise FrameError(f"frame of {n} bytes is over the {MAX_FRAME} byte limit")
                    if len(buf) - pos - 4 < n:
                        break
                    frames.append(_unpack(view[pos + 4:pos + 4 + n]))
                    pos += 4 + n
            del buf[:pos]
            if frames:
                return frames


# -- GenerateRequest ----------------------------------------------------------------------------
def encode_request(req: GenerateRequest, now: float | None = None) -> dict:
    """The deadline travels as seconds remaining, so the engine needs no shared clock. Every other
    field travels as it is: the gateway's own state (Timeline, prompt text, session id) is not in
    a `GenerateRequest` but in the `protocol.submission.Submission` the link client keeps."""
    now = time.monotonic() if now is None else now
    return {"id": req.request_id, "ids": req.prompt_token_ids, "params": asdict(req.params),
            "prio": req.priority, "tenant": req.tenant,
            "deadline_in": None if req.deadline is None else req.deadline - now,
            "trace": req.traceparent, "op": req.operation, "lora": None if req.lora is None else req.lora.wire(),
            "preempts": req.preempts}


def decode_request(d: dict, now: float | None = None) -> GenerateRequest:
    """Rebuilt in the receiver's clock: `arrival` is now, `deadline` now + what was left.
    The params are re-validated by `SamplingParams` itself (the engine trusts only its own types)."""
    now = time.monotonic() if now is None else now
    left = d.get("deadline_in")
    return GenerateRequest(request_id=str(d["id"]), prompt_token_ids=list(d["ids"]),
                           params=SamplingParams(**d["params"]), priority=int(d.get("prio", 0)),
                           tenant=str(d.get("tenant") or "anonymous"),
                           deadline=None if left is None else now + float(left), traceparent=d.get("trace"),
                           operation=d.get("op"), arrival=now, lora=LoraRef.from_wire(d.get("lora")),
                           preempts=None if d.get("preempts") is None else str(d["preempts"]))


# -- RequestOutput ------------------------------------------------------------------------------
def encode_output(out: RequestOutput) -> dict:
    """Without the prompt ids and text: the receiver has them (it sent the request). Choices,
    logprobs, events and grammar stats travel as rows, in their dataclasses' field order
    (`protocol.rows`); the events are copied, as the engine appends to them in place and closes a
    preemption record in place (`EngineCore._note_recovered`), and `OutputFrames` compares what it
    sent last with what there is now."""
    return {"t": "out", "id": out.request_id, "cached": out.num_cached_tokens, "fin": out.finished,
            "pre": out.num_preemptions, "ev": to_row(out.events), "outs": [to_row(c) for c in out.outputs],
            "gr": None if out.grammar is None else to_row(out.grammar),
            "plp": None if out.prompt_logprobs is None else
            [None if x is None else to_row(x) for x in out.prompt_logprobs]}


class OutputFrames:
    """One request's output frames, with its engine events only when they changed.

    Most decode steps change none of a request's events, but they were sent with every token:
    at c=32 the `behind` list (who a request queued behind, up to the whole batch) and the
    `stalls` went out and were decoded 32 times a step, which doubled the gateway's CPU per
    token on the link (benchmarks/README.md, engine_link). An unchanged `ev` is sent as None,
    and the receiver keeps the events it decoded last (`decode_output`'s `events`)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: list | None = None

    def encode(self, out: RequestOutput) -> dict:
        d = encode_output(out)
        if d["ev"] == self._last:
            d["ev"] = None
        else:
            self._last = d["ev"]
        return d


def decode_output(d: dict, request: GenerateRequest, events: EngineEvents | None = None,
                  prompt: str | None = None) -> RequestOutput:
    """Event times stay in the sender's clock; the link client shifts them. `events`: the ones
    to use when the frame carries none (unchanged since the request's last frame, `OutputFrames`).
    `prompt`: the text to echo on the output, which only the receiver has (an engine sees ids).
    A malformed frame is a FrameError naming the request."""
    try:
        outs = [from_row(CompletionOutput, c) for c in d["outs"]]
        if d["ev"] is not None:
            events = from_row(EngineEvents, d["ev"])
        elif events is None:
            raise FrameError(f"output frame for {request.request_id!r} without events, and none before it")
        return RequestOutput(request_id=request.request_id, outputs=outs, prompt_token_ids=request.prompt_token_ids,
                             num_cached_tokens=int(d.get("cached", 0)), finished=bool(d["fin"]),
                             events=events, num_preemptions=int(d.get("pre", 0)), prompt=prompt,
                             grammar=None if d.get("gr") is None else from_row(GrammarStats, d["gr"]),
                             prompt_logprobs=None if d.get("plp") is None else
                             [None if x is None else from_row(TokenLogprob, x) for x in d["plp"]])
    except (TypeError, ValueError, KeyError) as exc:
        raise FrameError(f"malformed output frame for {request.request_id!r}: {exc}") from None


# -- EmbeddingRequest / EmbeddingOutput ----------------------------------------------------------
# Vectors travel as little-endian float32 bytes: the encoder computes in float32, so the gateway
# gets exactly the numbers an in-process replica would return, at a quarter of msgpack's float64 size.
def encode_embedding_request(req: EmbeddingRequest, now: float | None = None) -> dict:
    now = time.monotonic() if now is None else now
    return {"id": req.request_id, "inputs": req.inputs, "prio": req.priority, "tenant": req.tenant,
            "deadline_in": None if req.deadline is None else req.deadline - now, "trace": req.traceparent}


def decode_embedding_request(d: dict, now: float | None = None) -> EmbeddingRequest:
    now = time.monotonic() if now is None else now
    left = d.get("deadline_in")
    return EmbeddingRequest(request_id=str(d["id"]), inputs=[list(x) for x in d["inputs"]],
                            priority=int(d.get("prio", 0)), tenant=str(d.get("tenant") or "anonymous"),
                            deadline=None if left is None else now + float(left), traceparent=d.get("trace"),
                            arrival=now)


def _f32(vector: list[float]) -> bytes:
    packed = array("f", vector)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _floats(raw: bytes) -> list[float]:
    packed = array("f")
    packed.frombytes(raw)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def encode_embedding_output(out: EmbeddingOutput) -> dict:
    ev = out.events
    return {"t": "vec", "id": out.request_id, "n": out.num_prompt_tokens,
            "ev": [ev.queued, ev.scheduled, ev.first_token, ev.finished],
            "vecs": [_f32(v) for v in out.vectors]}


def decode_embedding_output(d: dict) -> EmbeddingOutput:
    """Event times stay in the sender's clock; the link client shifts them."""
    queued, scheduled, first, finished = d["ev"]
    return EmbeddingOutput(request_id=str(d["id"]), vectors=[_floats(v) for v in d["vecs"]],
                           num_prompt_tokens=int(d.get("n", 0)),
                           events=EngineEvents(queued, scheduled, first, finished))


# -- every message: encode / decode --------------------------------------------------------------
# The messages encoded field by field, by frame type.
FIELD_MESSAGES: dict[str, type] = {
    "hello": Hello, "welcome": Welcome, "denied": Denied, "ping": Ping, "pong": Pong, "reset": Reset,
    "reset_done": ResetDone, "abort": Abort, "err": LinkError, "state": EngineState, "stall_bound": StallBound,
}
_TAGS = {cls: tag for tag, cls in FIELD_MESSAGES.items()}
_NESTED = {LinkInfo}  # message classes that appear as a field of another


def encode(msg: object) -> dict:
    """The frame map of one message of the link."""
    if type(msg) is RequestOutput:
        return encode_output(msg)
    tag = _TAGS.get(type(msg))
    if tag is not None:
        d = _fields_of(msg)
        d["t"] = tag
        return d
    if isinstance(msg, GenerateRequest):
        return {"t": "add", "req": encode_request(msg)}
    if isinstance(msg, EmbeddingRequest):
        return {"t": "embed", "req": encode_embedding_request(msg)}
    if isinstance(msg, EmbeddingOutput):
        return encode_embedding_output(msg)
    raise TypeError(f"{type(msg).__name__} is not a message of the engine link")


def decode(d: dict) -> Any:
    """The message a frame map holds; `FrameError` for a malformed one, None for a frame type
    this version does not know (ignored, so a newer peer may add one). An `out` frame is decoded
    by `decode_output`, against the request it answers."""
    kind = d["t"]
    cls = FIELD_MESSAGES.get(kind)
    try:
        if cls is not None:
            return _build(cls, d)
        if kind == "add":
            return decode_request(d["req"])
        if kind == "embed":
            return decode_embedding_request(d["req"])
        if kind == "vec":
            return decode_embedding_output(d)
    except FrameError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise FrameError(f"malformed {kind!r} frame: {exc}") from None
    return None


def _fields_of(msg: object) -> dict:
    return {name: _field(v) for name in _NAMES[type(msg)] for v in (getattr(msg, name),)}


def _field(v: object) -> object:
    if type(v) in _NESTED:
        return _fields_of(v)
    if isinstance(v, Settings):  # a settings dataclass (LinkInfo.engine): its JSON-safe fields
        return v.as_dict()
    return v


def _build(cls: type, d: dict) -> Any:
    if not isinstance(d, dict):
        raise FrameError(f"{cls.__name__} must be a map")
    nested, models, names = _NESTED_FIELDS[cls], _MODEL_FIELDS[cls], _NAMES[cls]
    out = {}
    for k, v in d.items():
        if k not in names:
            continue
        if k in nested:
            v = _build(nested[k], v)
        elif k in models and v is not None:
            try:
                v = models[k].coerce(v)
            except (TypeError, ValueError) as exc:
                raise FrameError(f"malformed {cls.__name__}.{k}: {exc}") from None
        out[k] = v
    return cls(**out)


def _model_of(hint: object) -> type[Settings] | None:
    """`M` for a field typed `M` or `M | None`, M a settings dataclass (tokenpath.knobs); else None."""
    for t in (hint, *typing.get_args(hint)):
        if is_settings(t):
            return t
    return None


# Each message class's fields, those that hold another message, and those that hold a settings
# dataclass (read once, at import).
_NAMES = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in (*FIELD_MESSAGES.values(), *_NESTED)}
_HINTS = {cls: typing.get_type_hints(cls) for cls in _NAMES}
_NESTED_FIELDS = {cls: {name: t for name, t in hints.items() if t in _NESTED} for cls, hints in _HINTS.items()}
_MODEL_FIELDS = {cls: {name: m for name, t in hints.items() if (m := _model_of(t)) is not None}
                 for cls, hints in _HINTS.items()}
