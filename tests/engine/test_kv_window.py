"""Sliding-window layers keep only their window's KV blocks (engine/kv_groups.py): the block
manager's rule on its own, then real engines (tiny Mistral and Gemma 3 on the torch and native
paths, Gemma 3 270M) whose greedy tokens do not change while their window groups' blocks stay
bounded, prefix hits included.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import LoadedLLM, make_prompts
from tests.engine.tiny_models import cached_tiny, save_gguf
from tokenpath import LLM, SamplingParams
from tokenpath.engine.block_hash import block_hashes
from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.kv_groups import NULL_BLOCK, KVLayout
from tokenpath.engine.model_config import ModelConfig
from tokenpath.engine.sequence import Sequence
from tokenpath.protocol.sampling_params import SamplingParams as Params

BS = 16


def _cfg(windows: tuple[int | None, ...]) -> ModelConfig:
    return ModelConfig("gemma3", 64, 32, 64, len(windows), 2, 1, 16, 1e-6, 1e6, 4096, True, False,
                       layer_windows=windows)


def test_layers_group_by_attention_type():
    gemma = KVLayout.for_model(_cfg(((512,) * 5 + (None,)) * 3))  # Gemma 3 270M: 15 windowed, 3 global
    assert gemma.windows == (None,) + (512,) * 5 and gemma.group_size == 3
    assert [gemma.layer_group[i] for i in (5, 11, 17)] == [0, 0, 0]  # the global layers: group 0
    pairs = list(zip(gemma.layer_group, gemma.layer_slot, strict=True))
    assert len(set(pairs)) == 18  # one (group, tensor) per layer: no two layers write one place
    mistral = KVLayout.for_model(_cfg((8,) * 4))
    assert mistral.windows == (8,) and mistral.group_size == 4
    assert KVLayout.for_model(_cfg((None,) * 4)) == KVLayout.single(4)
    assert KVLayout.for_model(_cfg((8, None, 8)), hybrid=False) == KVLayout.single(3)


def _run(bm: BlockManager, seq: Sequence, chunk: int, held: list[list[int]] | None = None) -> None:
    """Compute `seq` to its end as the engine would: allocate, compute, commit; decode steps
    append a token."""
    while True:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert bm.allocate(seq, n)
        seq.num_computed_tokens += n
        bm.commit_computed(seq)
        if held is not None:
            held.append(bm.held_blocks(seq))
        if seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens:
            return
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)  # the sampled token


def _seq(name: str, prompt: list[int], max_tokens: int = 40) -> Sequence:
    return Sequence(name, 0, list(prompt), len(prompt), Params(max_tokens=max_tokens))


def test_a_window_group_holds_its_window_and_gives_the_rest_back():
    bm = BlockManager(200, BS, windows=(None, 32), max_chunk=64)
    seq = _seq("long", list(range(1, 401)))
    held: list[list[int]] = []
    _run(bm, seq, 64, held)
    assert held[-1][0] == bm.blocks_needed(seq.num_computed_tokens)  # the full group: the whole context
    assert max(h[1] for h in held) <= bm.blocks_needed(32 - 1 + 64) + 1  # prefill chunks
    decode = held[7:]  # after the 400-token prompt's 7 chunks
    assert decode and all(h[1] <= bm.blocks_needed(32) + 1 for h in decode)
    assert NULL_BLOCK in seq.block_tables[1] and NULL_BLOCK not in seq.block_tables[0]
    assert bm.max_blocks_needed(440) == bm.blocks_needed(440) + bm.blocks_needed(32 - 1 + 64) + 1
    assert bm.check_consistency() == []
    bm.release(seq)
    assert bm.num_free_blocks == 200 and bm.check_consistency() == []


def test_a_prefix_hit_needs_the_window_blocks_of_its_end():
    """The rule: full groups hold every block of the hit, window groups those their window reads."""
    bm = BlockManager(200, BS, windows=(None, 32), max_chunk=64)
    prompt = list(range(1, 201))  # 12 full blocks before the last token
    first = _seq("first", prompt, max_tokens=1)
    _run(bm, first, 64)
    bm.release(first)
    again = _seq("again", prompt)
    bm.lookup_prefix(again)
    assert again.num_computed_tokens == 12 * BS
    full, window = again.block_tables
    assert len(full) == len(window) == 12 and NULL_BLOCK not in full
    first_needed = (12 * BS - 32 + 1) // BS  # the next query, at 192, reads from 161 on
    assert window[:first_needed] == [NULL_BLOCK] * first_needed and NULL_BLOCK not in window[first_needed:]
    bm.release(again)
    # The window group's block 11 evicted (as the pool's LRU would): the hit ends where the window
    # group still holds what its next query reads, although the full group holds more.
    hashes = block_hashes(prompt, BS)
    evicted = bm.group_cached[1].pop(hashes[11])
    bm.block_hash[evicted] = None
    third = _seq("third", prompt)
    bm.lookup_prefix(third)
    assert third.num_computed_tokens == 11 * BS
    bm.release(third)
    assert bm.check_consistency() == []


def test_with_windows_only_a_hit_needs_only_the_last_blocks():
    bm = BlockManager(100, BS, windows=(8,), max_chunk=32)
    prompt = list(range(1, 91))
    first = _seq("first", prompt, max_tokens=1)
    _run(bm, first, 32)
    assert bm.held_blocks(first) == [1]  # block 5: positions 80-90, the last query reads 83-90
    bm.release(first)
    again = _seq("again", prompt)
    bm.lookup_prefix(again)
    assert again.num_computed_tokens == 5 * BS and bm.held_blocks(again) == [1]  # block 4 only
    bm.release(again)
    assert bm.check_consistency() == []


# ------------------------------------------------------------ real engines


def _tokens_and_bound(llm: LLM, prompts: list[list[int]], new: int) -> tuple[list[list[int]], int]:
    """Greedy tokens, and the most blocks any window group of any sequence held in a decode step."""
    most = [0]
    layout = llm.engine.runner.layout

    def observe(scheduled, start, end) -> None:  # noqa: ANN001 - EngineCore's step observer
        for seq, n in scheduled:
            if n == 1 and seq.block_tables:
                held = llm.engine.blocks.held_blocks(seq)
                most[0] = max([most[0]] + [h for h, w in zip(held, layout.windows, strict=True) if w is not None])

    llm.engine.step_observers.append(observe)
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    finally:
        llm.engine.step_observers.remove(observe)
    return [o.outputs[0].token_ids for o in out], most[0]


def _check_same_tokens(path: str, **kwargs: object) -> None:
    common = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8, **kwargs)
    hybrid = LLM(path, **common)
    windows = {w for w in hybrid.engine.runner.layout.windows if w is not None}
    assert windows == {8}
    prompts = make_prompts(hybrid.tokenizer, [17, 40, 90], seed=5)
    got, most = _tokens_and_bound(hybrid, prompts, 40)
    assert 0 < most <= hybrid.engine.blocks.blocks_needed(8) + 1  # 2 blocks at decode, whatever the context
    baseline = LLM(path, disable_hybrid_kv_cache_manager=True, **common)
    ref, _ = _tokens_and_bound(baseline, prompts, 40)
    assert got == ref
    hits = hybrid.engine.blocks.prefix_hits
    again, _ = _tokens_and_bound(hybrid, prompts, 40)  # from cached prefixes
    assert hybrid.engine.blocks.prefix_hits > hits and again == got
    assert hybrid.engine.blocks.check_consistency() == []
    assert hybrid.engine.blocks.num_free_blocks == hybrid.engine.blocks.num_blocks


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_torch_path_keeps_its_tokens_with_windowed_blocks(kind):
    _check_same_tokens(str(cached_tiny(kind)), quantization="none")


def test_native_path_keeps_its_tokens_with_windowed_blocks():
    hf_dir = cached_tiny("gemma3")
    gguf = save_gguf("gemma3", hf_dir, hf_dir.parent / "model.gguf")
    _check_same_tokens(str(gguf))


@pytest.mark.requires("gemma3")
def test_gemma3_270m_past_its_window(gemma3_270m: LoadedLLM, gemma3_270m_flat: LoadedLLM):
    """A 560-token prompt (window 512), on the default native path: the same tokens as with every
    layer's blocks kept, the 15 window layers' blocks bounded by the window, and a prefix hit.
    Both engines (256-token steps) are loaded once per session: tests/engine/conftest.py."""
    hybrid = gemma3_270m.llm
    assert {w for w in hybrid.engine.runner.layout.windows if w is not None} == {512}
    assert gemma3_270m_flat.llm.engine.runner.layout.windows == (None,)
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box." for i in range(120))
    prompt = hybrid.tokenizer.encode(text)[:560]
    assert len(prompt) == 560
    got, most = _tokens_and_bound(hybrid, [prompt], 8)
    assert most <= hybrid.engine.blocks.blocks_needed(512) + 1
    ref, _ = _tokens_and_bound(gemma3_270m_flat.llm, [prompt], 8)
    assert got == ref
    hits = hybrid.engine.blocks.prefix_hits
    again, _ = _tokens_and_bound(hybrid, [prompt], 8)
    assert again == got and hybrid.engine.blocks.prefix_hits - hits >= 34 * BS
