"""Keys, authentication and model access through the real guard and store."""

from __future__ import annotations

import pytest

from tokenpath.errors import (
    AuthenticationError,
    InvalidRequestError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from tokenpath.gateway import DenyListPolicy, Gateway, GatewayStore, Principal
from tokenpath.gateway.admin import create_key, set_tenant
from tokenpath.gateway.keys import generate_key, hash_key, key_prefix, looks_like_key, verify_key
from tokenpath.gateway.policy import load_policy


def test_generated_keys_have_the_documented_shape_and_only_a_salted_hash_is_kept():
    a, b = generate_key(), generate_key()
    assert a.secret.startswith("tp-") and len(a.secret) >= 3 + 32 and looks_like_key(a.secret)
    assert a.prefix == a.secret[:11] and key_prefix(a.secret) == a.prefix
    assert a.salt != b.salt and a.secret not in (a.digest, a.salt)
    assert verify_key(a.secret, a.salt, a.digest)
    assert not verify_key(b.secret, a.salt, a.digest)
    assert hash_key(a.secret, b.salt) != a.digest  # the salt matters
    assert not looks_like_key("sk-" + a.secret[3:]) and not looks_like_key(a.secret[:20])


async def test_auth_is_off_until_a_key_exists(store, clock):
    gw = Gateway(store, clock=clock)
    assert not gw.auth_enabled
    assert await gw.authenticate({}) == Principal()
    create_key(store, "acme", now=clock())
    assert gw.auth_enabled
    with pytest.raises(AuthenticationError):
        await gw.authenticate({})


async def test_a_first_key_made_by_another_process_turns_auth_on_at_the_next_request(store_location, clock):
    """With no key, the gateway asks the store before every request, on the event loop where the
    store answers at once (SQLite's `read_nowait`: no thread hop); a key another process made is
    seen by the next request all the same, and a closed store is asked off the loop (and fails)."""
    store = GatewayStore(store_location)
    gw = Gateway(store, clock=clock)
    assert store.has_keys_nowait() is (False if store.db.kind == "sqlite" else None)
    assert await gw.authenticate({}) == Principal()
    other = GatewayStore(store_location)  # another process's connection to the same store
    create_key(other, "acme", now=clock())
    other.close()
    with pytest.raises(AuthenticationError):
        await gw.authenticate({})
    store.close()
    assert store.has_keys_nowait() is None


async def test_the_key_and_its_tenant_are_read_on_the_loop_and_still_see_another_process(store_location, clock):
    """A stored key and its tenant are read before every request: on the event loop where the store
    answers at once (SQLite's `read_nowait`: no thread hop), off it otherwise (PostgreSQL, a closed
    store, which then fails closed). Either way a change another process made is seen by the next
    request: the tenant's model list, then the key's revocation."""
    serving, admin = GatewayStore(store_location), GatewayStore(store_location)
    try:
        secret, record = create_key(admin, "acme", now=clock())
        sqlite = serving.db.kind == "sqlite"
        assert serving.find_key_nowait(record.prefix) == ([record] if sqlite else None)
        assert serving.find_key_nowait("tp-nokey000") == ([] if sqlite else None)
        assert serving.get_tenant_nowait("nobody") == ([] if sqlite else None)
        gw = Gateway(serving, clock=clock)
        p = await gw.authenticate({"Authorization": f"Bearer {secret}"})
        assert p.tenant == "acme" and p.allowed_models is None
        set_tenant(admin, "acme", models=frozenset({"a"}), now=clock())
        tenant = serving.get_tenant_nowait("acme")
        assert tenant is None if not sqlite else [t.models for t in tenant] == [frozenset({"a"})]
        assert (await gw.authenticate({"Authorization": f"Bearer {secret}"})).allowed_models == frozenset({"a"})
        assert admin.revoke_key(record.prefix, clock())
        with pytest.raises(AuthenticationError):
            await gw.authenticate({"Authorization": f"Bearer {secret}"})
        serving.close()
        assert serving.find_key_nowait(record.prefix) is None and serving.get_tenant_nowait("acme") is None
        with pytest.raises(ServiceUnavailableError):  # off the loop, where the closed store fails
            await gw.authenticate({"Authorization": f"Bearer {secret}"})
    finally:
        serving.close()
        admin.close()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "Bearer tp-not-a-real-key"},
        {"api-key": "tp-" + "A" * 43},
    ],
)
async def test_missing_malformed_or_unknown_keys_are_401(store, clock, headers):
    create_key(store, "acme", now=clock())
    with pytest.raises(AuthenticationError) as err:
        await Gateway(store, clock=clock).authenticate(headers)
    assert err.value.status_code == 401
    assert "tp-" + "A" * 8 not in err.value.message and "not-a-real" not in err.value.message


