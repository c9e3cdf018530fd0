"""The packaged Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q6_K, Q5_0, Q8_0 blocks; 5 windowed layers of
512 to each global one; QK-norm, sandwich norms, GeGLU, 262k vocabulary): greedy tokens equal
transformers float32 on the same GGUF for at least 6 of 8 prompts x 16 tokens (the issue's bar:
both dequantize the same blocks, and float32 sums in a different order may flip a near tie).

Skipped, with the reason, only when the packages are not installed (`make install` installs them).
transformers' reference tokens are cached in the data dir beside the assembled file's hash.
"""

from __future__ import annotations

import hashlib
import json
import warnings

import pytest
import torch

from tests.engine.conftest import LoadedLLM, hf_greedy
from tests.engine.tiny_models import cached_json
from tokenpath import LLM, SamplingParams
from tokenpath.config import resolve_data_dir
from tokenpath.engine.loader import resolve_model_path

pytestmark = pytest.mark.requires("gemma3")

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):",
           "The three primary colors are", "Water boils at a temperature of",
           "In 1969, the first person to walk on the moon was", "A haiku about the sea:\n",
           "The most important rule of writing is"]
NEW = 16


@pytest.fixture
def gemma(gemma3_270m: LoadedLLM) -> LLM:
    return gemma3_270m.llm  # loaded once per session (tests/engine/conftest.py)


def test_config_is_gemma3(gemma):
    cfg = gemma.engine.runner.model_config
    assert cfg.architecture == "gemma3" and cfg.num_layers == 18 and cfg.head_dim == 256
    assert cfg.layer_windows.count(512) == 15 and cfg.layer_windows[5] is None
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert gemma.engine.runner.native is not None  # the default: the native kernels on the file's blocks


def test_greedy_matches_transformers(gemma):
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("gemma-3-270m")
    prompts = [gemma.tokenizer.encode(p) for p in PROMPTS]
    assert all(p[0] == gemma.tokenizer.bos_token_id for p in prompts)  # the GGUF's add_bos_token

    def reference():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        return hf_greedy(hf.eval(), prompts, NEW, gemma.tokenizer.eos_token_id)

    key = hashlib.sha256(json.dumps([path.name, path.stat().st_size, prompts, NEW]).encode()).hexdigest()[:12]
    ref = cached_json(resolve_data_dir() / "test-cache" / f"gemma3-270m-ref-{key}.json", reference)
    p = SamplingParams(temperature=0, max_tokens=NEW)
    got = [o.outputs[0].token_ids for o in gemma.generate(prompts, p)]
    same = sum(g == r for g, r in zip(got, ref, strict=True))
    assert same >= 6, (got, ref)
    text = gemma.tokenizer.decode(got[0])
    assert "Paris" in text or "France" in text, text


def test_chat_template_file(gemma, tmp_path):
    """A base model has no chat template: chat is refused, naming the fix, until one is given."""
    from tokenpath.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="--chat-template"):
        gemma.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                   "{% endfor %}<start_of_turn>model\n")
    from tokenpath.engine.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model_path("gemma-3-270m"), tpl)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<start_of_turn>model")
