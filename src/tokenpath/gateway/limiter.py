"""Rate-limit decisions: pure functions over a snapshot of usage, so the store can call them inside
the same transaction that read the snapshot and records the admission (which is what makes the
limits exact under concurrency: read, decide and write happen under one lock).

Windows:
- requests and tokens per minute use a *sliding* 60 s window over admission rows, so no two
  adjacent instants can together admit twice the limit (a fixed window allows that at its edges);
- daily tokens use the UTC calendar day of the gateway's clock (`day_of`), reset at midnight.

Tokens are reserved at admission (prompt + max_tokens) and the admission row is rewritten to the
real use when the request ends, which returns the unused part to the window and to the day.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenpath.gateway.base import Limits

WINDOW_S = 60.0
DAY_S = 86400


def day_of(now: float) -> int:
    """UTC day number of a wall-clock time; quotas reset when it changes."""
    return int(now // DAY_S)


@dataclass
class ScopeUsage:
    """What one scope (a key, or a whole tenant) has used, read inside the reserving transaction."""

    kind: str  # "key" or "tenant"
    name: str
    limits: Limits
    requests: int = 0  # admissions in the sliding window
    tokens: int = 0  # tokens of those admissions (reserved, or actual once reconciled)
    oldest_at: float | None = None  # the oldest admission still in the window
    day_tokens: int = 0


@dataclass
class Verdict:
    allowed: bool
    headers: dict[str, str] = field(default_factory=dict)
    reason: str | None = None  # "requests", "tokens", "daily_tokens", "too_large"
    scope: ScopeUsage | None = None  # the scope that refused
    message: str = ""
    retry_after: float = 0.0


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: '450ms', '12s', '6m0s', '1h2m3s'."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{int(seconds)}s"
    total = int(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m}m{s}s" if h else f"{m}m{s}s"


def decide(usages: Sequence[ScopeUsage], tokens: int, now: float) -> Verdict:
    """Admit a request of `tokens` tokens if every scope is within every limit."""
    for u in usages:
        lim = u.limits
        if lim.tpm is not None and tokens > lim.tpm:
            return _too_large(u, tokens, lim.tpm, "tokens per minute")
        if lim.daily_tokens is not None and tokens > lim.daily_tokens:
            return _too_large(u, tokens, lim.daily_tokens, "tokens per day")
    for u in usages:
        lim = u.limits
        if lim.rpm is not None and u.requests + 1 > lim.rpm:
            return _refuse(u, "requests", f"requests per minute: limit {lim.rpm}, used {u.requests}", usages, now)
        if lim.tpm is not None and u.tokens + tokens > lim.tpm:
            msg = f"tokens per minute: limit {lim.tpm}, used {u.tokens}, requested {tokens}"
            return _refuse(u, "tokens", msg, usages, now)
        if lim.daily_tokens is not None and u.day_tokens + tokens > lim.daily_tokens:
            msg = f"tokens per day: limit {lim.daily_tokens}, used {u.day_tokens}, requested {tokens}"
            verdict = _refuse(u, "daily_tokens", msg, usages, now)
            verdict.retry_after = (day_of(now) + 1) * DAY_S - now
            return verdict
    after = [_charged(u, tokens, now) for u in usages]
    return Verdict(allowed=True, headers=rate_limit_headers(after, now))


def sliding_retry_after(
    rows: Sequence[tuple[float, int]], now: float, excess_requests: int, excess_tokens: int
) -> float:
    """Seconds until enough of the window's admissions (oldest first) expire to make room."""
    freed_tokens = 0
    for freed_requests, (at, tokens) in enumerate(rows, start=1):
        freed_tokens += tokens
        if freed_requests >= excess_requests and freed_tokens >= excess_tokens:
            return max(0.0, at + WINDOW_S - now)
    return WINDOW_S


def excess(u: ScopeUsage, reason: str, tokens: int) -> tuple[int, int]:
    """How many requests / tokens must leave the window before this request fits."""
    if reason == "requests":
        return u.requests + 1 - (u.limits.rpm or 0), 0
    return 0, u.tokens + tokens - (u.limits.tpm or 0)


def rate_limit_headers(usages: Sequence[ScopeUsage], now: float) -> dict[str, str]:
    """x-ratelimit-* for the tightest scope of each kind; empty when no limit applies."""
    headers: dict[str, str] = {}
    for kind, limit_of, used_of in (
        ("requests", lambda u: u.limits.rpm, lambda u: u.requests),
        ("tokens", lambda u: u.limits.tpm, lambda u: u.tokens),
    ):
        limited = [u for u in usages if limit_of(u) is not None]
        if not limited:
            continue
        tight = min(limited, key=lambda u: limit_of(u) - used_of(u))
        reset = WINDOW_S if tight.oldest_at is None else tight.oldest_at + WINDOW_S - now
        headers[f"x-ratelimit-limit-{kind}"] = str(limit_of(tight))
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, limit_of(tight) - used_of(tight)))
        headers[f"x-ratelimit-reset-{kind}"] = format_duration(reset)
    daily = [u for u in usages if u.limits.daily_tokens is not None]
    if daily:
        tight = min(daily, key=lambda u: u.limits.daily_tokens - u.day_tokens)
        headers["x-ratelimit-limit-tokens-day"] = str(tight.limits.daily_tokens)
        headers["x-ratelimit-remaining-tokens-day"] = str(max(0, tight.limits.daily_tokens - tight.day_tokens))
        headers["x-ratelimit-reset-tokens-day"] = format_duration((day_of(now) + 1) * DAY_S - now)
    return headers


def _charged(u: ScopeUsage, tokens: int, now: float) -> ScopeUsage:
    return ScopeUsage(
        u.kind, u.name, u.limits, u.requests + 1, u.tokens + tokens,
        now if u.oldest_at is None else u.oldest_at, u.day_tokens + tokens,
    )


def _refuse(u: ScopeUsage, reason: str, detail: str, usages: Sequence[ScopeUsage], now: float) -> Verdict:
    who = f"key {u.name}" if u.kind == "key" else f"tenant {u.name!r}"
    return Verdict(
        allowed=False, reason=reason, scope=u, headers=rate_limit_headers(usages, now),
        message=f"Rate limit reached for {who} on {detail}. Please retry later.",
    )


def _too_large(u: ScopeUsage, tokens: int, limit: int, what: str) -> Verdict:
    who = f"key {u.name}" if u.kind == "key" else f"tenant {u.name!r}"
    return Verdict(
        allowed=False, reason="too_large", scope=u,
        message=(f"Request too large for {who}: it needs {tokens} tokens (prompt + max_tokens), more than "
                 f"the limit of {limit} {what}. Lower max_tokens or shorten the prompt."),
    )
