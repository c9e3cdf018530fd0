"""Re-sizing a reservation made on an estimate (`Gateway.adjust`) on both limits backends: the SQL
store and Redis (a real redis-server; tests/gateway/test_redis_limits.py walks both at random and
compares them). A grown admission is decided as if it were asked for now, without counting a
second request; a refused one leaves the window; a resent Redis adjust changes nothing."""

from __future__ import annotations

import pytest
from redis_fixtures import free_port

from tokenpath.errors import RateLimitError, ServiceUnavailableError
from tokenpath.gateway import Gateway, Limits
from tokenpath.gateway.admin import create_key


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture(params=["sql", "redis"])
def gateway_for(request: pytest.FixtureRequest, store, clock):
    """A gateway on the SQL store's limits or on Redis's (the keys are in the store either way)."""
    limits = request.getfixturevalue("make_limits")() if request.param == "redis" else None
    return lambda: Gateway(store, clock=clock, limits=limits)


async def test_growth_counts_no_second_request_and_refusal_frees_the_admission(store, clock, gateway_for):
    secret, _ = create_key(store, "acme", limits=Limits(rpm=3, tpm=100, daily_tokens=1000), now=clock())
    gw = gateway_for()
    p = await gw.authenticate(bearer(secret))
    a = await gw.reserve(p, "m", 10)  # the estimate, before tokenizing
    await gw.adjust(a, 60)  # the exact count: still one request of three
    assert a.headers["x-ratelimit-remaining-requests"] == "2"
    assert a.headers["x-ratelimit-remaining-tokens"] == "40"
    assert a.headers["x-ratelimit-remaining-tokens-day"] == "940"
    clock.advance(10)
    b = await gw.reserve(p, "m", 30)
    await gw.adjust(b, 20)  # shrinking gives the difference back at once
    clock.advance(10)
    c = await gw.reserve(p, "m", 5)
    with pytest.raises(RateLimitError) as err:  # 60 + 20 + 90 > 100: refused, the admission removed
        await gw.adjust(c, 90)
    assert c.reconciled
    assert "tokens per minute: limit 100, used 80, requested 90" in err.value.message
    assert err.value.retry_after == pytest.approx(50)  # a's 60 is not enough to leave; b's 20 too is
    # c's request and tokens are gone from the window (else the third request would be refused)
    # and from the day.
    after = await gw.reserve(p, "m", 20)
    assert after.headers["x-ratelimit-remaining-requests"] == "0"
    assert after.headers["x-ratelimit-remaining-tokens"] == "0"
    assert after.headers["x-ratelimit-remaining-tokens-day"] == str(1000 - 60 - 20 - 20)


async def test_refused_growth_retry_after_ignores_the_refused_admission(store, clock, gateway_for):
    secret, _ = create_key(store, "acme", limits=Limits(tpm=100), now=clock())
    gw = gateway_for()
    p = await gw.authenticate(bearer(secret))
    a = await gw.reserve(p, "m", 10)
    clock.advance(10)
    await gw.reserve(p, "m", 80)
    with pytest.raises(RateLimitError) as err:  # 80 + 30 > 100: a's 10 leaving would be enough, but a is gone
        await gw.adjust(a, 30)
    assert err.value.retry_after == pytest.approx(60)  # when the 80 leaves, not when a would have (50)


async def test_a_resent_adjust_changes_nothing(store, clock, make_limits):
    """The client resends a script after a dropped connection: the second run must return the
    first one's verdict and charge, give back or remove nothing more."""
    secret, _ = create_key(store, "acme", limits=Limits(rpm=10, tpm=1000, daily_tokens=5000), now=clock())
    limits = make_limits()
    gw = Gateway(store, clock=clock, limits=limits)
    p = await gw.authenticate(bearer(secret))

    async def twice(r, tokens: int):
        args = (r.admission_id, p.key_prefix, p.tenant, Limits(rpm=10, tpm=1000, daily_tokens=5000), Limits(),
                r.day, r.tokens, tokens, clock())
        first, second = await limits.adjust(*args), await limits.adjust(*args)
        assert (first.allowed, first.headers, first.reason, first.retry_after, first.message) == \
            (second.allowed, second.headers, second.reason, second.retry_after, second.message)
        return first

    grown = await twice(await gw.reserve(p, "m", 100), 300)  # grow: +200 once
    assert grown.allowed and grown.headers["x-ratelimit-remaining-tokens"] == "700"
    assert (await twice(await gw.reserve(p, "m", 400), 250)).allowed  # shrink: -150 once
    refused = await twice(await gw.reserve(p, "m", 100), 600)  # 300 + 250 + 600 > 1000
    assert not refused.allowed and refused.reason == "tokens"
    probe = await gw.reserve(p, "m", 1)  # the window: 300 + 250 + 1, three requests; the day the same
    assert probe.headers["x-ratelimit-remaining-requests"] == str(10 - 3)
    assert probe.headers["x-ratelimit-remaining-tokens"] == str(1000 - 551)
    assert probe.headers["x-ratelimit-remaining-tokens-day"] == str(5000 - 551)


@pytest.mark.requires("redis")
async def test_adjust_with_redis_unreachable_fails_closed_or_open(store, clock):
    from tokenpath.gateway.redis_limits import RedisLimits

    args = ("0" * 32, "tp-key", "acme", Limits(tpm=100), Limits(), 1, 10, 50, clock())
    closed = RedisLimits(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)  # nothing listens there
    with pytest.raises(ServiceUnavailableError) as err:
        await closed.adjust(*args)
    assert err.value.to_body()["error"]["code"] == "rate_limits_unavailable"
    opened = RedisLimits(f"redis://127.0.0.1:{free_port()}/0", fail_open=True, timeout_s=0.5)
    assert (await opened.adjust(*args)).allowed  # as configured: the request goes on with its estimate
    await closed.aclose()
    await opened.aclose()
