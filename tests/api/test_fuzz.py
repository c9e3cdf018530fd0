"""Schemathesis against the server's own OpenAPI schema: no generated request, valid or not, is a 5xx.

A dedicated server with tiny caps (YAML `--config`) keeps every generation to a few tokens, so
the run stays bounded on a CPU.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

CONFIG = """\
caps:
  max_tokens: 3
  max_n: 2
  max_prompts: 2
  max_embedding_inputs: 4
  max_messages: 8
"""


@pytest.fixture(scope="module")
def fuzz_server(server_factory, tmp_path_factory):
    cfg = tmp_path_factory.mktemp("cfg") / "server.yaml"
    cfg.write_text(CONFIG)
    return server_factory("--config", str(cfg))


def _operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    return [op for op in ops if op.path.startswith("/v1/")]


def _fuzz(op, mode: GenerationMode, url: str, seen: dict[int, int]) -> None:
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=12, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        resp = case.call(base_url=url, timeout=120)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, (op.path, case.body, resp.status_code, resp.text[:500])
        if resp.status_code >= 400 and resp.status_code != 405:
            body = resp.json()
            if op.path.startswith("/v1/messages"):  # Anthropic's error shape on its own paths
                assert set(body) == {"type", "error"} and body["type"] == "error", resp.text[:500]
                assert set(body["error"]) == {"type", "message"}, resp.text[:500]
            else:
                assert set(body) == {"error"}, resp.text[:500]

    try:
        check()
    except Unsatisfiable:
        # An operation whose every input is valid has no negative case (POST /v1/models/{id}/load:
        # a path id only, any string of which is well formed): nothing to get wrong, as for a GET.
        if mode != GenerationMode.NEGATIVE:
            raise


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_for_any_generated_request(fuzz_server, mode):
    ops = _operations(fuzz_server.url)
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"}
    seen: dict[int, int] = {}
    for op in ops:
        if mode == GenerationMode.NEGATIVE and op.method.upper() in ("GET", "DELETE"):
            continue  # GET /v1/models, DELETE /v1/responses/{id}: nothing to get wrong (no negative case)
        _fuzz(op, mode, fuzz_server.url, seen)
    assert seen  # something ran
    if mode == GenerationMode.NEGATIVE:
        assert any(400 <= code < 500 for code in seen)
    assert fuzz_server.proc.poll() is None  # never taken down
    assert httpx.get(fuzz_server.url + "/health", timeout=30).status_code == 200
