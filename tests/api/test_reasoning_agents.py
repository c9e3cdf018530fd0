"""Reasoning in the agent APIs (issue 35 item 3), end to end with the real SDKs: a real server
serving a tiny random Qwen3 checkpoint (tests/engine/tiny_models.py) whose chat template is the
real Qwen3 one with DeepSeek-R1's generation prompt (it ends the prompt with an open `<think>`),
so every reply starts inside its think block. Random weights never close it: the thinking budget
(`serve --reasoning-budget`, Anthropic's `thinking.budget_tokens`) does, and the model answers after.

- `/v1/responses`: the block is a `reasoning` item (`reasoning_text` content), streamed as
  `response.reasoning_text.delta`, counted in `usage.output_tokens_details.reasoning_tokens`.
- `/v1/messages`: `thinking` blocks, streamed as `thinking_delta`; without `thinking`, the
  template is told `enable_thinking: false` and the reply has no block.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from openai.types.responses import ResponseReasoningItem
from tests.engine.tiny_models import save_tiny

MODEL = "tiny-thinker"
QWEN3 = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
BUDGET = 8  # the server's --reasoning-budget
ASK = "Think, then answer: what colour is the sky?"


def _thinker(folder: Path) -> Path:
    """Qwen3's template, its generation prompt opening the think block as DeepSeek-R1's does."""
    path = save_tiny("qwen3", folder / MODEL)
    template = QWEN3.read_text()
    tail = "{{- '<|im_start|>assistant\\n' }}"
    assert tail in template
    template = template.replace(tail, tail + "\n    {%- if not (enable_thinking is defined and enable_thinking is false) "
                                "%}{{- '<think>\\n' }}{%- endif %}")
    (path / "chat_template.jinja").write_text(template)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Path:
    return _thinker(tmp_path_factory.mktemp("thinker"))


@pytest.fixture(scope="module")
def server(server_factory, thinker):  # noqa: ANN201
    return server_factory("--model", str(thinker), "--served-model-name", MODEL, "--reasoning-budget", str(BUDGET))


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server.base_url


@pytest.fixture(scope="module")
def oai(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(base_url) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=120)


def _create(oai: openai.OpenAI, **kw):  # noqa: ANN202
    return oai.responses.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0, **kw)


def test_responses_reasoning_item_then_the_answer(oai):
    resp = _create(oai)
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"], resp.output
    item = resp.output[0]
    assert isinstance(item, ResponseReasoningItem) and item.summary == []
    assert item.content and item.content[0].type == "reasoning_text" and item.content[0].text.strip()
    assert "<think>" not in resp.output_text and "</think>" not in resp.output_text
    details = resp.usage.output_tokens_details
    # The budget's tokens, then the closing tag's (counted as reasoning), then the answer.
    assert BUDGET < details.reasoning_tokens < resp.usage.output_tokens, resp.usage
    # The stored response carries the item too, and the SDK sends it back as input: accepted.
    assert oai.responses.retrieve(resp.id).output[0].type == "reasoning"
    again = oai.responses.create(model=MODEL, max_output_tokens=4, temperature=0,
                                 input=[{"role": "user", "content": ASK}, *[o.model_dump() for o in resp.output],
                                        {"role": "user", "content": "And at night?"}])
    assert again.status in ("completed", "incomplete")


def test_responses_reasoning_streamed_as_typed_events(oai):
    whole = _create(oai)
    events = list(_create(oai, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2].item.type == "reasoning" and events[3].part.type == "reasoning_text"
    first_text = kinds.index("response.output_text.delta")
    done = kinds.index("response.reasoning_text.done")
    assert set(kinds[4:done]) == {"response.reasoning_text.delta"}
    assert kinds[done:done + 3] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done"]
    assert done < first_text
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == events[done].text == whole.output[0].content[0].text
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert [o.type for o in final.response.output] == ["reasoning", "message"]
    assert final.response.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens
    assert [e.sequence_number for e in events] == list(range(len(events)))


def _message(claude: anthropic.Anthropic, budget: int | None, **kw):  # noqa: ANN202
    thinking = {"type": "enabled", "budget_tokens": budget} if budget else anthropic.NOT_GIVEN
    return claude.messages.create(model=MODEL, max_tokens=30, extra_body={"temperature": 0}, thinking=thinking,
                                  messages=[{"role": "user", "content": ASK}], **kw)


def test_messages_thinking_block_held_to_its_budget(claude):
    short, long = _message(claude, 4), _message(claude, 12)
    for msg in (short, long):
        assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
        assert msg.content[0].thinking.strip() and isinstance(msg.content[0].signature, str)
        assert "</think>" not in msg.content[1].text
    # Greedy from the same prompt: the smaller budget's thinking is cut from the larger one's.
    a, b = short.content[0].thinking, long.content[0].thinking
    assert len(a) < len(b) and b.startswith(a.rstrip()), (a, b)


def test_messages_thinking_streamed_as_thinking_deltas(claude):
    whole = _message(claude, 6)
    kinds = []
    with claude.messages.stream(model=MODEL, max_tokens=30, extra_body={"temperature": 0}, thinking={"type": "enabled",
                                "budget_tokens": 6}, messages=[{"role": "user", "content": ASK}]) as stream:
        for ev in stream:
            if ev.type == "content_block_delta":
                kinds.append(ev.delta.type)
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and "text_delta" in kinds
    assert kinds.index("text_delta") > max(i for i, k in enumerate(kinds) if k == "thinking_delta")
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == whole.content[0].thinking
    assert final.content[0].signature == whole.content[0].signature  # (the stream's signature_delta)
    assert final.content[1].text == whole.content[1].text


def test_thinking_signature_checked_when_the_block_comes_back(claude):
    """A thinking block is signed (an HMAC of its text under the server's key); sent back in the
    history unchanged it is accepted, changed (its text or its signature) or unsigned it is a 400
    in Anthropic's shape naming the block's signature."""
    msg = _message(claude, 4)
    block = msg.content[0].model_dump()
    assert block["signature"].startswith("tp1.") and len(block["signature"]) > 40

    def again(thinking_block: dict):  # noqa: ANN202
        history = [{"role": "user", "content": ASK},
                   {"role": "assistant", "content": [thinking_block, msg.content[1].model_dump()]},
                   {"role": "user", "content": "And at night?"}]
        return claude.messages.create(model=MODEL, max_tokens=4, messages=history,
                                      thinking={"type": "enabled", "budget_tokens": 2})

    def count(thinking_block: dict):  # noqa: ANN202  (count_tokens checks the same history)
        history = [{"role": "user", "content": ASK},
                   {"role": "assistant", "content": [thinking_block, msg.content[1].model_dump()]},
                   {"role": "user", "content": "And at night?"}]
        return claude.messages.count_tokens(model=MODEL, messages=history,
                                            thinking={"type": "enabled", "budget_tokens": 2})

    assert again(block).content  # (unchanged: accepted)
    assert count(block).input_tokens > 0
    for bad in ({**block, "thinking": block["thinking"] + " (edited)"}, {**block, "signature": ""},
                {**block, "signature": block["signature"][:-2] + "AA"}):
        for call in (again, count):
            with pytest.raises(anthropic.BadRequestError) as err:
                call(bad)
            body = err.value.response.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert body["error"]["message"].startswith("messages.1.content.0.signature: invalid signature"), body


def test_thinking_sent_back_continues_a_tool_loop(claude, oai):
    """A tool-use round trip that sends the turn's thinking back: Qwen3's template writes it inside
    `<think>` for the turn after the last user query, so the prompt holds it (its tokens counted in
    input_tokens) and the loop goes on with its reasoning; without it the prompt is shorter."""
    signed = _message(claude, 6).content[0]  # (a thinking block this server wrote and signed)
    weather = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}

    def round_trip(blocks: list):  # noqa: ANN202
        history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": [*blocks, use]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
        return claude.messages.create(model=MODEL, max_tokens=4, messages=history, tools=[weather],
                                      thinking={"type": "enabled", "budget_tokens": 2})

    with_thought, without = round_trip([signed.model_dump()]), round_trip([])
    assert with_thought.usage.input_tokens > without.usage.input_tokens + 2, (with_thought.usage, without.usage)

    first = _create(oai)  # Responses: the reasoning item sent back before the call it led to
    reasoning = first.output[0].model_dump()
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    tools = [{"type": "function", "name": "get_weather", "parameters": weather["input_schema"]}]
    sizes = [oai.responses.create(model=MODEL, max_output_tokens=2, tools=tools, store=False,
                                  input=[{"role": "user", "content": ASK}, *items, call, output]).usage.input_tokens
             for items in ([reasoning], [])]
    assert sizes[0] > sizes[1] + 2, sizes


def test_budget_that_cannot_be_held_is_refused_or_said(claude, base_url):
    """A grammar decides every token (the think block's too): a request's own budget there is a 400
    naming `thinking` (Messages with a forced tool, as Anthropic refuses it); the server's
    --reasoning-budget there is not applied, and the reply says so, and why, in
    x-tokenpath-reasoning-budget rather than silently. `n` > 1 is held to (below)."""
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        with pytest.raises(anthropic.BadRequestError) as err:
            _message(claude, 4, tools=[tool], tool_choice=choice)
        assert err.value.response.json()["error"]["message"].startswith("thinking: thinking may not be enabled")
    auto = _message(claude, 4, tools=[tool], tool_choice={"type": "auto"})  # (no grammar: held to)
    assert auto.content[0].type == "thinking"

    ask = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 24, "temperature": 0}
    for extra, unapplied in (({"n": 2}, False), ({"response_format": {"type": "json_object"}}, True), ({}, False)):
        r = httpx.post(base_url + "/chat/completions", json={**ask, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        said = r.headers.get("x-tokenpath-reasoning-budget")
        if unapplied:
            assert said.startswith("unapplied; reason=grammar; why=") and "decides every token" in said, said
        else:
            assert said is None, said


def _closing_tokens(thinker: Path) -> int:
    from tokenpath.engine.tokenizer import Tokenizer

    return len(Tokenizer(thinker).backend.encode("</think>\n\n", add_special_tokens=False).ids)


def test_budget_held_per_choice_with_n(oai, thinker):
    """`n` = 3 under the server's budget: every choice's think block is cut at BUDGET tokens and
    closed for it (the tag counted as reasoning), and each goes on to an answer of its own; the
    choices are sampled apart (a seed per choice, as the engine gives them)."""
    n, tag = 3, _closing_tokens(thinker)
    resp = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], n=n, max_tokens=24,
                                       temperature=1.0, seed=7)
    assert sorted(c.index for c in resp.choices) == list(range(n))
    reasonings = []
    for c in resp.choices:
        reasoning = c.message.model_extra["reasoning_content"]
        assert reasoning and reasoning.strip(), c
        assert c.message.content and "</think>" not in c.message.content and "<think>" not in c.message.content, c
        assert c.finish_reason in ("stop", "length"), c
        reasonings.append(reasoning)
    assert len(set(reasonings)) > 1, reasonings  # (each choice thought on its own)
    # The budget's tokens and the tag's, per choice: the block was closed at the budget in each.
    assert resp.usage.completion_tokens_details.reasoning_tokens == n * (BUDGET + tag), resp.usage
    assert n * (BUDGET + tag) < resp.usage.completion_tokens <= n * 24, resp.usage


def test_the_budget_never_shortens_an_answer(oai):
    """A reply past its think block when the budget's tokens are spent (here: thinking turned off,
    the prompt closes the block) goes on to max_tokens: the budget counts thinking, not answers."""
    for n in (1, 2):
        resp = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], n=n,
                                           max_tokens=24, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        for c in resp.choices:
            assert not c.message.model_extra.get("reasoning_content"), c
            assert c.finish_reason in ("stop", "length"), c
        assert resp.usage.completion_tokens > n * BUDGET, resp.usage  # (24 each, unless one wrote EOS)
        assert all(c.finish_reason == "length" for c in resp.choices) == (resp.usage.completion_tokens == n * 24)


def test_budget_held_per_choice_with_n_streamed(oai):
    """The same streamed: each choice's reasoning deltas, then its answer, then its finish; the
    reasoning text of each choice is what the whole reply of the same seed carries."""
    n = 3
    kw = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "n": n, "max_tokens": 24,
          "temperature": 1.0, "seed": 11}
    whole = oai.chat.completions.create(**kw)
    reasoning = {i: "" for i in range(n)}
    content = {i: "" for i in range(n)}
    finish: dict[int, str] = {}
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert not content[c.index], "reasoning after the answer began"
                reasoning[c.index] += extra["reasoning_content"]
            content[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(finish) == list(range(n))
    for c in whole.choices:
        assert reasoning[c.index] == c.message.model_extra["reasoning_content"]
        assert content[c.index].strip() and "</think>" not in content[c.index]


def test_messages_without_thinking_turn_the_template_off(claude, base_url):
    """No `thinking` (or `disabled`): Qwen3's enable_thinking is false, the prompt holds an empty
    closed block, and the reply is all text; count_tokens counts that prompt."""
    msg = _message(claude, None)
    assert [b.type for b in msg.content] in (["text"], []), msg.content
    ask = [{"role": "user", "content": ASK}]
    off = claude.messages.count_tokens(model=MODEL, messages=ask).input_tokens
    on = claude.messages.count_tokens(model=MODEL, messages=ask,
                                      thinking={"type": "enabled", "budget_tokens": 5}).input_tokens
    assert off == msg.usage.input_tokens and off > on
    r = httpx.post(base_url.removesuffix("/v1") + "/v1/messages", json={
        "model": MODEL, "max_tokens": 2, "messages": ask, "thinking": {"type": "enabled", "budget_tokens": 5}})
    assert r.status_code == 200 and "x-tokenpath-ignored" not in r.headers  # (this model reasons)


# -- reasoning as a Timeline stage ------------------------------------------------------------------
def _timing(header: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+);dur=([\d.]+)", header)}


def test_reasoning_is_a_stage_of_its_own(server, oai, claude):
    """A reply that thought: `reasoning` (first token -> first answer token) apart from `decode` in
    Server-Timing, the audit row (`tokenpath trace`) and /metrics' time to first answer token; a
    reply that never thought has no reasoning stage."""
    raw = oai.responses.with_raw_response.create(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    timing = _timing(raw.headers["server-timing"])
    assert timing["reasoning"] > 0 and "decode" in timing, timing
    stages = sum(v for k, v in timing.items() if k != "total")
    assert abs(stages - timing["total"]) < 1.0, timing  # (ms: each rounded to 0.1)

    plain = claude.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=[{"role": "user",
                                                                                            "content": ASK}])
    timing = _timing(plain.headers["server-timing"])
    assert "reasoning" not in timing and "decode" in timing, timing

    rid = raw.headers["x-request-id"]
    tokenpath = str(Path(sys.executable).parent / "tokenpath")
    deadline = time.monotonic() + 30
    while True:  # the audit row is written as the request finishes
        out = subprocess.run([tokenpath, "trace", rid, "--json", "--data-dir", str(server.log.parent / "data")],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert [st["stage"] for st in s["stages"]][-2:] == ["reasoning", "decode"]
    assert 0 < s["time_to_first_reasoning_ms"] < s["time_to_first_answer_ms"] <= s["total_ms"]

    metrics = httpx.get(server.url + "/metrics").text
    count = re.search(r'^tokenpath:time_to_first_answer_token_seconds_count\{model_name="tiny-thinker"\} (\S+)',
                      metrics, re.M)
    assert count and float(count.group(1)) >= 1, metrics[-2000:]
    assert re.search(r'^tokenpath:request_stage_seconds_count\{model_name="tiny-thinker",stage="reasoning"\} [1-9]',
                     metrics, re.M), metrics[-2000:]
