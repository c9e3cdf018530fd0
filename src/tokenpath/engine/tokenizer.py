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
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers.decoders import DecodeStream

from tokenpath.engine.chat_template import ChatTemplate
from tokenpath.engine.digests import sha256
from tokenpath.engine.heap import trim_heap
from tokenpath.engine.structured.grammar import GrammarCache
from tokenpath.engine.tokenizer_bpe import CompactBPE
from tokenpath.engine.tokenizer_bpe import DecodeStream as CompactDecodeStream
from tokenpath.engine.tokenizer_json import read_tokenizer
from tokenpath.errors import InvalidRequestError, ModelLoadError
from tokenpath.protocol.sampling_params import StructuredOutput

if TYPE_CHECKING:  # imported by the first structured request (`llg_tokenizer`), not by every engine
    import llguidance


def read_chat_template(path: str | Path) -> str:
    """The operator's --chat-template file, read once at startup (a missing file fails the start)."""
    try:
        return Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"--chat-template {path}: cannot read it ({exc})") from exc


class Tokenizer:
    def __init__(self, source: Path, chat_template: str | Path | None = None) -> None:
        """`chat_template`: a template file that replaces the model's own (--chat-template)."""
        parts = _load_parts(source)
        trim_heap()  # the JSON parse's freed buffers: ~180 MiB for a 262k vocabulary
        # The `tokenizers` object, or for a large SentencePiece-style BPE (Gemma) the compact one of
        # engine/tokenizer_bpe.py, which answers the same calls (encode, decode, token_to_id, ...).
        self.backend: tokenizers.Tokenizer | CompactBPE = parts.backend
        specials = parts.specials
        eos = self._id(specials.get("eos_token"))
        self.eos_token_id: int = eos if eos is not None else -1
        self.bos_token_id: int | None = self._id(specials.get("bos_token"))
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids = {i for v in specials.values() if (i := self._id(v)) is not None}
        template = read_chat_template(chat_template) if chat_template is not None else parts.chat_template
        self.chat_template: str | None = (template if isinstance(template, str) or template is None
                                          else template.get("default") or next(iter(template.values()), None))
        self._template = ChatTemplate(template, specials) if template else None
        self._grammars: GrammarCache | None = None
        self._grammar_lock = threading.RLock()  # `grammars` builds under it, through `grammar_source`
        self._grammar_source: tuple[str, tuple[str, int, int]] | None = None

    def _id(self, token: object) -> int | None:
        """A special token's id (None: not a string, e.g. a list of extra tokens, or unknown)."""
        return self.backend.token_to_id(token) if isinstance(token, str) else None

    @property
    def grammars(self) -> GrammarCache:
        """Compiled grammars for this tokenizer, one cache per (spec, tokenizer). Built on first
        use, not at load: reading the vocabulary into llguidance takes a second or two, which only
        structured requests should pay (the API builds it off the event loop; an in-process engine
        then shares it)."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCache(self.llg_tokenizer())
                trim_heap()  # the build's freed buffers: 16 MiB of SmolLM2's 52 stayed resident without it
            return self._grammars

    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """This tokenizer as llguidance reads it (a new one each call: a second or two for a large
        vocabulary). What `llguidance.hf.from_tokenizer` builds, without transformers."""
        import llguidance

        _, (text, n_vocab, eos) = self.grammar_source()
        return llguidance.LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)

    def grammar_cached(self, spec: StructuredOutput) -> bool:
        """Whether `spec` is compiled already (False before the cache is built: building it reads
        the vocabulary, which is for a worker thread, not for the caller of this check)."""
        with self._grammar_lock:
            cache = self._grammars
        return cache is not None and cache.cached(spec)

    def grammar_source(self) -> tuple[str, tuple[str, int, int]]:
        """(a key, (tokenizer.json text, vocabulary size, EOS id)): what a grammar worker process
        needs to build this tokenizer for llguidance (what `llguidance.hf.from_tokenizer` does).
        Serialized once; the key is its digest."""
        with self._grammar_lock:
            if self._grammar_source is None:
                if isinstance(self.backend, CompactBPE):  # its file has no padding or truncation
                    text = self.backend.to_str()
                else:
                    backend = copy.copy(self.backend)
                    backend.no_padding()
                    backend.no_truncation()
                    text = backend.to_str()
                    del backend
                key = sha256(text.encode()).hexdigest()[:16]
                self._grammar_source = (key, (text, self.vocab_size, self.eos_token_id))
                trim_heap()  # the backend's copy and its JSON, freed: 35 of the 38 MiB it left resident (SmolLM2)
            return self._grammar_source

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
        if self._template is None:
            raise InvalidRequestError("this model has no chat template (a base model): use /v1/completions, "
                                      "or start the server with --chat-template FILE", param="messages")
        try:
            text = self._template.render(messages, add_generation_prompt, tools, variables)
        except InvalidRequestError:
            raise
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

    def __init__(self, backend: tokenizers.Tokenizer | CompactBPE, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._stream = (CompactDecodeStream(skip_special_tokens) if isinstance(backend, CompactBPE)
                        else DecodeStream(skip_special_tokens=skip_special_tokens))

    def step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._backend, token_id) or ""  # type: ignore[arg-type]
        except Exception:  # an id outside the vocabulary: emit nothing rather than kill the step loop
            return ""


def _cache_dir() -> Path:
    from tokenpath.config import data_subdir

    return data_subdir("tokenizers")  # 0700, as the data dir (save_pretrained would make it 0755)


def gguf_tokenizer_cache(source: Path) -> Path:
    """Where the tokenizer built from the GGUF file `source` is kept: the data dir's tokenizers/,
    under a key of the file's path, size and mtime (a replaced file is built again)."""
    st = source.stat()
    return _cache_dir() / sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class Parts:
    """What a tokenizer is made of here: `tokenizers`' object, the special tokens by role (the
    chat template's variables too), and the chat template (a table of named ones in some configs)."""
    backend: tokenizers.Tokenizer | CompactBPE
    specials: dict[str, Any]
    chat_template: str | dict[str, str] | None


