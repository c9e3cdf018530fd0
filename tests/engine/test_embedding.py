"""The project's BERT encoder reproduces sentence-transformers' all-MiniLM-L6-v2 vectors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tokenpath.engine.embedding import EmbeddingEngine, default_embedding_model_dir
from tokenpath.protocol import EmbeddingRequest

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hi",
    "Paged attention stores the KV cache in fixed-size blocks so that memory is not fragmented, "
    "and a prefix cache lets requests that share a system prompt reuse those blocks.",
    "Ünïcödé, emoji 🚀 and punctuation!?",
]


@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine.from_dir()


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    import sentence_transformers as st  # a [test] dependency: missing fails, never skips
    model = st.SentenceTransformer(str(default_embedding_model_dir()), device="cpu")
    return torch.tensor(model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True))


def test_batched_matches_sentence_transformers(engine, reference):
    ours = torch.tensor(engine.embed_texts(TEXTS))
    assert ours.shape == (len(TEXTS), 384)
    assert torch.allclose(ours, reference, atol=1e-4), (ours - reference).abs().max()


def test_single_inputs_match_sentence_transformers(engine, reference):
    for i, text in enumerate(TEXTS):
        ours = torch.tensor(engine.embed_texts([text])[0])
        assert torch.allclose(ours, reference[i], atol=1e-4), (i, (ours - reference[i]).abs().max())


def test_vectors_are_unit_length_and_distinguish_inputs(engine):
    a, b = (torch.tensor(v) for v in engine.embed_texts(["cats purr", "stock market crash"]))
    assert abs(a.norm().item() - 1) < 1e-5 and abs(b.norm().item() - 1) < 1e-5
    assert (a @ b).item() < 0.9


def test_a_batch_past_the_position_table_is_an_internal_error(engine):
    """Inputs are validated at the edge (a 400 naming the numbers, tests/api/test_http.py); the
    engine only guards its own invariant, once, instead of indexing past its position table."""
    with pytest.raises(ValueError, match="302 tokens"):
        engine.embed_texts(["word " * 300])


async def test_run_reports_the_engine_events(engine):
    ids = engine.tokenizer.encode_batch(TEXTS[:2])
    out = await engine.run(EmbeddingRequest("r", ids))
    ev = out.events
    assert out.request_id == "r" and len(out.vectors) == 2 and out.num_prompt_tokens == sum(map(len, ids))
    assert ev.queued <= ev.scheduled <= ev.first_token == ev.finished
    assert out.vectors == engine.embed_texts(TEXTS[:2])


async def test_concurrent_requests_are_batched(engine, reference):
    ids = engine.tokenizer.encode_batch(TEXTS)
    before = engine.num_batches
    results = await asyncio.gather(*(engine.embed([x]) for x in ids))
    # Every caller gets its own vector back, and they shared forward passes.
    for i, (vec,) in enumerate(results):
        assert torch.allclose(torch.tensor(vec), reference[i], atol=1e-4)
    assert engine.num_batches - before < len(TEXTS)
    await engine.shutdown()


async def test_forward_passes_stay_on_one_thread(engine, monkeypatch):
    """Every forward pass runs on the engine's own thread, even while the default executor is busy
    with other blocking work (database writes, tokenizing). Spread over the default pool's threads,
    each pass's freed tensors went into that thread's glibc arena: the gateway's RSS grew ~100 MiB
    in a soak's first embedding requests, one arena per pool thread."""
    threads: set[str] = set()
    real = engine.embed_ids

    def recording(batch):
        threads.add(threading.current_thread().name)
        return real(batch)

    monkeypatch.setattr(engine, "embed_ids", recording)
    ids = engine.tokenizer.encode_batch(TEXTS)
    for x in ids * 3:
        busy = [asyncio.create_task(asyncio.to_thread(time.sleep, 0.02)) for _ in range(3)]
        await engine.embed([x])
        await asyncio.gather(*busy)
    assert len(threads) == 1, threads
    await engine.shutdown()