async def test_right_prefix_wrong_secret_is_401_without_the_prefix(store, clock):
    secret, record = create_key(store, "acme", now=clock())
    forged = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    with pytest.raises(AuthenticationError) as err:
        await Gateway(store, clock=clock).authenticate({"Authorization": f"Bearer {forged}"})
    assert record.prefix not in err.value.message


async def test_bearer_and_api_key_headers_both_work(store, clock):
    secret, record = create_key(store, "acme", priority=3, now=clock())
    gw = Gateway(store, clock=clock)
    for headers in ({"authorization": f"bearer {secret}"}, {"API-Key": secret}):
        p = await gw.authenticate(headers)
        assert (p.tenant, p.key_prefix, p.priority, p.max_priority) == ("acme", record.prefix, 3, 3)


async def test_revocation_takes_effect_on_the_next_request_in_another_process(store_location, clock):
    serving, admin = GatewayStore(store_location), GatewayStore(store_location)
    try:
        secret, record = create_key(admin, "acme", now=clock())
        gw = Gateway(serving, clock=clock)
        await gw.authenticate({"Authorization": f"Bearer {secret}"})
        assert admin.revoke_key(record.prefix, clock())
        assert not admin.revoke_key(record.prefix, clock())  # already revoked
        with pytest.raises(AuthenticationError) as err:
            await gw.authenticate({"Authorization": f"Bearer {secret}"})
        assert "revoked" in err.value.message and secret[11:] not in err.value.message
        assert gw.auth_enabled  # revoking the last key does not turn auth off
    finally:
        serving.close()
        admin.close()


async def test_expired_key_is_401(store, clock):
    secret, _ = create_key(store, "acme", expires_at=clock() + 60, now=clock())
    gw = Gateway(store, clock=clock)
    await gw.authenticate({"api-key": secret})
    clock.advance(61)
    with pytest.raises(AuthenticationError) as err:
        await gw.authenticate({"api-key": secret})
    assert "expired" in err.value.message


async def test_model_access_key_and_tenant_lists_intersect(store, clock):
    set_tenant(store, "acme", models=frozenset({"a", "b", "c"}), now=clock())
    secret, _ = create_key(store, "acme", models=frozenset({"b", "c", "d"}), now=clock())
    gw = Gateway(store, clock=clock)
    p = await gw.authenticate({"api-key": secret})
    assert gw.visible_models(p, ["a", "b", "c", "d"]) == ["b", "c"]
    gw.check_model(p, "b")
    for model in ("a", "d"):
        with pytest.raises(PermissionDeniedError) as err:
            gw.check_model(p, model)
        assert err.value.status_code == 403
    anon = Principal()
    assert gw.visible_models(anon, ["a", "d"]) == ["a", "d"]


async def test_last_used_is_recorded(store, clock):
    secret, record = create_key(store, "acme", now=clock())
    assert record.last_used_at is None
    clock.advance(5)
    await Gateway(store, clock=clock).authenticate({"api-key": secret})
    assert store.find_key(record.prefix).last_used_at == clock()


async def test_policy_hook_rejects_with_content_policy_violation(store, clock, tmp_path):
    deny = tmp_path / "deny.txt"
    deny.write_text("# comment\nforbidden phrase\nbadword\n")
    gw = Gateway(store, clock=clock, policy=load_policy(f"deny-list:{deny}"))
    p = await gw.authenticate({})
    await gw.check_policy(p, ["a harmless text", "badwordish is not a whole word"])
    with pytest.raises(InvalidRequestError) as err:
        await gw.check_policy(p, ["fine", "this has a Forbidden  Phrase".replace("  ", " ")])
    assert err.value.code == "content_policy_violation" and err.value.status_code == 400
    assert "forbidden" not in err.value.message.lower()
    await Gateway(store, clock=clock).check_policy(p, ["badword"])  # off by default
    assert isinstance(load_policy("tests.gateway.test_auth:policy_for_tests"), DenyListPolicy)
    with pytest.raises(ValueError):
        load_policy("no_colon_here")


policy_for_tests = DenyListPolicy(["x"])