def _load_saved(directory: Path, config: dict | None = None) -> Parts:
    """A tokenizer as this module saves it (tokenizer.json, a plain tokenizer_config.json and
    chat_template.jinja), read by `tokenizers` alone. It is what transformers' generic fast class
    builds from the same files (the same object: checked on every cached tokenizer here), without
    importing transformers (~27 MiB resident in every process that holds a tokenizer) or its
    second, Python-side parse of tokenizer.json (Gemma 3's 262k vocabulary and 515k merges as
    dicts and lists: +200 MiB at the load's peak). `config`: its tokenizer_config.json, when read."""
    if config is None:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    template_file = directory / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    return Parts(read_tokenizer(directory / "tokenizer.json"),
                 {k: config[k] for k in SPECIAL_KEYS if isinstance(config.get(k), str)},
                 template if isinstance(template, str) else None)


def _from_transformers(hf: Any) -> Parts:  # noqa: ANN401 - a transformers fast tokenizer
    """The parts of a tokenizer transformers built (a class or file `_load_saved` does not read)."""
    template = getattr(hf, "chat_template", None)
    return Parts(hf.backend_tokenizer, dict(hf.special_tokens_map),
                 template if isinstance(template, (str, dict)) else None)


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


def _direct(config: dict) -> bool:
    """Whether `tokenizers` alone reads this saved tokenizer as transformers would: a plain config
    without `add_bos_token`/`add_eos_token`, which transformers turns into a new post-processor."""
    return _plain(config) and "add_bos_token" not in config and "add_eos_token" not in config


def _generic_fast(directory: Path) -> bool:
    """Whether a model directory's tokenizer is the generic fast class over tokenizer.json and
    nothing else (as this module saves them, and benchmarks/make_smollm2_hf.py): then it is loaded
    as the cached ones are. Any other class or file goes to AutoTokenizer, which knows them."""
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (_direct(config) and config.get("tokenizer_class") in GENERIC_FAST
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


def _load_parts(source: Path) -> Parts:
    try:
        if source.is_file():  # GGUF: build once from metadata, then reuse the saved tokenizer
            cached = gguf_tokenizer_cache(source)
            key = cached.name
            if (cached / "tokenizer.json").is_file():
                return _load_any_saved(cached)
            tmp = cached.with_name(f"{key}.tmp{os.getpid()}")
            _build_from_gguf(source, tmp)
            tok = _load_any_saved(tmp)  # as every later start will load it
            with contextlib.suppress(OSError):  # another process won the race; its copy is identical
                os.replace(tmp, cached)
            import shutil  # (here: its import is 0.6 MiB of every engine, for a first load's clean-up)

            shutil.rmtree(tmp, ignore_errors=True)  # (left only when that race was lost)
            return tok
        if _generic_fast(source):
            return _load_saved(source)
        # Only here: importing AutoTokenizer imports transformers' configuration code, which imports
        # torch where it is installed (~218 MiB of RSS); the saved and generic tokenizers above
        # load with `tokenizers` alone, so a GGUF engine never pays for it (issue 42).
        from transformers import AutoTokenizer

        return _from_transformers(AutoTokenizer.from_pretrained(str(source)))
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{source}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc


def _load_any_saved(directory: Path) -> Parts:
    """A tokenizer this module saved from a GGUF: read directly when its config is plain, else by
    transformers (added tokens or special tokens saved as objects, which it builds)."""
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if _direct(config):
        return _load_saved(directory, config)
    from transformers import PreTrainedTokenizerFast

    return _from_transformers(PreTrainedTokenizerFast.from_pretrained(str(directory)))
