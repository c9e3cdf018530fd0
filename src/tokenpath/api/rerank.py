"""`/v1/score` (vLLM's) and `/v1/rerank` (vLLM's, Cohere's and Jina's shape) on an embedding model
as a bi-encoder: every text is embedded once, in one request down the /v1/embeddings path (key,
model ACL, rate limits, admission, queue, replica, Timeline, audit: `embeddings.embed`), and a
pair's score is the cosine similarity of its two vectors, in [-1, 1].

A bi-encoder scores what a cross-encoder reranker (bge-reranker, Qwen3-Reranker) scores reading
query and document together; it ranks by topic and meaning, not by whether the document answers
the query, and its scores are not calibrated probabilities. No cross-encoder is packaged here.

- score: `{model, text_1, text_2}`, each a string or a list of strings: one `text_1` against each
  `text_2`, or pairwise when both are lists of one length -> `{id, object: "list", created, model,
  data: [{index, object: "score", score}], usage}`.
- rerank: `{model, query, documents, top_n, return_documents}` (documents: strings, or Cohere's
  `{"text": ...}` objects) -> `{id, model, results: [{index, relevance_score, document: {text}}],
  usage}`, best first, `top_n` of them (all when absent or 0).
A chat model is a 400 saying what these endpoints need.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tokenpath.api import intake
from tokenpath.api.embeddings import embed
from tokenpath.api.errors import OpenApiResponses
from tokenpath.api.intake import Routed
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import _Body
from tokenpath.api.state import AppState, get_state
from tokenpath.errors import InvalidRequestError

router = APIRouter()
_ERRORS: OpenApiResponses = {400: {"description": "Invalid request (OpenAI error body)"},
                             404: {"description": "Unknown model"}}


class ScoreRequest(_Body):
    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    user: str | None = None


class RerankRequest(_Body):
    model: str
    query: str
    documents: list[Any]  # strings or {"text": ...}: each checked by `_documents`, which names it
    top_n: Annotated[int, Field(ge=0)] | None = None
    return_documents: bool = True
    user: str | None = None
    # Accepted without effect (Cohere's): documents are not chunked here.
    max_chunks_per_doc: int | None = None
    rank_fields: list[str] | None = None


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    for i, t in enumerate(texts):
        if not t:
            at = param if isinstance(value, str) else f"{param}.{i}"
            raise InvalidRequestError(f"{at} is an empty string; score non-empty text", param=at)
    return texts


def _documents(documents: list[Any]) -> list[str]:
    if not documents:
        raise InvalidRequestError("documents must not be empty: send at least one document to rank",
                                  param="documents")
    out = []
    for i, d in enumerate(documents):
        text = d.get("text") if isinstance(d, dict) and set(d) == {"text"} else d
        if not isinstance(text, str):
            raise InvalidRequestError(f"documents.{i} must be a string (or {{\"text\": string}}), got "
                                      f"{type(d).__name__}", param=f"documents.{i}")
        if not text:
            raise InvalidRequestError(f"documents.{i} is an empty string; rank non-empty text",
                                      param=f"documents.{i}")
        out.append(text)
    return out


async def _begin(run: RequestRun, model: str) -> Routed:
    """Authenticate, then the embedding deployment; any other model is a 400 saying what this
    endpoint runs on."""
    who = await intake.authenticate(run)
    endpoint = run.endpoint
    try:
        return await intake.route(run, who, model, "embedding")
    except InvalidRequestError as exc:
        if exc.param != "model":
            raise
        raise InvalidRequestError(f"The model '{model[:256]}' cannot serve {endpoint}: scores here are the cosine "
                                  "similarity of an embedding model's vectors; pick an embedding model from "
                                  "/v1/models", param="model", code="model_not_supported") from None


async def _vectors(state: AppState, request: Request, run: RequestRun, routed: Routed, texts: list[str],
                   user: str | None) -> dict[str, list[float]]:
    """Each distinct text's vector, embedded in one request (a query scored against many documents,
    or a repeated document, is embedded once)."""
    distinct = list(dict.fromkeys(texts))
    cap = state.config.caps.max_embedding_inputs
    if len(distinct) > cap:
        raise InvalidRequestError(f"this request has {len(distinct)} distinct texts to embed, over the limit of "
                                  f"{cap}; send fewer documents", param="documents" if run.endpoint.endswith(
                                      "rerank") else "text_2")
    vectors = await embed(request, run, routed, list(distinct), user)
    return dict(zip(distinct, vectors, strict=True))


def _usage(run: RequestRun) -> dict:
    return {"prompt_tokens": run.prompt_tokens, "total_tokens": run.prompt_tokens, "completion_tokens": 0}


@router.post("/v1/score", responses=_ERRORS)
@router.post("/score", responses=_ERRORS, include_in_schema=False)
async def score(body: ScoreRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    run = RequestRun(state, request, "/v1/score", "score")
    try:
        routed = await _begin(run, body.model)
        left, right = _texts(body.text_1, "text_1"), _texts(body.text_2, "text_2")
        if len(left) == 1:
            left = left * len(right)
        elif len(left) != len(right):
            raise InvalidRequestError(f"text_1 has {len(left)} texts and text_2 {len(right)}: send one text_1, or "
                                      "as many as text_2 (scored pairwise)", param="text_2")
        vec = await _vectors(state, request, run, routed, left + right, body.user)
        data = [{"index": i, "object": "score", "score": cosine(vec[a], vec[b])}
                for i, (a, b) in enumerate(zip(left, right, strict=True))]
        return JSONResponse({"id": run.id, "object": "list", "created": int(time.time()),
                             "model": routed.deployment.name, "data": data, "usage": _usage(run)}, headers=run.headers(timing=True))
    except Exception as exc:
        return run.respond_to(exc)
    finally:
        await run.finish()


@router.post("/v1/rerank", responses=_ERRORS)
@router.post("/rerank", responses=_ERRORS, include_in_schema=False)
@router.post("/v2/rerank", responses=_ERRORS, include_in_schema=False)
async def rerank(body: RerankRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    run = RequestRun(state, request, "/v1/rerank", "rerank")
    try:
        routed = await _begin(run, body.model)
        if not body.query:
            raise InvalidRequestError("query is an empty string; rank against non-empty text", param="query")
        documents = _documents(body.documents)
        vec = await _vectors(state, request, run, routed, [body.query, *documents], body.user)
        scores = [cosine(vec[body.query], vec[d]) for d in documents]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": documents[i]}} if body.return_documents else {})} for i in order]
        return JSONResponse({"id": run.id, "model": routed.deployment.name, "results": results,
                             "usage": _usage(run)}, headers=run.headers(timing=True))
    except Exception as exc:
        return run.respond_to(exc)
    finally:
        await run.finish()
