"""CompactBPE (engine/tokenizer_bpe.py) is `tokenizers`' tokenizer of the same tokenizer.json, token
for token, in a fraction of the memory (issue 42: peak RSS).

A synthetic SentencePiece-style tokenizer (spaces as "▁", byte fallback, added tokens, a BOS
template, merges whose results repeat and tokens with "▁" inside) is compared on random text with
both merge paths (the native kernels' and Python's), in the fast tier; Gemma 3's own tokenizer on
the repository's text and random text, and its resident size in a fresh process, with the model."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from tokenizers.decoders import DecodeStream

from tokenpath.engine.kernels.library import native_library
from tokenpath.engine.tokenizer_bpe import CompactBPE
from tokenpath.engine.tokenizer_bpe import DecodeStream as CompactDecodeStream
from tokenpath.engine.tokenizer_bpe_spec import SPACE, compact_spec

ROOT = Path(__file__).resolve().parents[2]
ADDED = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<unused0>", "<unused12>", "\n\n\n", "\t\t"]
ALPHABET = list("abcdefghij <>/\n\t.é中") + [SPACE]


def _spec(seed: int = 0, n_merges: int = 3000) -> dict:
    """A tokenizer.json in Gemma's shape: merges of random pairs, where a concatenation already in
    the vocabulary keeps its id (several pairs then yield one result, as converted SentencePiece
    merges do), so "▁" also lands inside tokens after other characters."""
    rng = random.Random(seed)
    vocab = {t: i for i, t in enumerate(ADDED)}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    for c in ALPHABET:
        vocab.setdefault(c.replace(" ", SPACE), len(vocab))
    toks = [t for t in vocab if t not in ADDED and not t.startswith("<0x")]
    merges: list[list[str]] = []
    seen = set()
    while len(merges) < n_merges:
        a, b = rng.choice(toks), rng.choice(toks[:40])
        if (a, b) in seen or len(a + b) > 8:
            continue
        seen.add((a, b))
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            toks.append(a + b)
        merges.append([a, b])
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": t.startswith("<")} for t in ADDED],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False},
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}},
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                                                     {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def _texts(seed: int, n: int, pieces: list[str]) -> list[str]:
    rng = random.Random(seed)
    out = ["", " ", SPACE, "> </", f">{SPACE}</s>", "a" * 3000, " " * 50, "\n" * 40, "<unused0><unused0x>",
           "<<start_of_turn>>", "ok 😀 \u0301x"]
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            if r < 0.1:
                parts.append(rng.choice(ADDED))
            elif r < 0.15:
                parts.append(chr(rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0x2FFFF)])))
            elif r < 0.2:
                parts.append(rng.choice([" ", "\n", "\t"]) * rng.randint(1, 12))
            else:
                parts.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


def _compare(ours: CompactBPE, ref: tokenizers.Tokenizer, texts: list[str], seed: int) -> None:
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, special).ids == ref.encode(text, add_special_tokens=special).ids, repr(text)
    rng = random.Random(seed)
    n = ref.get_vocab_size()
    for k in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randint(0, 20))] if k % 2 else ref.encode(rng.choice(texts)).ids
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)
            theirs, mine = DecodeStream(skip_special_tokens=skip), CompactDecodeStream(skip)
            assert _steps(mine, ours, ids) == _steps(theirs, ref, ids)


def _steps(stream: DecodeStream | CompactDecodeStream, tok: object, ids: list[int]) -> list[str | None]:
    """Each step's text; "error" where the stream refused the step (the decoded text no longer
    starts with what it released: IncrementalDetokenizer then emits nothing)."""
    out: list[str | None] = []
    for i in ids:
        try:
            out.append(stream.step(tok, i))  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001 - `tokenizers` raises its own exception type
            out.append("error")
    return out


@pytest.mark.parametrize("merge_path", ["native", "python"])
def test_a_synthetic_sentencepiece_bpe_encodes_and_decodes_as_tokenizers(merge_path):
    spec = _spec()
    assert compact_spec(spec, min_vocab=0)
    ref = tokenizers.Tokenizer.from_str(json.dumps(spec))
    ours = CompactBPE(json.loads(json.dumps(spec)), Path("tokenizer.json"))
    if merge_path == "python":
        ours._lib = None  # as without the native kernels
    elif native_library() is None:
        pytest.fail("the native kernels are not built here")
    _compare(ours, ref, _texts(1, 400, ALPHABET + ["ab", "ca", "j."]), seed=2)
    assert ours.get_vocab_size() == ref.get_vocab_size()
    for token in ADDED + ["a", "<0x0A>", SPACE, "not a token"]:
        assert ours.token_to_id(token) == ref.token_to_id(token)
    for i in range(ref.get_vocab_size() + 2):
        assert ours.id_to_token(i) == ref.id_to_token(i)


def test_other_shapes_stay_on_tokenizers():
    assert not compact_spec(_spec())  # too small to be worth it: `tokenizers` holds it in a few MiB
    for change in ({"normalizer": None}, {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}},
                   {"post_processor": {"type": "ByteLevel"}}, {"padding": {"length": 8}}):
        assert not compact_spec({**_spec(), **change}, min_vocab=0), change
    spec = _spec()
    spec["model"]["byte_fallback"] = False
    assert not compact_spec(spec, min_vocab=0)
    spec = _spec()
    spec["added_tokens"][3]["normalized"] = True
    assert not compact_spec(spec, min_vocab=0)


def _gemma_tokenizer_json() -> Path:
    from tokenpath.engine.loader import gemma3_270m_path
    from tokenpath.engine.tokenizer import Tokenizer, gguf_tokenizer_cache

    gguf = gemma3_270m_path()
    tok = Tokenizer(gguf)  # builds the cached tokenizer.json where it is not there yet
    assert isinstance(tok.backend, CompactBPE)
    return gguf_tokenizer_cache(gguf) / "tokenizer.json"


@pytest.mark.requires("gemma3")
def test_gemma3s_tokenizer_encodes_and_decodes_as_tokenizers():
    path = _gemma_tokenizer_json()
    ref = tokenizers.Tokenizer.from_file(str(path))
    ours = CompactBPE(json.loads(path.read_text()), path)
    docs = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))[:20]]
    docs += [p.read_text() for p in sorted((ROOT / "src" / "tokenpath" / "engine").glob("*.py"))[:20]]
    _compare(ours, ref, docs + _texts(3, 300, ["the", " of", "ing", "é", "中文", "<", ">", "/", "\n", "  "]), seed=4)
    assert ours.get_vocab_size() == ref.get_vocab_size() == 262144


# A fresh interpreter builds Gemma 3's tokenizer as the engine does and prints the resident MiB it added.
_RSS = """import gc, sys
from pathlib import Path
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
from tokenpath.engine.tokenizer import Tokenizer
before = rss()
tok = Tokenizer(Path(sys.argv[1]))
gc.collect()
print(type(tok.backend).__name__, rss() - before)
"""


@pytest.mark.requires("gemma3")
def test_gemma3s_tokenizer_is_compact_in_memory():
    """`tokenizers` kept 78 MiB resident for this tokenizer (two hash maps of 262k strings, 515k
    merges, the added tokens' matchers); the compact one keeps ~22 (its arrays, and what the JSON
    parse leaves in the heap)."""
    from tokenpath.engine.loader import gemma3_270m_path

    _gemma_tokenizer_json()  # (cached before the measured run)
    out = subprocess.run([sys.executable, "-c", _RSS, str(gemma3_270m_path())], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.split()
    assert out[0] == "CompactBPE"
    assert float(out[1]) < 35, f"{out[1]} MiB resident for Gemma 3's tokenizer"
