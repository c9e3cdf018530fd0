"""Audit log, usage sums and the `tokenpath keys | audit | usage` commands, on real stores."""

from __future__ import annotations

import json
import logging

import pytest

from tokenpath.cli import main
from tokenpath.gateway import AuditRecord, Gateway, GatewayStore, Limits
from tokenpath.gateway.admin import create_key
from tokenpath.gateway.limiter import DAY_S, day_of


def record(request_id: str, time: float, **kw) -> AuditRecord:
    base = dict(tenant="acme", key_prefix="tp-abcdefgh", model="m1", endpoint="/v1/chat/completions",
                status=200, finish_reason="stop", prompt_tokens=10, cached_tokens=4, completion_tokens=5,
                queue_s=0.01, prefill_s=0.02, decode_s=0.5, total_s=0.6, client="127.0.0.1")
    base.update(kw)
    return AuditRecord(request_id=request_id, time=time, **base)


async def test_audit_rows_round_trip_and_text_only_when_turned_on(store, clock):
    hostile = "m1\n2026-01-01 admin logged in'; DROP TABLE audit_log; --\x1b[31m"
    quiet = Gateway(store, clock=clock)
    await quiet.audit(record("r1", clock(), model=hostile, prompt_text="secret prompt", completion_text="out"))
    await quiet.audit(record("r2", clock() + 1, status=499, finish_reason=None, error_type="client_disconnected"))
    await Gateway(store, clock=clock, log_text=True).audit(record("r3", clock() + 2, prompt_text="p", completion_text="c"))
    rows = store.query_audit()
    assert [r.request_id for r in rows] == ["r1", "r2", "r3"]
    assert rows[0].model == hostile  # stored as data, byte for byte
    assert rows[0].prompt_text is None and rows[0].completion_text is None
    assert (rows[1].status, rows[1].error_type) == (499, "client_disconnected")
    assert (rows[2].prompt_text, rows[2].completion_text) == ("p", "c")
    assert rows[0].queue_s == pytest.approx(0.01) and rows[0].cached_tokens == 4
    assert [r.request_id for r in store.query_audit(since=clock() + 1)] == ["r2", "r3"]
    assert store.query_audit(tenant="other") == []


async def test_audit_failure_is_logged_not_raised(store_location, clock, caplog):
    """A store that cannot be written: the row is spooled (not raised, not lost), the log names the
    cause (not only the exception class), /health's source says degraded, and shutdown counts it."""
    s = GatewayStore(store_location)
    gw = Gateway(s, clock=clock)
    s.close()  # every write now fails
    with caplog.at_level(logging.ERROR, logger="tokenpath.gateway"):
        await gw.audit(record("r-lost", clock()))
        health = gw.audit_health()
        assert health.degraded and "closed" in (health.reason or "")
        assert (health.spool_rows, health.spooled_total, health.dropped_total) == (1, 1, 0)
        await gw.audit_writer.aclose(timeout=0.2)
    assert "Cannot operate on a closed" in caplog.text or "closed" in caplog.text
    assert gw.audit_health().dropped_total == 1 and "1 audit rows could not be written" in caplog.text


