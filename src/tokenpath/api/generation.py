"""Chat and text completions: prompt -> guard -> router -> deployment -> OpenAI response or SSE.

One engine request per prompt (n choices inside it); a batched completions prompt runs its
prompts concurrently and numbers choices `prompt_index * n + choice`, as OpenAI does. Both the
SSE stream and the non-streaming wait stop on a client disconnect, and stopping closes the
deployment iterator, which aborts the request in the engine and frees its KV blocks.

This module is the request side (`handle`: the intake's stages, `api/intake.py`, with a chat's
own steps between them: caps, constraint, prompt, sampling, the reasoning budget); the reply side,
deltas -> body or SSE, is `api/replies.py`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from tokenpath.api import formatting as fmt
from tokenpath.api import intake, openai_fields, reasoning, structured, thinking
from tokenpath.api import tools as tool_calls
from tokenpath.api.inputs import check_caps, prompt_ids, sampling_params
from tokenpath.api.replies import Body, Generation, Items, WholeReply
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import ChatCompletionRequest
from tokenpath.api.sse import SSEResponse, until_stopped
from tokenpath.api.state import AppState
from tokenpath.api.streams import Deltas, merge
from tokenpath.errors import InvalidRequestError
from tokenpath.protocol import SamplingParams
from tokenpath.protocol.outputs import RequestOutput
from tokenpath.protocol.sampling_params import StructuredOutput
from tokenpath.routing.models import Deployment

__all__ = ["Body", "Edge", "Generation", "Items", "handle", "observe_structured"]


@dataclass(frozen=True)
class Edge:
    """Another API's shape over this same pipeline: the endpoint it is recorded under and the
    prefix of its ids, and what it changes, each optional:
    - `body`, `stream` (Anthropic's Messages): reshape the finished chat completion body, and the
      chat stream's items into its events; both get the run's accumulator (finish details);
    - `prepare` (the Responses API): the chat request it means, `(run, authenticated)`: built once
      the key is known (stored turns are per tenant), in place of a body given up front;
    - `make`: the Generation that writes its replies, `(run, submitted, body, chat, plan)`;
    - `rename`: how a pipeline error names its own fields;
    - `thinking` (Anthropic's `thinking`): the request field that asks for reasoning output, named
      in `x-tokenpath-ignored` when the model has no reasoning parser; `budget`: its thinking
      budget in tokens (`api/thinking.py`; else the server's `--reasoning-budget`); `variables`:
      chat template variables set where the template reads them, silently (`enable_thinking`)."""

    endpoint: str
    prefix: str
    body: Callable[[dict, fmt.Accumulator], dict] | None = None
    stream: Callable[[Items, fmt.Accumulator], AsyncIterator[bytes]] | None = None
    prepare: Callable[[RequestRun, intake.Authenticated], Awaitable[ChatCompletionRequest]] | None = None
    make: Callable[[RequestRun, intake.Submitted, Body, bool, tool_calls.ToolPlan | None], Generation] | None = None
    rename: Callable[[Exception], Exception] | None = None
    thinking: str | None = None
    budget: int | None = None
    variables: dict | None = None


async def handle(state: AppState, request: Request, body: Body | None, edge: Edge | None = None) -> Response:
    """The intake's stages in order (`api/intake.py`), cheapest refusals first: the body's size and
    time (middleware) and shape (schema), then the key, the route, the request's own caps and
    constraint, admission's precheck and the rate limits on an estimate, and only then the
    tokenizer; the reservation is made exact once the prompt is tokenized. `edge`: another API's
    shape (the body is then its translation to a chat request, or `edge.prepare` makes it)."""
    chat = (edge is not None and edge.prepare is not None) or isinstance(body, ChatCompletionRequest)
    run = (RequestRun(state, request, edge.endpoint, edge.prefix) if edge is not None else
           RequestRun(state, request, "/v1/chat/completions" if chat else "/v1/completions",
                      "chatcmpl" if chat else "cmpl"))
    handed_off = False
    try:
        who = await intake.authenticate(run)
        if edge is not None and edge.prepare is not None:
            body = await edge.prepare(run, who)
        if body is None:
            raise TypeError("handle: no body, and no edge to prepare one")
        body.reject_unsupported()
        ignored = openai_fields.check_chat(body) if isinstance(body, ChatCompletionRequest) else []
        routed = await intake.route(run, who, body.model, "chat" if chat else "completion", body.timeout,
                                    body.keep_alive)
        variables = _template_variables(state, run, routed.deployment, body, ignored, edge)
        floor = check_caps(state, routed.deployment, body)
        bias = body.token_bias(routed.deployment.tokenizer.vocab_size)
        plan, spec = await _constraint(state, run, routed.deployment, body)
        received = run.timeline.stamps["received"]
        priced = await intake.price(run, routed, floor.tokens, None if body.timeout is None else received + body.timeout)
        floor.check_context(routed.deployment.max_model_len)
        tokenized, params = await _tokenize(state, run, priced, body, plan, variables, bias, spec)
        submitted = _submit(state, run, tokenized, params, body, chat)
        stream = _deltas(run, _sources(state, run, submitted, chat, edge))
        if edge is not None and edge.make is not None:
            gen = edge.make(run, submitted, body, chat, plan)
        else:
            gen = Generation(run, submitted, body, chat, plan, edge)
        if body.stream:
            first = await gen.first(stream)
            handed_off = True
            return SSEResponse(gen.events(first, stream), run.stop, run.finish, headers=run.headers(),
                               timeline=run.timeline, stall_timeout=state.config.stream_stall_timeout,
                               max_unsent=state.config.stream_max_unsent_bytes)
        response = await gen.collect(stream)
        handed_off = isinstance(response, WholeReply)  # (it finishes the run once it is sent)
        return response
    except Exception as exc:
        return run.respond_to(edge.rename(exc) if edge is not None and edge.rename is not None else exc)
    finally:
        if not handed_off:
            await run.finish()


def _deltas(run: RequestRun, sources: list[AsyncGenerator[RequestOutput, None]]) -> Deltas:
    """The request's outputs as (prompt index, delta), until `run.stop`, the first held until the
    audit row is open (`_recorded_first`). One generation (the common case) is numbered by
    `_recorded_first` itself: a `merge` of one source only numbered its outputs, one more
    generator on each token's way, the first's included (issue 37: the gateway's added TTFT)."""
    if len(sources) == 1:
        return _recorded_first(run, until_stopped(sources[0], run.stop), numbered=False)
    return _recorded_first(run, until_stopped(merge(sources), run.stop), numbered=True)


async def _recorded_first(run: RequestRun, stream: AsyncGenerator[Any, None], numbered: bool) -> Deltas:
    """`stream` with its first output held until the audit row's open write completes (it runs
    beside the dispatch: `intake.recorded`), so no reply reaches the client unrecorded, whether
    streamed or whole. A write that failed fails the request before anything is sent, and closing
    this stream closes the generation (aborted in the engine). `numbered`: the stream's items are
    already (index, delta), else each is prompt 0's delta."""
    held = True
    try:
        async for item in stream:
            if held:
                await intake.recorded(run)
                held = False
            yield item if numbered else (0, item)
        if held:  # (no output at all: the reply is still the request's, recorded first)
            await intake.recorded(run)
    finally:
        await stream.aclose()


def _template_variables(state: AppState, run: RequestRun, dep: Deployment, body: Body, ignored: list[str],
                        edge: Edge | None) -> dict:
    """A chat request's template variables (`chat_template_kwargs`, `reasoning_effort`, the edge's
    own), and the fields the model will not read named in `x-tokenpath-ignored`."""
    if not isinstance(body, ChatCompletionRequest):
        return {}
    template = getattr(dep.tokenizer, "chat_template", None)
    variables, unread = reasoning.template_variables(template, body.chat_template_kwargs, body.reasoning_effort)
    if edge is not None and edge.variables:
        variables = {**reasoning.known_variables(template, edge.variables), **variables}
    if edge is not None and edge.thinking and not reasoning.uses_reasoning(state.config.reasoning_parser, template):
        unread.append(edge.thinking)
    run.extra_headers.update(openai_fields.ignored_header(ignored + unread))
    return variables


async def _constraint(state: AppState, run: RequestRun, dep: Deployment,
                      body: Body) -> tuple[tool_calls.ToolPlan | None, StructuredOutput | None]:
    """The tool plan and the output constraint, compiled and checked off the loop before anything
    is charged (a bad schema costs the limits nothing), and counted."""
    checks: list[tuple[str, str]] = []
    plan, spec = _constraint_of(body, getattr(dep.tokenizer, "chat_template", None), checks)
    if spec is not None or checks:
        info = await structured.compile_checked(state.grammar_workers, dep.tokenizer, spec,
                                                "tools" if spec is None else _spec_param(body, spec), checks)
        if spec is not None and info is not None:
            run.timeline.attrs["grammar"] = {"kind": "tools" if spec.tools else info.kind,
                                             "compile_ms": info.compile_ms, "cache_hit": info.cache_hit}
    observe_structured(state, plan, spec)
    return plan, spec


async def _tokenize(state: AppState, run: RequestRun, priced: intake.Priced, body: Body,
                    plan: tool_calls.ToolPlan | None, variables: dict, bias: dict[int, float] | None,
                    spec: StructuredOutput | None) -> tuple[intake.Tokenized, SamplingParams]:
    """The prompts' token ids and the sampling parameters their counts allow, then the intake's
    `tokenized` stage: charged prompt tokens + n x max_tokens for each prompt."""
    dep = priced.routed.deployment
    prompts, texts = await prompt_ids(state, dep, body, plan, variables)
    params = sampling_params(state, dep, body, prompts, bias, spec)
    prompt_tokens = sum(len(p) for p in prompts)
    if params.max_tokens is None:  # (sampling_params always sets it: what the context leaves, capped)
        raise TypeError("sampling_params left max_tokens unset")
    charge = prompt_tokens + params.max_tokens * params.n * len(prompts)
    return await intake.tokenize(run, priced, prompts, texts, charge, prompt_tokens, params), params


def _submit(state: AppState, run: RequestRun, tokenized: intake.Tokenized, params: SamplingParams, body: Body,
            chat: bool) -> intake.Submitted:
    """The reply's accumulator (a reasoning model's think-block parser, echo's prompt texts), then
    the intake's `submitted` stage."""
    dep, prompts = tokenized.priced.routed.deployment, tokenized.prompts
    session = intake.session_id(run, body.prompt_cache_key if isinstance(body, ChatCompletionRequest) else None,
                                body.user)
    acc = fmt.Accumulator(n=params.n, reasoning=_reasoning_parser(state, dep, prompts) if chat else None,
                          keep_token_ids=getattr(body, "return_token_ids", False))
    if getattr(body, "echo", False):  # OpenAI's echo: each prompt's text (and first token) before its reply
        acc.echo = [(text, dep.tokenizer.token_text(ids[0])) for text, ids in zip(tokenized.texts, prompts, strict=True)]
    return intake.submit(run, tokenized, params, acc, session)


def _sources(state: AppState, run: RequestRun, submitted: intake.Submitted, chat: bool,
             edge: Edge | None) -> list[AsyncGenerator[RequestOutput, None]]:
    """The deployment's output streams, one per prompt; a reasoning model's single prompt under a
    thinking budget (the edge's, else `--reasoning-budget`) is one budgeted stream."""
    dep, first = submitted.routed.deployment, submitted.requests[0]
    budget = edge.budget if edge is not None and edge.budget is not None else state.config.reasoning_budget
    parser = submitted.acc.reasoning if chat else None
    if budget is not None and parser is not None and thinking.applies(budget, first, parser):
        return [thinking.budgeted(dep, first, budget, parser)]
    run.extra_headers.update(thinking.unapplied_header(budget, first, parser))
    return [dep.generate(s) for s in submitted.requests]


def _reasoning_parser(state: AppState, dep: Deployment, prompts: tuple[list[int], ...]) -> reasoning.ReasoningParser | None:
    """The think-block parser of a reasoning model's chat replies (`serve --reasoning-parser`, else
    the chat template's), knowing whether the prompt itself opened the block."""
    tok = dep.tokenizer
    if not reasoning.uses_reasoning(state.config.reasoning_parser, getattr(tok, "chat_template", None)):
        return None
    tail = tok.decode(prompts[0][-8:], skip_special_tokens=False)
    return reasoning.ReasoningParser(starts_open=reasoning.prompt_opens_block(tail))


def _constraint_of(body: Body, chat_template: str | None,
                checks: list[tuple[str, str]]) -> tuple[tool_calls.ToolPlan | None, StructuredOutput | None]:
    """The request's tool plan (chat only) and the one grammar its output must follow, if any; the
    JSON schemas to meta-validate (off the loop, in `compile_checked`) go into `checks`."""
    spec = structured.requested(body, checks)
    plan = None
    if isinstance(body, ChatCompletionRequest):
        plan = tool_calls.parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls, chat_template)
        if plan is not None:
            checks.extend(plan.checks)
    if plan is not None and plan.parses and spec is not None:
        raise InvalidRequestError("response_format (or structured_outputs) together with tools is not supported: a "
                                  "reply cannot follow both; set tool_choice to 'none' or drop response_format",
                                  param="response_format")
    tool_spec = tool_calls.constraint(plan) if plan is not None else None
    return plan, spec or tool_spec


def _spec_param(body: Body, spec: StructuredOutput) -> str:
    if spec.tools:
        return "tools"
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        if getattr(body, name, None):
            return name
    return "response_format"


def observe_structured(state: AppState, plan: tool_calls.ToolPlan | None, spec: StructuredOutput | None) -> None:
    """The structured / tool request counter (the metric set may predate it: then nothing)."""
    counter = getattr(state.metrics, "structured_requests", None)
    if counter is None:
        return
    if plan is not None:
        counter.labels(kind="tools").inc()
    elif spec is not None:
        counter.labels(kind=spec.kind).inc()
