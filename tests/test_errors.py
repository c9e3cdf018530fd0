"""The error body's `code` when the raiser gives none: each error names its own default once
(`default_code`), an explicit code wins, and the 503s still carry their Retry-After."""

from __future__ import annotations

import pytest

from tokenpath.errors import (
    ContextLengthError,
    DuplicateRequestIdError,
    EngineDeadError,
    InvalidRequestError,
    RequestFailedError,
    TokenpathError,
)
from tokenpath.replica.base import ProgressTimeoutError, ReplicaStalledError


@pytest.mark.parametrize(("error", "code"), [
    (ContextLengthError, "context_length_exceeded"),
    (DuplicateRequestIdError, "duplicate_request_id"),
    (RequestFailedError, "engine_failed"),
    (ReplicaStalledError, "replica_stalled"),
    (ProgressTimeoutError, "progress_timeout"),
])
def test_an_error_with_its_own_code_uses_it_unless_the_raiser_gives_one(error: type[TokenpathError], code: str):
    assert error("m").code == code
    assert error("m").to_body()["error"]["code"] == code
    assert error("m", code="other").to_body()["error"]["code"] == "other"


@pytest.mark.parametrize("error", [InvalidRequestError, EngineDeadError])
def test_an_error_without_a_code_of_its_own_reports_its_type(error: type[TokenpathError]):
    e = error("m")
    assert e.code is None
    assert e.to_body()["error"]["code"] == e.error_type


def test_the_503s_keep_their_retry_after():
    assert ReplicaStalledError("m").headers["Retry-After"] == "1"
    assert EngineDeadError("m").headers["Retry-After"] == "5"
    assert ProgressTimeoutError("m").headers["Retry-After"] == "2"  # the base's: see errors.ServiceUnavailableError
    assert ReplicaStalledError("m", headers={"Retry-After": "9"}).headers["Retry-After"] == "9"
