"""Speculation under a grammar (structured output, tool calls): the proposal is cut where the
grammar would refuse it, and each verification row is masked by the grammar state after the
drafts before it.

Why this keeps exactness: row j's logits are the target's distribution after the first j drafts;
plain constrained decoding would mask that row by the grammar state after those same j tokens.
With the same mask, greedy verification picks what plain decoding would, and rejection sampling
draws from the same masked distribution. The drafts are all grammar-valid (cut here), so the
state after any accepted prefix exists; the matcher itself is never left advanced by the walk
(validate, then consume + rollback), and it takes the emitted tokens one at a time in the engine's
output loop, exactly where plain decoding's sampler would have.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (a matcher is handed in: only an engine that compiled a grammar ever imports it)
    import llguidance


def grammar_drafts(matcher: llguidance.LLMatcher, drafts: list[int]) -> list[int]:
    """`drafts` up to the first token the grammar refuses, and up to (including) a token that
    completes it: after that token plain decoding stops ("the grammar accepts nothing more"), so
    a later draft could never be emitted. The matcher ends where it began."""
    if not drafts:
        return drafts
    drafts = drafts[: matcher.validate_tokens(drafts)]
    walked = 0
    for t in drafts:
        if not matcher.consume_token(t):  # (validated: never; stop the walk all the same)
            break
        walked += 1
        if matcher.is_stopped():
            break
    matcher.rollback(walked)
    return drafts[:walked]
