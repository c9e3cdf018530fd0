"""Tool calls through the real chat templates of the model families (Qwen2.5, Qwen3, Hermes 3,
Llama 3.1; tests/fixtures/chat_templates says where they come from), with the real SmolLM2
tokenizer and transformers' template renderer, as `--chat-template FILE` would serve them:

- the format is detected from the template itself;
- `tools=` reaches the template: every tool's name, description and parameters are in the prompt;
- a past call, written by the template in its family's own format (what a model trained on that
  template emits), parses back as the same call, and the grammar that `required` decodes with
  accepts it; the tool's result lands in the family's tool turn.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tokenpath.api import tools
from tokenpath.api.inputs import chat_messages
from tokenpath.api.schemas import ChatCompletionRequest
from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.structured import GrammarCache
from tokenpath.engine.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "first"},
                                     "b": {"type": "integer", "description": "second"}},
    "required": ["a", "b"], "additionalProperties": False}}}
ECHO = {"type": "function", "function": {"name": "echo", "description": "Repeat a string", "parameters": {
    "type": "object", "properties": {"s": {"type": "string", "description": "the text"}}, "required": ["s"]}}}
HISTORY = [{"role": "user", "content": "What is 1+1?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
# (template file, format, regex for the call the template wrote, the tool turn it wrote)
FAMILIES = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", r"<tool_call>\n\{\"name\": \"add\".*?</tool_call>",
     "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>"),
    ("Qwen-Qwen3-0.6B.jinja", "hermes", r"<tool_call>\n\{\"name\": \"add\".*?</tool_call>",
     "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", r"<tool_call>\n\{\"name\": \"add\".*?</tool_call>",
     "<|im_start|>tool\n<tool_response>\n2\n</tool_response><|im_end|>"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3",
     r"(?<=assistant<\|end_header_id\|>\n\n)\{\"name\": \"add\".*?(?=<\|eot_id\|>)",
     # (Llama 3.1's template JSON-encodes a tool result, a string included: `is iterable`)
     '<|start_header_id|>ipython<|end_header_id|>\n\n"2"<|eot_id|>'),
]


@pytest.fixture(scope="module")
def source() -> Path:
    return resolve_model_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def grammars(source: Path) -> tuple[GrammarCache, Tokenizer]:
    tok = Tokenizer(source)
    return GrammarCache(tok.llg_tokenizer()), tok


@pytest.mark.parametrize(("file", "fmt_name", "call_re", "tool_turn"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_real_template_renders_tools_and_its_calls_parse(source, grammars, file, fmt_name, call_re, tool_turn):
    tok = Tokenizer(source, chat_template=TEMPLATES / file)
    assert tools.template_format(tok.chat_template) == fmt_name

    body = ChatCompletionRequest(model="m", messages=HISTORY, tools=[ADD, ECHO])
    plan = tools.parse_tools(body.tools, "auto", None, tok.chat_template)
    messages, passed = chat_messages(body, plan, tok.chat_template)
    assert passed is not None  # the template renders the tools itself
    text = tok.decode(tok.apply_chat_template(messages, True, passed), skip_special_tokens=False)
    for t in (ADD, ECHO):
        fn = t["function"]
        assert f'"name": "{fn["name"]}"' in text and fn["description"] in text, text
    assert '"integer"' in text and '"string"' in text  # the parameter schemas went in too

    (written,) = re.findall(call_re, text, re.S)
    content, calls = tools.parse_calls(written, plan)
    assert not content and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 1})]
    cache, smol = grammars
    required = tools.constraint(tools.parse_tools(body.tools, "required", None, tok.chat_template))
    matcher = cache.get(required).matcher
    assert matcher.consume_tokens(smol.encode(written)) and matcher.is_accepting(), written
    assert tool_turn in text
