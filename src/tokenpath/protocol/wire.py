"""The engine link's wire format: length-prefixed msgpack frames of plain maps and lists.

msgpack is compact, fast and safe to decode (no pickle: a frame can only ever become dicts,
lists, strings and numbers). Each frame is a 4-byte big-endian length and one msgpack map with a
`t` (type) key. The codecs below are the only place the protocol types are flattened, so adding a
field to `GenerateRequest` or `RequestOutput` means changing exactly one encoder and decoder.
"""

from __future__ import annotations

import asyncio
import struct
import time
from dataclasses import asdict

import msgpack

from tokenpath.protocol.outputs import (
    CompletionOutput,
    EngineEvents,
    GrammarStats,
    RequestOutput,
    TokenLogprob,
)
from tokenpath.protocol.requests import GenerateRequest
from tokenpath.protocol.sampling_params import SamplingParams

MAX_FRAME = 64 * 1024 * 1024  # a prompt of a million token ids is ~5 MB; anything bigger is garbage
_LEN = struct.Struct(">I")


class FrameError(Exception):
    """The peer sent something that is not a frame of this protocol."""


def pack(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


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
    """The deadline travels as seconds remaining, so the engine needs no shared clock."""
    now = time.monotonic() if now is None else now
    return {"id": req.request_id, "ids": req.prompt_token_ids, "params": asdict(req.params),
            "prio": req.priority, "tenant": req.tenant, "session": req.session_id,
            "deadline_in": None if req.deadline is None else req.deadline - now,
            "trace": req.traceparent, "op": req.operation}


def decode_request(d: dict, now: float | None = None) -> GenerateRequest:
    """Rebuilt in the receiver's clock: `arrival` is now, `deadline` now + what was left.
    The params are re-validated by `SamplingParams` itself (the engine trusts only its own types)."""
    now = time.monotonic() if now is None else now
    left = d.get("deadline_in")
    return GenerateRequest(request_id=str(d["id"]), prompt_token_ids=list(d["ids"]),
                           params=SamplingParams(**d["params"]), priority=int(d.get("prio", 0)),
                           tenant=str(d.get("tenant") or "anonymous"), session_id=d.get("session"),
                           deadline=None if left is None else now + float(left), traceparent=d.get("trace"),
                           operation=d.get("op"), arrival=now)


# -- RequestOutput ------------------------------------------------------------------------------
def _lp(x: TokenLogprob) -> list:
    return [x.token_id, x.token, x.logprob, [list(t) for t in x.top]]


def encode_output(out: RequestOutput) -> dict:
    """Without the prompt ids and text: the receiver has them (it sent the request)."""
    ev = out.events
    return {"t": "out", "id": out.request_id, "cached": out.num_cached_tokens, "fin": out.finished,
            "pre": out.num_preemptions, "ev": [ev.queued, ev.scheduled, ev.first_token, ev.finished,
                                               [list(c) for c in ev.prefill_chunks], ev.behind, ev.freed_by,
                                               ev.stalls, ev.preempted, ev.traced],
            "outs": [[c.index, c.text, c.token_ids, None if c.logprobs is None else [_lp(x) for x in c.logprobs],
                      c.finish_reason, c.stop_reason] for c in out.outputs],
            "gr": None if out.grammar is None else [out.grammar.compile_ms, out.grammar.cache_hit,
                                                     out.grammar.mask_us_per_token],
            # prompt logprobs: per prompt token None or [id, text, logprob, top, rank]
            "plp": None if out.prompt_logprobs is None else
            [None if x is None else [*_lp(x), x.rank] for x in out.prompt_logprobs]}


def decode_output(d: dict, request: GenerateRequest) -> RequestOutput:
    """Event times stay in the sender's clock; the link client shifts them."""
    outs = [CompletionOutput(index=i, text=text, token_ids=list(ids),
                             logprobs=None if lps is None else
                             [TokenLogprob(a, b, c, [tuple(t) for t in top]) for a, b, c, top in lps],
                             finish_reason=reason, stop_reason=stop)
            for i, text, ids, lps, reason, stop in d["outs"]]
    return RequestOutput(request_id=request.request_id, outputs=outs, prompt_token_ids=request.prompt_token_ids,
                         num_cached_tokens=int(d.get("cached", 0)), finished=bool(d["fin"]),
                         events=_events(d["ev"]), num_preemptions=int(d.get("pre", 0)),
                         prompt=request.prompt, grammar=None if d.get("gr") is None else GrammarStats(*d["gr"]),
                         prompt_logprobs=None if d.get("plp") is None else
                         [None if x is None else TokenLogprob(x[0], x[1], x[2], [tuple(t) for t in x[3]], x[4])
                          for x in d["plp"]])


def _events(ev: list) -> EngineEvents:
    """An engine of an older version sends fewer fields: what it leaves out stays empty."""
    queued, scheduled, first_token, finished, *rest = ev
    chunks = [(float(t), int(n)) for t, n in rest[0]] if rest else []
    out = EngineEvents(queued, scheduled, first_token, finished, chunks)
    if len(rest) >= 5:
        behind, freed_by, stalls, preempted = rest[1:5]
        out.behind = [[str(r), str(t), int(n), str(w)] for r, t, n, w in behind]
        out.freed_by = None if freed_by is None else str(freed_by)
        out.stalls = [[float(t), float(s), [[str(r), int(n)] for r, n in o]] for t, s, o in stalls]
        out.preempted = [[float(t), str(w), int(n), None if d is None else float(d)] for t, w, n, d in preempted]
    out.traced = bool(rest[5]) if len(rest) > 5 else False
    return out
