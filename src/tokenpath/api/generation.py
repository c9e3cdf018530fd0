"""Chat and text completions: prompt -> guard -> router -> deployment -> OpenAI response or SSE.

One engine request per prompt (n choices inside it); a batched completions prompt runs its
prompts concurrently and numbers choices `prompt_index * n + choice`, as OpenAI does. Both the
SSE stream and the non-streaming wait stop on a client disconnect, and stopping closes the
deployment iterator, which aborts the request in the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenpath.api import formatting as fmt
from tokenpath.api import openai_fields, reasoning, structured, thinking
from tokenpath.api import tools as tool_calls
from tokenpath.api.errors import error_body
from tokenpath.api.inputs import check_caps, generate_request, prompt_ids, sampling_params
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import ChatCompletionRequest, CompletionRequest
from tokenpath.api.sse import (
    DONE,
    STALLED,
    Interrupted,
    SSEResponse,
    sse_event,
    until_stopped,
    watch_disconnect,
)
from tokenpath.api.state import AppState
from tokenpath.errors import InvalidRequestError, TokenpathError
from tokenpath.protocol.outputs import RequestOutput
from tokenpath.protocol.sampling_params import StructuredOutput
from tokenpath.routing.models import Deployment

log = logging.getLogger("tokenpath.api")

# A request's outputs as the handler reads them: (prompt index, delta), closed with `aclose`.
Deltas = AsyncGenerator[tuple[int, RequestOutput], None]

Body = ChatCompletionRequest | CompletionRequest
# What the chat stream is before encoding: OpenAI chunk dicts, error bodies and DONE.
Items = AsyncGenerator[dict | str, None]


@dataclass(frozen=True)
class Edge:
    """Another API's shape over this same pipeline: the endpoint it is recorded under and the
    prefix of its ids, and what it changes, each optional:
    - `body`, `stream` (Anthropic's Messages): reshape the finished chat completion body, and the
      chat stream's items into its events; both get the run's accumulator (finish details);
    - `prepare` (the Responses API): the chat request it means, built once the key is known (stored
      turns are per tenant), in place of a body given up front;
    - `make`: the Generation that writes its replies, `(run, body, chat, parts, plan)`;
    - `rename`: how a pipeline error names its own fields;
    - `thinking` (Anthropic's `thinking`): the request field that asks for reasoning output, named
      in `x-tokenpath-ignored` when the model has no reasoning parser; `budget`: its thinking
      budget in tokens (`api/thinking.py`; else the server's `--reasoning-budget`); `variables`:
      chat template variables set where the template reads them, silently (`enable_thinking`)."""

    endpoint: str
    prefix: str
    body: Callable[[dict, fmt.Accumulator], dict] | None = None
    stream: Callable[[Items, fmt.Accumulator], AsyncIterator[bytes]] | None = None
    prepare: Callable[[RequestRun], Awaitable[ChatCompletionRequest]] | None = None
    make: Callable[[RequestRun, Body, bool, int, tool_calls.ToolPlan | None], Generation] | None = None
    rename: Callable[[Exception], Exception] | None = None
    thinking: str | None = None
    budget: int | None = None
    variables: dict | None = None


async def handle(state: AppState, request: Request, body: Body | None, edge: Edge | None = None) -> Response:
    """Cheapest refusals first: the body's size and time (middleware) and shape (schema), then the
    key, the request's own caps, admission, the rate limits on an estimate, and only then the
    tokenizer; the reservation is made exact once the prompt is tokenized. `edge`: another API's
    shape (the body is then its translation to a chat request, or `edge.prepare` makes it)."""
    chat = (edge is not None and edge.prepare is not None) or isinstance(body, ChatCompletionRequest)
    run = (RequestRun(state, request, edge.endpoint, edge.prefix) if edge is not None else
           RequestRun(state, request, "/v1/chat/completions" if chat else "/v1/completions",
                      "chatcmpl" if chat else "cmpl"))
    handed_off = False
    try:
        await run.authenticate()
        if edge is not None and edge.prepare is not None:
            body = await edge.prepare(run)
        if body is None:
            raise TypeError("handle: no body, and no edge to prepare one")
        body.reject_unsupported()
        ignored = openai_fields.check_chat(body) if isinstance(body, ChatCompletionRequest) else []
        run.user = body.user
        dep = await run.route(body.model, "chat" if chat else "completion", body.timeout, body.keep_alive)
        variables: dict = {}
        if isinstance(body, ChatCompletionRequest):
            run.session_key = body.prompt_cache_key
            template = getattr(dep.tokenizer, "chat_template", None)
            variables, unread = reasoning.template_variables(template, body.chat_template_kwargs,
                                                             body.reasoning_effort)
            if edge is not None and edge.variables:
                variables = {**reasoning.known_variables(template, edge.variables), **variables}
            if edge is not None and edge.thinking and not reasoning.uses_reasoning(state.config.reasoning_parser,
                                                                                    template):
                unread.append(edge.thinking)
            run.extra_headers.update(openai_fields.ignored_header(ignored + unread))
        floor = check_caps(state, dep, body)
        bias = body.token_bias(dep.tokenizer.vocab_size)
        checks: list[tuple[str, str]] = []
        plan, spec = _constraint(body, getattr(dep.tokenizer, "chat_template", None), checks)
        if spec is not None or checks:
            info = await structured.compile_checked(state.grammar_workers, dep.tokenizer, spec,
                                                    "tools" if spec is None else _spec_param(body, spec), checks)
            if spec is not None and info is not None:
                run.timeline.attrs["grammar"] = {"kind": "tools" if spec.tools else info.kind,
                                                 "compile_ms": info.compile_ms, "cache_hit": info.cache_hit}
        observe_structured(state, plan, spec)
        priority = run.priority()
        received = run.timeline.stamps["received"]
        deadline = None if body.timeout is None else received + body.timeout
        assert run.principal is not None
        dep.precheck(priority, run.principal.tenant, received, deadline)
        await run.reserve(floor.tokens)
        floor.check_context(dep.max_model_len)
        prompts, texts = await prompt_ids(state, dep, body, plan, variables)
        params = sampling_params(state, dep, body, prompts, bias, spec)
        run.sampling = params
        prompt_tokens = sum(len(p) for p in prompts)
        if params.max_tokens is None:  # (sampling_params always sets it: what the context leaves, capped)
            raise TypeError("sampling_params left max_tokens unset")
        await run.admit(texts, prompt_tokens + params.max_tokens * params.n * len(prompts), prompt_tokens)
        run.acc = fmt.Accumulator(n=params.n, reasoning=_reasoning_parser(state, dep, prompts) if chat else None,
                                  keep_token_ids=getattr(body, "return_token_ids", False))
        if getattr(body, "echo", False):  # OpenAI's echo: each prompt's text (and first token) before its reply
            run.acc.echo = [(text, dep.tokenizer.token_text(ids[0])) for text, ids in zip(texts, prompts, strict=True)]
        state.inflight[run.id] = run.stop
        submissions = [generate_request(run, i, len(prompts), ids, params, texts, priority, deadline)
                       for i, ids in enumerate(prompts)]
        budget = edge.budget if edge is not None and edge.budget is not None else state.config.reasoning_budget
        parser = run.acc.reasoning
        if chat and parser is not None and thinking.applies(budget, submissions[0], parser):
            assert budget is not None
            sources = [thinking.budgeted(dep, submissions[0], budget, parser)]
        else:
            run.extra_headers.update(thinking.unapplied_header(budget, submissions[0], parser if chat else None))
            sources = [dep.generate(s) for s in submissions]
        stream = until_stopped(_merge(sources), run.stop)
        if edge is not None and edge.make is not None:
            gen = edge.make(run, body, chat, len(prompts), plan)
        else:
            gen = Generation(run, body, chat, len(prompts), plan, edge)
        if body.stream:
            first = await gen.first(stream)
            handed_off = True
            return SSEResponse(gen.events(first, stream), run.stop, run.finish, headers=run.headers(),
                               timeline=run.timeline, stall_timeout=state.config.stream_stall_timeout,
                               max_unsent=state.config.stream_max_unsent_bytes)
        return await gen.collect(stream)
    except Exception as exc:
        return run.respond_to(edge.rename(exc) if edge is not None and edge.rename is not None else exc)
    finally:
        if not handed_off:
            await run.finish()


def _reasoning_parser(state: AppState, dep: Deployment, prompts: list[list[int]]) -> reasoning.ReasoningParser | None:
    """The think-block parser of a reasoning model's chat replies (`serve --reasoning-parser`, else
    the chat template's), knowing whether the prompt itself opened the block."""
    tok = dep.tokenizer
    if not reasoning.uses_reasoning(state.config.reasoning_parser, getattr(tok, "chat_template", None)):
        return None
    tail = tok.decode(prompts[0][-8:], skip_special_tokens=False)
    return reasoning.ReasoningParser(starts_open=reasoning.prompt_opens_block(tail))


def _constraint(body: Body, chat_template: str | None,
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


async def _merge(sources: list[AsyncGenerator[RequestOutput, None]]) -> Deltas:
    """(prompt index, delta) from several concurrent generations; closing it closes them all."""
    if len(sources) == 1:
        try:
            async for out in sources[0]:
                yield 0, out
        finally:
            await sources[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, src: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in src:
                await queue.put((i, out, None))
            await queue.put((i, None, None))
        except Exception as exc:
            await queue.put((i, None, exc))
        finally:
            await src.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Generation:
    """Turns the merged delta stream into a JSON body or SSE chunks."""

    def __init__(self, run: RequestRun, body: Body, chat: bool, parts: int,
                 plan: tool_calls.ToolPlan | None = None, edge: Edge | None = None) -> None:
        self.run = run
        self.edge = edge
        self.plan = plan if plan is not None and plan.parses else None
        self.body = body
        self.chat = chat
        self.parts = parts
        self.want_logprobs = body.logprobs_count is not None
        # (a LoRA adapter answers under its own name, as vLLM's do)
        self.model = run.lora.name if run.lora else run.deployment.name if run.deployment else body.model
        assert run.acc is not None
        self.acc: fmt.Accumulator = run.acc
        self.answered = False  # the first choice is past its think block (or never had one)

    def _add(self, part: int, out: RequestOutput) -> list:
        touched = self.acc.add(part, out)
        if out.grammar is not None and part == 0:  # the engine's side, for the trace and the audit row
            g = self.run.timeline.attrs.setdefault("grammar", {})
            if isinstance(g, dict):
                g.update({"engine_compile_ms": out.grammar.compile_ms, "engine_cache_hit": out.grammar.cache_hit,
                          "mask_us_per_token": out.grammar.mask_us_per_token})
        if part == 0 and any(c.index == 0 and c.token_ids for _, c in touched):
            self.run.token_times.append(time.monotonic())
            if self.acc.reasoning is not None and not self.answered:
                self._stamp_reasoning()
        return touched

    def _stamp_reasoning(self) -> None:
        """The Timeline's `first_reasoning` and `first_answer` (the `reasoning` stage) from the first
        choice's split; once it answered, nothing more is looked at per token."""
        ch = self.acc.choices.get(0)
        if ch is None:
            return
        stamps = self.run.timeline.stamps
        if ch.reasoning_tokens and "first_reasoning" not in stamps:
            self.run.timeline.stamp("first_reasoning")
        if ch.reasoning_done and "first_reasoning" not in stamps:
            self.answered = True  # (a reply that never thought: no reasoning stage, decode from first_token)
        elif ch.reasoning_done and ch.text:
            self.run.timeline.stamp("first_answer")
            self.answered = True

    async def first(self, stream: Deltas) -> tuple[int, RequestOutput] | None:
        """Wait for the first delta before sending headers: submission errors stay real HTTP errors."""
        async with watch_disconnect(self.run.request, self.run.stop):
            try:
                return await anext(stream)
            except StopAsyncIteration:
                return None

    async def drain(self, stream: Deltas) -> None:
        """Take the whole stream into the accumulator (a client that left raises; a shutdown ends
        the unfinished choices as `abort`), then stamp `finished`: what every whole reply needs."""
        run = self.run
        try:
            async with watch_disconnect(run.request, run.stop):
                async for part, out in stream:
                    self._add(part, out)
        except Interrupted as exc:
            if exc.reason == "disconnect":
                raise
            self.acc.abort_unfinished(self.parts)
        run.done()

    async def collect(self, stream: Deltas) -> Response:
        run = self.run
        await self.drain(stream)
        if self.chat:
            body = fmt.chat_body(run.id, run.created, self.model, self.acc, self.want_logprobs, run.timeline, self.plan)
        else:
            body = fmt.completion_body(run.id, run.created, self.model, self.acc, self.want_logprobs, run.timeline,
                                       getattr(self.body, "prompt_logprobs", None) is not None,
                                       token_ids=self.acc.keep_token_ids)
        if self.edge is not None and self.edge.body is not None:
            body = self.edge.body(body, self.acc)
        return JSONResponse(body, headers=run.headers(timing=True))

    # -- streaming ------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict]) -> dict:
        chunk = fmt.chunk(self.run.id, self.run.created, self.model, self.chat, choices,
                          include_usage=self.body.include_usage)
        if self.body.continuous_usage:  # vLLM's continuous_usage_stats: the counts so far, on every chunk
            chunk["usage"] = self.acc.usage()
        return chunk

    def _chunks(self, part: int, out: RequestOutput) -> list[dict]:
        make = fmt.chat_chunk_choice if self.chat else fmt.completion_chunk_choice
        chunks: list[dict] = []
        for ch, c in self._add(part, out):
            if self.acc.reasoning is not None:
                chunks.extend(self._chunk([x]) for x in fmt.chat_reasoning_chunk_choices(
                    ch, c.logprobs, c.finish_reason, self.want_logprobs, self.plan))
                continue
            if self.plan is not None:
                chunks.extend(self._chunk([x]) for x in fmt.chat_tool_chunk_choices(
                    ch, c.logprobs, c.finish_reason, self.want_logprobs, self.plan))
                continue
            if self.chat:
                if c.text or c.finish_reason or c.logprobs or not ch.started:
                    chunks.append(self._chunk([make(ch, c.text, c.logprobs, c.finish_reason, self.want_logprobs)]))
            elif c.text or c.finish_reason or c.logprobs or (c.token_ids and self.acc.keep_token_ids):
                chunks.append(self._chunk([fmt.completion_chunk_choice(
                    ch, c.text, c.logprobs, c.finish_reason, self.want_logprobs,
                    c.token_ids if self.acc.keep_token_ids else None)]))
        return chunks

    def _last(self, chunks: list[dict]) -> list[dict]:
        """When every prompt has finished: the timing extension goes on the last finish chunk
        (or on the usage chunk, when the client asked for usage)."""
        if len(self.acc.finished_parts) < self.parts or self.body.include_usage:
            return chunks
        self.run.done()
        if not chunks:
            chunks = [self._chunk([])]
        chunks[-1]["tokenpath"] = fmt.timing_extension(self.run.timeline)
        return chunks

    async def events(self, first: tuple[int, RequestOutput] | None, stream: Deltas) -> AsyncGenerator[bytes, None]:
        items = self._events(first, stream)
        try:
            if self.edge is not None and self.edge.stream is not None:
                async for event in self.edge.stream(items, self.acc):
                    yield event
            else:
                async for item in items:
                    yield sse_event(item)
        finally:  # closed early (client gone): close the generation now, not at garbage collection
            await items.aclose()
            await stream.aclose()

    async def _events(self, first: tuple[int, RequestOutput] | None, stream: Deltas) -> Items:
        run = self.run
        try:
            if first is not None:
                for c in self._last(self._chunks(*first)):
                    yield c
            async for part, out in stream:
                for c in self._last(self._chunks(part, out)):
                    yield c
        except Interrupted as exc:
            if exc.reason == "disconnect":
                run.disconnected()
                return
            if exc.reason == STALLED:  # nobody reads: no abort chunks (`finish` records the stall)
                return
            make = fmt.chat_chunk_choice if self.chat else fmt.completion_chunk_choice
            aborted = self.acc.abort_unfinished(self.parts)
            self.acc.finished_parts.update(range(self.parts))
            chunks = [self._chunk([make(ch, "", None, "abort", False)]) for ch in aborted]
            for c in self._last(chunks):
                yield c
        except TokenpathError as exc:
            run.fail(exc)
            yield exc.to_body()
            yield DONE
            return
        except Exception:
            log.exception("error while streaming %s", run.id)
            run.status, run.error_type = 500, "internal_error"
            yield error_body("internal server error while streaming", "internal_error")
            yield DONE
            return
        if self.body.include_usage:
            run.done()
            usage = self._chunk([])
            usage["usage"] = self.acc.usage()
            usage["tokenpath"] = fmt.timing_extension(run.timeline)
            yield usage
        yield DONE
