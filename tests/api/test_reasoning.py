"""Reasoning output on chat completions (issue 35 item 3), end to end: a real server serving a tiny
Qwen3 checkpoint made by transformers (tests/engine/tiny_models.py) whose own chat template is the
real Qwen3 one (tests/fixtures/chat_templates: it mentions <think>, so the parser is chosen from
it), made to write a think block by structured output (random weights would not write one). The block arrives as `reasoning_content` / `reasoning`, streamed
as deltas, never in `content`, and is counted in `usage.completion_tokens_details`.
`chat_template_kwargs` and `reasoning_effort` reach the template as Qwen3's `enable_thinking`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from tests.engine.tiny_models import save_tiny

from tokenpath.api.reasoning import ReasoningParser

CHAT_MODEL = "tiny-qwen3"
QWEN3 = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
THINK = r"<think>[a-z ]{1,20}</think>[a-z ]{1,20}"
ASK = [{"role": "user", "content": "Think, then answer: what colour is the sky?"}]


def _tiny_qwen3(folder: Path) -> Path:
    """A tiny random Qwen3 checkpoint whose own chat template is the real Qwen3 one."""
    path = save_tiny("qwen3", folder / "tiny-qwen3")
    (path / "chat_template.jinja").write_text(QWEN3.read_text())
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def qwen3(server_factory, tmp_path_factory) -> openai.OpenAI:
    path = _tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
    srv = server_factory("--model", str(path), "--served-model-name", CHAT_MODEL)
    return openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)


def _forced(**kw):  # noqa: ANN202
    return {"model": CHAT_MODEL, "messages": ASK, "max_tokens": 60, "temperature": 0, "seed": 3,
            "extra_body": {"guided_regex": THINK}, **kw}


def test_think_block_is_reasoning_content_not_content(qwen3):
    resp = qwen3.chat.completions.create(**_forced())
    msg = resp.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and re.fullmatch(r"[a-z ]{1,20}", reasoning), msg
    assert msg.model_extra["reasoning"] == reasoning
    assert "<think>" not in msg.content and "</think>" not in msg.content
    assert re.fullmatch(r"[a-z ]{1,20}", msg.content), msg.content
    used = resp.usage.completion_tokens_details.reasoning_tokens
    assert 0 < used < resp.usage.completion_tokens, resp.usage


def test_streamed_reasoning_deltas_add_up_to_the_same_split(qwen3):
    whole = qwen3.chat.completions.create(**_forced()).choices[0].message
    reasoning, content, usage = "", "", None
    for chunk in qwen3.chat.completions.create(**_forced(stream=True, stream_options={"include_usage": True})):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                assert not content, "reasoning after content"
                reasoning += extra["reasoning_content"]
            content += c.delta.content or ""
    assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content
    assert "<" not in content
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens > 0


def test_enable_thinking_and_reasoning_effort_reach_the_template(qwen3):
    """Qwen3's template writes an empty think block into the prompt when enable_thinking is false;
    reasoning_effort 'none' means the same there, and 'high' leaves thinking on."""
    def prompt_tokens(**extra) -> int:  # noqa: ANN003
        return qwen3.chat.completions.create(model=CHAT_MODEL, messages=ASK, max_tokens=1, **extra).usage.prompt_tokens

    on = prompt_tokens()
    off = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off > on
    assert prompt_tokens(reasoning_effort="none") == off
    assert prompt_tokens(reasoning_effort="high") == on


def test_history_reasoning_is_rendered_by_the_template(qwen3):
    """A past turn's reasoning_content (the SDK's model_dump of a reply) goes back to a template that
    renders it: the prompt grows by it."""
    reply = {"role": "assistant", "content": "Blue."}
    history = [*ASK, reply]
    plain = qwen3.chat.completions.create(model=CHAT_MODEL, messages=history, max_tokens=1).usage.prompt_tokens
    history = [*ASK, {**reply, "reasoning_content": "the sky scatters blue light more than red light"}]
    thought = qwen3.chat.completions.create(model=CHAT_MODEL, messages=history, max_tokens=1).usage.prompt_tokens
    assert thought > plain + 5


@pytest.mark.parametrize("text", ["<think>\nabc def\n</think>\n\nHello there", "no think at all", "<think>cut sh",
                                  "  <think>x</think>y"])
def test_split_grows_monotonically(text):
    """What streaming sends (the split of every prefix) is always a prefix of the final split."""
    p = ReasoningParser()
    final = p.split(text, True)
    for i in range(len(text) + 1):
        s = p.split(text[:i], False)
        assert final.reasoning.startswith(s.reasoning) and final.content.startswith(s.content), (i, s, final)


def test_prompt_that_opens_the_block():
    """DeepSeek-R1's templates end the prompt with <think>: the reply starts in reasoning."""
    s = ReasoningParser(starts_open=True).split("step one</think>\n\nanswer", True)
    assert (s.reasoning, s.content) == ("step one", "answer")
    assert ReasoningParser(starts_open=True).split("cut by max_tokens", True).reasoning == "cut by max_tokens"


def test_reasoning_parser_flag():
    """`serve --reasoning-parser` (vLLM's flag) is a setting of the server config; auto by default."""
    from tokenpath.cli import build_parser
    from tokenpath.server.config import build_config

    assert build_config(build_parser().parse_args(["serve"])).reasoning_parser == "auto"
    for value in ("none", "qwen3", "deepseek_r1"):
        assert build_config(build_parser().parse_args(["serve", "--reasoning-parser", value])).reasoning_parser == value
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "bogus"])


def test_reasoning_parser_none_leaves_the_block_in_content(server_factory, tmp_path_factory):
    path = _tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-none"))
    srv = server_factory("--model", str(path), "--served-model-name", CHAT_MODEL, "--reasoning-parser", "none")
    client = openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(**_forced())
    assert resp.choices[0].message.content.startswith("<think>")
    assert "reasoning_content" not in (resp.choices[0].message.model_extra or {})


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_a_tool_call(stream):
    """Qwen3 thinks, then calls a tool: the block is reasoning, the call parses from the content."""
    from tokenpath.api import formatting as fmt
    from tokenpath.api import tools
    from tokenpath.protocol.outputs import CompletionOutput, RequestOutput
    from tokenpath.telemetry.timeline import Timeline

    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    plan = tools.parse_tools([add], "auto", None, QWEN3.read_text())
    text = '<think>\nI should add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    acc = fmt.Accumulator(n=1, reasoning=ReasoningParser())
    reasoning, content, calls, reasons = "", "", [], []
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        out = RequestOutput("r", [CompletionOutput(0, p, [i], finish_reason="stop" if last else None)], [1], 0, last)
        for ch, c in acc.add(0, out):
            if stream:
                for x in fmt.chat_reasoning_chunk_choices(ch, None, c.finish_reason, False, plan):
                    reasoning += x["delta"].get("reasoning_content") or ""
                    content += x["delta"].get("content") or ""
                    calls += [tc for tc in x["delta"].get("tool_calls", ()) if "id" in tc]
                    reasons.append(x["finish_reason"])
    if stream:
        assert (reasoning, content, [tc["function"]["name"] for tc in calls]) == ("I should add.\n", "", ["add"])
        assert reasons[-1] == "tool_calls"
    else:
        (choice,) = fmt.chat_body("id", 0, "m", acc, False, Timeline("id"), plan)["choices"]
        msg = choice["message"]
        assert msg["reasoning_content"] == "I should add.\n" and msg["content"] is None
        assert choice["finish_reason"] == "tool_calls" and msg["tool_calls"][0]["function"]["name"] == "add"
    used = acc.usage()["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < used < len(pieces)
