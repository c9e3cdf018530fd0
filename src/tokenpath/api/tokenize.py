"""vLLM's utility endpoints: `POST /tokenize`, `POST /detokenize` and `GET /version`.

`/tokenize` takes vLLM's two forms, a completion prompt or chat messages, and tokenizes them with
the same code a generation request goes through (`inputs.prompt_ids`: the model's chat template,
the same special tokens), so its count is the `prompt_tokens` the request would be charged. Both
need a key with access to the model when auth is on, and go through the intake's first two stages
(`api/intake.py`: authenticated, routed) in a `RequestRun`, so each call is authenticated, logged
and audited like any other request.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tokenpath.api import intake
from tokenpath.api.inputs import prompt_ids
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _Body
from tokenpath.api.state import AppState, get_state
from tokenpath.config import version
from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.limits import DETOKENIZE_TOKENS, PARSED_MESSAGES

router = APIRouter()


class TokenizeRequest(_Body):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest: `prompt` or `messages`."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=PARSED_MESSAGES.value)
    # The completion form: True is what generation does; False (vLLM's, which `vllm bench serve`
    # sends to align its prompts) counts the text's own tokens, without BOS and the like.
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # the chat form: what generation does (the only choice)
    return_token_strs: bool = False

    def as_generation_body(self) -> ChatCompletionRequest | CompletionRequest:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give either `prompt` (completion form) or `messages` (chat form)",
                                      param="prompt")
        if not self.add_generation_prompt:
            raise InvalidRequestError("add_generation_prompt=false is not supported: /tokenize counts what a "
                                      "generation request would be charged, which always has it",
                                      param="add_generation_prompt")
        if not self.add_special_tokens and self.messages is not None:
            raise InvalidRequestError("add_special_tokens=false applies to the completion form (`prompt`) only",
                                      param="add_special_tokens")
        if self.messages is not None:
            return ChatCompletionRequest(model=self.model, messages=self.messages)
        return CompletionRequest(model=self.model, prompt=self.prompt)


class DetokenizeRequest(_Body):
    model: str
    tokens: list[int] = Field(max_length=DETOKENIZE_TOKENS.value)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, state: AppState = Depends(get_state)) -> Response:
    run = RequestRun(state, request, "/tokenize", "tok")
    try:
        who = await intake.authenticate(run)
        dep = (await intake.route(run, who, body.model, "chat" if body.messages is not None else "completion")).deployment
        generation = body.as_generation_body()
        if body.add_special_tokens:
            ids = (await prompt_ids(state, dep, generation))[0][0]
        else:  # the text's own tokens (vLLM's add_special_tokens=false)
            text = body.prompt or ""
            ids = await asyncio.to_thread(lambda: list(dep.tokenizer.backend.encode(text, add_special_tokens=False).ids))
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
        who = await intake.authenticate(run)
        dep = (await intake.route(run, who, body.model, "completion")).deployment
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
