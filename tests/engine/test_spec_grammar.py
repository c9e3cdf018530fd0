"""Speculative decoding under a grammar (engine/spec/grammar.py): structured output and tool calls
draft and accept tokens, greedy output is token for token the plain engine's, a draft the grammar
forbids is never accepted, and sampled output always parses."""

from __future__ import annotations

import json

import pytest

from tokenpath import LLM, SamplingParams
from tokenpath.api.tools import constraint, parse_tools, tagged_system_prompt
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.grammar import grammar_drafts
from tokenpath.engine.spec.ngram import NgramIndex
from tokenpath.protocol.sampling_params import StructuredOutput

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
RECORD = {"name": "Ada Lovelace", "born": "10 December 1815, London", "field": "mathematics",
          "known_for": "the first published computer program, for Babbage's Analytical Engine"}
SCHEMA = StructuredOutput("json", json.dumps({
    "type": "object", "properties": {k: {"type": "string"} for k in RECORD}, "required": list(RECORD),
    "additionalProperties": False}))
COPY = [{"role": "user", "content": "Copy this record as JSON exactly:\n" + json.dumps(RECORD)}]
TOOLS = [{"type": "function", "function": {
    "name": "write_file", "description": "Write a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"], "additionalProperties": False}}}]

pytestmark = [pytest.mark.slow, pytest.mark.requires("kernels")]  # (loads SmolLM2: not the fast tier)


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    kw = dict(kv_cache_memory="64MiB")
    return LLM("smollm2-135m-instruct", **kw), LLM("smollm2-135m-instruct", speculative_config=json.dumps(SPEC), **kw)


def _tool_chat() -> tuple[list[dict], StructuredOutput]:
    plan = parse_tools(TOOLS, "required", None, None)
    assert plan is not None
    spec = constraint(plan)
    assert spec is not None
    messages = [{"role": "system", "content": tagged_system_prompt(plan)},
                {"role": "user", "content": 'Call write_file with path "geometry.py" and content '
                                            '"def area(r): return 3.14159 * r * r".'}]
    return messages, spec


def _calls(text: str) -> list[dict]:
    """The JSON bodies of the tagged calls (the grammar: `<tool_call>{...}</tool_call>`, newline-separated)."""
    return [json.loads(part.removeprefix("<tool_call>").removesuffix("</tool_call>")) for part in text.split("\n")]


@pytest.mark.parametrize("case", ["json_schema", "tool_call"])
def test_greedy_constrained_output_is_the_plain_engines_with_drafts_accepted(pair, case):
    plain, llm = pair
    messages, structured = (COPY, SCHEMA) if case == "json_schema" else _tool_chat()
    p = SamplingParams(temperature=0, max_tokens=160, structured=structured)
    want, got = plain.chat(messages, p)[0], llm.chat(messages, p)[0]
    w, g = want.outputs[0], got.outputs[0]
    assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert g.finish_reason == "stop"  # the grammar completed, as without speculation
    assert got.events.spec is not None, "no draft under the grammar"
    drafts, proposed, accepted = got.events.spec
    assert proposed >= accepted > 0  # drafts were made and accepted: the test can fail
    assert drafts < len(g.token_ids)
    if case == "json_schema":
        assert json.loads(g.text) == RECORD
    else:
        assert _calls(g.text)[0] == {"name": "write_file", "arguments": {
            "path": "geometry.py", "content": "def area(r): return 3.14159 * r * r"}}
    assert llm.engine.blocks.check_consistency() == []


def test_drafts_are_cut_where_the_grammar_refuses_and_the_matcher_is_left_as_it_was(pair):
    _, llm = pair
    tok = llm.engine.tokenizer
    matcher = tok.grammars.get(SCHEMA).matcher
    doc = tok.encode(json.dumps(RECORD))
    newline = tok.encode("\n")
    assert len(newline) == 1
    assert grammar_drafts(matcher, doc[:5] + newline + doc[5:8]) == doc[:5]  # compact JSON: no newline
    assert grammar_drafts(matcher, newline + doc) == []
    assert grammar_drafts(matcher, doc + doc) == doc  # cut after the token that completes the document
    assert not matcher.is_error() and matcher.validate_tokens(doc) == len(doc)  # the walk was rolled back
    matcher.consume_tokens(doc[:3])
    assert grammar_drafts(matcher, doc[3:9]) == doc[3:9]  # from where the matcher stands


