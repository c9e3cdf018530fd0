"""The OpenAPI document the server publishes (`/openapi.json`): every operation has an id of its
own. Two operations sharing one (GET and POST /ping did) make FastAPI warn at every start, and
clients generated from the document cannot tell them apart."""

from __future__ import annotations

import warnings

from fastapi import FastAPI

from tokenpath.api import app as app_module


def test_every_operation_id_is_unique():
    app = FastAPI()
    for name in ("api_routes", "anthropic_routes", "dashboard_routes", "tokenize_routes", "lora_routes",
                 "responses_routes", "rerank_routes"):
        app.include_router(getattr(app_module, name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI's "Duplicate Operation ID" is a UserWarning
        doc = app.openapi()
    ids = [op["operationId"] for path in doc["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and "ping_get" in ids and "ping_post" in ids