def test_usage_sums_by_day_and_model(store, clock):
    midnight = (day_of(clock()) + 1) * DAY_S
    store.write_audit(record("a", midnight - 5, model="m1"))
    store.write_audit(record("b", midnight - 4, model="m2", prompt_tokens=1, completion_tokens=2))
    store.write_audit(record("c", midnight + 5, model="m1", prompt_tokens=100, completion_tokens=0))
    store.write_audit(record("d", midnight + 6, model="m1", tenant="other"))
    rows = store.usage(tenant="acme")
    assert [(u.model, u.requests, u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in rows] == [
        ("m1", 1, 10, 5, 15), ("m2", 1, 1, 2, 3), ("m1", 1, 100, 0, 100)]
    assert rows[0].day == rows[1].day != rows[2].day


def test_cli_keys_lifecycle_never_prints_the_key_twice(store_location, tmp_path, capsys):
    store_args = ["--data-dir", str(tmp_path / "data"), "--database-url", store_location]
    if not store_location.startswith("postgres"):
        store_args = ["--data-dir", str(tmp_path)]  # the SQLite file in the data dir
    assert main(["keys", "tenant", "acme", "--tpm", "5000", *store_args]) == 0
    assert capsys.readouterr().out.split() == ["tenant", "acme:", "rpm=-", "tpm=5000", "daily_tokens=-", "models=*"]
    assert main(["keys", "create", "--tenant", "acme", "--models", "a,b", "--rpm", "7", "--tpm", "900",
                 "--daily-tokens", "10000", "--priority", "2", "--expires", "2099-01-01", *store_args]) == 0
    out, err = capsys.readouterr()
    secret = out.strip()
    assert secret.startswith("tp-") and len(secret) >= 35 and secret[:11] in err
    assert main(["keys", "list", *store_args]) == 0
    listing = capsys.readouterr().out
    assert secret[:11] in listing and secret[11:] not in listing and "active" in listing
    assert main(["keys", "list", "--json", *store_args]) == 0
    row = json.loads(capsys.readouterr().out)
    assert (row["rpm"], row["tpm"], row["daily_tokens"], row["models"], row["priority"]) == (7, 900, 10000, ["a", "b"], 2)
    assert main(["keys", "revoke", secret[:11], *store_args]) == 0
    assert main(["keys", "revoke", "tp-nosuchke", *store_args]) == 1
    assert main(["keys", "list", *store_args]) == 0
    out, err = capsys.readouterr()
    assert "revoked" in out and secret[11:] not in out + err


def test_cli_audit_and_usage(store_location, tmp_path, capsys):
    store_args = ["--data-dir", str(tmp_path), "--database-url", store_location]
    if not store_location.startswith("postgres"):
        store_args = ["--data-dir", str(tmp_path)]
    s = GatewayStore(store_location if store_location.startswith("postgres") else tmp_path / "gateway.sqlite3")
    try:
        s.write_audit(record("r1", 1_796_000_000.0, model="evil\nFAKE LINE"))
        s.write_audit(record("r2", 1_796_000_100.0, tenant="other"))
    finally:
        s.close()
    assert main(["audit", "--tenant", "acme", *store_args]) == 0
    out = capsys.readouterr().out
    assert "evil\\nFAKE LINE" in out and "\nFAKE LINE" not in out and "r2" not in out
    assert len(out.strip().splitlines()) == 2
    assert main(["audit", "--json", "--since", "2026-11-29T00:00:00", *store_args]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["request_id"] for r in rows] == ["r1", "r2"] and rows[0]["model"] == "evil\nFAKE LINE"
    assert main(["usage", "--tenant", "acme", "--json", *store_args]) == 0
    (u,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (u["requests"], u["total_tokens"]) == (1, 15)


async def test_no_secret_beyond_the_prefix_in_store_logs_or_errors(store, store_location, clock, caplog):
    """Exercise every path that touches a key, then search everything the gateway wrote."""
    caplog.set_level(logging.DEBUG)
    secret, record_ = create_key(store, "acme", limits=Limits(rpm=1, tpm=100, daily_tokens=1000), now=clock())
    gw = Gateway(store, clock=clock)
    messages: list[str] = []
    p = await gw.authenticate({"Authorization": f"Bearer {secret}"})
    r = await gw.reserve(p, "m", 50)
    await gw.reconcile(r, 20)
    for attempt in (lambda: gw.reserve(p, "m", 10), lambda: gw.reserve(p, "m", 500),
                    lambda: gw.authenticate({"Authorization": f"Bearer {secret[:-1]}x"})):
        try:
            await attempt()
        except Exception as exc:  # noqa: BLE001 - every refusal's text is checked below
            messages.append(str(exc) + json.dumps(exc.to_body()) + json.dumps(exc.headers))
    gw.check_model(p, "m")
    await gw.audit(record("r", clock(), key_prefix=p.key_prefix))
    store.revoke_key(record_.prefix, clock())
    try:
        await gw.authenticate({"api-key": secret})
    except Exception as exc:  # noqa: BLE001
        messages.append(json.dumps(exc.to_body()))
    assert len(messages) == 4
    dump = _dump_all_text(store) + "\n".join(messages) + caplog.text
    assert record_.prefix in dump  # the prefix is meant to be seen...
    for i in range(len(record_.prefix) + 1, len(secret) + 1):  # ...nothing longer
        assert secret[:i] not in dump
    assert secret[11:19] not in dump and secret[-8:] not in dump


def _dump_all_text(store: GatewayStore) -> str:
    tables = ("tenants", "api_keys", "admissions", "daily_usage", "audit_log")
    parts = []
    with store.db.transaction() as tx:
        for t in tables:
            parts.extend(repr(row) for row in tx.q(f"SELECT * FROM {t}"))
    return "\n".join(parts)


def test_cli_tenant_changes_only_the_flags_given(store_location, tmp_path, capsys):
    store_args = ["--data-dir", str(tmp_path), "--database-url", store_location]
    if not store_location.startswith("postgres"):
        store_args = ["--data-dir", str(tmp_path)]
    assert main(["keys", "tenant", "t", "--rpm", "5", "--tpm", "100", "--models", "a,b", *store_args]) == 0
    assert main(["keys", "tenant", "t", "--tpm", "200", *store_args]) == 0
    assert main(["keys", "tenant", "t", "--rpm", "none", "--models", "none", *store_args]) == 0
    capsys.readouterr()
    assert main(["keys", "tenant", "t", *store_args]) == 0  # no flag: show
    assert capsys.readouterr().out.split() == ["tenant", "t:", "rpm=-", "tpm=200", "daily_tokens=-", "models=*"]
    with pytest.raises(SystemExit):
        main(["keys", "create", "--tenant", "t", "--rpm", "none", *store_args])  # 'none' only on tenants


def test_cli_expiry_durations_point_forward_and_since_points_back():
    from tokenpath.gateway.cli import parse_time

    assert parse_time("30d", now=1000.0, future=True) == 1000.0 + 30 * 86400
    assert parse_time("2h", now=10_000.0) == 10_000.0 - 7200
    assert parse_time("2026-11-30T00:00:00Z") == parse_time("2026-11-30") == 1_795_996_800.0