def test_a_draft_the_grammar_forbids_is_never_accepted(pair):
    """The schema pins a year that differs from the record being copied, so the n-gram proposer
    drafts the prompt's year, which the model itself prefers and the grammar forbids. Drafted
    without the grammar's cut (a proposer that bypasses it), verification's masks alone must
    refuse those drafts; with the cut, they are never drafted. Either way: the plain engine's output."""
    plain, llm = pair
    pinned = StructuredOutput("json", json.dumps({
        "type": "object", "properties": {**{k: {"type": "string"} for k in RECORD}, "born": {"const": "10 December 1816, London"}},
        "required": list(RECORD), "additionalProperties": False}))
    p = SamplingParams(temperature=0, max_tokens=80, structured=pinned)
    want = plain.chat(COPY, p)[0].outputs[0]
    assert "1816" in want.text and want.finish_reason == "stop"
    spec = llm.engine.spec
    refused: list[list[int]] = []
    index = NgramIndex(SPEC["prompt_lookup_min"], SPEC["prompt_lookup_max"])

    def uncut(seq: Sequence, k: int) -> list[int]:  # (k: SpecDecoder.draft_len's)
        drafts = index.propose(seq.token_ids, k)
        if seq.grammar is not None and seq.grammar.matcher.validate_tokens(drafts) < len(drafts):
            refused.append(drafts)
        return drafts

    spec.propose = uncut
    try:
        out = llm.chat(COPY, p)[0]
    finally:
        del spec.propose  # back to the class's method
    assert refused, "no draft the grammar forbids: the test tests nothing"
    assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (want.token_ids, "stop")
    _, proposed, accepted = out.events.spec
    assert proposed > accepted > 0
    cut = llm.chat(COPY, p)[0]  # the real proposer: cut by the grammar
    assert cut.outputs[0].token_ids == want.token_ids
    assert cut.events.spec is not None and cut.events.spec[2] > 0


def test_sampled_constrained_output_always_parses(pair):
    """Seeded sampling: every output is what the grammar allows token by token (a fresh matcher
    takes all of it), and every completed one parses (a small model may ramble inside a string
    until max_tokens: that one is a valid prefix)."""
    _, llm = pair
    messages, tool_spec = _tool_chat()
    grammars = llm.engine.tokenizer.grammars
    accepted, completed = 0, 0
    for seed in range(4):
        for msgs, structured in ((COPY, SCHEMA), (messages, tool_spec)):
            p = SamplingParams(temperature=0.7, max_tokens=160, seed=seed, structured=structured)
            out = llm.chat(msgs, p)[0]
            o = out.outputs[0]
            ids = list(o.token_ids)
            assert grammars.get(structured).matcher.validate_tokens(ids) == len(ids), o.text
            assert o.finish_reason in ("stop", "length")
            if o.finish_reason == "stop":
                docs = [json.loads(o.text)] if structured is SCHEMA else _calls(o.text)
                assert docs and all(isinstance(d, dict) for d in docs)
                completed += 1
            accepted += out.events.spec[2] if out.events.spec else 0
    assert accepted > 0 and completed >= 4
    assert llm.engine.blocks.check_consistency() == []


@pytest.mark.parametrize("structured", [None, SCHEMA], ids=["free", "json_schema"])
def test_logprobs_under_speculation_are_the_plain_engines(pair, structured):
    """Each emitted token's logprob and top ones come from its own verification row's raw logits
    (before the grammar's mask), as plain decoding reports them."""
    plain, llm = pair
    p = SamplingParams(temperature=0, max_tokens=60, logprobs=3, structured=structured)
    want, got = plain.chat(COPY, p)[0].outputs[0], llm.chat(COPY, p)[0]
    g = got.outputs[0]
    assert g.token_ids == want.token_ids
    assert got.events.spec is not None and got.events.spec[2] > 0  # drafts were accepted
    assert len(g.logprobs) == len(want.logprobs) == len(g.token_ids)
    for a, b in zip(g.logprobs, want.logprobs, strict=True):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t[0] for t in a.top] == [t[0] for t in b.top]
        assert [t[2] for t in a.top] == pytest.approx([t[2] for t in b.top], abs=1e-4)
