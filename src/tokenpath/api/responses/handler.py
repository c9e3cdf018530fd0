"""`/v1/responses`: create (through the chat pipeline, `generation.handle` with an `Edge`),
retrieve, delete and list the input items of a stored response.

A stored response is found only under its own tenant: another tenant's id is the same 404 as
an unknown one, never a 403 that would confirm it exists.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tokenpath.api import generation
from tokenpath.api.errors import OpenApiResponses
from tokenpath.api.intake import Authenticated, Submitted
from tokenpath.api.responses.schemas import ResponsesRequest
from tokenpath.api.responses.stream import ResponsesGeneration
from tokenpath.api.responses.translate import (
    Origins,
    chat_messages,
    chat_request,
    input_items,
    rename,
    stored_item,
)
from tokenpath.api.responses.turn import Turn, conversation_bytes
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import ChatCompletionRequest
from tokenpath.api.state import AppState, get_state
from tokenpath.api.tools import ToolPlan
from tokenpath.errors import InvalidRequestError, NotFoundError
from tokenpath.gateway.responses_store import ResponseStore, response_store
from tokenpath.protocol.limits import RESPONSE_ID

router = APIRouter()
_ERRORS: OpenApiResponses = {400: {"description": "Invalid request (OpenAI error body)"},
                             404: {"description": "Unknown model or response"}}


def _store(request: Request, state: AppState) -> ResponseStore:
    """This app's response store (the gateway's SQL store when it has one), made on first use."""
    store = getattr(request.app.state, "responses_store", None)
    if store is None:
        store = response_store(state.guard, state.config.responses_retention_s)
        request.app.state.responses_store = store
    return store


def _not_found(rid: str, param: str | None = None) -> NotFoundError:
    return NotFoundError(f"Response with id '{rid[:RESPONSE_ID.value]}' not found.", param=param, code="response_not_found")


async def _load(store: ResponseStore, rid: str, tenant: str, param: str | None = None) -> dict:
    if not rid or len(rid) > RESPONSE_ID.value:
        raise _not_found(rid, param)
    record = await asyncio.to_thread(store.get, rid, tenant, time.time())
    if record is None:
        raise _not_found(rid, param)
    return record


class _Create:
    """One create call's edge over the pipeline: the chat request it means, and its Generation."""

    def __init__(self, state: AppState, request: Request, req: ResponsesRequest) -> None:
        self.state, self.request, self.req = state, request, req
        self.turn: Turn | None = None
        self.origins = Origins()

    async def prepare(self, run: RequestRun, who: Authenticated) -> ChatCompletionRequest:
        req, config = self.req, self.state.config
        req.reject_unsupported()
        items = [stored_item(it) for it in input_items(req.input)]
        store = _store(self.request, self.state)
        prior: list[dict] = []
        names = [f"input.{i}" for i in range(len(items))] if isinstance(req.input, list) else ["input"]
        if req.previous_response_id is not None:
            record = await _load(store, req.previous_response_id, who.principal.tenant, "previous_response_id")
            prior = record["input"] + record["response"]["output"]
        conversation = prior + items
        keep = config.responses_store and req.store is not False
        if keep:
            size = conversation_bytes(conversation)
            if size > config.responses_max_bytes:
                raise InvalidRequestError(
                    f"this conversation is {size} bytes, over this server's cap of {config.responses_max_bytes} bytes "
                    "per stored response (responses_max_bytes); start a new chain, or send \"store\": false",
                    param="previous_response_id" if prior else "input", code="conversation_too_large")
        # The response's id is the request's own (`resp_<hex>`, OpenAI's form): the id a client holds
        # finds its audit row, trace and log line (they were two ids, resp_ and resp-).
        self.turn = Turn(req, conversation, store if keep else None, who.principal.tenant, id=run.id)
        names = ["previous_response_id"] * len(prior) + names
        return chat_request(req, chat_messages(conversation, req.instructions, names, self.origins))

    def rename(self, exc: Exception) -> Exception:
        return rename(exc, self.origins)

    def make(self, run: RequestRun, submitted: Submitted, body: generation.Body, chat: bool,
             plan: ToolPlan | None) -> ResponsesGeneration:
        if self.turn is None:  # (`prepare` sets it, and the pipeline calls `make` only after it)
            raise TypeError("make: no turn, prepare was not called")
        return ResponsesGeneration(run, submitted, body, chat, plan, turn=self.turn)


@router.post("/v1/responses", responses=_ERRORS)
async def create_response(body: ResponsesRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    call = _Create(state, request, body)
    edge = generation.Edge("/v1/responses", "resp_", prepare=call.prepare, make=call.make, rename=call.rename)
    return await generation.handle(state, request, None, edge)


@router.get("/v1/responses/{response_id}", responses=_ERRORS)
async def get_response(response_id: str, request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    principal = await state.guard.authenticate(request.headers)
    record = await _load(_store(request, state), response_id, principal.tenant)
    return JSONResponse(record["response"])


@router.get("/v1/responses/{response_id}/input_items", responses=_ERRORS)
async def get_input_items(response_id: str, request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    principal = await state.guard.authenticate(request.headers)
    record = await _load(_store(request, state), response_id, principal.tenant)
    items = record["input"]
    if request.query_params.get("order", "desc") != "asc":
        items = items[::-1]
    return JSONResponse({"object": "list", "data": items, "first_id": items[0].get("id") if items else None,
                         "last_id": items[-1].get("id") if items else None, "has_more": False})


@router.delete("/v1/responses/{response_id}", responses=_ERRORS)
async def delete_response(response_id: str, request: Request, state: AppState = Depends(get_state)) -> JSONResponse:
    principal = await state.guard.authenticate(request.headers)
    if not response_id or len(response_id) > RESPONSE_ID.value:
        raise _not_found(response_id)
    deleted = await asyncio.to_thread(_store(request, state).delete, response_id, principal.tenant)
    if not deleted:
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
