"""A thinking budget: after N tokens of reasoning, the think block is closed for the model.

Anthropic's `thinking.budget_tokens`, llama.cpp's `--reasoning-budget` (`serve --reasoning-budget`
here, the default of requests that name none). Qwen's own recipe, done inside the server so the
client sees one reply: the generation runs with `max_tokens` = the budget; if it stops there
still inside its think block, the closing tag (`</think>` and the blank line the templates put
after it) is appended to the reply, and the generation goes on from prompt + reply + tag as a
continuation, with the tokens left. The continuation's prompt is the first one's plus what it
wrote, so the prefix cache serves nearly all of it: the cost is one short prefill.

A reply that closes its block by itself within the budget, or stops (EOS, a stop string), is
passed through untouched; only a reply cut by the budget while reasoning is continued. Both
halves go through the deployment's same `generate` (admission, routing, the one Timeline); the
continuation's outputs are reported against the first prompt (its token count, its cache hits),
so usage reads as one request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from tokenpath.api.reasoning import CLOSE, ReasoningParser
from tokenpath.protocol.outputs import CompletionOutput, RequestOutput
from tokenpath.protocol.requests import GenerateRequest
from tokenpath.protocol.submission import Submission
from tokenpath.routing.models import Deployment

CLOSING = CLOSE + "\n\n"  # what Qwen3's and DeepSeek-R1's templates write after a think block
BUDGET_HEADER = "x-tokenpath-reasoning-budget"  # the server's budget, where it could not be held to


def _encode(tokenizer: Any, text: str) -> list[int]:
    """`text`'s token ids without the BOS a tokenizer may add to a whole prompt."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text))


def unapplied(budget: int | None, submission: Submission[GenerateRequest],
              parser: ReasoningParser | None) -> str | None:
    """Why a budget that would matter cannot be held to, or None (it can, or there is none to hold:
    no budget, no reasoning model, or a budget not below `max_tokens`). Only a single-choice reply
    unconstrained by a grammar can be cut and continued: a grammar decides every token, the think
    block's included, and `n` > 1 choices share one generation that cannot be continued per choice."""
    params = submission.request.params
    if budget is None or parser is None or (params.max_tokens is not None and budget >= params.max_tokens):
        return None
    if params.structured is not None:
        return "grammar"
    return "n" if params.n != 1 else None


def applies(budget: int | None, submission: Submission[GenerateRequest], parser: ReasoningParser | None) -> bool:
    """Whether a budget is held to (see `unapplied`)."""
    params = submission.request.params
    return (budget is not None and parser is not None and unapplied(budget, submission, parser) is None
            and (params.max_tokens is None or budget < params.max_tokens))


def unapplied_header(budget: int | None, submission: Submission[GenerateRequest],
                     parser: ReasoningParser | None) -> dict[str, str]:
    """The server's `--reasoning-budget` on a request it cannot hold to is said in a header,
    `x-tokenpath-reasoning-budget: unapplied; reason=grammar|n` (the request did not ask for it:
    not refused). A request's own budget is refused before this (Messages: `thinking` with a
    forced tool, as Anthropic refuses it)."""
    reason = unapplied(budget, submission, parser)
    return {} if reason is None else {BUDGET_HEADER: f"unapplied; reason={reason}"}


async def budgeted(dep: Deployment, submission: Submission[GenerateRequest], budget: int,
                   parser: ReasoningParser) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of `submission` with its reasoning held to `budget` tokens (see the module)."""
    request = submission.request
    params = request.params
    # (Ids of their own, as a batched prompt's: the gateway, not the first half's end, stamps `finished`.)
    first = dataclasses.replace(request, request_id=f"{request.request_id}-think",
                                params=dataclasses.replace(params, max_tokens=budget))
    text: list[str] = []
    ids: list[int] = []
    last: RequestOutput | None = None
    source = dep.generate(Submission(first, submission.timeline, prompt=submission.prompt,
                                     session_id=submission.session_id))
    try:
        async for out in source:
            c = out.outputs[0] if out.outputs else None
            if c is not None:
                text.append(c.text)
                ids.extend(c.token_ids)
            if out.finished and c is not None and c.finish_reason == "length" and len(ids) >= budget \
                    and not parser.split("".join(text), False).done:
                last = out  # cut by the budget inside its block: held back, continued below
                break
            yield out
    finally:
        await source.aclose()
    if last is None:
        return
    closing = _encode(dep.tokenizer, CLOSING)
    left = None if params.max_tokens is None else params.max_tokens - len(ids) - len(closing)
    cut = last.outputs[0]
    yield dataclasses.replace(last, finished=False, outputs=[dataclasses.replace(cut, finish_reason=None,
                                                                                 stop_reason=None)])
    if left is not None and left < 1:  # no room left for an answer: the reply ends with the tag
        yield dataclasses.replace(last, outputs=[CompletionOutput(0, CLOSING, closing, finish_reason="length")])
        return
    yield dataclasses.replace(last, finished=False, outputs=[CompletionOutput(0, CLOSING, closing)])
    rest = dataclasses.replace(request, request_id=f"{request.request_id}-answer",
                               prompt_token_ids=[*request.prompt_token_ids, *ids, *closing],
                               params=dataclasses.replace(params, max_tokens=left, prompt_logprobs=None))
    source = dep.generate(Submission(rest, submission.timeline, prompt=submission.prompt,
                                     session_id=submission.session_id))
    try:
        async for out in source:  # (reported against the first prompt: usage reads as one request)
            yield dataclasses.replace(out, prompt_token_ids=request.prompt_token_ids,
                                      num_cached_tokens=last.num_cached_tokens, prompt_logprobs=None)
    finally:
        await source.aclose()
