"""An engine imports only what its requests use (issue 42's peak RSS: each import below is resident
in every engine process, ~5-10 MiB apiece, beside a 94 MiB model).

- llguidance (and the API's jsonschema) are imported by the first structured request, not at load:
  engine/structured/, engine/tokenizer.py, api/grammar_worker.py.
- gguf-py is imported only to dequantize a tensor type the kernels do not read: its type and block
  tables are engine/ggml_types.py's copy, which must stay equal to the installed gguf-py's.

Each check runs in a fresh interpreter (this test process has imported everything already), and
the model run also shows the lazy import still happens: a json_schema request after a plain one
gets llguidance and its grammar.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenpath.engine.ggml_types import GGML_QUANT_SIZES, GGMLType

LAZY = ("llguidance", "jsonschema", "gguf", "torch")


def _run(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ggml_tables_equal_gguf_py():
    from gguf.constants import GGML_QUANT_SIZES as THEIRS
    from gguf.constants import GGMLQuantizationType

    for t in GGMLType:
        assert GGMLQuantizationType(int(t)).name == t.name
        assert GGML_QUANT_SIZES[t] == THEIRS[GGMLQuantizationType(int(t))], t.name
    assert set(GGML_QUANT_SIZES) == set(GGMLType)


IMPORTS = r"""
import json, sys
import tokenpath.engine.core, tokenpath.engine.async_engine, tokenpath.api.grammar_worker, tokenpath.api.app
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[1:])))
"""


def test_engine_and_api_modules_import_no_grammar_or_gguf_library():
    assert _run(IMPORTS, *LAZY) == []


ENGINE_ONLY = r"""
import json, sys
from tokenpath import LLM
import tokenpath.engine.core, tokenpath.engine.llm, tokenpath.protocol.wire  # (`LLM`: the offline engine)
from tokenpath.engine.block_hash import lora_root
from tokenpath.engine.heap import trim_heap

lora_root("a", "/p")
trim_heap()
print(json.dumps(sorted(m for m in sys.argv[1:] if m in sys.modules)))
"""
# Stdlib modules an engine process has no use for, each 0.4-3.8 MiB resident: _hashlib maps OpenSSL's
# libcrypto (engine/digests.py), statistics brings decimal and fractions, ctypes.util brings shutil,
# tempfile, bz2 and lzma, argparse is the CLI's.
STDLIB_UNUSED = ("_hashlib", "statistics", "ctypes.util", "shutil", "tempfile", "argparse")


def test_the_engine_path_imports_no_openssl_statistics_shutil_or_argparse():
    assert _run(ENGINE_ONLY, *STDLIB_UNUSED) == []


def test_the_engine_digests_are_hashlibs():
    import hashlib

    from tokenpath.engine.digests import blake2b, sha256

    assert sha256(b"tokenpath").hexdigest() == hashlib.sha256(b"tokenpath").hexdigest()
    assert blake2b(b"x", digest_size=8).digest() == hashlib.blake2b(b"x", digest_size=8).digest()


OFFLINE = r"""
import json, sys
from tokenpath import LLM, SamplingParams
from tokenpath.protocol.sampling_params import StructuredOutput

lazy = sys.argv[2:]
seen = lambda: sorted(m for m in sys.modules if m.split(".")[0] in lazy)
llm = LLM("smollm2-135m-instruct", max_model_len=512, kv_cache_memory="16MiB")
assert llm.engine.runner.native is not None, "not the native path"
plain = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
after_plain = seen()
schema = StructuredOutput("json", sys.argv[1])
out = llm.chat([{"role": "user", "content": "A person as JSON."}],
               SamplingParams(temperature=0, max_tokens=40, structured=schema))[0]
print(json.dumps({"after_plain": after_plain, "after_structured": seen(), "text": out.outputs[0].text,
                  "plain": plain.outputs[0].text}))
"""


@pytest.mark.slow
@pytest.mark.requires("kernels", "smollm2_gguf")
def test_gguf_engine_imports_llguidance_only_for_a_structured_request():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    got = _run(OFFLINE, json.dumps(schema), *LAZY)
    assert got["plain"]
    assert got["after_plain"] == [], f"imported by a plain GGUF request: {got['after_plain']}"
    assert "llguidance" in got["after_structured"]
    assert "gguf" not in got["after_structured"] and "torch" not in got["after_structured"]
    assert set(json.loads(got["text"])) == {"name"}


SAMPLER = r"""
import json, sys
import numpy as np
import tokenpath.engine.core
from tokenpath import SamplingParams
from tokenpath.engine.rng import Generator
from tokenpath.engine.sampler import Sampler

class Seq:  # what the sampler reads of a sequence
    def __init__(self, params, generator):
        self.params, self.generator, self.grammar = params, generator, None
        self.num_output_tokens, self.output_token_ids, self.token_ids = 0, [], []

logits = np.linspace(-1, 1, 1000, dtype=np.float32)[None, :]
seqs = [Seq(SamplingParams(temperature=1.0, seed=7), Generator(7)), Seq(SamplingParams(temperature=0.8), None)]
for s in seqs:
    Sampler(eos_token_id=0, seed=1)(logits.copy(), [s])
print(json.dumps(sorted(m for m in sys.modules if m.startswith("numpy.random"))))
"""


def test_seeded_sampling_does_not_import_numpy_random():
    """The sampler's uniforms come from Python's own MT19937 (engine/rng.py): numpy.random, which
    nothing else in an engine imports, is 2.3 MiB resident."""
    assert _run(SAMPLER) == []


ENGINE_PROCESS = r"""
import json, sys
from tokenpath.cli import build_parser, ENGINE_MODULE
args = build_parser(ENGINE_MODULE).parse_args(["engine", "--model", "smollm2-135m-instruct"])
import tokenpath.server.engine_process, tokenpath.engine.async_engine, tokenpath.replica.link_server
from tokenpath.telemetry.engine_spans import setup_engine_tracing, will_export
assert setup_engine_tracing([]) is None and not will_export(None, "00-" + "1" * 32 + "-" + "2" * 16 + "-01")
print(json.dumps(sorted(m for m in sys.argv[1:] if m in sys.modules)))
"""
# What `tokenpath engine` (an engine process a gateway launched, tracing off) has no use for: the
# HTTP server, the API, the gateway, the other commands, the OpenTelemetry SDK; 16 MiB of its RSS
# (75.0 -> 58.8 MiB after the imports above). pydantic stays: its flags are ServerConfig's fields.
SERVER_ONLY = ("uvicorn", "fastapi", "starlette", "opentelemetry", "tokenpath.api.app", "tokenpath.api.errors",
               "tokenpath.gateway",
               "tokenpath.bench", "tokenpath.server.serve")


def test_an_engine_process_imports_no_http_server_api_gateway_or_otel_sdk():
    assert _run(ENGINE_PROCESS, *SERVER_ONLY) == []
