"""POST /v1/embeddings: guard -> router -> the batched BERT embedding engine."""

from __future__ import annotations

import asyncio
import base64
from array import array

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import EmbeddingRequest
from tokenpath.api.sse import race_stop, watch_disconnect
from tokenpath.api.state import AppState
from tokenpath.errors import InvalidRequestError


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    # OpenAI's base64: little-endian float32 bytes (array uses native order; this is little-endian).
    packed = array("f", vector)
    if array("h", [1]).tobytes()[0] == 0:
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()


def _inputs(body: EmbeddingRequest, max_inputs: int) -> list:
    """The inputs as a list of strings / token-id lists, checked for count and emptiness."""
    raw = body.input
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise InvalidRequestError("input must not be empty; send a string, a list of strings or token ids",
                                  param="input")
    if all(isinstance(t, int) for t in raw):
        raw = [raw]
    if len(raw) > max_inputs:
        raise InvalidRequestError(f"input has {len(raw)} items, over the limit of {max_inputs}; send them in "
                                  "several requests", param="input")
    for i, t in enumerate(raw):
        if isinstance(t, str) and not t:
            raise InvalidRequestError(f"input.{i} is an empty string; embed non-empty text",
                                      param=f"input.{i}")
    return raw


def _estimate(raw: list) -> int:
    """Tokens for the rate limits before tokenizing: bytes / 4 for text, token ids exactly."""
    return sum(len(t.encode()) // 4 + 1 if isinstance(t, str) else len(t) for t in raw)


async def _tokenize(engine, raw: list) -> tuple[list[list[int]], list[str]]:  # noqa: ANN001
    texts = [t for t in raw if isinstance(t, str)]
    encoded = iter(await asyncio.to_thread(engine.tokenizer.encode_batch, texts) if texts else [])
    ids = [next(encoded) if isinstance(t, str) else list(t) for t in raw]
    for i, seq in enumerate(ids):
        engine.check_ids(seq, i)
    return ids, texts


async def handle_embeddings(state: AppState, request: Request, body: EmbeddingRequest) -> Response:
    run = RequestRun(state, request, "/v1/embeddings", "embd")
    try:
        await run.authenticate()
        dep = run.route(body.model, "embedding")
        engine = dep.embedder
        body.reject_unsupported(engine.dimensions)
        raw = _inputs(body, state.config.caps.max_embedding_inputs)
        await run.reserve(_estimate(raw))  # the limits are charged before anything is tokenized
        ids, texts = await _tokenize(engine, raw)
        run.prompt_tokens = sum(len(s) for s in ids)
        await run.admit(texts, run.prompt_tokens)
        run.timeline.stamp("scheduled")  # (no admission queue for embeddings yet: the encoder time is prefill)
        async with watch_disconnect(request, run.stop):
            vectors = await race_stop(engine.embed(ids), run.stop)
        run.timeline.stamp("finished")
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        usage = {"prompt_tokens": run.prompt_tokens, "total_tokens": run.prompt_tokens}
        return JSONResponse({"object": "list", "data": data, "model": dep.name, "usage": usage},
                            headers=run.headers(timing=True))
    except Exception as exc:
        return run.respond_to(exc)
    finally:
        await run.finish()
