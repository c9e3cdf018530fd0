"""The suffix proposer (engine/spec/suffix.py, vLLM's `{"method": "suffix"}`): its config is
vLLM's and checked at start-up, it drafts the most frequent continuation of the longest earlier
match, from the request itself and from earlier requests' outputs (the global trie, bounded),
and greedy output stays token for token the plain engine's."""

from __future__ import annotations

import json
import time

import pytest

from tests.engine.test_spec_decode import COPY
from tests.engine.tiny_models import cached_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.cli import build_parser
from tokenpath.config import EngineConfig, SpeculativeConfig
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.decoder import SpecDecoder
from tokenpath.engine.spec.suffix import MAX_OWN_PROMPT, SuffixCache, SuffixProposer, SuffixTrie
from tokenpath.server.config import build_config

SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}


# ---------------------------------------------------------------- configuration
def test_the_suffix_method_takes_vllms_names_and_defaults():
    got = build_config(build_parser().parse_args(["serve", "--speculative-config", json.dumps(
        {**SUFFIX, "suffix_decoding_max_tree_depth": 32, "suffix_decoding_min_token_prob": 0.2})])).engine
    spec = got.speculative_config
    assert spec is not None and spec.method == "suffix"
    assert (spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_min_token_prob) == (32, 0.2)
    default = SpeculativeConfig(**SUFFIX)  # vLLM's defaults
    assert (default.suffix_decoding_max_tree_depth, default.suffix_decoding_max_cached_requests,
            default.suffix_decoding_max_spec_factor, default.suffix_decoding_min_token_prob) == (24, 10000, 1.0, 0.1)


@pytest.mark.parametrize("bad, field", [
    ({**SUFFIX, "suffix_decoding_max_tree_depth": 2}, "suffix_decoding_max_tree_depth"),  # (matches of 2+)
    ({**SUFFIX, "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({**SUFFIX, "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({**SUFFIX, "suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
    ({**SUFFIX, "num_speculative_tokens": 1000}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 8},
     "suffix_decoding_max_tree_depth"),  # a suffix field under another method: refused, not ignored
])
def test_a_bad_suffix_config_is_a_start_up_error_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=json.dumps(bad))


# ---------------------------------------------------------------- the proposer
def test_it_drafts_the_most_frequent_continuation_of_the_longest_match():
    proposer = SuffixProposer(SuffixCache(24, 0), max_spec_factor=4.0, min_token_prob=0.1)
    #        (7, 8) -> 1 2 3 twice, -> 4 5 once; then (7, 8) again, after a token never seen before
    tokens = [7, 8, 1, 2, 3, 0, 7, 8, 4, 5, 6, 7, 8, 1, 2, 3, 11, 7, 8]
    assert proposer.propose(tokens, 3) == [1, 2, 3]
    # A longer match wins over a more frequent short one: (9, 6, 7, 8) was followed by 4 5.
    tokens = [7, 8, 1, 2, 7, 8, 1, 2, 9, 6, 7, 8, 4, 5, 0, 9, 6, 7, 8]
    assert SuffixProposer(SuffixCache(24, 0), 4.0, 0.1).propose(tokens, 2) == [4, 5]
    # max_spec_factor: at most factor x the match length (here a match of 2: 2 tokens)
    assert SuffixProposer(SuffixCache(24, 0), 1.0, 0.1).propose([1, 2, 3, 4, 5, 6, 0, 1, 2], 8) == [3, 4]
    assert SuffixProposer(SuffixCache(24, 0), 1.0, 0.1).propose([1, 2, 3, 4], 8) == []  # nothing repeats
    assert SuffixProposer(SuffixCache(24, 0), 4.0, 0.1).propose([1, 2, 3, 4, 1], 8) == []  # a lone token: no


def test_min_token_prob_stops_a_draft_where_the_history_disagrees():
    # After (0, 5, 6): 7 twice out of three, then after (0, 5, 6, 7): 9 once, 10 once.
    tokens = [5, 6, 7, 8, 0, 5, 6, 7, 9, 0, 5, 6, 7, 10, 0, 5, 6, 1, 0, 5, 6]
    assert SuffixProposer(SuffixCache(24, 0), 4.0, min_token_prob=0.5).propose(tokens, 4) == [7]  # 2/3, then 1/3
    # 0.3: 2/3, then 1/3 for 9 (a tie with 10: the first seen), then 1/3 for the 0 5 that followed it
    assert SuffixProposer(SuffixCache(24, 0), 4.0, min_token_prob=0.3).propose(tokens, 4) == [7, 9, 0, 5]


def test_a_request_drafts_from_an_earlier_requests_output():
    # (the rule policy: a fresh sequence drafts what the proposer finds; the priced ones: what pays)
    spec = SpecDecoder(SpeculativeConfig(**SUFFIX, draft_policy="rule"), max_model_len=4096)
    params = SamplingParams(temperature=0, max_tokens=100)
    first = Sequence("a", 0, [1, 2, 3], 3, params)
    first.token_ids += [40, 41, 42, 43, 44, 45, 46, 47, 48]  # its output
    spec.finished(first)
    second = Sequence("b", 0, [9, 9, 9, 40, 41, 42, 43], 7, params)  # another prompt, ending like it
    assert spec.drafts(second, budget=64) == [44, 45, 46, 47]  # (a match of 4: at most 4 drafts)
    ngram = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=8), max_model_len=4096)
    ngram.finished(first)
    assert ngram.drafts(Sequence("c", 0, [9, 9, 9, 40, 41, 42, 43], 7, params), budget=64) == []  # no memory


