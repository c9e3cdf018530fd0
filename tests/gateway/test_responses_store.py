"""Stored Responses API responses: per tenant, retention, deletion; on SQLite, PostgreSQL (when
TOKENPATH_TEST_POSTGRES_URL is set) and the in-memory store an app without a gateway store uses."""

from __future__ import annotations

import pytest

from tokenpath.gateway.responses_store import PRUNE_EVERY, MemoryResponses, ResponseStore, SqlResponses
from tokenpath.gateway.store import GatewayStore

DAY = 86400.0


@pytest.fixture(params=["sql", "memory"])
def responses(request: pytest.FixtureRequest, store: GatewayStore) -> ResponseStore:
    return SqlResponses(store, retention_s=DAY) if request.param == "sql" else MemoryResponses(retention_s=DAY)


def test_a_response_is_found_only_under_its_own_tenant(responses, clock):
    record = {"response": {"id": "resp_1", "output": []}, "input": [{"type": "message", "content": "héllo"}]}
    responses.put("resp_1", "alpha", clock(), record)
    assert responses.get("resp_1", "alpha", clock()) == record
    assert responses.get("resp_1", "beta", clock()) is None  # the same answer as an unknown id
    assert responses.get("resp_2", "alpha", clock()) is None
    assert responses.delete("resp_1", "beta") is False
    assert responses.get("resp_1", "alpha", clock()) == record
    assert responses.delete("resp_1", "alpha") is True
    assert responses.get("resp_1", "alpha", clock()) is None
    assert responses.delete("resp_1", "alpha") is False


def test_past_the_retention_limit_a_response_is_gone(responses, clock):
    responses.put("resp_old", "alpha", clock(), {"response": {}, "input": []})
    assert responses.get("resp_old", "alpha", clock() + DAY - 1) is not None
    assert responses.get("resp_old", "alpha", clock() + DAY + 1) is None


def test_expired_rows_are_deleted_as_new_ones_are_written(store, clock):
    responses = SqlResponses(store, retention_s=DAY)
    responses.put("resp_old", "alpha", clock(), {"response": {}, "input": []})
    for i in range(PRUNE_EVERY):
        responses.put(f"resp_{i}", "alpha", clock() + 2 * DAY, {"response": {}, "input": []})
    with store.db.transaction() as tx:
        ids = {r[0] for r in tx.q("SELECT id FROM stored_responses")}
    assert "resp_old" not in ids and len(ids) == PRUNE_EVERY
