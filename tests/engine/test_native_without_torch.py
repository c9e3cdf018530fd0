"""Serving a GGUF on the native kernels never imports torch (issue 42: the import alone is ~218 MiB
of RSS, as much as llama.cpp's whole server on SmolLM2).

Two real runs, each in a process of its own (this test process has torch loaded already):
the offline `LLM` on the SmolLM2 GGUF runs a chat request with everything a request can ask of
the engine (sampling with a seed, penalties, logprobs and prompt logprobs, a JSON-schema grammar,
n-gram speculation, a prefix-cache hit) and then reports `sys.modules`; and `tokenpath serve` on
the same file answers an OpenAI chat completion with sampling, logprobs and a json_schema
response_format, after which no process of its tree has libtorch mapped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import running_server

pytestmark = [pytest.mark.requires("kernels", "smollm2_gguf")]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

OFFLINE = r"""
import dataclasses, json, sys
from tokenpath import LLM, SamplingParams
from tokenpath.protocol.sampling_params import StructuredOutput

llm = LLM("smollm2-135m-instruct", max_model_len=1024, kv_cache_memory="64MiB",
          speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 3, "prompt_lookup_min": 1}))
assert llm.engine.runner.native is not None, "not the native path"
schema = StructuredOutput("json", sys.argv[1])
messages = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=7, max_tokens=32, logprobs=3,
                        prompt_logprobs=2, repetition_penalty=1.05, structured=schema)
first = llm.chat(messages, params)[0]
again = llm.chat(messages, dataclasses.replace(params, prompt_logprobs=None))[0]  # a prefix-cache hit
copy = llm.generate("one two three four one two three four one two three", SamplingParams(temperature=0,
                    max_tokens=12))[0]
print(json.dumps({
    "torch": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    "text": first.outputs[0].text,
    "cached": again.num_cached_tokens, "logprobs": len(first.outputs[0].logprobs or []),
    "prompt_logprobs": sum(p is not None for p in first.prompt_logprobs or []),
    "drafts": llm.engine.spec.stats.num_drafts, "copy": copy.outputs[0].text,
}))
"""


def test_offline_gguf_request_never_imports_torch():
    done = subprocess.run([sys.executable, "-c", OFFLINE, json.dumps(SCHEMA)], capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["torch"] == [], f"torch was imported: {got['torch'][:5]}"
    assert got["logprobs"] > 0 and got["prompt_logprobs"] > 0 and got["cached"] > 0
    assert got["drafts"] > 0  # the n-gram proposer drafted, and verification ran
    assert set(json.loads(got["text"])) == {"name", "age"}  # (32 tokens: a short object closes in them)


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def test_serve_gguf_chat_completion_never_maps_torch(tmp_path):
    with running_server(tmp_path, "--model", "smollm2-135m-instruct", "--max-model-len", "2048") as srv:
        body = {"model": "smollm2-135m-instruct", "max_tokens": 40, "temperature": 0.7, "top_p": 0.95, "seed": 3,
                "logprobs": True, "top_logprobs": 2,
                "messages": [{"role": "user", "content": "Describe a person as JSON with a name and an age."}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
        r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"]["content"]
        if choice["finish_reason"] == "stop":
            assert set(json.loads(choice["message"]["content"])) == {"name", "age"}
        mapped = {}
        for pid in _tree(srv.proc.pid):
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            mapped[pid] = "libtorch" in maps
        assert mapped and not any(mapped.values()), f"libtorch mapped in {mapped}"