def test_the_global_trie_is_bounded_in_requests_and_nodes():
    cache = SuffixCache(depth=8, max_cached_requests=4)
    for i in range(10):
        cache.add([10 * i + 1, 10 * i + 2, 10 * i + 3])  # request i's output
    assert len(cache.tries) == 2 and all(t.size == 1 + 2 * 6 for t in cache.tries)  # two generations of 2
    assert SuffixProposer(cache, 1.0, 0.1).propose([7, 1, 2], 4) == []  # request 0 went with its generation
    assert SuffixProposer(cache, 1.0, 0.1).propose([7, 61, 62], 4) == [63]  # requests 6 to 9 draft
    assert SuffixProposer(cache, 1.0, 0.1).propose([7, 91, 92], 4) == [93]
    small = SuffixCache(depth=8, max_cached_requests=10000, max_nodes=50)
    for i in range(100):
        small.add(list(range(100 * i, 100 * i + 20)))
    assert small.num_nodes <= 2 * (50 + 8 * 20)  # each generation stops taking requests at max_nodes
    off = SuffixCache(depth=8, max_cached_requests=0)
    off.add([1, 2, 3])
    assert off.tries == []


def test_the_proposer_costs_well_under_a_decode_step():
    tokens = [(i * 7919) % 49000 for i in range(500)]  # a prompt of 500 distinct tokens
    proposer = SuffixProposer(SuffixCache(24, 100), 1.0, 0.1)
    proposer.propose(tokens, 16)
    started = time.thread_time()
    for i in range(200):
        tokens.append(tokens[i % 400] if i % 5 else 1)
        proposer.propose(tokens, 16)
    per_step = (time.thread_time() - started) / 200
    assert per_step < 2e-3  # ~50 us on these loaded cores (the n-gram index: ~5 us)


def test_a_long_prompt_is_indexed_from_its_last_tokens_only():
    tokens = [(i * 7919) % 49000 for i in range(MAX_OWN_PROMPT + 3000)]
    proposer = SuffixProposer(SuffixCache(8, 0), 1.0, 0.1)
    proposer.propose(tokens, 4)
    assert proposer.own.size <= 1 + 8 * MAX_OWN_PROMPT  # not the whole prompt's
    assert proposer.propose([*tokens, *tokens[-4000:-3990]], 4) == tokens[-3990:-3986]  # (within the window)


def test_a_trie_counts_each_substring_up_to_its_depth():
    trie = SuffixTrie(depth=3)
    trie.insert([1, 2, 1, 2])
    node = trie.child[1]  # (root << 32 | 1)
    assert trie.count[node] == 2 and trie.cont[node] == 2  # "1" twice, followed by 2 both times
    assert trie.size == 1 + 2 + 2 + 2  # 1, 2, 12, 21, 121, 212 (depth 3: no 1212)


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("quantization", ["none", pytest.param("q8_0", marks=pytest.mark.requires("kernels"))])
def test_greedy_is_exact_with_drafts_from_earlier_requests_on_either_path(quantization):
    """A random tiny model repeats little, so the drafts come from the global trie: a prompt asked
    again drafts the first answer (accepted), another prompt drafts from it too (rejected)."""
    model = str(cached_tiny("llama"))
    kw = dict(num_kv_blocks=64, block_size=4, dtype="float32", quantization=quantization)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model, **kw)
    prompts = [plain.tokenizer.encode(text) for text in ("a b c d e f", "a b c d x y", "a b c d e f")]
    want = [plain.generate(prompt, p)[0].outputs[0].token_ids for prompt in prompts]
    llm = LLM(model, speculative_config=json.dumps({**SUFFIX, "suffix_decoding_max_spec_factor": 8.0}), **kw)
    got = [llm.generate(prompt, p)[0].outputs[0].token_ids for prompt in prompts]
    stats = llm.engine.spec.stats
    assert got == want
    assert stats.num_accepted_tokens > 0, stats
    assert llm.engine.blocks.check_consistency() == []


@pytest.mark.slow  # (loads SmolLM2: not the fast tier)
@pytest.mark.requires("kernels")
def test_greedy_is_token_for_token_the_plain_engines_on_smollm2_and_a_repeat_pays():
    p = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    story = [{"role": "user", "content": "Write a short story about a fox who learns to play the violin."}]
    plain = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB")
    want = [plain.chat(m, p)[0].outputs[0].token_ids for m in (COPY, story)]
    # The "rule" policy: the step counts below are the trie's doing only. The default "adaptive" one
    # prices drafts by measured step times, so how much it drafts follows the machine and its load
    # (on a loaded 2-core AVX2 host it once took 53 steps for the repeat, not under 48).
    rule = {**SUFFIX, "draft_policy": "rule"}
    llm = LLM("smollm2-135m-instruct", kv_cache_memory="64MiB", speculative_config=json.dumps(rule))
    assert llm.chat(COPY, p)[0].outputs[0].token_ids == want[0]
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    steps = llm.engine.steps
    assert llm.chat(story, p)[0].outputs[0].token_ids == want[1]
    first = llm.engine.steps - steps
    assert llm.chat(story, p)[0].outputs[0].token_ids == want[1]  # again: its answer is in the global trie
    again = llm.engine.steps - steps - first
    assert again < first / 2, (first, again)
    assert llm.engine.blocks.check_consistency() == []
