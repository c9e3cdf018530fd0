"""Constrained decoding in the engine (issue 22), on the real model: constrained and free rows in one
batch, termination, cut-off, min_tokens against the grammar, seeds, and the spec's trip over the
engine link's codec."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tokenpath import SamplingParams
from tokenpath.engine.structured import GrammarCache, GrammarError
from tokenpath.protocol import GenerateRequest
from tokenpath.protocol.sampling_params import StructuredOutput
from tokenpath.protocol.wire import decode_output, decode_request, encode_output, encode_request

SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "count"], "additionalProperties": False}
JSON = StructuredOutput("json", json.dumps(SCHEMA))
PROMPT = "Pick a colour and a count, as JSON:"


def test_mixed_batch_constrained_rows_valid_free_rows_untouched(smol_llm):
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = smol_llm.generate([PROMPT], free)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=1.0, max_tokens=40, seed=7, structured=JSON)
    regex = SamplingParams(temperature=1.0, max_tokens=10, seed=8, structured=StructuredOutput("regex", "[a-c]{4}"))
    outs = smol_llm.generate([PROMPT, PROMPT, PROMPT], [constrained, free, regex])
    json_out, free_out, regex_out = (o.outputs[0] for o in outs)
    assert free_out.token_ids == alone  # the free row is computed as if alone
    assert json_out.finish_reason == "stop"
    jsonschema.validate(json.loads(json_out.text), SCHEMA)
    assert regex_out.finish_reason == "stop" and re.fullmatch("[a-c]{4}", regex_out.text)
    assert outs[0].grammar is not None and outs[0].grammar.mask_us_per_token > 0


def test_seeded_constrained_sampling_repeats_and_n_choices_each_valid(smol_llm):
    p = SamplingParams(temperature=1.2, max_tokens=40, seed=42, n=3, structured=JSON)
    a = smol_llm.generate([PROMPT], p)[0]
    b = smol_llm.generate([PROMPT], p)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    for c in a.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_cut_off_is_length_and_min_tokens_yields_to_the_grammar(smol_llm):
    cut = smol_llm.generate([PROMPT], SamplingParams(max_tokens=3, structured=JSON))[0].outputs[0]
    assert cut.finish_reason == "length" and cut.text.startswith("{")
    # min_tokens would ban EOS, the only token a finished choice list allows: the grammar wins
    p = SamplingParams(temperature=0, max_tokens=10, min_tokens=8,
                       structured=StructuredOutput("choice", json.dumps(["yes", "no"])))
    c = smol_llm.generate(["Is water wet?"], p)[0].outputs[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop"


def test_spec_crosses_the_engine_link_codec():
    p = SamplingParams(max_tokens=5, structured=StructuredOutput("choice", '["a", "b"]', tools=True))
    frame = encode_request(GenerateRequest("r1", [1, 2, 3], p))
    back = decode_request(frame)
    assert back.params.structured == p.structured


def test_grammar_stats_cross_the_codec(smol_llm):
    out = smol_llm.generate([PROMPT], SamplingParams(max_tokens=30, structured=JSON))[0]
    req = GenerateRequest(out.request_id, out.prompt_token_ids, SamplingParams())
    assert decode_output(encode_output(out), req).grammar == out.grammar


def test_cache_and_refusals(smol_llm):
    cache = GrammarCache(smol_llm.tokenizer.llg_tokenizer())
    first, again = cache.get(JSON), cache.get(JSON)
    assert not first.hit and first.compile_seconds > 0 and again.hit
    with pytest.raises(GrammarError, match="uniqueItems"):
        cache.get(StructuredOutput("json", '{"type": "array", "uniqueItems": true}'))
    with pytest.raises(GrammarError, match="regex"):
        cache.get(StructuredOutput("regex", "(unclosed"))
