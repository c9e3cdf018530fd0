"""The engine link's embedding messages: `embed` (gateway -> engine) and `vec` (engine -> gateway).

A separate message kind from `add`/`out`, so an embedding engine and a chat engine share the
link's framing, handshake, clock sync, state push and abort without sharing a codec. Vectors
travel as little-endian float32 bytes: the encoder computes in float32, so the gateway gets
exactly the numbers an in-process replica would return, at a quarter of msgpack's float64 size.
"""

from __future__ import annotations

import sys
import time
from array import array

from tokenpath.protocol.embeddings import EmbeddingOutput, EmbeddingRequest
from tokenpath.protocol.outputs import EngineEvents


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
