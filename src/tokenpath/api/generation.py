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
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenpath.api import formatting as fmt
from tokenpath.api.errors import error_body
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import ChatCompletionRequest, CompletionRequest
from tokenpath.api.sse import DONE, Interrupted, SSEResponse, sse_event, until_stopped, watch_disconnect
from tokenpath.api.state import AppState
from tokenpath.engine.outputs import RequestOutput
from tokenpath.engine.sampling_params import SamplingParams
from tokenpath.errors import ContextLengthError, InvalidRequestError, TokenpathError
from tokenpath.replica.base import GenerateRequest
from tokenpath.routing.models import Deployment

log = logging.getLogger("tokenpath.api")

Body = ChatCompletionRequest | CompletionRequest


async def handle(state: AppState, request: Request, body: Body) -> Response:
    chat = isinstance(body, ChatCompletionRequest)
    run = RequestRun(state, request, "/v1/chat/completions" if chat else "/v1/completions",
                     "chatcmpl" if chat else "cmpl")
    handed_off = False
    try:
        await run.authenticate()
        body.reject_unsupported()
        run.user = body.user
        dep = run.route(body.model, "chat" if chat else "completion")
        priority = run.priority()
        received = run.timeline.stamps["received"]
        deadline = None if body.timeout is None else received + body.timeout
        assert run.principal is not None
        dep.precheck(priority, run.principal.tenant, received, deadline)
        prompts, texts = await _prompts(state, dep, body)
        params = _sampling_params(state, dep, body, prompts)
        run.sampling = params
        await run.admit(texts, sum(len(p) for p in prompts) + params.max_tokens * params.n * len(prompts))
        run.acc = fmt.Accumulator(n=params.n)
        state.inflight[run.id] = run.stop
        sources = [dep.generate(_generate_request(run, i, len(prompts), ids, params, texts, priority, deadline))
                   for i, ids in enumerate(prompts)]
        stream = until_stopped(_merge(sources), run.stop)
        gen = Generation(run, body, chat, len(prompts))
        if body.stream:
            first = await gen.first(stream)
            handed_off = True
            return SSEResponse(gen.events(first, stream), run.stop, run.finish, headers=run.headers())
        return await gen.collect(stream)
    except Exception as exc:
        return run.respond_to(exc)
    finally:
        if not handed_off:
            await run.finish()


def _generate_request(run: RequestRun, i: int, parts: int, ids: list[int], params: SamplingParams,
                      texts: list[str], priority: int, deadline: float | None) -> GenerateRequest:
    assert run.principal is not None
    return GenerateRequest(
        request_id=run.id if parts == 1 else f"{run.id}-{i}",
        prompt_token_ids=ids,
        params=params,
        timeline=run.timeline,
        priority=priority,
        tenant=run.principal.tenant,
        # Session affinity: an explicit x-session-id, else OpenAI's `user` field.
        session_id=run.request.headers.get("x-session-id") or run.user,
        prompt=texts[i] if i < len(texts) else None,
        deadline=deadline,
    )


# -- prompts -----------------------------------------------------------------------------------
async def _prompts(state: AppState, dep: Deployment, body: Body) -> tuple[list[list[int]], list[str]]:
    """Token ids per prompt (tokenized off the event loop) and the texts the policy hook sees."""
    caps, tok = state.config.caps, dep.tokenizer
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > caps.max_messages:
            raise InvalidRequestError(f"messages has {len(body.messages)} entries, over the limit of "
                                      f"{caps.max_messages}", param="messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        ids = await asyncio.to_thread(tok.apply_chat_template, messages)
        return [list(ids)], [m["content"] for m in messages]
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if len(prompt) > caps.max_prompts:
        raise InvalidRequestError(f"prompt has {len(prompt)} prompts, over the limit of {caps.max_prompts}",
                                  param="prompt")
    out: list[list[int]] = []
    texts: list[str] = []
    for p in prompt:
        if isinstance(p, str):
            ids = await asyncio.to_thread(tok.encode, p)
            texts.append(p)
        else:
            ids = list(p)
            bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary "
                                          f"[0, {tok.vocab_size})", param="prompt")
            texts.append(await asyncio.to_thread(tok.decode, ids))
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        out.append(list(ids))
    return out, texts


def _sampling_params(state: AppState, dep: Deployment, body: Body, prompts: list[list[int]]) -> SamplingParams:
    caps = state.config.caps
    where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    max_tokens = body.requested_max_tokens
    if max_tokens is not None and max_tokens > caps.max_tokens:
        raise InvalidRequestError(f"max_tokens is {max_tokens}, over this server's limit of {caps.max_tokens}",
                                  param="max_tokens")
    if body.n > caps.max_n:
        raise InvalidRequestError(f"n is {body.n}, over this server's limit of {caps.max_n}", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > caps.max_stop:
        raise InvalidRequestError(f"stop has {len(stop)} entries, over the limit of {caps.max_stop}", param="stop")
    longest = max(len(p) for p in prompts)
    limit = dep.max_model_len
    if max_tokens is None:
        max_tokens = min(limit - longest, caps.max_tokens)
    if longest + max(max_tokens, 1) > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the {where}, {max_tokens} in the completion). "
            f"Please reduce the length of the {where} or completion.",
            param=where,
        )
    def pick(value, default):  # noqa: ANN001, ANN202 - None means "the default"
        return default if value is None else value

    return SamplingParams(
        n=body.n,
        temperature=pick(body.temperature, 1.0),
        top_p=pick(body.top_p, 1.0),
        top_k=pick(body.top_k, -1),
        min_p=pick(body.min_p, 0.0),
        seed=body.seed,
        presence_penalty=pick(body.presence_penalty, 0.0),
        frequency_penalty=pick(body.frequency_penalty, 0.0),
        repetition_penalty=pick(body.repetition_penalty, 1.0),
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs_count,
        skip_special_tokens=body.skip_special_tokens,
    )


