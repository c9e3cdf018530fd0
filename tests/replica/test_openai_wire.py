"""The outward codec (`protocol.openai_wire`): every field of a request reaches an OpenAI-compatible
backend under vLLM's name, goes another way, or is refused by name; none is dropped (issue 37:
constraints and logprobs were dropped through URL replicas, and a 200 came back)."""

from __future__ import annotations

import json

import pytest

from tokenpath.errors import InvalidRequestError
from tokenpath.protocol import GenerateRequest, SamplingParams
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.openai_wire import (
    REQUEST_FIELDS,
    SAMPLING_FIELDS,
    SAMPLING_REFUSED,
    completion_body,
    prompt_payload,
    request_fields,
    sampling_params_fields,
)
from tokenpath.protocol.sampling_params import StructuredOutput

# A value other than the default for every mapped field, and what the body must then hold.
CHANGED: dict[str, tuple[object, object]] = {
    "n": (3, 3), "max_tokens": (7, 7), "temperature": (0.5, 0.5), "top_p": (0.9, 0.9),
    "skip_special_tokens": (False, False), "seed": (11, 11), "stop": (["\n"], ["\n"]),
    "stop_token_ids": ([5], [5]), "top_k": (20, 20), "min_p": (0.1, 0.1), "ignore_eos": (True, True),
    "presence_penalty": (0.5, 0.5), "min_tokens": (2, 2), "frequency_penalty": (0.3, 0.3),
    "logprobs": (3, 3), "repetition_penalty": (1.2, 1.2), "logit_bias": ({9: 5.0}, {9: 5.0}),
    "include_stop_str_in_output": (True, True),
    "structured": (StructuredOutput("choice", '["yes", "no"]'), {"choice": ["yes", "no"]}),
}


def test_every_field_has_a_fate():
    assert set(SAMPLING_FIELDS) | set(SAMPLING_REFUSED) == sampling_params_fields()
    assert not set(SAMPLING_FIELDS) & set(SAMPLING_REFUSED)
    assert set(REQUEST_FIELDS) == request_fields()
    assert set(CHANGED) == set(SAMPLING_FIELDS)  # (this test names a value for each)


@pytest.mark.parametrize("name", sorted(SAMPLING_FIELDS))
def test_a_mapped_field_reaches_the_body(name):
    value, sent = CHANGED[name]
    params = SamplingParams(**{name: value})
    body = completion_body(GenerateRequest("r", [1, 2, 3], params), "m", "vllm-0")
    assert body[SAMPLING_FIELDS[name][0]] == sent
    assert body["prompt"] == [1, 2, 3] and body["return_token_ids"] and body["stream"]


@pytest.mark.parametrize("name", sorted(SAMPLING_REFUSED))
def test_a_field_the_backend_cannot_carry_is_refused_by_name(name):
    params = SamplingParams(**{name: 2})
    with pytest.raises(InvalidRequestError) as refused:
        completion_body(GenerateRequest("r", [1], params), "m", "vllm-0")
    assert refused.value.param == name and "vllm-0" in refused.value.message


def test_defaults_stay_out_and_the_adapter_is_the_model():
    body = completion_body(GenerateRequest("r", [1], SamplingParams(), lora=LoraRef("sql-lora", "/x")), "base",
                           "vllm-0", user="session-1")
    assert body["model"] == "sql-lora" and body["user"] == "session-1"
    assert not {"top_k", "min_p", "stop", "seed", "logprobs", "structured_outputs"} & set(body)


def test_the_echoed_prompt_ids_are_cut_before_parsing_and_nothing_else():
    """vLLM's first chunk with `return_token_ids` (its field order): the prompt's ids become null,
    everything else parses as it was, and ids named inside a string (escaped quotes) stay."""
    chunk = {"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": 'say "prompt_token_ids":[1] ]', "logprobs": None, "finish_reason": None,
         "stop_reason": None, "prompt_token_ids": list(range(4096)), "token_ids": [42]}]}
    for dump in (json.dumps(chunk), json.dumps(chunk, separators=(",", ":"))):
        read = json.loads(prompt_payload(dump))
        assert read["choices"][0].pop("prompt_token_ids") is None
        expect = json.loads(dump)
        del expect["choices"][0]["prompt_token_ids"]
        assert read == expect
    later = json.dumps({"choices": [{"index": 0, "text": "x", "token_ids": [7]}]}, separators=(",", ":"))
    assert prompt_payload(later) is later  # (a chunk without them: untouched, not copied)
    text_only = json.dumps({"choices": [{"index": 0, "text": '"prompt_token_ids":[1, 2]'}]}, separators=(",", ":"))
    assert json.loads(prompt_payload(text_only)) == json.loads(text_only)
