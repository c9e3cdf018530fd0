"""Raw HTTP: SSE framing, status codes and OpenAI error bodies for client mistakes."""

from __future__ import annotations

import json
import re
import time

import pytest

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
MSG = [{"role": "user", "content": "Hi"}]


def assert_error(resp, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]


def test_sse_framing(http):
    body = {"model": CHAT, "messages": MSG, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.headers["x-request-id"].startswith("chatcmpl-")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    assert {p["id"] for p in payloads} == {resp.headers["x-request-id"]}
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" not in payloads[0]  # no include_usage: no usage field at all


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"n": 100}, "n"),
        ({"stop": [f"s{i}" for i in range(20)]}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"presence_penalty": -9}, "presence_penalty"),
        ({"seed": "abc"}, "seed"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"logit_bias": {"42": 500}}, "logit_bias"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream_options": {"include_usage": True}}, "any"),
    ],
)
def test_invalid_chat_values_are_400(http, extra, param):
    body = json.dumps({"model": CHAT, "messages": MSG, **extra})  # json.dumps writes NaN as NaN
    resp = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_error(resp, 400, param)


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "x"}], [{"content": "x"}], "hello", [{"role": "user", "content": 5}]],
)
def test_bad_messages_are_400(http, messages):
    assert_error(http.post("/v1/chat/completions", json={"model": CHAT, "messages": messages}), 400)


def test_too_many_messages_is_400(http):
    resp = http.post("/v1/chat/completions", json={"model": CHAT, "messages": MSG * 300, "max_tokens": 1})
    assert "300" in assert_error(resp, 400, "messages")["message"]


def test_context_length_error_says_the_numbers(http):
    prompt = "hello " * 5000
    resp = http.post("/v1/completions", json={"model": CHAT, "prompt": prompt, "max_tokens": 4000})
    err = assert_error(resp, 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert "8192" in err["message"] and "4000" in err["message"]


def test_unknown_model_is_404(http):
    err = assert_error(http.post("/v1/chat/completions", json={"model": "nope", "messages": MSG}), 404, "model")
    assert err["code"] == "model_not_found"
    assert_error(http.post("/v1/embeddings", json={"model": "nope", "input": "x"}), 404)
    assert_error(http.get("/v1/models/nope"), 404)


def test_wrong_task_is_400(http):
    assert_error(http.post("/v1/chat/completions", json={"model": EMBED, "messages": MSG}), 400, "model")


@pytest.mark.parametrize(
    ("content", "ctype"),
    [(b"{not json", "application/json"), (b"[1, 2]", "application/json"), (b"", "application/json"),
     (b"hello", "text/plain"), (b"\xff\xfe\x00", "application/json")],
)
def test_body_that_is_not_a_json_object_is_400(http, content, ctype):
    resp = http.post("/v1/chat/completions", content=content, headers={"content-type": ctype})
    assert resp.status_code in (400, 415)
    assert_error(resp, resp.status_code)


def test_oversized_body_is_413_with_or_without_content_length(http):
    big = json.dumps({"model": CHAT, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]})
    assert_error(http.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"}), 413)

    def chunks():  # chunked transfer: no Content-Length to trust
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536].encode()

    resp = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(resp, 413)


def test_oversized_headers_are_rejected(http):
    resp = http.get("/v1/models", headers={"x-junk": "a" * 15000, "x-junk2": "b" * 5000})
    assert resp.status_code in (400, 431)


def test_bad_x_priority_is_400(http):
    resp = http.post("/v1/chat/completions", json={"model": CHAT, "messages": MSG, "max_tokens": 1},
                     headers={"x-priority": "urgent"})
    assert_error(resp, 400, "x-priority")


@pytest.mark.parametrize(
    "body",
    [
        {"model": CHAT, "prompt": ""},
        {"model": CHAT, "prompt": []},
        {"model": CHAT, "prompt": [10**9]},
        {"model": CHAT, "prompt": "x", "suffix": "y"},
        {"model": CHAT, "prompt": "x", "logprobs": 99},
        {"model": CHAT, "prompt": ["x"] * 100, "max_tokens": 1},
        {"model": CHAT},
    ],
)
def test_invalid_completions_are_400(http, body):
    assert_error(http.post("/v1/completions", json=body), 400)


@pytest.mark.parametrize(
    "body",
    [
        {"model": EMBED, "input": ""},
        {"model": EMBED, "input": []},
        {"model": EMBED, "input": "word " * 300},
        {"model": EMBED, "input": [[101, 10**7, 102]]},
        {"model": EMBED, "input": "x", "encoding_format": "hex"},
        {"model": EMBED, "input": "x", "dimensions": 12},
        {"model": EMBED, "input": 42},
    ],
)
def test_invalid_embeddings_are_400(http, body):
    assert_error(http.post("/v1/embeddings", json=body), 400)


