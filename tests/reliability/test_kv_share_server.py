"""Another tenant's requests are not preempted to make KV room for a tenant filling the pool
(issue 41; engine/kv_share.py), on the real server.

Tenant A runs three long greedy streams on a pool of 16 blocks (`--num-kv-blocks`, 256 tokens:
less than the three need, so they preempt one another as they grow); a slot of the four
(`--max-num-seqs 4`) stays free. Once the pool is full, tenant B sends short requests one after
another. Before,
each of B's requests was the latest arrival and so the KV victim whenever one of A's grew into the
full pool, and waited in the queue behind A's preempted ones (in the slow-reader flood: B's later
requests took 37-41 s, all of it in decode). Now A, over its share of the pool, gives its own
sequences, and B's requests go ahead of A's preempted ones. Checked on what the engine recorded,
not on timings: B's audit rows show no preemption; A's streams still complete token for token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.api.conftest import Server, running_server
from tests.reliability.nasty_bodies import CHAT_MODEL
from tests.reliability.test_share_preemption import streams
from tests.reliability.test_stall_tenants import HI, closed_rows, create_key

pytestmark = pytest.mark.slow

PROMPTS = ("Tell me a long story about a lighthouse keeper and the sea.",
           "Explain, step by step and at length, how bread is baked.",
           "Describe at length a walk through an old city at night.")


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, str]]:
    tmp = tmp_path_factory.mktemp("kvshare")
    flood, other = create_key(tmp / "data", "flood"), create_key(tmp / "data", "other")
    with running_server(tmp, "--model", CHAT_MODEL, "--max-num-seqs", "4", "--num-kv-blocks", "16",
                        "--block-size", "16") as srv:
        yield srv, flood, other


def test_another_tenants_requests_are_not_the_victims_of_a_full_pool(small_pool: tuple[Server, str, str]):
    srv, a_key, b_key = small_pool
    flood = streams(srv, a_key, "a", PROMPTS)
    deadline = time.monotonic() + 120
    while sum(len(s.parts) for s in flood) < 150 and time.monotonic() < deadline:
        time.sleep(0.1)  # (three prompts and 150 tokens: more than the pool holds)
    b_ids, took = [], []
    with httpx.Client(base_url=srv.base_url, timeout=300, headers={"Authorization": f"Bearer {b_key}"}) as http:
        for i in range(4):
            b_ids.append(f"b-{i}-{time.monotonic_ns()}")
            t0 = time.monotonic()
            reply = http.post("/chat/completions", json=HI, headers={"x-request-id": b_ids[-1]})
            took.append(round(time.monotonic() - t0, 2))
            assert reply.status_code == 200, reply.text
    a_going = sum(not s.done.is_set() for s in flood)
    for s in flood:
        s.join(300)
    rows = closed_rows(srv, [*b_ids, *(s.request_id for s in flood)])
    b_timing = [json.loads(rows[i].timing or "{}") for i in b_ids]
    a_timing = [json.loads(rows[s.request_id].timing or "{}") for s in flood]
    print(f"B took {took} s; A still going after B: {a_going}; preemptions B "
          f"{[t.get('preemptions', 0) for t in b_timing]}, A {[t.get('preemptions', 0) for t in a_timing]}")
    assert a_going >= 1  # (B's requests ran beside A's: the pool was contended)
    assert [t.get("preemptions", 0) for t in b_timing] == [0, 0, 0, 0], b_timing
    assert sum(t.get("preemptions", 0) for t in a_timing) >= 1  # (the pool was short: A gave its own)
    assert [(s.status, s.finish) for s in flood] == [(200, "length")] * 3
