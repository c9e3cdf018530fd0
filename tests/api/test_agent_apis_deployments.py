"""The agent APIs in every deployment (issue 35 item 6): `/v1/responses` and `/v1/messages` are
shapes at the edge over the chat pipeline, so they must work wherever chat completions do. Each
deployment is a real server: engine processes (`--replicas 2`), a URL replica (a second gateway
in front of the first, through a routing file), and Ray actors (`--ray local`). The real `openai`
and `anthropic` SDKs send a Responses and a Messages request, streamed and not; the request log
line of each names the replica kind that served it."""

from __future__ import annotations

import anthropic
import openai
import pytest

MODEL = "smollm2-135m-instruct"
ASK = "Name three colours."
GREEDY = {"temperature": 0}  # (this anthropic SDK has no sampling arguments; the API takes them in the body)


def _logged(server, request_id: str) -> dict:
    """The server's request log line for one request (written as the request ends: a streamed
    reply's client may read its last event a moment before)."""
    return server.request_log(request_id)


@pytest.fixture(scope="module")
def procs(server_factory):
    return server_factory("--model", MODEL, "--replicas", "2", "--max-model-len", "1024", "--kv-cache-memory", "32MiB")


@pytest.fixture(scope="module")
def front(server_factory, procs, tmp_path_factory):
    routing = tmp_path_factory.mktemp("front") / "routing.yaml"
    routing.write_text(f"deployments:\n  - name: {MODEL}\n    model: {MODEL}\n    replicas: [{{url: '{procs.url}'}}]\n")
    return server_factory("--routing", str(routing))


@pytest.fixture(scope="module")
def ray_served(server_factory):
    return server_factory("--model", MODEL, "--ray", "local", "--replicas", "1", "--max-model-len", "1024",
                          "--kv-cache-memory", "32MiB")


def _check(server, replica_marker: str) -> None:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    whole = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=6, temperature=0)
    assert whole.status in ("completed", "incomplete") and whole.output_text.strip(), whole
    assert 0 < whole.usage.output_tokens <= 6
    ends = [e.response for e in oai.responses.create(model=MODEL, input=ASK, max_output_tokens=6, temperature=0,
                                                      stream=True)
            if e.type in ("response.completed", "response.incomplete")]  # (cut by max_output_tokens: incomplete)
    assert len(ends) == 1
    streamed = ends[0]
    assert streamed.output_text == whole.output_text  # (greedy: the same text, whichever replica)
    msg = claude.messages.create(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": ASK}],
                                 extra_body=GREEDY)
    assert msg.content[0].text.strip() and 0 < msg.usage.output_tokens <= 6
    with claude.messages.stream(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": ASK}],
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == msg.content[0].text
    for request_id, endpoint in ((whole.id, "/v1/responses"), (streamed.id, "/v1/responses"),
                                 (msg.id, "/v1/messages"), (final.id, "/v1/messages")):
        row = _logged(server, request_id)
        assert row["endpoint"] == endpoint and row["status"] == 200, row
        assert replica_marker in row["replica"], row


def test_engine_processes(procs):
    _check(procs, "engine-")


def test_a_url_replica_in_front_of_another_gateway(front):
    _check(front, "-url")


@pytest.mark.requires("ray")
def test_ray_actors(ray_served):
    _check(ray_served, f"{MODEL}-0")  # (an actor replica's name: the model's, numbered)
    assert "Ray cluster" in ray_served.output()  # (Ray's own start-up line: the actors' cluster)
