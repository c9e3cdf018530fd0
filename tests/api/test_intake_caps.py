"""The intake's two floor/exact pairs (api/inputs.py): the context length and the per-request
token cap are each one function, called on the floor before tokenizing and on the exact count
after; the messages are the ones clients (and tests/api/test_input_edges.py) already read.
No server: these run in the fast tier."""

from __future__ import annotations

import pytest

from tokenpath.api.inputs import Floor, check_context, check_request_tokens
from tokenpath.errors import ContextLengthError, InvalidRequestError


def test_context_floor_refuses_with_the_at_least_message():
    with pytest.raises(ContextLengthError) as info:
        Floor(tokens=0, longest_prompt=4000, completion=200, where="prompt").check_context(4096)
    assert info.value.message == (
        "This model's maximum context length is 4096 tokens. However, the prompt alone is at least 4000 tokens "
        "long, and 200 more are asked for the completion. Please reduce the length of the prompt or completion.")
    assert info.value.param == "prompt"


def test_context_exact_refuses_with_what_was_requested():
    with pytest.raises(ContextLengthError) as info:
        check_context(4000, 200, 4096, "messages", floor=False)
    assert info.value.message == (
        "This model's maximum context length is 4096 tokens. However, you requested 4200 tokens (4000 in the "
        "messages, 200 in the completion). Please reduce the length of the messages or completion.")
    assert info.value.param == "messages"


@pytest.mark.parametrize("floor", [True, False])
def test_context_edges_are_the_same_on_both_sides(floor):
    check_context(4000, 96, 4096, "prompt", floor=floor)  # exactly full: admitted
    with pytest.raises(ContextLengthError):
        check_context(4000, 97, 4096, "prompt", floor=floor)
    # No max_tokens and no room left (what the context leaves is <= 0): one token is still needed.
    with pytest.raises(ContextLengthError, match=r"4096 tokens \(4096 in the prompt, 0 in the completion\)"):
        check_context(4096, 0, 4096, "prompt", floor=False)


def test_request_cap_counts_prompts_and_n_times_max_tokens():
    assert check_request_tokens(100, 10, 2, 3, 15) == 100  # 10 + 2 x 15 x 3: at the cap, admitted
    with pytest.raises(InvalidRequestError) as info:
        check_request_tokens(100, 11, 2, 3, 15)
    assert info.value.message == (
        "this request may cost 101 tokens (prompt tokens + n=2 x max_tokens=15 for each of 3 prompt(s)), over "
        "this server's limit of 100 tokens per request; lower max_tokens, n or the number of prompts")
    assert info.value.param == "max_tokens" and info.value.code == "request_too_large"
