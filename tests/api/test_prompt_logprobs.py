"""`prompt_logprobs` (vLLM's extra on /v1/completions, and SamplingParams offline): perplexity of a
held-out text measured through the HTTP API equals transformers float32 on the same weights, in
process and through engine processes (the engine link's messages, which Ray uses too), chunked
prefill and sliding windows included; bad values are OpenAI-format 400s.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import httpx
import pytest
import torch
from tests.api.conftest import CHAT_MODEL
from tests.engine.tiny_models import cached_json, cached_tiny, smol_tokenizer

from tokenpath import LLM, SamplingParams

TEXT = (Path(__file__).parents[1] / "engine" / "data" / "perplexity_text.txt").read_text()
TINY_TOKENS = 600  # past the tiny Gemma 3's window of 8 and its 128-token prefill chunks
SMOL_TOKENS = 512


def _reference(model_dir: Path, ids: list[int], gguf: str | None = None) -> float:
    """Perplexity of `ids` by transformers float32 (cached beside the checkpoint)."""
    from transformers import AutoModelForCausalLM

    key = hashlib.sha256(json.dumps([ids, gguf]).encode()).hexdigest()[:12]

    def compute() -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kw = {"gguf_file": gguf} if gguf else {}
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kw).eval()
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
        return math.exp(-lp.mean().item())

    return cached_json(model_dir.parent / f"ppl-{key}.json", compute)


def _api_perplexity(http: httpx.Client, model: str, ids: list[int], top: int = 0) -> tuple[float, list]:
    r = http.post("/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0,
                                            "prompt_logprobs": top})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    lps = [entry[str(token)]["logprob"] for entry, token in zip(plp[1:], ids[1:], strict=True)]
    return math.exp(-sum(lps) / len(lps)), plp


def _model_name(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    """The held-out text in SmolLM2's vocabulary (the tiny checkpoints share it), sent as ids."""
    return smol_tokenizer().encode(TEXT)


def test_tiny_perplexity_matches_transformers_in_process_and_over_the_link(server_factory, text_ids):
    tiny_ids = text_ids[:TINY_TOKENS]
    hf_dir = cached_tiny("gemma3")
    ref = _reference(hf_dir, tiny_ids)
    flags = ("--model", str(hf_dir), "--dtype", "float32", "--quantization", "none", "--max-num-batched-tokens", "128")
    results = []
    for extra in ((), ("--replicas", "2")):  # in process; engine processes (the engine link)
        srv = server_factory(*flags, *extra)
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            model = _model_name(http)
            ppl, plp = _api_perplexity(http, model, tiny_ids, top=3)
            assert abs(ppl - ref) / ref < 1e-3, (ppl, ref)
            for entry, token in zip(plp[1:], tiny_ids[1:], strict=True):
                mine = entry[str(token)]
                assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
                ranked = sorted((v["rank"], v["logprob"]) for k, v in entry.items() if k != str(token))
                assert len(entry) in (3, 4) and all(r <= 3 for r, _ in ranked)
                assert all(lp >= mine["logprob"] - 1e-6 for r, lp in ranked if r < mine["rank"])
            again, _ = _api_perplexity(http, model, tiny_ids)  # a repeat: not served from the prefix cache
            assert again == pytest.approx(ppl, rel=1e-9)
            results.append(ppl)
    assert results[1] == pytest.approx(results[0], rel=1e-6)


def test_smollm2_perplexity_within_one_percent_of_transformers(server, text_ids):
    """The default server (native kernels on the GGUF's Q4_1 blocks) against transformers float32
    on the same GGUF."""
    from tokenpath.engine.loader import resolve_model_path

    ids = text_ids[:SMOL_TOKENS]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        ppl, _ = _api_perplexity(http, CHAT_MODEL, ids)
    ref = _gguf_reference(resolve_model_path(CHAT_MODEL), ids)
    assert abs(ppl - ref) / ref < 0.01, (ppl, ref)


def _gguf_reference(path: Path, ids: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    from tokenpath.config import resolve_data_dir

    key = hashlib.sha256(json.dumps([ids, path.name]).encode()).hexdigest()[:12]

    def compute() -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32).eval()
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])
        return math.exp(-lp.mean().item())

    cache = resolve_data_dir() / "test-cache"
    cache.mkdir(parents=True, exist_ok=True)
    return cached_json(cache / f"smollm2-ppl-{key}.json", compute)


