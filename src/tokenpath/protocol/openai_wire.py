"""The outward codec: a `GenerateRequest` as an OpenAI-compatible backend's `/v1/completions` body
(vLLM's spelling of its extras), and the parts of that backend's stream read back.

One place for every field (`SAMPLING_FIELDS`, `REQUEST_FIELDS`): each field of `SamplingParams`
and `GenerateRequest` is sent under the backend's name, carried another way, or refused with a
400 that names it and the backend, never dropped. A new field that is none of these fails
tests/replica/test_openai_wire.py. The engine link has its own codec (`wire.py`); this one is for
servers tokenpath does not run: vLLM, SGLang, llama.cpp, another gateway.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import fields

from tokenpath.errors import InvalidRequestError
from tokenpath.protocol.outputs import TokenLogprob
from tokenpath.protocol.requests import GenerateRequest
from tokenpath.protocol.sampling_params import SamplingParams, StructuredOutput

# SamplingParams field -> (the body's key, the backend's default: sent only when it differs;
# a required key's default is None and it is always sent).
SAMPLING_FIELDS: dict[str, tuple[str, object]] = {
    "n": ("n", None), "max_tokens": ("max_tokens", None), "temperature": ("temperature", None),
    "top_p": ("top_p", None), "skip_special_tokens": ("skip_special_tokens", None),
    "seed": ("seed", None), "stop": ("stop", []), "stop_token_ids": ("stop_token_ids", []),
    "top_k": ("top_k", -1), "min_p": ("min_p", 0.0), "ignore_eos": ("ignore_eos", False),
    "presence_penalty": ("presence_penalty", 0.0), "min_tokens": ("min_tokens", 0),
    "frequency_penalty": ("frequency_penalty", 0.0), "logprobs": ("logprobs", None),
    "repetition_penalty": ("repetition_penalty", 1.0), "logit_bias": ("logit_bias", None),
    "include_stop_str_in_output": ("include_stop_str_in_output", False),
    "structured": ("structured_outputs", None),  # vLLM's spelling (tokenpath serve reads it too)
}
# SamplingParams fields a backend stream cannot carry back: a 400 naming the field when set.
SAMPLING_REFUSED: dict[str, str] = {
    "prompt_logprobs": "the streamed completions a URL replica reads carry no prompt logprobs",
}
_ALWAYS = {"n", "max_tokens", "temperature", "top_p", "skip_special_tokens"}
# GenerateRequest fields, and how each reaches the backend (or why it does not need to).
REQUEST_FIELDS: dict[str, str] = {
    "request_id": "the X-Request-Id header",
    "prompt_token_ids": "`prompt`, as token ids (the gateway's tokenization is the engine's)",
    "params": "SAMPLING_FIELDS",
    "lora": "`model`: the adapter's name, which the backend serves as a model",
    "traceparent": "the traceparent header",
    "priority": "gateway-side: the gateway's queue orders by it before dispatch",
    "tenant": "gateway-side: fairness and quotas are the gateway's (the session id goes as `user`)",
    "deadline": "gateway-side: the gateway enforces it up to the first token",
    "arrival": "gateway-side: the Timeline's own stamp",
    "operation": "gateway-side: the trace's operation name",
    "preempts": "gateway-side: share preemption pauses requests on tokenpath's own engines only (a URL "
                "replica's `can_preempt` is false, so admission never sets it for one)",
}


def sampling_params_fields() -> set[str]:
    return {f.name for f in fields(SamplingParams)}


def request_fields() -> set[str]:
    return {f.name for f in fields(GenerateRequest)}


def completion_body(request: GenerateRequest, model: str, backend: str, user: str | None = None) -> dict:
    """The streaming `/v1/completions` body for `request`. `return_token_ids` (vLLM's, and
    tokenpath's) makes each chunk carry its token ids, so usage and quotas count what the backend
    generated, not a re-encoding of its text; `include_usage` brings its usage (and vLLM's
    per-request metrics) on the last chunk. It costs vLLM 0.32 no engine work: its completions
    stream (serving.py `completion_stream_generator`) only adds the lists to the chunks it sends,
    the prompt's ids once, in the first (`prompt_payload` skips those); the 90-270 ms once blamed
    on it were its benchmark's prompts, longer where it was asked for
    (benchmarks/results/vllm_token_ids-loaded.md)."""
    p = request.params
    for name, why in SAMPLING_REFUSED.items():
        if getattr(p, name) is not None:
            raise InvalidRequestError(f"{name} is not supported through remote replica '{backend}': {why}",
                                      param=name, code="unsupported_parameter")
    body: dict = {"model": request.lora.name if request.lora is not None else model,
                  "prompt": request.prompt_token_ids, "stream": True,
                  "stream_options": {"include_usage": True}, "return_token_ids": True}
    for name, (key, default) in SAMPLING_FIELDS.items():
        value = getattr(p, name)
        if name in _ALWAYS or value != default:
            body[key] = structured_body(value) if isinstance(value, StructuredOutput) else value
    if user:
        body["user"] = user
    return body


def structured_body(spec: StructuredOutput) -> dict:
    """A constraint as vLLM's `structured_outputs` spells it ({json: schema}, {regex: str},
    {choice: [..]}, {grammar: str}); the JSON kinds travel parsed, as vLLM expects them."""
    value = json.loads(spec.spec) if spec.kind in ("json", "choice") else spec.spec
    return {spec.kind: value}


def _token_id(token: str, fallback: int) -> int:
    """vLLM's `return_tokens_as_token_ids` spells tokens "token_id:N"; other tokens' ids are unknown."""
    if token.startswith("token_id:"):
        with contextlib.suppress(ValueError):
            return int(token[9:])
    return fallback


def completion_logprobs(lp: dict | None, ids: list[int]) -> list[TokenLogprob]:
    """A completions choice's `logprobs` ({tokens, token_logprobs, top_logprobs}) -> ours, one entry
    per token of the chunk; the sampled tokens' ids from the chunk where the server sent them."""
    if not lp:
        return []
    tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [None] * len(tokens)
    out = []
    for i, (tok, value, top) in enumerate(zip(tokens, values, tops, strict=False)):
        tid = _token_id(tok, ids[i] if i < len(ids) else -1)
        alts = [(_token_id(t, -1), t, float(v)) for t, v in (top or {}).items()]
        alts.sort(key=lambda a: -a[2])
        out.append(TokenLogprob(token_id=tid, token=tok, logprob=float(value if value is not None else 0.0), top=alts))
    return out


