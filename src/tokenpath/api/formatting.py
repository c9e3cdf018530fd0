"""Engine outputs -> OpenAI's exact response shapes (chat and legacy completions, streaming and not).

`Accumulator` folds the engine's per-choice deltas into whole choices; the `*_body` and `*_chunk`
functions only reshape. Usage counts completion tokens over all choices and reports prefix-cache
hits as `prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenpath.api.reasoning import ReasoningParser
from tokenpath.api.tools import ParsedCall, ToolPlan, call_start, parse_calls, parse_cut_calls, streamed_calls
from tokenpath.errors import RequestFailedError
from tokenpath.protocol.outputs import CompletionOutput, RequestOutput, TokenLogprob
from tokenpath.telemetry.timeline import Timeline


@dataclass
class Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # vLLM's return_token_ids
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it (Anthropic's stop_sequence)
    started: bool = False  # for streaming chat: the first delta carries the role
    content_sent: int = 0  # streaming with tools: characters of `text` already sent as content
    call_ids: list[str] = field(default_factory=list)  # streaming constrained calls: ids sent so far
    args_sent: list[int] = field(default_factory=list)  # ... and characters of arguments sent per call
    # With a reasoning parser (api/reasoning.py): `raw` is the reply as written, `text` its content
    # and `reasoning` its think block, each as much as is safe to send so far.
    raw: str = ""
    reasoning: str = ""
    reasoning_sent: int = 0
    reasoning_done: bool = False
    reasoning_tokens: int = 0
    pending_tokens: int = 0  # tokens written while it was not yet known whether a block opens


def _split(parser: ReasoningParser, ch: Choice, c: CompletionOutput) -> None:
    """Reasoning and content of a reasoning model's reply so far; the delta's tokens count as
    reasoning while the block is open, its closing tag's included."""
    ch.raw += c.text
    if ch.reasoning_done and ch.text:  # past the block, content is the rest of the reply as written:
        ch.text += c.text  # append, rather than re-split the whole reply each token
        return
    split = parser.split(ch.raw, c.finish_reason is not None)
    if not ch.reasoning_done:
        if split.thought:
            ch.reasoning_tokens += ch.pending_tokens + len(c.token_ids)
            ch.pending_tokens = 0
        elif not split.done:
            ch.pending_tokens += len(c.token_ids)
    ch.reasoning, ch.text, ch.reasoning_done = split.reasoning, split.content, split.done


@dataclass
class Accumulator:
    """Whole choices from deltas. `part` numbers the prompts of a batched completions request."""

    n: int
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    finished_parts: set[int] = field(default_factory=set)
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)  # per part
    reasoning: ReasoningParser | None = None  # chat replies of a reasoning model
    keep_token_ids: bool = False  # vLLM's return_token_ids: each choice keeps its ids (only then: per-token work)
    echo: list[tuple[str, str]] | None = None  # OpenAI's echo: per part, the prompt's text and its first token's

    def index(self, part: int, choice: int) -> int:
        return part * self.n + choice

    def add(self, part: int, out: RequestOutput) -> list[tuple[Choice, CompletionOutput]]:
        self.prompt_tokens[part] = out.num_prompt_tokens
        self.cached_tokens[part] = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[part] = out.prompt_logprobs
        touched = []
        for c in out.outputs:
            idx = self.index(part, c.index)
            ch = self.choices.setdefault(idx, Choice(idx))
            if self.reasoning is None:
                ch.text += c.text
            else:
                _split(self.reasoning, ch, c)
            ch.num_tokens += len(c.token_ids)
            if self.keep_token_ids:
                ch.token_ids.extend(c.token_ids)
            ch.logprobs.extend(c.logprobs or ())
            if c.finish_reason == "error":  # not an OpenAI finish reason: the request failed
                raise RequestFailedError(f"choice {idx} failed in the engine")
            if c.finish_reason is not None:
                ch.finish_reason = c.finish_reason
                ch.stop_reason = c.stop_reason
            touched.append((ch, c))
        if out.finished:
            self.finished_parts.add(part)
        return touched

    def abort_unfinished(self, parts: int) -> list[Choice]:
        """Mark every choice that has not finished as aborted (server shutdown)."""
        aborted = []
        for part in range(parts):
            for i in range(self.n):
                ch = self.choices.setdefault(self.index(part, i), Choice(self.index(part, i)))
                if ch.finish_reason is None:
                    ch.finish_reason = "abort"
                    if self.reasoning is not None:  # (what was held back as a possible tag is the reply's)
                        _split(self.reasoning, ch, CompletionOutput(ch.index, finish_reason="abort"))
                    aborted.append(ch)
        return aborted

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        out = {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }
        if self.reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens
                                                                        for c in self.choices.values())}
        return out

    def finish_reason(self) -> str | None:
        reasons = [c.finish_reason for c in self.choices.values() if c.finish_reason]
        return reasons[0] if reasons else None

    def sorted(self) -> list[Choice]:
        return [self.choices[k] for k in sorted(self.choices)]


