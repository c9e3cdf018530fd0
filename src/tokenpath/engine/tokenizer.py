"""Tokenizer, chat template and incremental detokenization.

The tokenizer itself is the field's library (Hugging Face `tokenizers`, built by `transformers`
from GGUF metadata or from a model directory); this module only adapts it. Building the tokenizer
from GGUF metadata takes seconds (and ~1 GB for a 262k vocabulary: it runs in a child process),
so the result is cached as tokenizer.json next to nothing the user owns: in the data dir, keyed by
the GGUF file's size and mtime.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from tokenizers.decoders import DecodeStream

from tokenpath.engine.heap import trim_heap
from tokenpath.engine.structured.grammar import GrammarCache
from tokenpath.errors import InvalidRequestError, ModelLoadError
from tokenpath.protocol.sampling_params import StructuredOutput


def read_chat_template(path: str | Path) -> str:
    """The operator's --chat-template file, read once at startup (a missing file fails the start)."""
    try:
        return Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"--chat-template {path}: cannot read it ({exc})") from exc


class Tokenizer:
    def __init__(self, source: Path, chat_template: str | Path | None = None) -> None:
        """`chat_template`: a template file that replaces the model's own (--chat-template)."""
        self._hf = _load_hf_tokenizer(source)
        trim_heap()  # the JSON parse's freed buffers: ~180 MiB for a 262k vocabulary
        if chat_template is not None:
            self._hf.chat_template = read_chat_template(chat_template)
        self.backend = self._hf.backend_tokenizer
        self.eos_token_id: int = self._hf.eos_token_id if self._hf.eos_token_id is not None else -1
        self.bos_token_id: int | None = self._hf.bos_token_id
        self.vocab_size: int = len(self._hf)
        self.chat_template: str | None = getattr(self._hf, "chat_template", None)
        self.all_special_ids = set(self._hf.all_special_ids)
        self._grammars: GrammarCache | None = None
        self._grammar_lock = threading.Lock()
        self._grammar_source: tuple[str, tuple[str, int, int]] | None = None

    @property
    def grammars(self) -> GrammarCache:
        """Compiled grammars for this tokenizer, one cache per (spec, tokenizer). Built on first
        use, not at load: reading the vocabulary into llguidance takes a second or two, which only
        structured requests should pay (the API builds it off the event loop; an in-process engine
        then shares it)."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self._hf, self.vocab_size)
            return self._grammars

    def grammar_cached(self, spec: StructuredOutput) -> bool:
        """Whether `spec` is compiled already (False before the cache is built: building it reads
        the vocabulary, which is for a worker thread, not for the caller of this check)."""
        with self._grammar_lock:
            cache = self._grammars
        return cache is not None and cache.cached(spec)

    def grammar_source(self) -> tuple[str, tuple[str, int, int]]:
        """(a key, (tokenizer.json text, vocabulary size, EOS id)): what a grammar worker process
        needs to build this tokenizer for llguidance without transformers (what
        `llguidance.hf.from_tokenizer` does). Serialized once; the key is its digest."""
        with self._grammar_lock:
            if self._grammar_source is None:
                backend = copy.copy(self._hf.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                text = backend.to_str()
                key = hashlib.sha256(text.encode()).hexdigest()[:16]
                self._grammar_source = (key, (text, self.vocab_size, self.eos_token_id))
            return self._grammar_source

    @property
    def hf(self):  # noqa: ANN201 - the transformers tokenizer, for libraries that build on it (llguidance)
        return self._hf

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token as OpenAI logprobs show it."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, variables: dict | None = None) -> list[int]:
        """`tools` (OpenAI tool definitions) go to templates that render them (Qwen, Llama 3.1);
        the API renders tools itself for templates that know none (`api/tools.py`). `variables`:
        more template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template (a base model): use /v1/completions, "
                                      "or start the server with --chat-template FILE", param="messages")
        extra = {**(variables or {}), **({"tools": tools} if tools else {})}
        try:
            text = self._hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=False, **extra)
        except Exception as exc:  # a template error is the caller's input, e.g. an unsupported role order
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        return self.backend.encode(text, add_special_tokens=False).ids

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.backend, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one token at a time into text, never splitting a multi-byte UTF-8 character.

    `tokenizers.decoders.DecodeStream` returns None while a character is incomplete (byte-level
    BPE splits emoji and CJK across tokens), so partial bytes are held back until they complete.
    """

    def __init__(self, backend, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""
        except Exception:  # an id outside the vocabulary: emit nothing rather than kill the step loop
            return ""


def _cache_dir() -> Path:
    from tokenpath.config import data_subdir

    return data_subdir("tokenizers")  # 0700, as the data dir (save_pretrained would make it 0755)


def gguf_tokenizer_cache(source: Path) -> Path:
    """Where the tokenizer built from the GGUF file `source` is kept: the data dir's tokenizers/,
    under a key of the file's path, size and mtime (a replaced file is built again)."""
    st = source.stat()
    return _cache_dir() / hashlib.sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def _load_cached(cached: Path):  # noqa: ANN202 - a transformers tokenizer
    """The tokenizer this module saved: the generic fast class over tokenizer.json, with the saved
    config and chat template. What `from_pretrained` builds (the same class, tokenizer and
    template, checked on every cached tokenizer here), without its second, Python-side parse of
    tokenizer.json (Gemma 3's 262k vocabulary and 515k merges as dicts and lists: +200 MiB at the
    load's peak)."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((cached / "tokenizer_config.json").read_text())
    if not _plain(config):  # added tokens or special tokens as objects: from_pretrained builds those
        return PreTrainedTokenizerFast.from_pretrained(str(cached))
    config.pop("tokenizer_class", None)
    template = cached / "chat_template.jinja"
    if template.is_file():
        config["chat_template"] = template.read_text()
    return PreTrainedTokenizerFast(tokenizer_file=str(cached / "tokenizer.json"), **config)


GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")  # classes that are tokenizer.json alone
_MORE_TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                         "merges.txt", "vocab.txt")


def _plain(config: object) -> bool:
    """Whether a tokenizer_config.json holds only plain values (strings, numbers, lists of
    strings), which the fast class takes as they are; transformers turns some objects in it
    (`added_tokens_decoder`, special tokens saved as AddedToken dicts) into its own types first."""
    return isinstance(config, dict) and "added_tokens_decoder" not in config and all(
        v is None or isinstance(v, (str, int, float, bool)) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
        for v in config.values())


def _generic_fast(directory: Path) -> bool:
    """Whether a model directory's tokenizer is the generic fast class over tokenizer.json and
    nothing else (as this module saves them, and benchmarks/make_smollm2_hf.py): then it is loaded
    as the cached ones are. Any other class or file goes to AutoTokenizer, which knows them."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (_plain(config) and config.get("tokenizer_class") in GENERIC_FAST
            and (directory / "tokenizer.json").is_file()
            and not any((directory / name).exists() for name in _MORE_TOKENIZER_FILES))


