"""Chat templates render here (`engine/chat_template.py`, without transformers) exactly as
transformers' `apply_chat_template` renders them: every template the tests ship, over
conversations that use what agents send (tools, tool results, reasoning, null content, template
variables), with and without a generation prompt. And a GGUF engine's tokenizer never imports
transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenpath.engine.chat_template import ChatTemplate
from tokenpath.engine.loader import resolve_model_path
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.errors import InvalidRequestError

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number", "description": "<b> & é"}},
    "required": ["a", "b"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi wörld 🙂 <b>"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": None, "audio": None},
     {"role": "user", "content": "Again"}],
    [{"role": "user", "content": "What is 1+2?"},
     {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning_content": "I should add."},
     {"role": "tool", "tool_call_id": "call_1", "content": "3"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "Four.", "reasoning": "2+2 is 4."},
     {"role": "user", "content": "And 3+3?"}],
]


def _reference(template: str):  # noqa: ANN202 - transformers' tokenizer over the SmolLM2 vocabulary
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(_smollm2_dir()))
    ref.chat_template = template
    return ref


def _smollm2_dir() -> Path:
    from tokenpath.engine.tokenizer import gguf_tokenizer_cache

    gguf = resolve_model_path("smollm2-135m-instruct")
    Tokenizer(gguf)  # builds the saved tokenizer when this data dir has none yet
    return gguf_tokenizer_cache(gguf)


def _templates() -> list[tuple[str, str]]:
    found = [(p.name, p.read_text()) for p in sorted(TEMPLATES.glob("*.jinja"))]
    own = Tokenizer(resolve_model_path("smollm2-135m-instruct")).chat_template
    assert own and len(found) >= 4
    return [*found, ("smollm2 (from the GGUF)", own)]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_every_shipped_template_renders_as_transformers_renders_it(tools):
    tok = Tokenizer(resolve_model_path("smollm2-135m-instruct"))
    compared = 0
    for name, text in _templates():
        ref, ours = _reference(text), ChatTemplate(text, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                                           "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"})
        for messages in CONVERSATIONS:
            for gen in (True, False):
                for variables in ({}, {"enable_thinking": False}):
                    try:
                        want = ref.apply_chat_template(messages, tools=tools, add_generation_prompt=gen,
                                                       tokenize=False, **variables)
                    except Exception as exc:  # the template refuses this conversation: so must ours
                        with pytest.raises(type(exc)):
                            ours.render(messages, gen, tools, variables)
                        continue
                    got = ours.render(messages, gen, tools, variables)
                    assert got == want, (name, messages, gen, variables)
                    compared += 1
    assert compared >= 40  # the rest are conversations a template refuses (checked above: ours refuses too)
    # and the Tokenizer's ids are the text's, as transformers tokenizes a rendered chat
    ref = _reference(tok.chat_template or "")
    assert tok.apply_chat_template(CONVERSATIONS[1]) == ref.apply_chat_template(
        CONVERSATIONS[1], add_generation_prompt=True, tokenize=True, return_dict=False)


def test_a_named_template_table_picks_tool_use_only_with_tools():
    table = ChatTemplate({"default": "D{{ messages|length }}", "tool_use": "T{{ tools|length }}"}, {})
    assert table.render([{"role": "user", "content": "x"}]) == "D1"
    assert table.render([{"role": "user", "content": "x"}], tools=TOOLS) == "T1"
    with pytest.raises(InvalidRequestError, match="no 'default' entry"):
        ChatTemplate({"tool_use": "T"}, {}).render([{"role": "user", "content": "x"}])


def test_reserved_names_and_sandbox_escapes_are_refused():
    template = ChatTemplate("{{ messages[0].content }}", {})
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs.messages") as info:
        template.render([{"role": "user", "content": "x"}], variables={"messages": []})
    assert info.value.param == "chat_template_kwargs.messages"
    import jinja2

    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ ''.__class__.__mro__ }}", {}).render([])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render([])
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable: a template cannot edit the messages
        ChatTemplate("{{ messages.append(1) }}", {}).render([])


def test_a_gguf_tokenizer_and_its_chat_never_import_transformers():
    code = ("import sys\nfrom tokenpath.engine.loader import resolve_model_path\n"
            "from tokenpath.engine.tokenizer import Tokenizer\n"
            "t = Tokenizer(resolve_model_path('smollm2-135m-instruct'))\n"
            "ids = t.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "t.llg_tokenizer()\n"
            "print(len(ids) > 3, 'transformers' in sys.modules)\n")
    _smollm2_dir()  # the saved tokenizer exists (building it is transformers' job, in a child)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]
