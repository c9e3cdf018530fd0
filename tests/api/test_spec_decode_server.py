"""Speculative decoding behind `tokenpath serve`: the OpenAI client gets the plain engine's
greedy text, /metrics counts the drafts under vLLM's names, and a bad --speculative-config is a
start-up error naming the field."""

from __future__ import annotations

import json

import pytest
from tests.api.conftest import CHAT_MODEL, read_metric

from tokenpath import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
TEXT = ("The lighthouse at Kerrow Point was built in 1871 from granite quarried on the island itself. "
        "Its lamp was electrified in 1952, and the last keeper left in 1989.")
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]

pytestmark = pytest.mark.requires("kernels")


def test_openai_client_gets_the_plain_greedy_text_and_metrics_count_drafts(server_factory):
    import httpx
    from openai import OpenAI

    srv = server_factory("--model", CHAT_MODEL, "--speculative-config", json.dumps(SPEC))
    client = OpenAI(base_url=srv.base_url, api_key="unused")
    got = client.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, temperature=0, max_tokens=48)
    llm = LLM(CHAT_MODEL, kv_cache_memory="64MiB")
    want = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].text
    assert got.choices[0].message.content == want
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    assert read_metric(text, "spec_decode_num_accepted_tokens_total") > 0
    assert read_metric(text, "spec_decode_num_draft_tokens_total") >= read_metric(
        text, "spec_decode_num_accepted_tokens_total")


def test_a_bad_speculative_config_stops_serve_naming_the_field(server_factory):
    bad = json.dumps({**SPEC, "num_speculative_tokens": 99})
    with pytest.raises(RuntimeError, match="num_speculative_tokens"):
        server_factory("--model", CHAT_MODEL, "--speculative-config", bad)
