"""The dashboard's numbers move while requests decode on engine processes (`serve --replicas 2`):
each in-flight request's token count and its replica's generation tokens grow before any request
finishes (they used to count finished requests only, so tok/s read 0.0 while 8 requests decoded)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.telemetry.conftest import Served, chat, launch, stop


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory, receiver) -> Served:
    srv = launch(tmp_path_factory.mktemp("dash-replicas"), receiver, "--replicas", "2", wait=600)
    try:
        yield srv
    finally:
        assert stop(srv) == 0, srv.output()[-3000:]


def test_tokens_and_replica_counts_move_during_decode(two_engines: Served):
    srv = two_engines
    admin = srv.headers("admin")
    done = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=srv.url, timeout=300) as client, client.stream(
                "POST", "/v1/chat/completions", headers=srv.headers(),
                json=chat(1000, stream=True, ignore_eos=True)) as resp:
            for _ in resp.iter_lines():
                pass
        done.set()

    workers = [threading.Thread(target=stream) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        seen: list[tuple[int, int]] = []  # (sum of in-flight tokens, sum of replica generation tokens)
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=srv.url, timeout=30, headers=admin) as http:
            while time.monotonic() < deadline and not done.is_set():
                d = http.get("/dashboard/data").json()
                streaming = [r for r in d["inflight"] if r["stage"] == "decode"]
                if streaming:
                    reps = [r for dep in d["deployments"] for r in dep["replicas"]]
                    seen.append((sum(r["tokens"] for r in streaming), sum(r["generation_tokens"] for r in reps)))
                if len(seen) >= 3 and seen[-1][0] > seen[0][0] and seen[-1][1] > seen[0][1]:
                    break
                time.sleep(0.3)
        assert len(seen) >= 2, "no request was seen decoding"
        assert seen[-1][0] > seen[0][0] and seen[-1][1] > seen[0][1], seen
        assert not done.is_set() or seen[-1][1] > 0
    finally:
        for w in workers:
            w.join(300)