def test_too_long_embedding_input_names_the_numbers(http):
    err = assert_error(http.post("/v1/embeddings", json={"model": EMBED, "input": ["ok", "word " * 300]}), 400)
    assert "input[1]" in err["message"] and "302" in err["message"] and "256" in err["message"]


def test_unknown_route_and_method_use_the_error_shape(http):
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_health_and_metrics(http, metric):
    assert http.get("/health").json()["status"] == "ok"
    http.post("/v1/chat/completions", json={"model": CHAT, "messages": MSG, "max_tokens": 2})
    # A request is counted as it ends, just after its reply: on a fresh server (this test alone) the
    # first scrape can come before that.
    deadline = time.monotonic() + 10
    while metric(text := http.get("/metrics").text, "generation_tokens_total") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total"):
        metric(text, name)
    assert metric(text, "generation_tokens_total") >= 2
    # vLLM's waiting by reason: the two reasons sum to num_requests_waiting (nothing waits here).
    by_reason = {r: float(v) for r, v in re.findall(
        rf'^tokenpath:num_requests_waiting_by_reason\{{model_name="{re.escape(CHAT)}",reason="(\w+)"\}} (\S+)$', text, re.M)}
    assert by_reason == {"capacity": 0.0, "deferred": 0.0}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "time_per_output_token_seconds", "request_inference_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_max_num_generation_tokens",
                 "request_gateway_queue_time_seconds",
                 # vLLM's families added for its dashboards and routers (issue 37 item 6)
                 "request_params_max_tokens", "request_prefill_kv_computed_tokens", "request_num_preemptions"):
        assert metric(text, name + "_count") >= 1
    metric(text, "prompt_tokens_cached_total")
    metric(text, "gpu_cache_usage_perc")
    # The KV pool's resident bytes: the blocks that request wrote, a sliver of the pool (native kernels).
    assert 0 < metric(text, "kv_cache_resident_bytes") < 64 * 2**20
    # Embeddings have their own series: no first token, no decode (the embedding model has no TTFT).
    http.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "hello"})
    text = http.get("/metrics").text
    assert metric(text, "embedding_request_latency_seconds_count", model="all-minilm-l6-v2") >= 1
    assert 'time_to_first_token_seconds_count{model_name="all-minilm-l6-v2"}' not in text
    # A client cannot grow the label set: an unknown model name counts under `unknown`.
    assert http.post("/v1/chat/completions", json={"model": "made-up-model-7f3a", "messages": MSG}).status_code == 404
    text = http.get("/metrics").text
    assert "made-up-model-7f3a" not in text
    assert re.search(r'^tokenpath:requests_total\{[^}]*model_name="unknown"[^}]*status="404"', text, re.M)
    assert 'tokenpath:request_success_total{finished_reason="length",model_name="smollm2-135m-instruct"}' in text


def test_server_survives_a_burst_of_garbage(http):
    for content in (b"\x00" * 100, b'{"model": 1}', b'{"messages": null}', b"[]" * 1000, b'"' * 50):
        resp = http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert 400 <= resp.status_code < 500
    assert http.get("/health").status_code == 200


def test_tokenize_detokenize_and_version(http):
    """vLLM's utility endpoints: /tokenize counts exactly what a request is charged as prompt_tokens."""
    done = http.post("/v1/chat/completions", json={"model": CHAT, "messages": MSG, "max_tokens": 1}).json()
    chat = http.post("/tokenize", json={"model": CHAT, "messages": MSG, "return_token_strs": True}).json()
    assert chat["count"] == len(chat["tokens"]) == done["usage"]["prompt_tokens"]
    assert chat["max_model_len"] > 0 and len(chat["token_strs"]) == chat["count"]
    plain = http.post("/tokenize", json={"model": CHAT, "prompt": "Hello world"}).json()
    assert plain["token_strs"] is None and plain["count"] == len(plain["tokens"]) >= 2
    back = http.post("/detokenize", json={"model": CHAT, "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}
    # vLLM's add_special_tokens=false (`vllm bench serve` aligns its prompts with it; a 400 before):
    # the text's own tokens, decoding back to it.
    own = http.post("/tokenize", json={"model": CHAT, "prompt": "Hello world", "add_special_tokens": False})
    assert own.status_code == 200, own.text
    assert http.post("/detokenize", json={"model": CHAT, "tokens": own.json()["tokens"]}).json() == {
        "prompt": "Hello world"}
    for path, body, param in (("/tokenize", {"model": CHAT, "prompt": "a", "messages": MSG}, "prompt"),
                              ("/tokenize", {"model": CHAT, "messages": MSG, "add_special_tokens": False},
                               "add_special_tokens"),
                              ("/tokenize", {"model": CHAT, "messages": MSG, "add_generation_prompt": False},
                               "add_generation_prompt"),
                              ("/detokenize", {"model": CHAT, "tokens": [10**9]}, "tokens")):
        bad = http.post(path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert http.post("/tokenize", json={"model": "no-such-model", "prompt": "a"}).status_code == 404
    version = http.get("/version")
    assert version.status_code == 200 and version.json()["version"]
