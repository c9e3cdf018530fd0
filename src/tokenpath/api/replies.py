"""The reply side of chat and text completions: the merged delta stream -> an OpenAI body or SSE.

`Generation` reads the deltas of a request (`api/streams.py`) into its accumulator and writes the
reply: a JSON body once every choice finished, or chunks while they are generated (tool calls,
reasoning deltas, the timing extension on the last chunk, usage). Another API's shape (`Edge`)
reshapes the finished body or the chunk stream; the Responses API subclasses it. The request side
(key, route, admission, prompt, sampling) is `api/generation.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from tokenpath.api import formatting as fmt
from tokenpath.api import tools as tool_calls
from tokenpath.api.errors import error_body
from tokenpath.api.intake import Submitted
from tokenpath.api.run import RequestRun
from tokenpath.api.schemas import ChatCompletionRequest, CompletionRequest
from tokenpath.api.sse import DONE, STALLED, Interrupted, sse_event, watch_disconnect
from tokenpath.api.streams import Deltas
from tokenpath.errors import TokenpathError
from tokenpath.protocol.outputs import RequestOutput
from tokenpath.telemetry.timeline import Timeline

if TYPE_CHECKING:
    from tokenpath.api.generation import Edge

log = logging.getLogger("tokenpath.api")

Body = ChatCompletionRequest | CompletionRequest
# What the chat stream is before encoding: OpenAI chunk dicts, error bodies and DONE.
Items = AsyncGenerator[dict | str, None]


class WholeReply(JSONResponse):
    """A whole (non-streaming) reply that ends its request once it is sent: `on_sent` (the run's
    `finish`: the reconcile, the audit row's close, the log line, metrics) runs after the body's
    last byte, whether the send succeeded or not, as a stream's does (`SSEResponse`'s `on_close`).
    Run before the reply, that work was on every non-streaming request's latency: ~1-2 ms in front
    of vLLM, the close row's write (a thread hop and a SQLite commit) the largest part (issue 37).
    The reply's own numbers (Server-Timing, the timing extension, usage) are fixed before it is
    sent, so nothing it carries changes; the close row lands just after the client has the body,
    as a stream's always did."""

    def __init__(self, content: object, headers: dict[str, str], on_sent: Callable[[], Awaitable[None]],
                 timeline: Timeline | None = None) -> None:
        super().__init__(content, headers=headers)
        self.on_sent = on_sent
        self.timeline = timeline  # stamped `first_sent` once the body is handed to the connection

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
            if self.timeline is not None:
                self.timeline.stamp("first_sent")
        finally:
            await self.on_sent()


class Generation:
    """Turns the merged delta stream into a JSON body or SSE chunks."""

    def __init__(self, run: RequestRun, submitted: Submitted, body: Body, chat: bool,
                 plan: tool_calls.ToolPlan | None = None, edge: Edge | None = None) -> None:
        self.run = run
        self.edge = edge
        self.plan = plan if plan is not None and plan.parses else None
        self.body = body
        self.chat = chat
        self.parts = len(submitted.tokenized.prompts)
        self.want_logprobs = body.logprobs_count is not None
        self.model = submitted.routed.served_name
        self.acc: fmt.Accumulator = submitted.acc
        self.answered = False  # the first choice is past its think block (or never had one)
        self.echoed: set[int] = set()  # streamed `echo`: the choices whose prompt text went out already

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
        return WholeReply(body, run.headers(timing=True), run.finish, run.timeline)

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
            else:
                text, base, head = c.text, 0, None
                if self.acc.echo is not None:  # OpenAI's and vLLM's streamed echo: a choice's first chunk
                    echo = self.acc.echo[ch.index // self.acc.n]  # starts with its prompt's text (and, with
                    base = len(echo[0])  # `logprobs`, its tokens': they ride with the first sampled token)
                    if ch.index not in self.echoed:
                        self.echoed.add(ch.index)
                        text = echo[0] + text
                        if self.want_logprobs:
                            head = fmt.echo_logprobs(echo, self.acc.prompt_logprobs.get(ch.index // self.acc.n),
                                                     c.logprobs)
                if text or c.finish_reason or c.logprobs or (c.token_ids and self.acc.keep_token_ids):
                    choice = fmt.completion_chunk_choice(ch, text, c.logprobs, c.finish_reason,
                                                         self.want_logprobs and head is None,
                                                         c.token_ids if self.acc.keep_token_ids else None, base)
                    if head is not None:  # (built once, the prompt's tokens first)
                        choice["logprobs"] = head
                    chunks.append(self._chunk([choice]))
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
