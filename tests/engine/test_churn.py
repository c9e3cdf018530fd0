"""After 200 requests with a random mix of finishes, stop strings, aborts at random steps and
preemptions, every block is free and the prefix-cache index is consistent."""

from __future__ import annotations

import random

from tests.engine.tiny_models import save_tiny
from tokenpath import LLM, SamplingParams
from tokenpath.protocol import GenerateRequest


def test_random_mix_frees_everything(tmp_path):
    llm = LLM(str(save_tiny("llama", tmp_path / "tiny")), dtype="float32", num_kv_blocks=40,
              max_num_batched_tokens=96, max_num_seqs=12, block_size=8)
    core = llm.engine
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "a", "river", "stone"]
    shared = " ".join(rng.choice(words) for _ in range(40))
    submitted = aborted = 0
    finish_reasons: dict[str, int] = {}
    live: list[str] = []
    while submitted < 200 or core.has_work():
        for _ in range(rng.randint(0, 4)):
            if submitted >= 200:
                break
            prompt = (shared if rng.random() < 0.5 else "") + " ".join(rng.choice(words)
                                                                      for _ in range(rng.randint(1, 60)))
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=rng.randint(1, 40),
                                    n=rng.choice([1, 1, 1, 2]), seed=rng.randint(0, 9),
                                    stop=[rng.choice(words)] if rng.random() < 0.3 else [])
            rid = f"r{submitted}"
            core.add_request(GenerateRequest(rid, llm.tokenizer.encode(prompt), params))
            live.append(rid)
            submitted += 1
        if live and rng.random() < 0.1:
            victim = live.pop(rng.randrange(len(live)))
            if core.abort(victim) is not None:
                aborted += 1
        for out in core.step():
            for c in out.outputs:
                if c.finish_reason:
                    finish_reasons[c.finish_reason] = finish_reasons.get(c.finish_reason, 0) + 1
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        assert core.blocks.check_consistency() == []
    assert aborted > 5
    assert core.scheduler.num_preemptions > 0
    assert finish_reasons.get("stop", 0) > 0 and finish_reasons.get("length", 0) > 0
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
    assert not core.requests and not core.scheduler.waiting and not core.scheduler.running
    assert core.blocks.check_consistency() == []


def test_the_warm_up_runs_before_serving_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """EngineCore's warm-up (llama.cpp's --warmup) runs the model before the engine serves, then
    leaves no trace: no request, no cached block (its 8 prompt tokens fill two 4-token blocks),
    counters at zero, and the first request's output what an engine without it gives."""
    from tokenpath.engine.runner import ModelRunner

    calls: list[int] = []
    run = ModelRunner.execute

    def counted(self, scheduled):  # noqa: ANN001, ANN202
        calls.append(len(scheduled))
        return run(self, scheduled)

    monkeypatch.setattr(ModelRunner, "execute", counted)
    path = str(save_tiny("llama", tmp_path / "tiny"))
    cold = LLM(path, dtype="float32", block_size=4, warmup=False)
    assert calls == []
    warm = LLM(path, dtype="float32", block_size=4)
    assert len(calls) == 2  # its prefill and one decode step
    core = warm.engine
    assert not core.requests and core.steps == core.prompt_tokens == core.generation_tokens == 0
    assert core.blocks.prefix_queries == core.blocks.prefix_hits == 0 and not core.blocks.cached_hashes()
    assert core.blocks.num_free_blocks == core.blocks.num_blocks and core.blocks.check_consistency() == []
    params = SamplingParams(temperature=0.8, max_tokens=12)  # (the engine's own generator: not advanced)
    got = [llm.generate("the river and the stone", params)[0].outputs[0].token_ids for llm in (warm, cold)]
    assert got[0] == got[1]
    short = LLM(path, dtype="float32", max_model_len=6)  # (too short for the warm-up: it serves unwarmed)
    assert len(short.generate([5, 6], SamplingParams(max_tokens=3, temperature=0.0))[0].outputs[0].token_ids) == 3
