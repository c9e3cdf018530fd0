"""A Qwen3-MoE GGUF's own chat template, and Hermes tool calls with it, through the server (issue 36
item 1: "the chat templates that ship in the GGUF, and tool calls with them").

The tiny random Qwen3-MoE of tests/engine/tiny_models.py as a GGUF whose `tokenizer.chat_template`
is Qwen3's (tests/fixtures/chat_templates/Qwen-Qwen3-0.6B.jinja; the Qwen3 MoE models ship the
family's template), served by `tokenpath serve` with no `--chat-template`:
- the prompt is the GGUF template's rendering (a tool turn written as Qwen3's `<tool_response>`,
  which SmolLM2's own template, the tokenizer's otherwise, does not write), and a request with
  `tools=` has exactly the prompt that template gives with the tools in it;
- `tool_choice="required"` decodes a Hermes `<tool_call>` that comes back as an OpenAI tool call
  (the format detected from the GGUF's template), and the call and its result make valid history.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tests.engine.tiny_models import cached_tiny, save_gguf

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
HISTORY = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_gguf("qwen3moe", cached_tiny("qwen3moe"), tmp_path_factory.mktemp("gguf") / "qwen3moe-chat.gguf",
                     chat_template=TEMPLATE.read_text())


def test_gguf_template_renders_and_hermes_tool_calls_come_back(server_factory, gguf):
    from tokenpath.api import tools
    from tokenpath.api.inputs import chat_messages
    from tokenpath.api.schemas import ChatCompletionRequest
    from tokenpath.engine.tokenizer import Tokenizer

    tok = Tokenizer(gguf)
    assert tok.chat_template == TEMPLATE.read_text() and tools.template_format(tok.chat_template) == "hermes"
    srv = server_factory("--model", str(gguf), "--served-model-name", "tiny-moe", "--replicas", "1",
                         "--max-model-len", "1024", "--kv-cache-memory", "16MiB")
    with httpx.Client(base_url=srv.url, timeout=120) as http:
        r = http.post("/tokenize", json={"model": "tiny-moe", "messages": HISTORY})
        assert r.status_code == 200, r.text
        text = tok.decode(r.json()["tokens"], skip_special_tokens=False)
        assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text, text
        assert text.endswith("<|im_start|>assistant\n"), text

        body = {"model": "tiny-moe", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                "tools": [WEATHER], "tool_choice": "required", "max_tokens": 80, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        # the prompt the GGUF's template gives with the tools rendered into it, token for token
        req = ChatCompletionRequest(**body)
        plan = tools.parse_tools(req.tools, "required", None, tok.chat_template)
        messages, passed = chat_messages(req, plan, tok.chat_template)
        assert passed is not None and reply["usage"]["prompt_tokens"] == len(tok.apply_chat_template(messages, True, passed))
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", reply
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["unit"] in "cf"

        history = [body["messages"][0], choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "rain"}]
        r = http.post("/v1/chat/completions", json={**body, "messages": history, "tool_choice": "auto", "max_tokens": 4})
        assert r.status_code == 200, r.text
