"""vLLM's utility endpoints: `POST /tokenize`, `POST /detokenize` and `GET /version`.

`/tokenize` takes vLLM's two forms, a completion prompt or chat messages, and tokenizes them with
the same code a generation request goes through (`inputs.prompt_ids`: the model's chat template,
the same special tokens), so its count is the `prompt_tokens` the request would be charged. Both
need a key with access to the model when auth is on, and go through `RequestRun`, so each call is
authenticated, logged and audited like any other request.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tokenpath.api.inputs import prompt_ids
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Body
from tokenpath.api.state import AppState, get_state
from tokenpath.config import version
from tokenpath.errors import InvalidRequestError

router = APIRouter()


class TokenizeRequest(_Body):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest: `prompt` or `messages`."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=4096)
    add_special_tokens: bool = True  # the completion form: what generation does (the only choice)
    add_generation_prompt: bool = True  # the chat form: what generation does (the only choice)
    return_token_strs: bool = False

    def as_generation_body(self) -> ChatCompletionRequest | CompletionRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give either `prompt` (completion form) or `messages` (chat form)",
                                      param="prompt")
        if not self.add_special_tokens or not self.add_generation_prompt:
            which = "add_special_tokens" if not self.add_special_tokens else "add_generation_prompt"
            raise InvalidRequestError(f"{which}=false is not supported: /tokenize counts what a generation "
                                      "request would be charged, which always has it", param=which)
        if self.messages is not None:
            return ChatCompletionRequest(model=self.model, messages=self.messages)
        return CompletionRequest(model=self.model, prompt=self.prompt)


class DetokenizeRequest(_Body):
    model: str
    tokens: list[int] = Field(max_length=1_000_000)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    run = RequestRun(state, request, "/tokenize", "tok")
    try:
        await run.authenticate()
        dep = await run.route(body.model, "chat" if body.messages is not None else "completion")
        ids = (await prompt_ids(state, dep, body.as_generation_body()))[0][0]
        out: dict = {"count": len(ids), "max_model_len": dep.max_model_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [dep.tokenizer.token_text(t) for t in ids]
        return JSONResponse(out, headers=run.headers())
    except Exception as exc:
        return run.respond_to(exc)
    finally:
        await run.finish()


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    run = RequestRun(state, request, "/detokenize", "tok")
    try:
        await run.authenticate()
        dep = await run.route(body.model, "completion")
        bad = next((t for t in body.tokens if not 0 <= t < dep.tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {dep.tokenizer.vocab_size})",
                                      param="tokens")
        text = await asyncio.to_thread(dep.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text}, headers=run.headers())
    except Exception as exc:
        return run.respond_to(exc)
    finally:
        await run.finish()


@router.get("/version")
async def get_version() -> JSONResponse:
    return JSONResponse({"version": version()})
