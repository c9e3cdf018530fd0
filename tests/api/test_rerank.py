"""/v1/score and /v1/rerank (issue 35 item 4) on the real MiniLM embedding model as a bi-encoder,
through a real server: the scores are the cosine similarity of the vectors /v1/embeddings returns,
the ranking is by them, and the requests go the embeddings' way (key, Timeline, audit id, metrics).
A chat model and malformed bodies are 400s in OpenAI's shape, naming the field."""

from __future__ import annotations

import math
import re

import httpx
import pytest
from tests.api.conftest import CHAT_MODEL, EMBED_MODEL

QUERY = "What is the capital of France?"
DOCS = ["The capital of Brazil is Brasilia.", "Paris is the capital and largest city of France.",
        "Cats are small domesticated carnivores."]
KEY = "k-rerank"


@pytest.fixture(scope="module")
def keyed(server_factory):  # noqa: ANN201
    return server_factory("--api-key", KEY)


@pytest.fixture
def client(keyed):  # noqa: ANN201
    with httpx.Client(base_url=keyed.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (math.hypot(*a) * math.hypot(*b))


def _embed(client: httpx.Client, texts: list[str]) -> list[list[float]]:
    r = client.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": texts})
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def test_rerank_ranks_by_the_embeddings_cosine(client):
    r = client.post("/v1/rerank", json={"model": EMBED_MODEL, "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == r.headers["x-request-id"] and body["id"].startswith("rerank-")
    assert body["model"] == EMBED_MODEL and body["usage"]["prompt_tokens"] > 0
    results = body["results"]
    assert [x["index"] for x in results][0] == 1  # the one about Paris
    assert sorted(x["index"] for x in results) == [0, 1, 2]
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    q, *d = _embed(client, [QUERY, *DOCS])
    for x in results:
        assert x["relevance_score"] == pytest.approx(_cos(q, d[x["index"]]), abs=1e-4)
        assert x["document"] == {"text": DOCS[x["index"]]}
    assert "prefill;dur=" in r.headers["server-timing"]  # the embeddings' Timeline


def test_rerank_top_n_cohere_documents_and_aliases(client):
    r = client.post("/v2/rerank", json={"model": EMBED_MODEL, "query": QUERY, "top_n": 1, "return_documents": False,
                                        "documents": [{"text": t} for t in DOCS]})
    assert r.status_code == 200, r.text
    (only,) = r.json()["results"]
    assert only["index"] == 1 and "document" not in only
    assert client.post("/rerank", json={"model": EMBED_MODEL, "query": QUERY, "documents": DOCS}).status_code == 200


def test_score_one_against_many_and_pairwise(client):
    r = client.post("/v1/score", json={"model": EMBED_MODEL, "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [x["index"] for x in body["data"]] == [0, 1, 2] and {x["object"] for x in body["data"]} == {"score"}
    q, *d = _embed(client, [QUERY, *DOCS])
    assert [x["score"] for x in body["data"]] == pytest.approx([_cos(q, v) for v in d], abs=1e-4)
    pair = client.post("/score", json={"model": EMBED_MODEL, "text_1": [QUERY, DOCS[0]], "text_2": [DOCS[1], DOCS[0]]})
    assert pair.status_code == 200, pair.text
    first, same = (x["score"] for x in pair.json()["data"])
    assert first == pytest.approx(_cos(q, d[1]), abs=1e-4) and same == pytest.approx(1.0, abs=1e-4)


def test_the_gateway_guards_them(keyed):
    for path, body in (("/v1/rerank", {"query": QUERY, "documents": DOCS}), ("/v1/score", {"text_1": "a",
                                                                                         "text_2": "b"})):
        r = httpx.post(keyed.url + path, json={"model": EMBED_MODEL, **body}, timeout=60)
        assert r.status_code == 401, r.text


def test_metrics_count_them_as_embedding_requests(client):
    def requests(endpoint: str) -> float:
        text = client.get("/metrics").text
        rows = re.findall(rf'^tokenpath:requests_total\{{[^}}]*endpoint="{re.escape(endpoint)}"[^}}]*status="200"'
                          r'[^}]*\} (\S+)$', text, re.M)
        return sum(float(v) for v in rows)

    before = requests("/v1/rerank")
    assert client.post("/v1/rerank", json={"model": EMBED_MODEL, "query": QUERY, "documents": DOCS}).status_code == 200
    assert requests("/v1/rerank") == before + 1


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/rerank", {"model": CHAT_MODEL, "query": QUERY, "documents": DOCS}, "model"),
    ("/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": ["ok", 3]}, "documents.1"),
    ("/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": ["ok", {"title": "x"}]}, "documents.1"),
    ("/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": ["ok", ""]}, "documents.1"),
    ("/v1/rerank", {"model": EMBED_MODEL, "query": "", "documents": DOCS}, "query"),
    ("/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": [f"d{i}" for i in range(3000)]}, "documents"),
    ("/v1/rerank", {"model": EMBED_MODEL, "query": QUERY, "documents": DOCS, "bogus": 1}, "bogus"),
    ("/v1/score", {"model": CHAT_MODEL, "text_1": "a", "text_2": "b"}, "model"),
    ("/v1/score", {"model": EMBED_MODEL, "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/score", {"model": EMBED_MODEL, "text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"model": EMBED_MODEL, "text_1": "a", "text_2": [1]}, "text_2"),
])
def test_bad_input_is_a_400_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if param == "model":
        assert "embedding model" in error["message"], error