_BUILD = """import sys, warnings
warnings.simplefilter("ignore")
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])
"""


def _build_from_gguf(source: Path, out: Path) -> None:
    """Build the tokenizer from the GGUF's metadata (transformers' converter) and save it to `out`,
    in a child process: the converter reads the file with gguf-py, whose per-value arrays of a 262k
    vocabulary peak near 1 GB; in a child, that peak never adds to the engine's, and its memory
    all goes back when the child exits. Once per file (the result is cached)."""
    done = subprocess.run([sys.executable, "-c", _BUILD, str(source.parent), source.name, str(out)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise ModelLoadError(f"{source}: cannot build the tokenizer from its metadata "
                             f"({lines[-1] if lines else f'exit status {done.returncode}'})")


def _load_hf_tokenizer(source: Path):
    try:
        if source.is_file():  # GGUF: build once from metadata, then reuse the saved tokenizer
            cached = gguf_tokenizer_cache(source)
            key = cached.name
            if (cached / "tokenizer.json").is_file():
                return _load_cached(cached)
            tmp = cached.with_name(f"{key}.tmp{os.getpid()}")
            _build_from_gguf(source, tmp)
            tok = _load_cached(tmp)  # as every later start will load it
            with contextlib.suppress(OSError):  # another process won the race; its copy is identical
                os.replace(tmp, cached)
            shutil.rmtree(tmp, ignore_errors=True)  # (left only when that race was lost)
            return tok
        if _generic_fast(source):
            return _load_cached(source)
        # Only here: importing AutoTokenizer imports transformers' configuration code, which imports
        # torch where it is installed (~218 MiB of RSS); the saved and generic tokenizers above
        # load with the fast class alone, so a GGUF engine never pays for it (issue 42).
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source))
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{source}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc
