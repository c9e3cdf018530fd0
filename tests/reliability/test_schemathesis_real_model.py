"""Schemathesis with the real model names in its cases, so generated requests get past the 404
for an unknown model and reach validation, the tokenizer and the engine (issue 10). Checked with
schemathesis' own `not_a_server_error`, bounded by example count and tiny caps so it fits in CI."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.api.conftest import Server, running_server
from tests.api.test_fuzz import CONFIG
from tests.reliability.nasty_bodies import CHAT_MODEL, EMBED_MODEL

MODEL_FOR = {"/v1/chat/completions": CHAT_MODEL, "/v1/completions": CHAT_MODEL, "/v1/embeddings": EMBED_MODEL}


@pytest.fixture(scope="module")
def small_caps_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("schemathesis")
    (tmp / "server.yaml").write_text(CONFIG)
    with running_server(tmp, "--config", str(tmp / "server.yaml")) as srv:
        yield srv


def with_real_model(case):
    if isinstance(case.body, dict) and case.path in MODEL_FOR:
        case.body["model"] = MODEL_FOR[case.path]
    return case


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_error_with_the_real_model(small_caps_server, mode):
    url = small_caps_server.url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.path in MODEL_FOR]
    assert len(ops) == 3
    statuses: dict[int, int] = {}
    for op in ops:
        @given(case=op.as_strategy(generation_mode=mode).map(with_real_model))
        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            resp = case.call(base_url=url, timeout=120)
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            case.validate_response(resp, checks=[not_a_server_error])

        check()
    if mode == GenerationMode.POSITIVE:
        assert statuses.get(200, 0) > 0, statuses  # the real model was reached, not only 404s
    assert httpx.get(url + "/health", timeout=30).status_code == 200
