"""A decode step's work outside the kernels (issue 42): features that are off cost nothing, and
the runner's inputs, built in Python lists and made arrays once, are what the kernels were given
before (numpy pieces per sequence), on a windowed model's mixed prefill/decode steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.conftest import make_prompts
from tests.engine.tiny_models import cached_tiny, save_gguf
from tokenpath import LLM, SamplingParams
from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.sampler import Sampler
from tokenpath.engine.sequence import Sequence
from tokenpath.protocol.sampling_params import SamplingParams as Params


def _seq(name: str, prompt: list[int], **params: object) -> Sequence:
    return Sequence(name, 0, list(prompt), len(prompt), Params(**params))


def _counted(obj: object, name: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of obj.name from now on (the real method still runs)."""
    calls: list[int] = []
    real = getattr(obj, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_allocate_without_windows_never_looks_for_blocks_to_drop(monkeypatch):
    """No sliding window: a decode step's allocate does not walk the tables for out-of-window
    blocks; with a window group it still does, and gives them back."""
    flat = BlockManager(64, 16, windows=(None,), max_chunk=64)
    calls = _counted(flat, "_drop_out_of_window", monkeypatch)
    seq = _seq("a", list(range(1, 40)), max_tokens=8)
    for _ in range(4):
        assert flat.allocate(seq, 1)
        seq.num_computed_tokens += 1
    assert calls == []
    windowed = BlockManager(64, 16, windows=(None, 16), max_chunk=64)
    calls = _counted(windowed, "_drop_out_of_window", monkeypatch)
    seq = _seq("b", list(range(1, 80)), max_tokens=8)
    assert windowed.allocate(seq, 79)
    seq.num_computed_tokens = 79
    assert windowed.allocate(seq, 1)
    assert calls and -1 in seq.block_tables[1]
    assert windowed.check_consistency() == []


def test_plain_greedy_rows_take_only_the_argmax(monkeypatch):
    """Greedy rows without logprobs, penalties or grammar: the argmax, and no penalty pass or
    sampling path; a batch with one row that asks for logprobs takes the full path, same tokens."""
    sampler = Sampler(eos_token_id=0)
    logits = np.random.default_rng(3).standard_normal((3, 50)).astype(np.float32)
    logits[1, 7] = logits[1].max() + 1.0
    penalties = _counted(sampler, "_apply_penalties", monkeypatch)
    plain = [_seq(f"s{i}", [1, 2], temperature=0.0) for i in range(3)]
    result = sampler(logits, plain)
    assert result.token_ids == np.argmax(logits, axis=-1).tolist() and result.token_ids[1] == 7
    assert result.logprobs == [None, None, None] and penalties == []
    mixed = plain[:2] + [_seq("lp", [1, 2], temperature=0.0, logprobs=1)]
    full = sampler(logits, mixed)
    assert full.token_ids == result.token_ids and penalties == [1]
    assert full.logprobs[:2] == [None, None] and full.logprobs[2][1][0][0] == result.token_ids[2]


def _reference_inputs(runner, scheduled):  # noqa: ANN001, ANN202 - the runner's inputs as main built them
    """ids, pos, slots [G, T], row table, tables [G, N]: the numpy construction per sequence."""
    bs, ids, pos, tabs, rts, offset = runner.block_size, [], [], [], [], 0
    for seq, n in scheduled:
        start = seq.num_computed_tokens
        ids += seq.token_ids[start : start + n] + seq.draft_ids
        pos.append(np.arange(start, start + n, dtype=np.int32))
        table = np.maximum(np.asarray(seq.block_tables, dtype=np.int32).reshape(len(seq.block_tables), -1), 0)
        tabs.append(table)
        rts.append(np.full(n, offset, dtype=np.int32))
        offset += table.shape[1]
    p, rt = np.concatenate(pos), np.concatenate(rts)
    tables = np.concatenate(tabs, axis=1)
    slots = tables[:, rt + p // bs].astype(np.int64) * bs + p % bs
    return np.asarray(ids, dtype=np.int32), p, slots, rt, tables


@pytest.mark.requires("kernels")
def test_native_inputs_are_the_per_sequence_construction():
    """A windowed model (tiny Gemma 3: six KV-cache groups, freed window blocks), prompts in
    chunks beside decodes: every step's arrays equal the per-sequence numpy construction."""
    hf_dir = cached_tiny("gemma3")
    gguf = save_gguf("gemma3", hf_dir, hf_dir.parent / "model.gguf")
    llm = LLM(str(gguf), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8)
    runner = llm.engine.runner
    assert runner.layout.num_groups > 1 and None in runner.layout.windows
    native, real = runner.native, runner.native.forward
    seen: list[tuple[int, ...]] = []  # each step's rows per sequence

    def checked(ids, pos, slots, rt, tables, logit_rows, lora=None, generated=None):  # noqa: ANN001, ANN202
        ref = _reference_inputs(runner, scheduled[0])
        for got, want in zip((ids, pos, slots, rt, tables), ref, strict=True):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        seen.append(tuple(n for _, n in scheduled[0]))
        return real(ids, pos, slots, rt, tables, logit_rows, lora, generated)

    scheduled: list = [None]
    execute = runner._execute_native

    def keep(native_, sched):  # noqa: ANN001, ANN202 - what the step scheduled, for the reference
        scheduled[0] = sched
        return execute(native_, sched)

    native.forward, runner._execute_native = checked, keep
    prompts = make_prompts(llm.tokenizer, [17, 40, 90], seed=5)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 30 for o in out)
    assert any(max(s) > 1 and 1 in s for s in seen)  # a prompt chunk beside decode rows
    assert any(set(s) == {1} for s in seen)  # decode rows only
