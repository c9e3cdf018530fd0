"""`serve --replicas 2 --otlp-endpoint`: one request is one trace across processes.

The gateway sends `traceparent` naming its `dispatch` span to the engine process it picked;
that process (exporting to the same receiver, as `tokenpath-engine`) makes its own request
root a child of it, with its engine queue/prefill/decode spans beneath, all inside the
gateway's dispatch span in time.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.telemetry.conftest import Served, chat, launch, stop
from tests.telemetry.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    receiver = OtlpReceiver().start()
    srv = launch(tmp_path_factory.mktemp("replicas"), receiver, "--replicas", "2", wait=600)
    try:
        yield srv
    finally:
        code = stop(srv)
        receiver.stop()
    assert code == 0, srv.output()[-3000:]


def test_one_trace_spans_the_gateway_and_the_engine_process(two_replicas: Served):
    srv = two_replicas
    with httpx.Client(base_url=srv.url, timeout=300) as http, http.stream(
            "POST", "/v1/chat/completions", headers=srv.headers(), json=chat(8, stream=True)) as resp:
        assert resp.status_code == 200
        rid = resp.headers["x-request-id"]
        assert "[DONE]" in "".join(resp.iter_lines())
    roots = srv.receiver.wait_for(lambda s: s["attributes"].get("gen_ai.response.id") == rid, timeout=30)
    assert len(roots) == 1
    root = roots[0]
    srv.receiver.wait_for(lambda s: s["trace_id"] == root["trace_id"] and s["service"] == "tokenpath-engine"
                          and s["name"] == "engine.decode", timeout=30)
    spans = srv.receiver.trace(root["trace_id"])
    services = {s["service"] for s in spans}
    assert services == {"tokenpath", "tokenpath-engine"}, services
    dispatch = next(s for s in spans if s["name"].startswith("dispatch ") and s["service"] == "tokenpath")
    assert dispatch["parent_id"] == root["span_id"] and dispatch["attributes"]["tokenpath.replica"].startswith("engine-")
    engine_root = next(s for s in spans if s["service"] == "tokenpath-engine" and s["kind"] == "SPAN_KIND_SERVER")
    assert engine_root["parent_id"] == dispatch["span_id"]
    ids = {s["span_id"] for s in spans}
    assert all(s["parent_id"] in ids for s in spans if s is not root)
    engine_spans = [s for s in spans if s["service"] == "tokenpath-engine"]
    assert {"engine.queue", "engine.prefill", "engine.decode"} <= {s["name"] for s in engine_spans}
    for s in engine_spans:
        assert dispatch["start"] <= s["start"] <= s["end"] <= dispatch["end"], s["name"]
