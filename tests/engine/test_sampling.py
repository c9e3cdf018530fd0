"""Sampling semantics on the real model: seeds, top_k=1, stop strings, penalties, logprobs, n > 1."""

from __future__ import annotations

import math

from tokenpath import SamplingParams

PROMPT = "Write a short poem about the sea, with many lines:\n"


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


def test_seeded_sampling_is_reproducible_even_when_batched(smol_llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    alone = smol_llm.generate([PROMPT], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24)
    batched = smol_llm.generate(["Hello there", PROMPT, "Another prompt here"], [others, p, others])
    assert batched[1].outputs[0].token_ids == alone
    different_seed = smol_llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=24))
    assert different_seed[0].outputs[0].token_ids != alone


def test_each_result_echoes_its_text_prompt(smol_llm):
    """The engine sees token ids only; the offline LLM puts each text prompt back on its result."""
    outs = smol_llm.generate(["Hello there", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
    assert outs[0].prompt == "Hello there" and outs[1].prompt is None


def test_top_k_1_equals_greedy(smol_llm):
    greedy = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))
    top1 = smol_llm.generate([PROMPT], SamplingParams(temperature=1.3, top_k=1, max_tokens=20, seed=5))
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_stop_strings_never_appear(smol_llm):
    free = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].text
    words = [w for w in free.split() if len(w) > 3]
    stop = words[len(words) // 2]
    out = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=48, stop=[stop, "\n\n\n"]))
    c = out[0].outputs[0]
    assert stop not in c.text
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert free.startswith(c.text)


def test_stop_token_ids_and_min_tokens(smol_llm):
    base = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    stop_tok = base.token_ids[3]
    out = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_tok]))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok and c.token_ids[-1] == stop_tok
    eos = smol_llm.tokenizer.eos_token_id
    forced = smol_llm.generate(["Say hi."], SamplingParams(temperature=0, max_tokens=40, min_tokens=30))
    assert eos not in forced[0].outputs[0].token_ids[:30]
    assert len(forced[0].outputs[0].token_ids) >= 30


def test_ignore_eos_gives_exact_length(smol_llm):
    out = smol_llm.chat([{"role": "user", "content": "Say yes."}],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 40 and out[0].outputs[0].finish_reason == "length"


def test_penalties_change_repetitive_output(smol_llm):
    plain = smol_llm.generate(["one one one one one"], SamplingParams(temperature=0, max_tokens=16))
    penal = smol_llm.generate(["one one one one one"],
                              SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.8))
    freq = smol_llm.generate(["one one one one one"],
                             SamplingParams(temperature=0, max_tokens=16, frequency_penalty=2.0,
                                            presence_penalty=2.0))
    ids = plain[0].outputs[0].token_ids
    assert penal[0].outputs[0].token_ids != ids
    assert len(set(freq[0].outputs[0].token_ids)) > len(set(ids))


def test_logprobs(smol_llm):
    out = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logprobs=20))
    c = out[0].outputs[0]
    assert len(c.logprobs) == 8
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 20
        assert lp.top[0][0] == tok  # greedy: the sampled token is the most likely one
        assert math.isclose(lp.top[0][2], lp.logprob, abs_tol=1e-5)


def test_n_choices_share_the_prompt(smol_llm):
    hits = smol_llm.engine.blocks.prefix_hits
    long_prompt = PROMPT * 12
    out = smol_llm.generate([long_prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    assert smol_llm.engine.blocks.prefix_hits > hits  # choices 1 and 2 reused choice 0's prompt blocks


def test_utf8_never_split_in_stream(smol_llm):
    tok = smol_llm.tokenizer
    text = "emoji 🙂🎉 and 世界 and é"
    ids = tok.encode(text)
    d = tok.detokenizer()
    pieces = [d.step(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