def timing_extension(timeline: Timeline) -> dict:
    """The `tokenpath` extension object the bench tool reads (seconds from the Timeline)."""
    return {"timing": timeline.durations()}


# -- logprobs ----------------------------------------------------------------------------------
def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(items: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": _bytes(lp.token),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for _, t, v in lp.top],
            }
            for lp in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict:
    offsets, pos = [], offset
    for lp in items:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t: v for _, t, v in lp.top} for lp in items],
        "text_offset": offsets,
    }


def prompt_logprobs(items: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    holding the prompt's token and the top ones asked for."""
    out: list[dict | None] = []
    for lp in items:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token}}
        for rank, (token_id, text, value) in enumerate(lp.top, start=1):
            entry.setdefault(str(token_id), {"logprob": value, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out


# -- whole responses ---------------------------------------------------------------------------
def _message(c: Choice, plan: ToolPlan | None, reasoning: bool = False) -> tuple[dict, str | None]:
    """The assistant message of a finished choice, and its finish reason: a reply that parses as
    tool calls carries them (`content` null when there is no other text) and ends "tool_calls".
    A reply cut by max_tokens keeps the calls written whole and ends "length". A reasoning
    model's think block is `reasoning_content` (and vLLM's newer name, `reasoning`)."""
    message: dict = {"role": "assistant", "content": c.text, "refusal": None}
    if reasoning:
        message["reasoning_content"] = message["reasoning"] = c.reasoning or None
    if plan is None or not plan.parses or c.finish_reason not in ("stop", "length"):
        return message, c.finish_reason
    if c.finish_reason == "length":
        content, calls = parse_cut_calls(c.text, plan)
        message["content"] = content
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return message, "length"
    content, calls = parse_calls(c.text, plan)
    if not calls:
        return message, c.finish_reason
    message["content"] = content
    message["tool_calls"] = [call.openai() for call in calls]
    return message, "tool_calls"


def _head(obj: str, rid: str, created: int, model: str, choices: list) -> dict:
    """The fields every OpenAI body and chunk opens with, in OpenAI's order."""
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": choices}


def _final(obj: str, rid: str, created: int, model: str, choices: list, acc: Accumulator,
           timeline: Timeline) -> dict:
    """A non-streamed body: the head, then its usage and tokenpath's timing extension."""
    return {**_head(obj, rid, created, model, choices), "usage": acc.usage(),
            "tokenpath": timing_extension(timeline)}


def chat_body(rid: str, created: int, model: str, acc: Accumulator, want_logprobs: bool, timeline: Timeline,
              plan: ToolPlan | None = None) -> dict:
    choices = []
    for c in acc.sorted():
        message, reason = _message(c, plan, acc.reasoning is not None)
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None, "finish_reason": reason})
    return _final("chat.completion", rid, created, model, choices, acc, timeline)


def _echoed(acc: Accumulator, echo: list[tuple[str, str]], c: Choice, want_logprobs: bool) -> tuple[str, dict | None]:
    """A choice's text and logprobs under OpenAI's `echo`: the prompt first, then the reply. The
    prompt's tokens carry their logprobs (the first token has none, as in OpenAI's and vLLM's)."""
    part = c.index // acc.n
    return echo[part][0] + c.text, echo_logprobs(echo[part], acc.prompt_logprobs.get(part), c.logprobs) \
        if want_logprobs else None