async def _merge(sources: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta) from several concurrent generations; closing it closes them all."""
    if len(sources) == 1:
        try:
            async for out in sources[0]:
                yield 0, out
        finally:
            await sources[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, src: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in src:
                await queue.put((i, out, None))
            await queue.put((i, None, None))
        except Exception as exc:
            await queue.put((i, None, exc))
        finally:
            await src.aclose()  # type: ignore[attr-defined]

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

    def __init__(self, run: RequestRun, body: Body, chat: bool, parts: int) -> None:
        self.run = run
        self.body = body
        self.chat = chat
        self.parts = parts
        self.want_logprobs = body.logprobs_count is not None
        self.model = run.deployment.name if run.deployment else body.model
        assert run.acc is not None
        self.acc: fmt.Accumulator = run.acc

    def _add(self, part: int, out: RequestOutput) -> list:
        touched = self.acc.add(part, out)
        if part == 0 and any(c.index == 0 and c.token_ids for _, c in touched):
            self.run.token_times.append(time.monotonic())
        return touched

    async def first(self, stream: AsyncIterator) -> tuple[int, RequestOutput] | None:
        """Wait for the first delta before sending headers: submission errors stay real HTTP errors."""
        async with watch_disconnect(self.run.request, self.run.stop):
            try:
                return await anext(stream)
            except StopAsyncIteration:
                return None

    async def collect(self, stream: AsyncIterator) -> Response:
        run = self.run
        try:
            async with watch_disconnect(run.request, run.stop):
                async for part, out in stream:
                    self._add(part, out)
        except Interrupted as exc:
            if exc.reason == "disconnect":
                raise
            self.acc.abort_unfinished(self.parts)
        run.timeline.stamp("finished")
        build = fmt.chat_body if self.chat else fmt.completion_body
        body = build(run.id, run.created, self.model, self.acc, self.want_logprobs, run.timeline)
        return JSONResponse(body, headers=run.headers(timing=True))

    # -- streaming ------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict]) -> dict:
        return fmt.chunk(self.run.id, self.run.created, self.model, self.chat, choices,
                         include_usage=self.body.include_usage)

    def _chunks(self, part: int, out: RequestOutput) -> list[dict]:
        make = fmt.chat_chunk_choice if self.chat else fmt.completion_chunk_choice
        chunks = []
        for ch, c in self._add(part, out):
            if c.text or c.finish_reason or c.logprobs or (self.chat and not ch.started):
                chunks.append(self._chunk([make(ch, c.text, c.logprobs, c.finish_reason, self.want_logprobs)]))
        return chunks

    def _last(self, chunks: list[dict]) -> list[dict]:
        """When every prompt has finished: the timing extension goes on the last finish chunk
        (or on the usage chunk, when the client asked for usage)."""
        if len(self.acc.finished_parts) < self.parts or self.body.include_usage:
            return chunks
        self.run.timeline.stamp("finished")
        if not chunks:
            chunks = [self._chunk([])]
        chunks[-1]["tokenpath"] = fmt.timing_extension(self.run.timeline)
        return chunks

    async def events(self, first: tuple[int, RequestOutput] | None, stream: AsyncIterator) -> AsyncIterator[bytes]:
        try:
            async for event in self._events(first, stream):
                yield event
        finally:  # closed early (client gone): close the generation now, not at garbage collection
            await stream.aclose()  # type: ignore[attr-defined]

    async def _events(self, first: tuple[int, RequestOutput] | None, stream: AsyncIterator) -> AsyncIterator[bytes]:
        run = self.run
        try:
            if first is not None:
                for c in self._last(self._chunks(*first)):
                    yield sse_event(c)
            async for part, out in stream:
                for c in self._last(self._chunks(part, out)):
                    yield sse_event(c)
        except Interrupted as exc:
            if exc.reason == "disconnect":
                run.disconnected()
                return
            make = fmt.chat_chunk_choice if self.chat else fmt.completion_chunk_choice
            aborted = self.acc.abort_unfinished(self.parts)
            self.acc.finished_parts.update(range(self.parts))
            chunks = [self._chunk([make(ch, "", None, "abort", False)]) for ch in aborted]
            for c in self._last(chunks):
                yield sse_event(c)
        except TokenpathError as exc:
            run.fail(exc)
            yield sse_event(exc.to_body())
            yield sse_event(DONE)
            return
        except Exception:
            log.exception("error while streaming %s", run.id)
            run.status, run.error_type = 500, "internal_error"
            yield sse_event(error_body("internal server error while streaming", "internal_error"))
            yield sse_event(DONE)
            return
        if self.body.include_usage:
            run.timeline.stamp("finished")
            usage = self._chunk([])
            usage["usage"] = self.acc.usage()
            usage["tokenpath"] = fmt.timing_extension(run.timeline)
            yield sse_event(usage)
        yield sse_event(DONE)
