"""A Mixtral and a Qwen3-MoE made by llama.cpp's own converter give llama.cpp's greedy tokens: the peers tier.

The tiny random Mixtral and Qwen3-MoE of tests/engine/tiny_models.py (8 experts, top-2, SmolLM2's
vocabulary; the Qwen3-MoE with head_dim 32 over a hidden size of 64, every layer sparse and its
top-k renormalized, since llama.cpp's qwen3moe graph needs a router in each layer and always
renormalizes) are each converted to a float32 GGUF by the vendored `convert_hf_to_gguf.py` (not by the suite's own gguf-py
writer, whose layout is tokenpath's reading of the converter's), and served by the vendored
`llama-server`. Its greedy tokens, prompt by prompt, are those of:
- tokenpath's torch path on that very GGUF (float32 throughout, like llama.cpp here);
- tokenpath's native kernels on the safetensors checkpoint the converter read (float32 matrices);
- transformers on that checkpoint.
llama.cpp keeps its KV cache in float32 (`-ctk f32 -ctv f32 -fa off`): with its default f16 cache
the first token of a random-weight model already differs, which says nothing about either engine.
The converter's GGUF also gives the safetensors' logits exactly on the torch path, so the loader reads
the converter's layout (its Q/K row permutation, its stacked experts) as transformers' own.
A gpt-oss the converter writes is refused at load, naming its experts' type (no gpt-oss GGUF is
read yet; llama.cpp's YaRN also always truncates its correction range, which gpt-oss' config
turns off, so its tokens would not be transformers' reference anyway).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.procs import LLAMA_SERVER, free_port  # noqa: E402

pytestmark = [pytest.mark.requires("llamacpp"), pytest.mark.timeout(900)]
LLAMA_CPP = LLAMA_SERVER.parents[2]  # the vendored source: build/bin/llama-server
NEW_TOKENS = 16
LENGTHS = [5, 17, 40, 90]

# The converter, as a llama.cpp user without sentencepiece runs it on a tokenizer.json-only
# checkpoint: its llama vocabulary step tries sentencepiece first and does not catch the
# ImportError, only the FileNotFoundError a checkpoint without tokenizer.model gives. That is
# what this makes it raise, so it falls through to the BPE (gpt2) vocabulary as it is meant to.
_CONVERT = """
import sys
sys.path.insert(0, sys.argv.pop(1))
import convert_hf_to_gguf
from conversion.base import TextModel

def _no_sentencepiece(self, add_to_gguf=True):
    raise FileNotFoundError("no tokenizer.model")

TextModel._set_vocab_sentencepiece = _no_sentencepiece
convert_hf_to_gguf.main()
"""


@pytest.fixture(scope="module", params=["mixtral", "qwen3moe-sparse"])
def hf_dir(request: pytest.FixtureRequest) -> Path:
    from tests.engine.tiny_models import cached_tiny

    return cached_tiny(request.param)


def _convert(hf_dir: Path, out: Path) -> Path:
    """`hf_dir` as a float32 GGUF, by llama.cpp's own converter."""
    subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP), str(hf_dir), "--outtype", "f32",
                    "--outfile", str(out)], check=True, capture_output=True, timeout=600,
                   env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"})  # nothing written into the vendored tree
    return out


@pytest.fixture(scope="module")
def converted(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _convert(hf_dir, tmp_path_factory.mktemp("converted") / f"{hf_dir.parent.name}-f32.gguf")


@pytest.fixture(scope="module")
def prompts(hf_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tests.engine.conftest import make_prompts

    return make_prompts(AutoTokenizer.from_pretrained(str(hf_dir)), LENGTHS, seed=3)


@pytest.fixture(scope="module")
def llamacpp_tokens(converted: Path, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[list[list[int]]]:
    """llama-server's greedy tokens for each prompt, given as token ids (it adds no BOS to those),
    one request at a time with no prompt cache reused between them."""
    port = free_port()
    log = tmp_path_factory.mktemp("llamacpp") / "llama-server.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(converted), "--host", "127.0.0.1", "--port", str(port),
                                 "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-c", "1024", "-np", "1", "-t", "2"],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"llama-server did not come up: {log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        out = []
        for ids in prompts:
            r = httpx.post(f"{url}/completion", timeout=300, json={
                "prompt": ids, "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "return_tokens": True})
            r.raise_for_status()
            body = r.json()
            assert body["tokens_evaluated"] == len(ids)  # the prompt as given: no BOS added
            out.append(body["tokens"])
        yield out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _greedy(model: str, prompts: list[list[int]], quantization: str, native: bool) -> list[list[int]]:
    from tokenpath import LLM, SamplingParams

    llm = LLM(model, dtype="float32", quantization=quantization, max_num_batched_tokens=48, max_num_seqs=8)
    assert (llm.engine.runner.native is not None) == native
    p = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, p)]


def test_converted_gguf_reads_as_the_checkpoint(converted: Path, hf_dir: Path):
    import numpy as np
    import torch

    from tests.engine.test_quantized_quality import all_logits, runner
    from tokenpath.engine.loader import load_model

    gguf, hf = load_model(str(converted)), load_model(str(hf_dir))
    assert (gguf.config.num_experts, gguf.config.num_experts_per_tok) == (8, 2)
    assert (gguf.config.architecture, gguf.config.moe_layers, gguf.config.head_dim) == \
        ({"mixtral": "llama", "qwen3moe": "qwen3moe"}[hf.config.architecture], hf.config.moe_layers, hf.config.head_dim)
    ids = np.random.default_rng(0).integers(3, hf.config.vocab_size, 40).tolist()
    assert torch.equal(all_logits(runner(gguf, "none"), ids), all_logits(runner(hf, "none"), ids))


def test_torch_path_on_the_converted_gguf(converted: Path, prompts, llamacpp_tokens):
    assert _greedy(str(converted), prompts, "none", native=False) == llamacpp_tokens


@pytest.mark.requires("kernels")
def test_native_kernels_on_the_checkpoint(hf_dir: Path, prompts, llamacpp_tokens):
    """The converter's source in its own float32 matrices (a float32 GGUF runs natively only as
    Q8_0, which is not llama.cpp's float32 arithmetic)."""
    assert _greedy(str(hf_dir), prompts, "auto", native=True) == llamacpp_tokens


def test_transformers_on_the_checkpoint(hf_dir: Path, prompts, llamacpp_tokens):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine.conftest import hf_greedy

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    assert hf_greedy(hf, prompts, NEW_TOKENS, None) == llamacpp_tokens


def test_converted_gpt_oss_gguf_is_refused(tmp_path: Path):
    """The tiny gpt-oss through the same converter (float experts, split into ffn_{gate,up}_exps):
    tokenpath reads no gpt-oss GGUF yet, and says so at load naming an expert tensor's type,
    rather than computing a llama with experts from it (its safetensors run on torch:
    tests/engine/test_gpt_oss.py)."""
    from tests.engine.tiny_models import cached_tiny
    from tokenpath.engine.loader import load_model
    from tokenpath.errors import ModelLoadError

    gguf = _convert(cached_tiny("gpt-oss"), tmp_path / "gpt-oss-f32.gguf")
    with pytest.raises(ModelLoadError, match=r"gpt-oss GGUF is not supported yet \(blk\.0\.ffn_\w+_exps\.weight is F32\)"):
        load_model(str(gguf))
