"""Loading a GGUF model costs its weights, not copies of them (issue 42, memory).

The reader (`engine/gguf_file.py`) gives what gguf-py's reader gives, without decoding the
vocabulary to read the hyperparameters; a truncated file names the tensor that runs past its end;
and a whole load (metadata, tokenizer, native weights) in a fresh process stays within a bound
that the old loader exceeded (gguf-py's per-value arrays, the second parse of tokenizer.json,
the file's pages resident beside the repacked copy).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tokenpath.engine.gguf_file import GGUFFile
from tokenpath.engine.loader import load_model, resolve_model_path
from tokenpath.errors import ModelLoadError


def test_the_reader_reads_what_gguf_py_reads():
    import gguf

    path = resolve_model_path("smollm2-135m-instruct")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        assert field.contents() == theirs.fields[key].contents(), key
    assert ours.fields["tokenizer.ggml.tokens"].count == len(theirs.fields["tokenizer.ggml.tokens"].data)
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name
    ours.release(ours.tensors[0])  # dropped pages read back the same
    assert np.array_equal(ours.tensors[0].data.view(np.uint8), np.asarray(theirs.tensors[0].data).view(np.uint8))


def test_a_truncated_tensor_is_named(tmp_path):
    path = resolve_model_path("smollm2-135m-instruct")
    reader = GGUFFile(path)
    last = max(reader.tensors, key=lambda t: t.offset)
    bad = tmp_path / "cut.gguf"
    with open(path, "rb") as f:
        bad.write_bytes(f.read(last.offset + 10))
    with pytest.raises(ModelLoadError, match=f"cut.gguf.*'{last.name}' runs past the end"):
        load_model(str(bad))


_PROBE = """
import json, sys
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024
from tokenpath.config import EngineConfig
from tokenpath.engine.loader import load_model
from tokenpath.engine.runner import ModelRunner
from tokenpath.engine.tokenizer import Tokenizer
base = hwm()
loaded = load_model(sys.argv[1])
Tokenizer(loaded.tokenizer_source)
ModelRunner(loaded, EngineConfig(model=sys.argv[1], max_model_len=1024, kv_cache_memory="16MiB"), 1024)
print(json.dumps({"base": base, "peak": hwm()}))
"""


@pytest.mark.requires("kernels")
def test_a_native_load_peaks_near_its_weights():
    """SmolLM2-135M Q4_1 (94 MiB file): the old loader peaked ~310 MiB above the imports (gguf-py's
    arrays of the 49k-token vocabulary, the file's pages beside the repack), this one ~150. RSS
    barely depends on machine load, but the bound leaves room: 230 MiB."""
    from tokenpath.engine.tokenizer import Tokenizer

    Tokenizer(resolve_model_path("smollm2-135m-instruct"))  # the tokenizer cache is built once, not measured
    out = subprocess.run([sys.executable, "-c", _PROBE, "smollm2-135m-instruct"], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["peak"] - got["base"] < 230, got


def test_a_requantized_matrix_is_dequantized_a_block_of_rows_at_a_time():
    """Types the kernels do not read are requantized from float32 row blocks: the same values as
    the whole matrix, in order (the embedding of a 262k vocabulary never exists whole in float32)."""
    gguf = load_model("smollm2-135m-instruct").gguf
    assert gguf is not None
    for name in ("embed.weight", "layers.0.down_proj.weight", "layers.0.q_proj.weight", "norm.weight"):
        whole = gguf.dequantized(name)
        blocks = list(gguf.dequantized_rows(name, chunk_rows=1000))
        assert np.array_equal(np.concatenate(blocks) if whole.ndim == 2 else blocks[0], whole), name
        assert max(len(b) for b in blocks) <= (1000 if whole.ndim == 2 else len(whole)), name


_MAPPED = """
import json, sys
from tokenpath import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=1024, kv_cache_memory="16MiB", enable_prefix_caching=False)
llm.generate([[1000 + i for i in range(40)]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
runner, rss, inside = llm.engine.runner, 0, False
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:
            inside = line.rstrip().endswith(".gguf")
        elif inside and head[0] == "Rss:":
            rss += int(head[1])
print(json.dumps({"file_rss_kib": rss, "native": runner.native is not None}))
"""


@pytest.mark.requires("kernels")
@pytest.mark.parametrize("model", ["gemma-3-270m", "smollm2-135m-instruct"])
def test_no_page_of_the_gguf_file_stays_resident_after_a_native_load_and_a_step(model):
    """Every matrix and vector is copied (repacked) at load, so none of the file's pages needs to
    stay in the engine's RSS, before or after it computes. Dropping each tensor's pages after its
    copy was not enough: reading the next tensors mapped earlier ones back (39 MiB of Gemma 3
    270M's 241 MiB file stayed resident). Norms read in place from the mapping were not either:
    each read at step time mapped 64 KiB of folios around it back (22 MiB of SmolLM2's file)."""
    gguf = resolve_model_path(model)
    out = subprocess.run([sys.executable, "-c", _MAPPED, str(gguf)], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["native"] and got["file_rss_kib"] < 1024, got


_GARBAGE = """
import gc, json, sys
from tokenpath import LLM
llm = LLM(sys.argv[1], max_model_len=1024, kv_cache_memory="16MiB", warmup=False)
print(json.dumps(gc.collect()))
"""


@pytest.mark.requires("kernels", "smollm2_gguf")
def test_a_load_leaves_no_reference_cycles_to_collect():
    """The engine collects the load's reference cycles before it trims the heap (engine/core.py), so
    their arenas and heap pages go back with the trim instead of waiting, resident, for a later
    collection: 591 objects were left for it after SmolLM2's load (0.9 MiB of its prefill peak)."""
    out = subprocess.run([sys.executable, "-c", _GARBAGE, "smollm2-135m-instruct"], capture_output=True, text=True,
                         timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == 0
