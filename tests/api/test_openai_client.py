"""Every endpoint through the official `openai` client, sync and async, streaming and not."""

from __future__ import annotations

import base64
import math
import struct

import openai
import pytest

CHAT_MODEL = "smollm2-135m-instruct"
EMBED_MODEL = "all-minilm-l6-v2"

HELLO = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_models_list_and_retrieve(client):
    ids = {m.id for m in client.models.list()}
    assert ids == {CHAT_MODEL, EMBED_MODEL}
    assert client.models.retrieve(CHAT_MODEL).object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_completion_shape_usage_and_timing(client):
    raw = client.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=HELLO, max_tokens=6,
                                                           temperature=0)
    resp = raw.parse()
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion" and resp.model == CHAT_MODEL
    assert len(resp.choices) == 1 and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.choices[0].message.content
    u = resp.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 6 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0
    timing = resp.model_extra["tokenpath"]["timing"]
    assert set(timing) == {"upload", "gateway", "queue", "engine_queue", "prefill", "decode", "total"}
    assert timing["total"] >= timing["prefill"] + timing["decode"]
    header = raw.headers["server-timing"]
    assert header.startswith("upload;dur=") and "gateway;dur=" in header and "engine_queue;dur=" in header and "total;dur=" in header


def test_max_completion_tokens_and_n_choices(client):
    resp = client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_completion_tokens=3, n=3,
                                          seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    assert resp.usage.completion_tokens <= 9 and resp.usage.completion_tokens >= 3


def test_seed_makes_sampling_repeatable(client):
    texts = {client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=8, temperature=1.0,
                                            seed=1234).choices[0].message.content for _ in range(2)}
    assert len(texts) == 1


def test_stop_string_is_not_emitted(client):
    kw = {"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kw).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = client.chat.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.message.content
    assert full.startswith(cut.message.content)


def test_chat_logprobs_shape(client):
    resp = client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=3, logprobs=True,
                                          top_logprobs=2, temperature=0)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2
        # Greedy: the sampled token is the most likely one.
        assert math.isclose(item.logprob, max(t.logprob for t in item.top_logprobs), abs_tol=1e-4)


def test_chat_stream_with_usage(client):
    chunks = list(client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body, usage = chunks[:-1], chunks[-1]
    assert usage.choices == [] and 0 < usage.usage.completion_tokens <= 5
    assert set(usage.model_extra["tokenpath"]["timing"]) == {"upload", "gateway", "queue", "engine_queue",
                                                             "prefill", "decode", "total"}
    assert body[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text


def test_continuous_usage_stats_puts_the_counts_so_far_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (guidellm always sends it)."""
    chunks = list(client.chat.completions.create(
        model=CHAT_MODEL, messages=HELLO, max_tokens=6, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6


def test_chat_stream_without_usage_carries_timing_on_the_finish_chunk(client):
    chunks = list(client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=4, stream=True))
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert "total" in last.model_extra["tokenpath"]["timing"]
    assert all("tokenpath" not in (c.model_extra or {}) for c in chunks[:-1])


def test_streamed_text_equals_non_streamed_text_greedy(client):
    kw = {"model": CHAT_MODEL, "messages": HELLO, "max_tokens": 8, "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
    assert streamed == whole


def test_completions_string_list_and_token_ids(client):
    one = client.completions.create(model=CHAT_MODEL, prompt="The capital of France is", max_tokens=4,
                                    temperature=0)
    assert one.object == "text_completion" and one.id.startswith("cmpl-") and one.choices[0].text
    ids = client.completions.create(model=CHAT_MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=2)
    assert ids.usage.prompt_tokens == 5
    many = client.completions.create(model=CHAT_MODEL, prompt=["Hello", "The sky is"], n=2, max_tokens=2,
                                     logprobs=1, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[2].text == many.choices[3].text  # greedy: both choices of prompt 2 agree
    lp = many.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)


def test_completions_stream(client):
    chunks = list(client.completions.create(model=CHAT_MODEL, prompt="Once upon a time", max_tokens=5,
                                            stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


def test_prefix_cache_reports_cached_tokens(client):
    system = "You are a careful assistant. " * 20
    kw = {"model": CHAT_MODEL, "max_tokens": 1,
          "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]}
    client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_text_parts_content_equals_string_content(client):
    kw = {"model": CHAT_MODEL, "max_tokens": 4, "temperature": 0}
    a = client.chat.completions.create(**kw, messages=HELLO)
    b = client.chat.completions.create(**kw, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]}])
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_embeddings_float_base64_batched_and_single(client):
    texts = ["a cat sat on the mat", "quarterly revenue grew", "a kitten rested on a rug"]
    batch = client.embeddings.create(model=EMBED_MODEL, input=texts)
    assert batch.object == "list" and [d.index for d in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > len(texts)
    vecs = [d.embedding for d in batch.data]
    assert all(len(v) == 384 and math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-4) for v in vecs)

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b, strict=True))

    assert cos(vecs[0], vecs[2]) > cos(vecs[0], vecs[1])  # meaning, not noise
    single = client.embeddings.create(model=EMBED_MODEL, input=texts[1]).data[0].embedding
    assert max(abs(x - y) for x, y in zip(single, vecs[1], strict=True)) < 1e-4
    raw = client.embeddings.with_raw_response.create(model=EMBED_MODEL, input=texts[1], encoding_format="base64")
    b64 = raw.http_response.json()["data"][0]["embedding"]
    decoded = struct.unpack("<384f", base64.b64decode(b64))
    assert max(abs(x - y) for x, y in zip(decoded, single, strict=True)) < 1e-6


def test_embeddings_token_id_input(client):
    # [CLS] hello [SEP] in MiniLM's vocabulary equals the text "hello".
    by_ids = client.embeddings.create(model=EMBED_MODEL, input=[[101, 7592, 102]]).data[0].embedding
    by_text = client.embeddings.create(model=EMBED_MODEL, input="hello").data[0].embedding
    assert max(abs(x - y) for x, y in zip(by_ids, by_text, strict=True)) < 1e-5


def test_client_errors_through_the_sdk(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=HELLO)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=CHAT_MODEL, messages=HELLO, temperature=5)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=EMBED_MODEL, input="word " * 400)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=CHAT_MODEL, input="chat models do not embed")


async def test_async_client_chat_stream_and_embeddings(aclient):
    stream = await aclient.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=4, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 4 or chunks[-2].choices[0].finish_reason == "stop"
    resp = await aclient.chat.completions.create(model=CHAT_MODEL, messages=HELLO, max_tokens=2)
    assert resp.choices[0].message.content
    comp = await aclient.completions.create(model=CHAT_MODEL, prompt="1, 2, 3,", max_tokens=2)
    assert comp.choices[0].text
    emb = await aclient.embeddings.create(model=EMBED_MODEL, input=["x", "y"])
    assert len(emb.data) == 2
    models = [m.id async for m in aclient.models.list()]
    assert CHAT_MODEL in models
    await aclient.close()
