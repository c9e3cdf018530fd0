"""The API calls the real gateway at its fixed points: keys (401), model ACL (403), filtered
/v1/models, x-ratelimit-* headers from the reservation, 429 past the RPM limit, and one audit row
per request, errors included."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

CHAT = "smollm2-135m-instruct"
EMBED = "all-minilm-l6-v2"
TOKENPATH = str(Path(sys.executable).parent / "tokenpath")


@pytest.fixture(scope="module")
def gated(tmp_path_factory, launch_server):
    tmp = tmp_path_factory.mktemp("gated")
    data = tmp / "data"
    out = subprocess.run([TOKENPATH, "keys", "create", "--data-dir", str(data), "--tenant", "acme",
                          "--models", EMBED, "--rpm", "4"], capture_output=True, text=True, check=True)
    key = out.stdout.split()[0]
    srv = launch_server(tmp)
    yield srv, key, data
    assert srv.stop() == 0, srv.output()[-3000:]


def test_keys_acl_limits_and_audit(gated):
    srv, key, data = gated
    anonymous = openai.OpenAI(base_url=srv.base_url, api_key="tp-not-a-real-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.embeddings.create(model=EMBED, input="x")
    assert httpx.post(srv.base_url + "/embeddings", json={"model": EMBED, "input": "x"}).status_code == 401

    client = openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0)
    assert [m.id for m in client.models.list()] == [EMBED]
    raw = client.embeddings.with_raw_response.create(model=EMBED, input="hello")
    assert raw.headers["x-ratelimit-limit-requests"] == "4"
    request_id = raw.headers["x-request-id"]
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    statuses = []
    for _ in range(4):
        try:
            client.embeddings.create(model=EMBED, input="again")
            statuses.append(200)
        except openai.RateLimitError as exc:
            statuses.append(429)
            assert int(exc.response.headers["retry-after"]) >= 1
    assert statuses[-1] == 429

    rows = subprocess.run([TOKENPATH, "audit", "--data-dir", str(data), "--json", "--limit", "100"],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    audit = [json.loads(r) for r in rows]
    ours = [r for r in audit if r["request_id"] == request_id]
    assert len(ours) == 1 and ours[0]["status"] == 200 and ours[0]["tenant"] == "acme"
    assert ours[0]["endpoint"] == "/v1/embeddings" and ours[0]["prompt_tokens"] == 3
    assert {r["status"] for r in audit} >= {200, 401, 403, 429}
