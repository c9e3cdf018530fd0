"""POST /v1/embeddings: guard -> router -> admission -> an embedding replica, like chat.

The body becomes one `EmbeddingRequest` (tokenized and validated in `api.inputs`), in the
gateway's `Submission` with the run's Timeline and session id, which the deployment admits,
queues or refuses (429 + Retry-After under overload, 503 with no healthy replica) and dispatches
to a replica: the in-process encoder, or an engine process over the engine link
(`serve --embedding-replicas N`). Its Timeline gets the same stages as a generation.
"""

from __future__ import annotations

import base64
from array import array

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenpath.api import intake
from tokenpath.api.inputs import EmbeddingInputs, embedding_estimate, embedding_ids, embedding_inputs
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import EmbeddingRequest
from tokenpath.api.sse import race_stop, watch_disconnect
from tokenpath.api.state import AppState


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    # OpenAI's base64: little-endian float32 bytes (array uses native order; this is little-endian).
    packed = array("f", vector)
    if array("h", [1]).tobytes()[0] == 0:
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()


async def embed(request: Request, run: RequestRun, routed: intake.Routed, raw: EmbeddingInputs,
                user: str | None) -> list[list[float]]:
    """The vectors of `raw` (checked inputs) on the routed deployment: the intake's `priced`
    (admission's precheck, the rate limits on an estimate, before anything is tokenized) and
    `tokenized` stages, then the replica; `finished` stamped. What /v1/embeddings, /v1/score and
    /v1/rerank share. `user`: OpenAI's field, the session affinity when no x-session-id is sent."""
    priced = await intake.price(run, routed, embedding_estimate(raw))
    dep = routed.deployment
    ids, texts = await embedding_ids(dep, raw)
    run.prompt_tokens = sum(len(s) for s in ids)  # (recorded before the policy hook: a refusal counts them)
    tokenized = await intake.tokenize(run, priced, ids, texts, run.prompt_tokens, run.prompt_tokens)
    async with watch_disconnect(request, run.stop):
        out = await race_stop(dep.embed(intake.embedding_request(run, tokenized, intake.session_id(run, None, user))), run.stop)
    await intake.recorded(run)  # (the audit row's open write ran beside the engine's work)
    run.done()
    return out.vectors


async def handle_embeddings(state: AppState, request: Request, body: EmbeddingRequest) -> Response:
    """Cheapest refusals first, as for chat: key, caps, admission, rate limits, then the tokenizer."""
    run = RequestRun(state, request, "/v1/embeddings", "embd")
    try:
        who = await intake.authenticate(run)
        routed = await intake.route(run, who, body.model, "embedding", keep_alive=body.keep_alive)
        dep = routed.deployment
        body.reject_unsupported(dep.dimensions)
        raw = embedding_inputs(body, state.config.caps.max_embedding_inputs)
        vectors = await embed(request, run, routed, raw, body.user)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                for i, v in enumerate(vectors)]
        usage = {"prompt_tokens": run.prompt_tokens, "total_tokens": run.prompt_tokens}
        return JSONResponse({"object": "list", "data": data, "model": dep.name, "usage": usage},
                            headers=run.headers(timing=True))
    except Exception as exc:
        return run.respond_to(exc)
    finally:
        await run.finish()
