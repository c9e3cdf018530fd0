"""A thinking budget: after N tokens of reasoning, the think block is closed for the model.

Anthropic's `thinking.budget_tokens`, llama.cpp's `--reasoning-budget` (`serve --reasoning-budget`
here, the default of requests that name none). Qwen's own recipe, done inside the server so the
client sees one reply: the generation runs with `max_tokens` = the budget; if a choice stops there
still inside its think block, the closing tag (`</think>` and the blank line the templates put
after it) is appended to that choice, and it goes on from prompt + its reply + tag as a
continuation, with the tokens left. The continuation's prompt is the first one's plus what it
wrote, so the prefix cache serves nearly all of it: the cost is one short prefill.

With `n` > 1 the first half is still one engine request (the n choices share the prompt's
prefill); each choice is then judged on its own, and each one cut while reasoning gets a
continuation of its own (one engine request per such choice, run concurrently, its outputs
renumbered as that choice). A choice that stops (EOS, a stop string) within the budget is passed
through untouched; one that closed its block by itself and was cut by the budget while
answering goes on without a tag, so the budget never shortens an answer.

Every half goes through the deployment's same `generate` (admission, routing, the one Timeline);
the continuations' outputs are reported against the first prompt (its token count, its cache
hits), so usage reads as one request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from tokenpath.api.reasoning import CLOSE, ReasoningParser
from tokenpath.api.streams import merge
from tokenpath.protocol.outputs import CompletionOutput, RequestOutput
from tokenpath.protocol.requests import GenerateRequest
from tokenpath.protocol.submission import Submission
from tokenpath.routing.models import Deployment

CLOSING = CLOSE + "\n\n"  # what Qwen3's and DeepSeek-R1's templates write after a think block
BUDGET_HEADER = "x-tokenpath-reasoning-budget"  # the server's budget, where it could not be held to
# Why a budget is not held to under a grammar, said in the header beside `reason=grammar`.
GRAMMAR_WHY = ("a grammar decides every token, the think block's included; a closing tag it does not allow "
               "would break the output it promises")


def _encode(tokenizer: Any, text: str) -> list[int]:
    """`text`'s token ids without the BOS a tokenizer may add to a whole prompt."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer.encode(text))


def unapplied(budget: int | None, submission: Submission[GenerateRequest],
              parser: ReasoningParser | None) -> str | None:
    """Why a budget that would matter cannot be held to, or None (it can, or there is none to hold:
    no budget, no reasoning model, or a budget not below `max_tokens`). Only a reply unconstrained
    by a grammar can be cut and continued: a grammar decides every token, the think block's
    included, so the tag appended would break it (and a grammar that forbids the tag never lets
    the block close anyway). Any `n` is held to, choice by choice."""
    params = submission.request.params
    if budget is None or parser is None or (params.max_tokens is not None and budget >= params.max_tokens):
        return None
    return "grammar" if params.structured is not None else None


def applies(budget: int | None, submission: Submission[GenerateRequest], parser: ReasoningParser | None) -> bool:
    """Whether a budget is held to (see `unapplied`)."""
    params = submission.request.params
    return (budget is not None and parser is not None and unapplied(budget, submission, parser) is None
            and (params.max_tokens is None or budget < params.max_tokens))


def unapplied_header(budget: int | None, submission: Submission[GenerateRequest],
                     parser: ReasoningParser | None) -> dict[str, str]:
    """The server's `--reasoning-budget` on a request it cannot hold to is said in a header,
    `x-tokenpath-reasoning-budget: unapplied; reason=grammar; why="..."` (the request did not ask
    for it: not refused). A request's own budget is refused before this (Messages: `thinking`
    with a forced tool, as Anthropic refuses it)."""
    reason = unapplied(budget, submission, parser)
    return {} if reason is None else {BUDGET_HEADER: f'unapplied; reason={reason}; why="{GRAMMAR_WHY}"'}


@dataclasses.dataclass
class _Held:
    """One choice of the first half: its text and ids so far, and whether the budget cut it (its
    finish is then held back from the client: it goes on)."""

    text: list[str] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)
    cut: bool = False