# The key of a chunk's echoed prompt ids (vLLM's `return_token_ids` sends them on a stream's first
# chunk). Inside a JSON string every `"` is escaped, so this can only match a key.
_PROMPT_IDS = '"prompt_token_ids":'


def prompt_payload(payload: str) -> str:
    """A chunk's JSON with its `prompt_token_ids` list (the prompt's ids, echoed back: the gateway
    sent them, and reads nothing from them) replaced by null, before it is parsed. The first chunk,
    the first token's, carries them; parsing them is on the path to the client's first token:
    ~0.3 ms of the gateway's CPU for a 4096-token prompt, ~0.07 for 512 (loaded), where finding
    and cutting them out costs ~2 us, and <1 us on a chunk without them
    (benchmarks/sse_prompt_ids.py, results/vllm_token_ids-loaded.md). The
    list is of integers, so the first `]` after its `[` closes it; any other value is left."""
    start = payload.find(_PROMPT_IDS)
    if start < 0:
        return payload
    at = start + len(_PROMPT_IDS)
    while payload[at:at + 1] in (" ", "\t", "\n", "\r") and at < len(payload):
        at += 1
    end = payload.find("]", at) if payload[at:at + 1] == "[" else -1
    if end < 0:
        return payload  # (null, or not JSON: the parser says so)
    return f'{payload[:start]}"prompt_token_ids":null{payload[end + 1:]}'


def cached_tokens(data: dict) -> int:
    """Prompt tokens the backend served from its cache (`usage.prompt_tokens_details`)."""
    usage = data.get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
