"""The fate of every OpenAI chat-completions request field, in one table.

Each field a client may send is one of:

- `honoured`: it does what OpenAI documents (or the nearest thing here, said in the note);
- `ignored`: accepted and a no-op, because it changes nothing a client could observe here
  (`safety_identifier`, `verbosity` on models with no such control...). The response names the
  ignored fields the request set in the `x-tokenpath-ignored-fields` header, so a client can see
  it was not acted on;
- `refused`: a 400 naming the field, because honouring it is impossible here (web search,
  audio output): returning something else than asked for would be worse than an error.

`tests/api/test_openai_fields.py` checks every entry against a real server, and that every field
of the installed `openai` SDK's `CompletionCreateParams` has an entry, so a new OpenAI field is a
failing test until it gets a fate here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenpath.api.schemas import ChatCompletionRequest
from tokenpath.errors import InvalidRequestError

IGNORED_HEADER = "x-tokenpath-ignored-fields"
Kind = Literal["honoured", "ignored", "refused"]


@dataclass(frozen=True)
class Fate:
    kind: Kind
    note: str = ""


H: Kind = "honoured"
IGN: Kind = "ignored"
R: Kind = "refused"
CHAT_FIELDS: dict[str, Fate] = {
    "messages": Fate(H, "text content; history may carry every field OpenAI's replies carry (ignored)"),
    "model": Fate(H),
    "audio": Fate(R, "audio output"),
    "frequency_penalty": Fate(H),
    "function_call": Fate(R, "the legacy functions API; 'none' and 'auto' are accepted (they ask for nothing)"),
    "functions": Fate(R, "the legacy functions API; send tools"),
    "logit_bias": Fate(H),
    "logprobs": Fate(H),
    "max_completion_tokens": Fate(H),
    "max_tokens": Fate(H),
    "metadata": Fate(IGN, "stored nowhere (the audit log keeps its own record)"),
    "modalities": Fate(R, "audio output; ['text'] is accepted"),
    "moderation": Fate(R, "no moderation model runs here"),
    "n": Fate(H),
    "parallel_tool_calls": Fate(H),
    "prediction": Fate(R, "predicted outputs"),
    "presence_penalty": Fate(H),
    "prompt_cache_key": Fate(H, "the session-affinity key for routing, as x-session-id (which wins)"),
    "prompt_cache_options": Fate(IGN, "the prefix cache is automatic"),
    "prompt_cache_retention": Fate(IGN, "the prefix cache is automatic"),
    "reasoning_effort": Fate(H, "a template variable where the chat template knows it; 'none'/'minimal' turn "
                            "off enable_thinking; on a model without reasoning, other levels are refused"),
    "response_format": Fate(H),
    "safety_identifier": Fate(IGN),
    "seed": Fate(H),
    "service_tier": Fate(IGN, "one tier here"),
    "stop": Fate(H),
    "store": Fate(IGN, "chat completions are not stored"),
    "stream": Fate(H),
    "stream_options": Fate(H),
    "temperature": Fate(H),
    "tool_choice": Fate(H),
    "tools": Fate(H, "function tools"),
    "top_logprobs": Fate(H),
    "top_p": Fate(H),
    "user": Fate(H, "the audit row's user, and the session-affinity key when nothing else is sent"),
    "verbosity": Fate(IGN, "no model here has a verbosity control"),
    "web_search_options": Fate(R, "no web search runs here"),
    # vLLM's extras
    "chat_template_kwargs": Fate(H, "template variables; a key the template never reads is ignored"),
}
STREAM_OPTIONS: dict[str, Fate] = {
    "include_usage": Fate(H),
    "include_obfuscation": Fate(IGN, "no obfuscation padding is added"),
    "continuous_usage_stats": Fate(H, "vLLM's"),
}
_REFUSED_HERE = ("web_search_options", "moderation")  # (the others: ChatCompletionRequest.reject_unsupported)


def check_chat(body: ChatCompletionRequest) -> list[str]:
    """Refuse what cannot be honoured (by name); the ignored fields the request set, for the header."""
    for name in _REFUSED_HERE:
        if getattr(body, name) is not None:
            raise InvalidRequestError(f"{name} is not supported by this server ({CHAT_FIELDS[name].note}); remove "
                                      "it from the request", param=name, code="unsupported_parameter")
    ignored = [name for name, fate in CHAT_FIELDS.items()
               if fate.kind == IGN and name in body.model_fields_set and getattr(body, name) is not None]
    opts = body.stream_options
    if opts is not None:
        ignored += [f"stream_options.{name}" for name, fate in STREAM_OPTIONS.items()
                    if fate.kind == IGN and name in opts.model_fields_set and getattr(opts, name) is not None]
    return ignored


def ignored_header(names: list[str]) -> dict[str, str]:
    return {IGNORED_HEADER: ", ".join(names)} if names else {}