async def budgeted(dep: Deployment, submission: Submission[GenerateRequest], budget: int,
                   parser: ReasoningParser) -> AsyncGenerator[RequestOutput, None]:
    """The outputs of `submission` with each choice's reasoning held to `budget` tokens (see the
    module): the first half with `max_tokens` = budget, then a continuation per choice it cut."""
    request = submission.request
    params = request.params
    # (Ids of their own, as a batched prompt's: the gateway, not the first half's end, stamps `finished`.)
    first = dataclasses.replace(request, request_id=f"{request.request_id}-think",
                                params=dataclasses.replace(params, max_tokens=budget))
    held: dict[int, _Held] = {}
    last: RequestOutput | None = None
    source = dep.generate(Submission(first, submission.timeline, prompt=submission.prompt,
                                     session_id=submission.session_id))
    try:
        async for out in source:
            passed, changed = [], False
            for c in out.outputs:
                h = held.setdefault(c.index, _Held())
                h.text.append(c.text)
                h.ids.extend(c.token_ids)
                if c.finish_reason == "length" and len(h.ids) >= budget:
                    h.cut = True  # cut by the budget: goes on below (this delta goes out less its finish)
                    c, changed = dataclasses.replace(c, finish_reason=None, stop_reason=None), True
                passed.append(c)
            if out.finished:
                last = out
            goes_on = out.finished and any(h.cut for h in held.values())  # (finished: the first half's end)
            if changed or goes_on:
                out = dataclasses.replace(out, outputs=passed, finished=out.finished and not goes_on)
            yield out
    finally:
        await source.aclose()
    cut = {i: h for i, h in held.items() if h.cut}
    if last is None or not cut:
        return
    closing = _encode(dep.tokenizer, CLOSING)
    pending: list[tuple[int, GenerateRequest]] = []
    ends: list[CompletionOutput] = []
    for i, h in sorted(cut.items()):
        tag = [] if parser.split("".join(h.text), False).done else closing  # (closed by itself: no tag)
        left = None if params.max_tokens is None else params.max_tokens - len(h.ids) - len(tag)
        if left is not None and left < 1:  # no room left for an answer: the choice ends here
            ends.append(CompletionOutput(i, CLOSING if tag else "", tag, finish_reason="length"))
            continue
        if tag:
            yield dataclasses.replace(last, finished=False, outputs=[CompletionOutput(i, CLOSING, tag)])
        seed = None if params.seed is None else (params.seed + i) % 2**64  # (the engine's seed of choice i)
        suffix = "" if params.n == 1 else str(i)
        pending.append((i, dataclasses.replace(
            request, request_id=f"{request.request_id}-answer{suffix}",
            prompt_token_ids=[*request.prompt_token_ids, *h.ids, *tag],
            params=dataclasses.replace(params, n=1, seed=seed, max_tokens=left, prompt_logprobs=None))))
    if ends:
        yield dataclasses.replace(last, finished=not pending, outputs=ends)
    if not pending:
        return
    async for i, out, done in _continued(dep, submission, pending):
        # (reported against the first prompt: usage reads as one request)
        yield dataclasses.replace(out, finished=done, outputs=[dataclasses.replace(c, index=i) for c in out.outputs],
                                  prompt_token_ids=request.prompt_token_ids, num_cached_tokens=last.num_cached_tokens,
                                  prompt_logprobs=None)


async def _continued(dep: Deployment, submission: Submission[GenerateRequest],
                     pending: list[tuple[int, GenerateRequest]]) -> AsyncGenerator[tuple[int, RequestOutput, bool], None]:
    """(choice, output, every continuation finished) from the continuations, run concurrently;
    closing it closes them all (aborting them in the engine)."""
    stream = merge([dep.generate(Submission(req, submission.timeline, prompt=submission.prompt,
                                            session_id=submission.session_id)) for _, req in pending])
    unfinished = len(pending)
    try:
        async for k, out in stream:
            unfinished -= out.finished
            yield pending[k][0], out, out.finished and unfinished == 0
    finally:
        await stream.aclose()