@pytest.mark.parametrize("value", [-1, 21, "many", True, 1.5])
def test_bad_prompt_logprobs_are_400s(server, value):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 1,
                                                "prompt_logprobs": value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt_logprobs" or "prompt_logprobs" in err["message"], err
        r = http.post("/v1/completions", json={"model": CHAT_MODEL, "prompt": "Hi", "max_tokens": 1,
                                                "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_offline_prompt_logprobs_are_computed_not_cached():
    llm = LLM(str(cached_tiny("mistral")), dtype="float32", quantization="none", num_kv_blocks=64,
              max_num_batched_tokens=32)
    prompt = llm.tokenizer.encode(TEXT)[:90]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0]
    first, second = (llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))[0]
                     for _ in range(2))
    assert first.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(first.prompt_logprobs) == 90 and first.prompt_logprobs[0] is None
    for lp in first.prompt_logprobs[1:]:
        assert len(lp.top) == 2 and lp.top[0][2] >= lp.top[1][2]
        assert (lp.rank <= 2) == (lp.token_id in [t for t, _, _ in lp.top])
    assert [lp.token_id for lp in first.prompt_logprobs[1:]] == prompt[1:]
    assert [lp.logprob for lp in second.prompt_logprobs[1:]] == [lp.logprob for lp in first.prompt_logprobs[1:]]
    assert second.num_cached_tokens == 0  # computed again, although its blocks were cached


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_does(server, text_ids):
    """OpenAI's `echo` (a 400 before): lm-evaluation-harness scores a continuation with `echo: true,
    logprobs: 1, max_tokens: 1` and reads the prompt's tokens from `logprobs`. The echoed text is
    the prompt then the reply; the prompt's logprobs are `prompt_logprobs`' own (first one None)."""
    ids = text_ids[:40]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        _, plp = _api_perplexity(http, CHAT_MODEL, ids, top=1)
        prompt = http.post("/detokenize", json={"model": CHAT_MODEL, "tokens": ids}).json()["prompt"]
        r = http.post("/v1/completions", json={"model": CHAT_MODEL, "prompt": ids, "max_tokens": 1,
                                                "temperature": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
        lp = choice["logprobs"]
        n = len(lp["tokens"])
        assert n == len(ids) + 1 == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = [entry[str(t)]["logprob"] for entry, t in zip(plp[1:], ids[1:], strict=True)]
        assert lp["token_logprobs"][1:-1] == pytest.approx(expected, abs=1e-4)
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] >= len(prompt) - 1
        plain = http.post("/v1/completions", json={"model": CHAT_MODEL, "prompt": prompt, "max_tokens": 3,
                                                    "temperature": 0, "echo": True}).json()["choices"][0]
        assert plain["text"].startswith(prompt) and plain["logprobs"] is None


def test_a_streamed_echo_starts_each_choice_with_its_prompt(server):
    """OpenAI's and vLLM's `echo` with `stream` (a 400 before): each choice's first chunk starts
    with its prompt's text, and the streamed text equals the unstreamed reply's. With `logprobs`
    (a 400 until this stop) the first chunk carries the prompt's tokens and their logprobs (they
    ride with the first sampled token) and the later chunks' offsets count from the prompt's start:
    the chunks' logprobs joined equal the unstreamed reply's, token for token, offsets included."""
    body = {"model": CHAT_MODEL, "prompt": ["The sky is", "Water is"], "max_tokens": 4, "temperature": 0,
            "echo": True, "n": 2}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for extra in ({}, {"logprobs": 2}):
            whole = http.post("/v1/completions", json={**body, **extra}).json()["choices"]
            texts: dict[int, list[str]] = {}
            joined: dict[int, dict[str, list]] = {}
            with http.stream("POST", "/v1/completions", json={**body, **extra, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            texts.setdefault(c["index"], []).append(c["text"])
                            for k, v in (c["logprobs"] or {}).items():
                                joined.setdefault(c["index"], {}).setdefault(k, []).extend(v)
            assert sorted(texts) == [0, 1, 2, 3]
            for c in whole:
                prompt = body["prompt"][c["index"] // 2]
                assert texts[c["index"]][0].startswith(prompt)
                assert "".join(texts[c["index"]]) == c["text"] and c["text"].startswith(prompt)
                if extra:
                    lp = c["logprobs"]
                    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) > 4  # the prompt's, then 4
                    assert "".join(lp["tokens"]) == c["text"]
                    assert joined[c["index"]] == lp, (joined[c["index"]], lp)
                else:
                    assert c["index"] not in joined
