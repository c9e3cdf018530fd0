"""The table of hostile request bodies the fault suite throws at a server (issue 10).

Each case is raw bytes plus headers, so malformed JSON, odd encodings and duplicate keys reach
the server exactly as an attacker would send them. Every answer must be a 4xx OpenAI error or a
200; never a 5xx, a hang or a dead model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

CHAT_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"


@dataclass
class Nasty:
    name: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})


def chat(**extra: object) -> dict:
    return {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra}


def js(obj: object) -> bytes:
    return json.dumps(obj).encode()


def raw_surrogate(body: dict, field_path: str) -> bytes:
    """JSON text with a lone surrogate escape (`\\ud800`) at `field_path` (json.dumps would
    escape it the same way; this keeps the intent readable)."""
    return json.dumps(body).replace("SURROGATE", "a\\ud800b").encode()


def deep(n: int) -> bytes:
    return b'{"model": "' + CHAT_MODEL.encode() + b'", "messages": ' + b"[" * n + b"]" * n + b"}"


CASES: list[Nasty] = [
    # sampling values that once killed the engine (defect 1)
    Nasty("temperature_1e-320", "/v1/chat/completions", js(chat(temperature=1e-320))),
    Nasty("top_p_1e-46", "/v1/chat/completions", js(chat(top_p=1e-46, temperature=1))),
    Nasty("repetition_penalty_1e-300", "/v1/chat/completions", js(chat(repetition_penalty=1e-300))),
    Nasty("top_k_2^63", "/v1/chat/completions", js(chat(top_k=2**63))),
    Nasty("top_k_2^64", "/v1/completions", js({"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 2, "top_k": 2**64})),
    Nasty("seed_2^70", "/v1/chat/completions", js(chat(seed=2**70))),
    Nasty("max_tokens_2^63", "/v1/chat/completions", js(chat(max_tokens=2**63))),
    Nasty("n_huge", "/v1/chat/completions", js(chat(n=10**12))),
    Nasty("logprobs_huge", "/v1/chat/completions", js(chat(logprobs=True, top_logprobs=10**9))),
    # non-finite numbers (Python's json accepts NaN/Infinity literals)
    Nasty("nan_temperature", "/v1/chat/completions",
          js(chat()).replace(b'"max_tokens": 3', b'"max_tokens": 3, "temperature": NaN')),
    Nasty("infinity_top_p", "/v1/chat/completions",
          js(chat()).replace(b'"max_tokens": 3', b'"max_tokens": 3, "top_p": Infinity')),
    Nasty("neg_infinity_penalty", "/v1/chat/completions",
          js(chat()).replace(b'"max_tokens": 3', b'"max_tokens": 3, "presence_penalty": -Infinity')),
    # invalid Unicode (defect 7), in every string field a prompt reaches
    Nasty("surrogate_content", "/v1/chat/completions",
          raw_surrogate({"model": CHAT_MODEL, "messages": [{"role": "user", "content": "SURROGATE"}]}, "content")),
    Nasty("surrogate_prompt", "/v1/completions",
          raw_surrogate({"model": CHAT_MODEL, "prompt": "SURROGATE", "max_tokens": 2}, "prompt")),
    Nasty("surrogate_stop", "/v1/chat/completions", raw_surrogate(chat(stop=["SURROGATE"]), "stop")),
    Nasty("surrogate_embedding", "/v1/embeddings", raw_surrogate({"model": EMBED_MODEL, "input": "SURROGATE"}, "input")),
    Nasty("invalid_utf8", "/v1/chat/completions", js(chat()).replace(b'"Hi"', b'"H\xff\xfei"')),
    # shapes and encodings
    Nasty("deep_nesting", "/v1/chat/completions", deep(5000)),
    Nasty("duplicate_keys", "/v1/chat/completions",
          js(chat()).replace(b'"max_tokens": 3', b'"max_tokens": 3, "max_tokens": 99999999')),
    Nasty("bom", "/v1/chat/completions", b"\xef\xbb\xbf" + js(chat())),
    Nasty("utf16_body", "/v1/chat/completions", json.dumps(chat()).encode("utf-16"),
          {"content-type": "application/json; charset=utf-16"}),
    Nasty("text_plain", "/v1/chat/completions", js(chat()), {"content-type": "text/plain"}),
    Nasty("empty_body", "/v1/chat/completions", b""),
    Nasty("json_array", "/v1/chat/completions", b"[1, 2, 3]"),
    Nasty("json_null", "/v1/chat/completions", b"null"),
    Nasty("truncated", "/v1/chat/completions", js(chat())[:-7]),
    Nasty("257_messages", "/v1/chat/completions",
          js(chat(messages=[{"role": "user", "content": "a"}] * 257))),
    Nasty("100k_metadata_keys", "/v1/chat/completions", js(chat(metadata={f"k{i}": "v" for i in range(100_000)}))),
    Nasty("content_null", "/v1/chat/completions", js(chat(messages=[{"role": "user", "content": None}]))),
    Nasty("image_part", "/v1/chat/completions", js(chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]))),
    Nasty("empty_prompt_list", "/v1/completions", js({"model": CHAT_MODEL, "prompt": [], "max_tokens": 2})),
    Nasty("token_id_out_of_vocab", "/v1/completions", js({"model": CHAT_MODEL, "prompt": [2**40], "max_tokens": 2})),
    Nasty("negative_token_id", "/v1/completions", js({"model": CHAT_MODEL, "prompt": [[-1, 5]], "max_tokens": 2})),
    Nasty("stop_token_ids_huge", "/v1/chat/completions", js(chat(stop_token_ids=[2**80]))),
    Nasty("embedding_empty", "/v1/embeddings", js({"model": EMBED_MODEL, "input": ""})),
    Nasty("embedding_ids_huge", "/v1/embeddings", js({"model": EMBED_MODEL, "input": [[2**40]]})),
    Nasty("wrong_types", "/v1/chat/completions", js(chat(temperature="hot", n="2", stream="yes"))),
]