def echo_logprobs(echo: tuple[str, str], prompt: list[TokenLogprob | None] | None, reply: list[TokenLogprob]) -> dict:
    """`logprobs` of an echoed prompt (`echo`: its text and first token's) followed by `reply`'s
    tokens: the whole reply's (unstreamed), or a streamed choice's first chunk's. Offsets count from
    the prompt's first character, so a stream's later chunks add the prompt's length to theirs
    (`completion_chunk_choice`'s `base`)."""
    text, first = echo
    prompt = prompt or []
    head = completion_logprobs([lp for lp in prompt if lp is not None])
    tail = completion_logprobs(reply, offset=len(text))
    if prompt and prompt[0] is None:  # the first prompt token: text only
        head = {"tokens": [first, *head["tokens"]], "token_logprobs": [None, *head["token_logprobs"]],
                "top_logprobs": [None, *head["top_logprobs"]],
                "text_offset": [0, *(o + len(first) for o in head["text_offset"])]}
    return {k: head[k] + tail[k] for k in head}


def completion_body(rid: str, created: int, model: str, acc: Accumulator, want_logprobs: bool,
                    timeline: Timeline, want_prompt_logprobs: bool = False, token_ids: bool = False) -> dict:
    choices: list[dict[str, Any]] = []
    for c in acc.sorted():
        text, logprobs = (_echoed(acc, acc.echo, c, want_logprobs) if acc.echo is not None else
                          (c.text, completion_logprobs(c.logprobs) if want_logprobs else None))
        choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    if token_ids:  # vLLM's return_token_ids: the generated ids, so a gateway in front counts exactly
        for body, ch in zip(choices, acc.sorted(), strict=True):
            body["token_ids"] = ch.token_ids
    if want_prompt_logprobs:
        for body in choices:
            part = acc.prompt_logprobs.get(body["index"] // acc.n)
            body["prompt_logprobs"] = None if part is None else prompt_logprobs(part)
    return _final("text_completion", rid, created, model, choices, acc, timeline)


# -- streaming chunks --------------------------------------------------------------------------
def chat_chunk_choice(ch: Choice, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
                      want_logprobs: bool) -> dict:
    delta: dict = {"content": text} if text or not ch.started else {}
    if not ch.started:
        delta["role"] = "assistant"
        ch.started = True
    return {
        "index": ch.index,
        "delta": delta,
        "logprobs": chat_logprobs(logprobs or []) if want_logprobs and logprobs else None,
        "finish_reason": finish_reason,
    }


ARGUMENT_FRAGMENT = 16  # characters of arguments per streamed delta


def chat_tool_chunk_choices(ch: Choice, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
                            want_logprobs: bool, plan: ToolPlan) -> list[dict]:
    """Streaming with tools: content is sent up to where a call may start and held from there;
    when the choice finishes, the calls go out as OpenAI streams them (per call: a delta with its
    index, id, type and function name with empty arguments, then argument fragments), and the
    finish reason is "tool_calls". A reply that does not parse as calls is sent as content."""
    out: list[dict] = []
    lp = chat_logprobs(logprobs or []) if want_logprobs and logprobs else None

    def emit(delta: dict, reason: str | None = None) -> None:
        nonlocal lp
        if not ch.started:
            delta = {"role": "assistant", **delta}
            ch.started = True
        out.append({"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": reason})
        lp = None

    if plan.choice in ("required", "named"):
        _stream_constrained(ch, finish_reason, plan, emit)
        return out
    start = call_start(ch.text, plan)
    cut = finish_reason == "length"  # (the calls written whole are kept; the markup never becomes content)
    calls = parse_calls(ch.text, plan)[1] if finish_reason == "stop" else parse_cut_calls(ch.text, plan)[1] if cut else []
    safe = len(ch.text) if start == -1 else start
    if not calls and finish_reason is not None and not cut:
        safe = len(ch.text)
    if safe > ch.content_sent:
        emit({"content": ch.text[ch.content_sent:safe]})
        ch.content_sent = safe
    for k, call in enumerate(calls):
        emit({"tool_calls": [{"index": k, "id": call.id, "type": "function",
                              "function": {"name": call.name, "arguments": ""}}]})
        for j in range(0, len(call.arguments), ARGUMENT_FRAGMENT):
            emit({"tool_calls": [{"index": k, "function": {"arguments": call.arguments[j:j + ARGUMENT_FRAGMENT]}}]})
    if finish_reason is not None:
        emit({}, "tool_calls" if calls and not cut else finish_reason)
    elif not out and (lp is not None or not ch.started):
        emit({})
    return out


def _stream_constrained(ch: Choice, finish_reason: str | None, plan: ToolPlan, emit) -> None:  # noqa: ANN001
    """`required` / named calls: the grammar guarantees their shape, so each call's first delta
    goes out as soon as its name is written and its arguments stream while they are generated."""
    # (a call cut by max_tokens is not finished: its held-back tail is not sent as if it were)
    calls = streamed_calls(ch.text, plan, finished=finish_reason is not None and finish_reason != "length")
    for k, (name, args) in enumerate(calls):
        if k == len(ch.call_ids):
            ch.call_ids.append(ParsedCall(name, "").id)
            ch.args_sent.append(0)
            emit({"tool_calls": [{"index": k, "id": ch.call_ids[k], "type": "function",
                                  "function": {"name": name, "arguments": ""}}]})
        if len(args) > ch.args_sent[k]:
            emit({"tool_calls": [{"index": k, "function": {"arguments": args[ch.args_sent[k]:]}}]})
            ch.args_sent[k] = len(args)
    if finish_reason is not None:
        emit({}, "tool_calls" if finish_reason == "stop" and calls else finish_reason)
    elif not ch.started:
        emit({})


def chat_reasoning_chunk_choices(ch: Choice, logprobs: list[TokenLogprob] | None, finish_reason: str | None,
                                 want_logprobs: bool, plan: ToolPlan | None) -> list[dict]:
    """A reasoning model's reply streamed: the think block as `reasoning_content` (and `reasoning`)
    deltas while it is written, then its content (or tool calls) as any other reply's."""
    out: list[dict] = []
    new = ch.reasoning[ch.reasoning_sent:]
    if new:
        delta: dict = {"reasoning_content": new, "reasoning": new}
        if not ch.started:
            delta = {"role": "assistant", **delta}
            ch.started = True
        lp = chat_logprobs(logprobs or []) if want_logprobs and logprobs else None
        out.append({"index": ch.index, "delta": delta, "logprobs": lp, "finish_reason": None})
        ch.reasoning_sent = len(ch.reasoning)
        logprobs = None  # (sent with the reasoning)
    if plan is not None:
        return out + chat_tool_chunk_choices(ch, logprobs, finish_reason, want_logprobs, plan)
    text = ch.text[ch.content_sent:]
    ch.content_sent = len(ch.text)
    if text or finish_reason or (want_logprobs and logprobs) or not ch.started:
        out.append(chat_chunk_choice(ch, text, logprobs, finish_reason, want_logprobs))
    return out


def completion_chunk_choice(ch: Choice, text: str, logprobs: list[TokenLogprob] | None,
                            finish_reason: str | None, want_logprobs: bool, token_ids: list[int] | None = None,
                            base: int = 0) -> dict:
    """`base`: where the reply starts in the choice's whole text (an echoed prompt's length)."""
    offset = base + len(ch.text) - len(text)
    out = {
        "index": ch.index,
        "text": text,
        "logprobs": completion_logprobs(logprobs or [], offset) if want_logprobs and logprobs else None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:  # vLLM's return_token_ids: this chunk's ids
        out["token_ids"] = token_ids
    return out


def chunk(rid: str, created: int, model: str, chat: bool, choices: list[dict], *,
          include_usage: bool = False) -> dict:
    body = _head("chat.completion.chunk" if chat else "text_completion", rid, created, model, choices)
    if include_usage:
        body["usage"] = None
    return body
