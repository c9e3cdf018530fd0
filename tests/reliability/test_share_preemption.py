"""Another tenant's first request does not wait for a flooding tenant's requests to end (issue 41).

Tenant A fills every running slot (`--max-num-seqs 2`) with long greedy generations; tenant B,
idle until then, sends one short request. The share (admission/share.py) gives B one of the two
slots, but A holds both: before, B's request was dispatched into the engine's queue and waited
there for one of A's to end (in the slow-reader flood, 54-59 s: a stream's socket filling, then
the stall bound). Now admission pauses A's latest request in the engine (admission/preempt.py;
preempted by recompute) and B runs in its slot. Checked on the real server, on what dispatched
B, not on timings:

- B's audit row names the preemption that dispatched it (`admission_preempted`: A's request),
  and B's reply came while both of A's streams were still going;
- A's paused request says so on its own row (`admission_paused`: by B's request; its
  `preempted` cause names B as the culprit, for the tenant share);
- both of A's streams complete, each token for token what the same request produces alone at
  temperature 0: the pause lost or repeated nothing.

In-process and with the engine in its own process (a `--routing` file with one `local` replica:
the request's `preempts` crosses the engine link).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.api.conftest import Server, running_server
from tests.reliability.nasty_bodies import CHAT_MODEL
from tests.reliability.test_stall_tenants import HI, closed_rows, create_key

MAX_TOKENS = 160
PROMPTS = ("Tell me a long story about a lighthouse keeper and the sea.",
           "Explain, step by step and at length, how bread is baked.")


class Stream(threading.Thread):
    """One of A's streaming requests, read as it comes: its text, its first token, its end."""

    def __init__(self, srv: Server, key: str, request_id: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.srv, self.key, self.request_id, self.prompt = srv, key, request_id, prompt
        self.parts: list[str] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.status: int | None = None
        self.finish: str | None = None

    def run(self) -> None:
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": self.prompt}], "stream": True,
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        try:
            with httpx.Client(base_url=self.srv.base_url, timeout=300,
                              headers={"Authorization": f"Bearer {self.key}"}) as http, \
                    http.stream("POST", "/chat/completions", json=body,
                                headers={"x-request-id": self.request_id}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            self.parts.append(choice["delta"]["content"])
                            self.first.set()
                        self.finish = choice.get("finish_reason") or self.finish
        finally:
            self.first.set()
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(self.parts)


def streams(srv: Server, key: str, tag: str, prompts: tuple[str, ...] = PROMPTS) -> list[Stream]:
    """A's streams, started one after the other (each once its first token came), so which
    one was dispatched last, the one to pause, is known."""
    out = []
    for i, prompt in enumerate(prompts):
        s = Stream(srv, key, f"{tag}-{i}-{time.monotonic_ns()}", prompt)
        s.start()
        assert s.first.wait(120), "no first token"
        out.append(s)
    return out


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def two_tenants(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Server, str, str]]:
    tmp = tmp_path_factory.mktemp("sharepreempt")
    flood, other = create_key(tmp / "data", "flood"), create_key(tmp / "data", "other")
    args: tuple[str, ...] = ("--model", CHAT_MODEL, "--max-num-seqs", "2")
    if request.param == "engine-process":  # one `tokenpath engine` process behind the gateway
        routing = tmp / "routing.yaml"
        routing.write_text(f"deployments:\n  - name: {CHAT_MODEL}\n    replicas:\n"
                           "      - local: 1\n        engine: {max_num_seqs: 2}\n")
        args = ("--routing", str(routing))
    with running_server(tmp, *args) as srv:
        yield srv, flood, other


def test_a_tenants_first_request_takes_a_slot_from_the_tenant_holding_them_all(
        two_tenants: tuple[Server, str, str]):
    srv, a_key, b_key = two_tenants
    alone = streams(srv, a_key, "alone")  # the reference: A's requests with nobody else about
    for s in alone:
        s.join(300)
    assert [(s.status, s.finish) for s in alone] == [(200, "length")] * 2

    flood = streams(srv, a_key, "a")  # both running slots are A's
    b_id = f"b-{time.monotonic_ns()}"
    with httpx.Client(base_url=srv.base_url, timeout=300, headers={"Authorization": f"Bearer {b_key}"}) as http:
        reply = http.post("/chat/completions", json=HI, headers={"x-request-id": b_id})
    a_going = [not s.done.is_set() for s in flood]
    for s in flood:
        s.join(300)
    assert reply.status_code == 200, reply.text
    assert a_going == [True, True]  # B's reply came while both of A's streams still ran

    rows = closed_rows(srv, [b_id, *(s.request_id for s in flood)])
    b_row, a_rows = rows[b_id], [rows[s.request_id] for s in flood]
    b_timing = json.loads(b_row.timing or "{}")
    a_timing = [json.loads(r.timing or "{}") for r in a_rows]
    print(f"B: {b_timing.get('admission')}, {b_timing.get('admission_preempted')}; "
          f"A: {[t.get('admission_paused') for t in a_timing]}")
    # What dispatched B: the preemption of A's latest request, not the end of one of A's.
    assert b_timing.get("admission_preempted", {}).get("request_id") == a_rows[1].request_id, b_timing
    assert b_timing["admission_preempted"]["tenant"] == "flood"
    assert not any(c.get("detail", {}).get("freed_by") for c in b_timing.get("causes", [])), b_timing
    # The paused request says by whom; the other was never paused.
    assert a_timing[1].get("admission_paused") == [
        {"by": b_row.request_id, "tenant": "other", "replica": a_timing[1]["replica"]}], a_timing[1]
    assert a_timing[1].get("preemptions", 0) >= 1
    preempted = [c for c in a_timing[1].get("causes", []) if c["kind"] == "preempted"]
    assert preempted and b_row.request_id in preempted[0]["detail"]["for_tenant_share"], a_timing[1]
    assert "admission_paused" not in a_timing[0]
    # Nothing lost or repeated: each of A's streams is what it is alone.
    assert [(s.status, s.finish) for s in flood] == [(200, "length")] * 2
    assert [(r.status, r.finish_reason) for r in a_rows] == [(200, "length")] * 2
    assert [s.text for s in flood] == [s.text for s in alone]
