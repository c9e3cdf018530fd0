"""`open_gateway` (what `tokenpath serve` calls) and the serve-time rule it feeds."""

from __future__ import annotations

import pytest

from tokenpath.cli import main
from tokenpath.errors import InvalidRequestError
from tokenpath.gateway import AuditRecord, Gateway, GatewayStore, open_gateway
from tokenpath.gateway.admin import create_key


async def test_empty_data_dir_means_auth_off_but_audit_rows_written(tmp_path):
    gw = open_gateway(tmp_path)
    try:
        assert isinstance(gw, Gateway) and not gw.auth_enabled
        p = await gw.authenticate({"Authorization": "Bearer whatever"})
        assert p.tenant == "anonymous" and p.key_prefix is None
        r = await gw.reserve(p, "m", 10)
        assert r.headers == {}  # no limits apply: no rate-limit headers
        await gw.audit(AuditRecord("r1", 1.0, p.tenant, None, "m", "/v1/chat/completions", 200))
        assert [row.request_id for row in gw.store.query_audit()] == ["r1"]
        assert (tmp_path / "gateway.sqlite3").is_file()
    finally:
        gw.close()


def test_serve_refuses_a_public_host_without_keys(tmp_path, capsys):
    assert main(["serve", "--host", "0.0.0.0", "--port", "0", "--data-dir", str(tmp_path)]) == 2
    assert "no API keys exist" in capsys.readouterr().err


async def test_options_from_the_environment(tmp_path, monkeypatch):
    deny = tmp_path / "deny.txt"
    deny.write_text("forbidden\n")
    monkeypatch.setenv("TOKENPATH_POLICY", f"deny-list:{deny}")
    monkeypatch.setenv("TOKENPATH_AUDIT_TEXT", "1")
    gw = open_gateway(tmp_path)
    try:
        p = await gw.authenticate({})
        with pytest.raises(InvalidRequestError):
            await gw.check_policy(p, ["forbidden"])
        await gw.audit(AuditRecord("r", 1.0, "anonymous", None, "m", "/v1/completions", 200, prompt_text="hello"))
        assert gw.store.query_audit()[0].prompt_text == "hello"
    finally:
        gw.close()


def test_database_url_from_the_environment_wins_over_the_data_dir(tmp_path, monkeypatch):
    other = tmp_path / "elsewhere.sqlite3"
    store = GatewayStore(other)
    create_key(store, "acme")
    store.close()
    monkeypatch.setenv("TOKENPATH_DATABASE_URL", f"sqlite://{other}")
    gw = open_gateway(tmp_path / "data")
    try:
        assert gw.auth_enabled
    finally:
        gw.close()
