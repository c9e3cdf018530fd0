"""Reading a tokenizer.json into `tokenizers` with a compact heap (issue 42: peak RSS).

`tokenizers.Tokenizer.from_file` hands the whole file to serde, which buffers the model (an
untagged enum) as generic values before building it: the vocabulary's strings, which the tokenizer
keeps, are allocated among the ~1.3 million temporary strings of the buffered vocabulary and merges
(Gemma 3: 262k tokens, 515k merges). Once those are freed, most heap pages still hold a few live
strings, and glibc cannot hand any of them back: Gemma 3's tokenizer stays at 97 MiB resident for
69 MiB in use, SmolLM2's at 16 MiB for 8.

`read_tokenizer_json` builds the same tokenizer from the same file with less garbage among the
kept strings: Python parses the file (its objects live in its own arenas, returned whole when
freed), the BPE model is made from the parsed vocabulary and merges by `models.BPE`, and the rest
of the pipeline (added tokens, normalizer, pre-tokenizer, post-processor, decoder) is read by
`from_str` around a model that holds only the added tokens' entries, so that each added token
resolves to the id the file gives it, as it does against the full vocabulary. The result serializes
to the JSON `from_file`'s does (tests/engine/test_tokenizer_json.py checks it, and that it encodes and
decodes alike). Gemma 3: 78 MiB resident instead of 97; SmolLM2: 13 instead of 16.

A large SentencePiece-style BPE (Gemma's 262k tokens) is read by `read_tokenizer` into a
`CompactBPE` instead (engine/tokenizer_bpe.py): ~15 MiB where `tokenizers` holds ~78.

Other models (WordPiece, Unigram, a BPE with merges in the legacy "a b" spelling) go to
`from_file`: nothing here would change how they read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers.models import BPE

from tokenpath.engine.tokenizer_bpe import CompactBPE
from tokenpath.engine.tokenizer_bpe_spec import compact_spec

# models.BPE's keyword arguments that a serialized BPE model carries (None: the default).
BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
               "byte_fallback", "ignore_merges")


def _bpe_parts(spec: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]] | None:
    """The vocabulary and merges of a serialized BPE model, or None where this module does not
    build it (another model type, or merges in the legacy "a b" strings, whose split is the
    library's own)."""
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        return None
    if not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return None
    for i, (a, b) in enumerate(merges):  # in place: the pairs as models.BPE takes them, no second list
        merges[i] = (a, b)
    return vocab, merges


def read_tokenizer(path: Path) -> tokenizers.Tokenizer | CompactBPE:
    """The tokenizer saved at `path`: a `CompactBPE` where it reads the file exactly (a large
    SentencePiece-style BPE: Gemma's), else `tokenizers`' own (`read_tokenizer_json`)."""
    spec = json.loads(path.read_text(encoding="utf-8"))
    if compact_spec(spec):
        return CompactBPE(spec, path)
    box = [spec]
    del spec  # the box holds the only reference: `_from_spec` frees the parse before it builds
    return _from_spec(box, path)


def read_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
    """The tokenizer saved at `path` (a tokenizer.json), as `Tokenizer.from_file` reads it."""
    return _from_spec([json.loads(path.read_text(encoding="utf-8"))], path)


def _from_spec(box: list[dict[str, Any]], path: Path) -> tokenizers.Tokenizer:
    """The parsed file (taken out of `box`, so that it is freed where this function frees it)."""
    spec = box.pop()
    parts = _bpe_parts(spec)
    if parts is None:
        del spec
        return tokenizers.Tokenizer.from_file(str(path))
    vocab, merges = parts
    model = spec["model"]
    options = {k: model[k] for k in BPE_OPTIONS if model.get(k) is not None}
    # The shell's model: the added tokens' own entries, so each resolves to the file's id.
    model["vocab"] = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    model["merges"] = []
    shell = tokenizers.Tokenizer.from_str(json.dumps(spec))
    del spec, model
    shell.model = BPE(vocab, merges, **options)
    return shell
