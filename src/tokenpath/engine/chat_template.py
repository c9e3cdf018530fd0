"""A model's chat template, rendered as `transformers`' `apply_chat_template` renders it.

Why not transformers itself: importing its tokenizer class costs ~27 MiB of resident memory and a
second of start-up in every process that holds a tokenizer (the gateway and each engine), and the
generic fast tokenizer it builds is `tokenizers`' own object, unchanged (checked on every saved
tokenizer, `tests/engine/test_tokenizer_cache.py`). What it adds for chat is a Jinja environment;
the templates on the Hub are written against that environment, so this module keeps its contract,
and the tests render every shipped template both ways and compare the text:

- a sandbox that cannot mutate its inputs (`ImmutableSandboxedEnvironment`), `trim_blocks` and
  `lstrip_blocks`, `loopcontrols`, and the `{% generation %}` tag (its body rendered as is);
- `tojson` without HTML escaping (and with `indent`/`separators`/`sort_keys`), `raise_exception`,
  `strftime_now`, a `dict` callable, and a `namespace` that refuses underscore names;
- message keys whose value is None are dropped (OpenAI's replies carry `content: null`, which
  templates print as "None"), and a message's reasoning is given under `reasoning_content` and
  `thinking` whichever of `reasoning_content`/`thinking`/`reasoning` the client sent;
- the special tokens (`bos_token`, `eos_token`, ...) are template variables, and the caller's
  variables (vLLM's `chat_template_kwargs`) override them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from tokenpath.errors import InvalidRequestError

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplate:
    """One template (or a table of named ones, as some tokenizer configs hold), compiled on first
    use. `specials`: the tokenizer's special tokens by role (`bos_token` -> "<s>")."""

    def __init__(self, source: str | Mapping[str, str], specials: Mapping[str, Any]) -> None:
        self.source = source
        self.specials = dict(specials)
        self._compiled: dict[str, Any] = {}

    def text(self, tools: bool) -> str:
        """The template that renders this request: a table's `tool_use` entry when tools are sent
        and it has one, else its `default` (as transformers chooses)."""
        if isinstance(self.source, str):
            return self.source
        name = "tool_use" if tools and "tool_use" in self.source else "default"
        if name not in self.source:
            raise InvalidRequestError(f"the model's chat templates ({', '.join(self.source)}) have no "
                                      f"'{name}' entry", param="messages")
        return self.source[name]

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text. Raises jinja2's errors (the caller turns them into a 400)."""
        for key in variables or ():
            if key in RESERVED:
                raise InvalidRequestError(f"chat_template_kwargs.{key} is set by the request itself, not by a "
                                          "template variable", param=f"chat_template_kwargs.{key}")
        source = self.text(bool(tools))
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = _environment().from_string(source)
        chat = [_message(m) for m in messages]
        return template.render(messages=chat, tools=tools or None, documents=None,
                               add_generation_prompt=add_generation_prompt,
                               **{**self.specials, **(variables or {})})


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    plain = {k: v for k, v in message.items() if v is not None}
    reasoning = next((plain[k] for k in REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _environment() -> Any:  # noqa: ANN401 - jinja2's Environment (imported here: only chat requests need it)
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks; a
        prompt renders its body unchanged."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:  # noqa: ANN401
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:  # noqa: ANN401
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace, refusing underscore names (no reach into CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's own signature trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:  # noqa: ANN401
            _check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,  # noqa: ANN401
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Dict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=Dict(), namespace=Namespace)
    return env
