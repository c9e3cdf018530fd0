"""The Responses API's replies over the chat pipeline's Generation: one JSON response object, or
the typed SSE events (`response.created` ... `response.completed`), each with its sequence_number.

Streaming reuses the chat Generation's chunks (tool-call parsing and argument streaming
included) and re-tells them as items: a reasoning model's think block opens a `reasoning` item
whose `reasoning_text` part streams as `response.reasoning_text.delta`; content deltas open a `message` item with one
`output_text` part, a tool call opens a `function_call` item whose arguments stream as
`response.function_call_arguments.delta`; each item is closed (`.done` events) before the next
opens, and all before `response.completed` (or `response.incomplete`, or `response.failed`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator

from fastapi.responses import Response

from tokenpath.api import formatting as fmt
from tokenpath.api.intake import Submitted
from tokenpath.api.replies import Body, Generation, WholeReply
from tokenpath.api.responses.translate import new_id
from tokenpath.api.responses.turn import Turn, call_item, message_item, output_of, reasoning_item, status_of
from tokenpath.api.run import RequestRun
from tokenpath.api.sse import Interrupted
from tokenpath.api.streams import Deltas
from tokenpath.api.tools import ToolPlan
from tokenpath.errors import TokenpathError
from tokenpath.protocol.outputs import RequestOutput

log = logging.getLogger("tokenpath.api")


def _event(kind: str, data: dict) -> bytes:
    payload = json.dumps({"type": kind, **data}, separators=(",", ":"), allow_nan=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode()


class ResponsesGeneration(Generation):
    def __init__(self, run: RequestRun, submitted: Submitted, body: Body, chat: bool, plan: ToolPlan | None = None,
                 *, turn: Turn) -> None:
        super().__init__(run, submitted, body, chat, plan)
        self.turn = turn
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.open: dict | None = None  # the item being written
        self.text = ""

    async def collect(self, stream: Deltas) -> Response:
        run = self.run
        await self.drain(stream)
        chat = fmt.chat_body(run.id, run.created, self.model, self.acc, False, run.timeline, self.plan)
        choice = chat["choices"][0]
        status, incomplete = status_of(choice["finish_reason"])
        body = self.turn.response(self.model, status, output_of(choice["message"]), chat["usage"], incomplete)
        await self.turn.save(body)
        return WholeReply(body, run.headers(timing=True), run.finish, run.timeline)

    # -- streaming ------------------------------------------------------------------------------
    def _emit(self, kind: str, **data: object) -> bytes:
        self.seq += 1
        return _event(kind, {"sequence_number": self.seq - 1, **data})

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        i = len(self.output)
        out = []
        part: dict[str, object]
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            out.append(self._emit("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=self.text))
            out.append(self._emit("response.content_part.done", item_id=item["id"], output_index=i,
                                  content_index=0, part=part))
            done = reasoning_item(self.text, item_id=item["id"])
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            out.append(self._emit("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=self.text, logprobs=[]))
            out.append(self._emit("response.content_part.done", item_id=item["id"], output_index=i,
                                  content_index=0, part=part))
            done = message_item(self.text, item_id=item["id"])
        else:
            out.append(self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=item["arguments"]))
            done = call_item(item["call_id"], item["name"], item["arguments"], item_id=item["id"])
        out.append(self._emit("response.output_item.done", output_index=i, item=done))
        self.output.append(done)
        return out

    def _open_message(self) -> tuple[dict, list[bytes]]:
        """The new message item (now `self.open`) and the events that close the last one and open it."""
        out = self._close()
        item = self.open = {**message_item("", "in_progress"), "content": []}
        self.text = ""
        i = len(self.output)
        out.append(self._emit("response.output_item.added", output_index=i, item=item))
        out.append(self._emit("response.content_part.added", item_id=item["id"], output_index=i,
                              content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []}))
        return item, out

    def _reasoning(self, delta: str) -> list[bytes]:
        """A reasoning model's think block: one `reasoning` item, its text one `reasoning_text` part."""
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out.extend(self._close())
            self.open = {**reasoning_item("", "in_progress"), "content": []}
            self.text = ""
            i = len(self.output)
            out.append(self._emit("response.output_item.added", output_index=i, item=self.open))
            out.append(self._emit("response.content_part.added", item_id=self.open["id"], output_index=i,
                                  content_index=0, part={"type": "reasoning_text", "text": ""}))
        self.text += delta
        out.append(self._emit("response.reasoning_text.delta", item_id=self.open["id"],
                              output_index=len(self.output), content_index=0, delta=delta))
        return out

    def _text(self, delta: str) -> list[bytes]:
        out: list[bytes] = []
        item = self.open
        if item is None or item["type"] != "message":
            item, out = self._open_message()
        self.text += delta
        out.append(self._emit("response.output_text.delta", item_id=item["id"], output_index=len(self.output),
                              content_index=0, delta=delta, logprobs=[]))
        return out

    def _call(self, tc: dict) -> list[bytes]:
        out = []
        fn = tc.get("function") or {}
        if tc.get("id"):
            out.extend(self._close())
            self.open = call_item(tc["id"], fn.get("name", ""), "", "in_progress", item_id=new_id("fc"))
            out.append(self._emit("response.output_item.added", output_index=len(self.output), item=dict(self.open)))
        args = fn.get("arguments") or ""
        if args and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += args
            out.append(self._emit("response.function_call_arguments.delta", item_id=self.open["id"],
                                  output_index=len(self.output), delta=args))
        return out

    def _translate(self, part: int, out: RequestOutput) -> tuple[list[bytes], str | None]:
        events: list[bytes] = []
        reason = None
        for chunk in self._chunks(part, out):
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    events.extend(self._reasoning(delta["reasoning_content"]))
                if delta.get("content"):
                    events.extend(self._text(delta["content"]))
                for tc in delta.get("tool_calls") or ():
                    events.extend(self._call(tc))
                reason = choice.get("finish_reason") or reason
        return events, reason

    async def events(self, first: tuple[int, RequestOutput] | None, stream: Deltas) -> AsyncGenerator[bytes, None]:
        """Its own events, already encoded (the chat Generation's are dicts it encodes itself)."""
        events = self._response_events(first, stream)
        try:
            async for event in events:
                yield event
        finally:  # closed early (client gone): close the generation now, not at garbage collection
            await events.aclose()
            await stream.aclose()

    async def _response_events(self, first: tuple[int, RequestOutput] | None,
                               stream: Deltas) -> AsyncGenerator[bytes, None]:
        """The events, those made from one engine output joined into one write: a token's delta
        can come with item and part events around it (~10 at the start and end of a reply), and
        each write is a send through the server and a syscall (+1.5 ms on a 16-token stream
        against chat completions, one write per token, when each event was its own)."""
        run, turn = self.run, self.turn
        start = turn.response(self.model, "in_progress", [])
        yield self._emit("response.created", response=start) + self._emit("response.in_progress", response=start)
        reason = None
        try:
            if first is not None:
                events, reason = self._translate(*first)
                if events:
                    yield b"".join(events)
            async for part, out in stream:
                events, got = self._translate(part, out)
                reason = got or reason
                if events:
                    yield b"".join(events)
        except Interrupted as exc:
            if exc.reason == "disconnect":
                run.disconnected()
                return
            self.acc.abort_unfinished(self.parts)
            reason = "abort"
        except TokenpathError as exc:
            run.fail(exc)
            yield self._failed(exc.code or exc.error_type, exc.message)
            return
        except Exception:
            log.exception("error while streaming %s", run.id)
            run.status, run.error_type = 500, "internal_error"
            yield self._failed("server_error", "internal server error while streaming")
            return
        empty = self.open is None and not self.output  # an empty reply is still one (empty) message
        closing = [*(self._open_message()[1] if empty else []), *self._close()]
        run.done()
        status, incomplete = status_of(reason)
        body = turn.response(self.model, status, self.output, self.acc.usage(), incomplete)
        body["tokenpath"] = fmt.timing_extension(run.timeline)
        await turn.save({k: v for k, v in body.items() if k != "tokenpath"})
        closing.append(self._emit("response.incomplete" if status == "incomplete" else "response.completed",
                                  response=body))
        yield b"".join(closing)

    def _failed(self, code: str, message: str) -> bytes:
        body = self.turn.response(self.model, "failed", self.output, self.acc.usage(),
                                  error={"code": code, "message": message})
        return self._emit("response.failed", response=body)
