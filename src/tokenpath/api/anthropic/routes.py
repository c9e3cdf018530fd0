"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's shape over the chat pipeline."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from tokenpath.api import generation, intake, openai_fields
from tokenpath.api import tools as tool_calls
from tokenpath.api.anthropic import signature
from tokenpath.api.anthropic.errors import reshape
from tokenpath.api.anthropic.schemas import CountTokensRequest, MessagesRequest
from tokenpath.api.anthropic.stream import message_events
from tokenpath.api.anthropic.translate import message_body, thinking, to_chat
from tokenpath.api.errors import OpenApiResponses
from tokenpath.api.inputs import prompt_ids
from tokenpath.api.reasoning import known_variables
from tokenpath.api.run import RequestRun, refuse_early
from tokenpath.api.state import AppState, get_state
from tokenpath.errors import TokenpathError

router = APIRouter()
IGNORED_HEADER = "x-tokenpath-ignored"  # names request fields accepted but without effect here
_ERRORS: OpenApiResponses = {400: {"description": "Invalid request (Anthropic error body)"},
                             404: {"description": "Unknown model"}, 529: {"description": "Overloaded"}}


def _key(request: Request, state: AppState) -> bytes:
    """This app's thinking-signature key (`signature.signing_key`), read on first use."""
    key = getattr(request.app.state, "thinking_signing_key", None)
    if key is None:
        key = request.app.state.thinking_signing_key = signature.signing_key(state.config)
    return key


@router.post("/v1/messages", responses=_ERRORS)
async def messages(body: MessagesRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    key = functools.partial(_key, request, state)  # (read only where a thinking block is signed or checked)
    try:
        chat = to_chat(body)
        signature.check_history(body.messages, key)
    except TokenpathError as exc:  # a malformed block or tool: refused and recorded like a schema error
        return reshape(await refuse_early(state, request, exc, {"model": body.model}))
    stops = body.stop_sequences
    wants, budget = thinking(body)
    # Thinking off (or not asked for): a hybrid template (Qwen3's enable_thinking) is told so.
    edge = generation.Edge("/v1/messages", "msg_", functools.partial(message_body, stops=stops, key=key),
                           functools.partial(message_events, stops=stops, key=key), thinking="thinking" if wants else None,
                           budget=budget, variables=None if wants else {"enable_thinking": False})
    response = reshape(await generation.handle(state, request, chat, edge))
    ignored = response.headers.get(openai_fields.IGNORED_HEADER)
    if ignored:  # (`thinking` on a model without reasoning: named under this API's header name)
        del response.headers[openai_fields.IGNORED_HEADER]
        response.headers[IGNORED_HEADER] = ignored
    return response


@router.post("/v1/messages/count_tokens", responses=_ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    """The prompt's tokens as `/v1/messages` would count them: the same translation, tool
    rendering and chat template (`inputs.prompt_ids`), so it is the `input_tokens` a request gets.
    Thinking blocks are checked as there: a forged one is the same 400, not a count of a prompt
    that `/v1/messages` would refuse."""
    run = RequestRun(state, request, "/v1/messages/count_tokens", "msg_")
    try:
        who = await intake.authenticate(run)
        chat = to_chat(body)
        signature.check_history(body.messages, functools.partial(_key, request, state))
        chat.reject_unsupported()
        dep = (await intake.route(run, who, body.model, "chat")).deployment
        plan = tool_calls.parse_tools(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                                      getattr(dep.tokenizer, "chat_template", None))
        template = getattr(dep.tokenizer, "chat_template", None)
        off = {} if thinking(body)[0] else known_variables(template, {"enable_thinking": False})
        ids = (await prompt_ids(state, dep, chat, plan, off))[0][0]
        return JSONResponse({"input_tokens": len(ids)}, headers=run.headers())
    except Exception as exc:
        return reshape(run.respond_to(exc))
    finally:
        await run.finish()
