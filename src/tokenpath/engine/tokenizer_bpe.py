"""A compact BPE tokenizer for large SentencePiece-style vocabularies (issue 42: peak RSS).

`tokenizers` holds a BPE model as three hash maps: token -> id, id -> token (each with its own
copy of every string) and (pair) -> (rank, id). For Gemma 3's 262k tokens and 515k merges that is
~70 MiB resident, plus ~8 for the added tokens' matchers: a quarter of the engine's non-weight
memory, where llama.cpp keeps its vocabulary in ~35. `CompactBPE` encodes and decodes the same
tokenizer.json token for token from flat arrays instead: the tokens' UTF-8 bytes in one buffer with
their offsets, the merges as sorted 64-bit pair keys with their ranks and results (~16 MiB in all).

Only one shape is read this way (engine/tokenizer_bpe_spec.py `compact_spec` says which), the one SentencePiece-converted BPE
models have (Gemma 2/3): a BPE with byte fallback, spaces replaced by "▁" and no pre-tokenizer
split left after that, added tokens matched on the raw text, a template that adds special tokens.
Everything else, and small vocabularies, stays on `tokenizers`. What makes it exact:
- the merge loop is `tokenizers`' `Word::merge_all` (a min-heap on (rank, position), an entry
  dropped when its pair no longer yields its result), on the same initial symbols (`merge_word`:
  a character's token, else its bytes' <0xNN> tokens);
- the text is cut into words only where no token can span the cut: before a "▁" whose preceding
  character never precedes "▁" inside any token (Gemma 3: only ">" does, in ">▁</"); no merge
  result can then contain both sides, so each word merges as it would inside the whole;
- added tokens are found leftmost-longest, as `tokenizers`' Aho-Corasick matcher finds them;
- decoding hands the tokens' strings to the file's own decoder object (`tokenizers.decoders`),
  as `Tokenizer.decode` does.
tests/engine/test_tokenizer_bpe.py holds it to `tokenizers` on Gemma 3's tokenizer.
"""

from __future__ import annotations

import heapq
import json
import re
from array import array
from bisect import bisect_left
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from tokenpath.engine.tokenizer_bpe_spec import SPACE, template

CACHE_WORDS = 10_000  # words kept encoded (as `tokenizers`' BPE cache): text repeats its words


class Encoding:
    """What callers read from `tokenizers.Encoding`: the ids."""

    __slots__ = ("ids",)

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class CompactBPE:
    """The tokenizer of a tokenizer.json that `compact_spec` accepts, with the part of
    `tokenizers.Tokenizer`'s interface the engine and the API call."""

    def __init__(self, spec: dict[str, Any], path: Path) -> None:
        self.path = path  # the file it was read from: grammars read it again (`to_str`)
        model = spec["model"]
        vocab: dict[str, int] = model["vocab"]
        added = spec.get("added_tokens") or []
        self._added = {t["content"]: int(t["id"]) for t in added}
        self._special = frozenset(t["content"] for t in added if t.get("special"))
        self._vocab_len = len(vocab)
        self._n_added_outside = sum(1 for t, i in self._added.items() if vocab.get(t) != i)
        # id -> token: the added tokens' own strings over the model's (as `tokenizers` looks them up).
        table: dict[int, str] = {i: t for t, i in vocab.items()}
        table.update({i: t for t, i in self._added.items()})
        n = max(table) + 1
        pieces = [table.get(i, "").encode() for i in range(n)]
        self._present: np.ndarray = np.zeros(n, dtype=np.bool_)
        self._present[list(table)] = True
        del table
        self._blob = b"".join(pieces)
        self._offsets: np.ndarray = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=self._offsets[1:])
        del pieces
        # Single-character tokens by code point (ascending), for the words' initial symbols.
        chars = sorted((ord(t), i) for t, i in vocab.items() if len(t) == 1)
        self._char_cps = np.array([c for c, _ in chars], dtype=np.uint32)
        self._char_ids = np.array([i for _, i in chars], dtype=np.int32)
        self._cps = array("I", self._char_cps.tobytes())  # (the same, for the per-character path)
        self._bytes = [vocab[f"<0x{b:02X}>"] for b in range(256)]
        self._merges(vocab, model["merges"], n)
        # Cut a word before "▁" unless the character before it precedes "▁" inside some token.
        before = {t[j - 1] for t in vocab if SPACE in t[1:] for j in range(1, len(t)) if t[j] == SPACE}
        before.add(SPACE)
        self._cut = re.compile(f"(?<=[^{''.join(re.escape(c) for c in sorted(before))}])(?={SPACE})")
        # Added tokens, leftmost-longest: the positions where one may start; there, by the first
        # character, the second characters that can follow it and the lengths to try (longest first).
        self._added_next: dict[str, tuple[frozenset[str], list[int]]] = {}
        for first in {t[0] for t in self._added if t}:
            group = [t for t in self._added if t[:1] == first]
            self._added_next[first] = (frozenset(t[1] for t in group if len(t) > 1),
                                       sorted({len(t) for t in group}, reverse=True))
        firsts = "".join(sorted(re.escape(c) for c in self._added_next))
        self._added_start = re.compile(f"[{firsts}]") if firsts else None
        self._template = template(spec.get("post_processor")) or [None]
        shell: dict[str, Any] = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": None, "post_processor": None, "decoder": spec.get("decoder"),
                 "model": {"type": "BPE", "vocab": {}, "merges": []}}
        self._decoder = tokenizers.Tokenizer.from_str(json.dumps(shell)).decoder
        self._cache: dict[str, list[int]] = {}
        self._lib: Any = False  # the native kernels' library (`_native`): False until looked up

    def _merges(self, vocab: dict[str, int], merges: list[list[str]], n_ids: int) -> None:
        """The merges by left id: those whose left symbol is a are entries starts[a] ..
        starts[a + 1] - 1 of `_rights` (ascending), `_ranks` and `_results`. A pair listed twice
        keeps its last rank, as `tokenizers`' map does."""
        n = len(merges)
        flat = list(chain.from_iterable(merges))  # (C-level maps below: a Python loop took ~1 s here)
        ids = np.fromiter(map(vocab.__getitem__, flat), dtype=np.uint64, count=2 * n)
        results = np.fromiter(map(vocab.__getitem__, map(str.__add__, flat[0::2], flat[1::2])), dtype=np.uint32,
                              count=n)
        del flat
        keys = ids[0::2] << np.uint64(32) | ids[1::2]
        del ids
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        last: np.ndarray = np.ones(n, dtype=np.bool_)
        last[:-1] = keys[:-1] != keys[1:]
        keep = order[last]
        keys = keys[last]
        self._starts: np.ndarray = np.searchsorted(keys >> np.uint64(32), np.arange(n_ids + 1, dtype=np.uint64)).astype(np.int32)
        self._rights = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        self._ranks = keep.astype(np.uint32)
        self._results = results[keep]
        self._pointers: tuple[int, ...] = (self._starts.ctypes.data, n_ids, self._rights.ctypes.data, self._ranks.ctypes.data,
                          self._results.ctypes.data)
        self._lists: tuple[list[int], list[int], list[int], list[int]] | None = None  # (for `_merge`)

    def _merge(self, a: int, b: int) -> tuple[int, int] | None:
        """(rank, result) of the pair (a, b), or None (the Python path's lookup)."""
        if self._lists is None:
            self._lists = (self._starts.tolist(), self._rights.tolist(), self._ranks.tolist(), self._results.tolist())
        starts, rights, ranks, results = self._lists
        hi = starts[a + 1]
        i = bisect_left(rights, b, starts[a], hi)
        if i < hi and rights[i] == b:
            return ranks[i], results[i]
        return None

    def _initial(self, word: str) -> list[int]:
        """A word's initial symbols (`merge_word`): each character's token, else its bytes' tokens."""
        c: list[int] = []
        cps, fallback = self._cps, self._bytes
        for ch in word:
            cp = ord(ch)
            at = bisect_left(cps, cp)
            if at < len(cps) and cps[at] == cp:
                c.append(int(self._char_ids[at]))
            else:
                c.extend(fallback[b] for b in ch.encode())
        return c

    def _word(self, word: str) -> list[int]:
        """`Word::merge_all` over one word, in Python: where the native kernels are not built."""
        c = self._initial(word)
        n = len(c)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        gone = [False] * n
        heap = []
        for pos in range(n - 1):
            m = self._merge(c[pos], c[pos + 1])
            if m is not None:
                heap.append((m[0], pos, m[1]))
        heapq.heapify(heap)
        while heap:
            _, pos, new = heapq.heappop(heap)
            right = nxt[pos]
            if gone[pos] or right == -1:
                continue
            m = self._merge(c[pos], c[right])
            if m is None or m[1] != new:
                continue
            c[pos] = new
            gone[right] = True
            nxt[pos] = after = nxt[right]
            if after != -1:
                prev[after] = pos
            left = prev[pos]
            if left >= 0 and (m := self._merge(c[left], new)) is not None:
                heapq.heappush(heap, (m[0], left, m[1]))
            if after != -1 and (m := self._merge(new, c[after])) is not None:
                heapq.heappush(heap, (m[0], pos, m[1]))
        return [c[i] for i in range(n) if not gone[i]]

    def _bpe(self, words: list[str]) -> list[list[int]]:
        """Each word's ids: from the cache, the others merged in one call."""
        found = [self._cache.get(w) for w in words]
        todo = [i for i, hit in enumerate(found) if hit is None]
        if todo:
            for i, ids in zip(todo, self._merge_words([words[i] for i in todo]), strict=True):
                found[i] = ids
                if len(self._cache) < CACHE_WORDS:
                    self._cache[words[i]] = ids
        return found  # type: ignore[return-value]

    def _merge_words(self, words: list[str]) -> list[list[int]]:
        """Each word merged: by the native kernels' tp_bpe_merge (csrc/bpe.cpp) in one call, which
        runs without the GIL at `tokenizers`' speed; in Python (`_word`) without them."""
        lib = self._native()
        if lib is None:
            return [self._word(w) for w in words]
        cps = np.frombuffer("".join(words).encode("utf-32-le"), dtype=np.uint32)
        at = np.minimum(np.searchsorted(self._char_cps, cps), len(self._char_cps) - 1)
        if (self._char_cps[at] == cps).all():  # every character a token: no byte fallback
            s = self._char_ids[at]
            e = np.cumsum([len(w) for w in words], dtype=np.int32)
        else:
            syms: list[int] = []
            ends: list[int] = []
            for w in words:
                syms.extend(self._initial(w))
                ends.append(len(syms))
            s = np.array(syms, dtype=np.int32)
            e = np.array(ends, dtype=np.int32)
        out: np.ndarray = np.empty(len(e), dtype=np.int32)
        lib.tp_bpe_merge(*self._pointers, s.ctypes.data, e.ctypes.data, len(e), out.ctypes.data)
        flat = s[:int(out[-1])].tolist()
        return [flat[a:b] for a, b in zip([0, *out[:-1].tolist()], out.tolist(), strict=True)]

    def _native(self) -> Any:  # noqa: ANN401 - the ctypes library
        """The native kernels' library, or None (not built, or switched off)."""
        if self._lib is False:
            from tokenpath.engine.kernels.library import native_library

            found = native_library()
            self._lib = found.lib if found is not None else None
        return self._lib

    def _pieces(self, text: str) -> list[str | int]:
        """`text` cut around its added tokens (leftmost, then longest): strings and added ids."""
        out: list[str | int] = []
        if self._added_start is None:
            return [text]
        at = 0
        pos = 0
        while (found := self._added_start.search(text, pos)) is not None:
            s = found.start()
            follows, lens = self._added_next[text[s]]
            if text[s + 1:s + 2] not in follows:
                lens = [1]  # only a one-character token can start here
            hit = next((text[s:s + n] for n in lens if text[s:s + n] in self._added), None)
            if hit is None:
                pos = s + 1
                continue
            if s > at:
                out.append(text[at:s])
            out.append(self._added[hit])
            at = pos = s + len(hit)
        if at < len(text):
            out.append(text[at:])
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        pieces = self._pieces(text)
        # The words of every piece between added tokens (normalized: " " -> "▁"), merged together.
        words = [[w for w in self._cut.split(p.replace(" ", SPACE)) if w] if isinstance(p, str) else p
                 for p in pieces]
        merged = iter(self._bpe([w for ws in words if isinstance(ws, list) for w in ws]))
        ids: list[int] = []
        for ws in words:
            if isinstance(ws, int):
                ids.append(ws)
            else:
                for _ in ws:
                    ids.extend(next(merged))
        if add_special_tokens:
            ids = [i for item in self._template for i in (ids if item is None else item)]
        return Encoding(ids)

    def id_to_token(self, token_id: int) -> str | None:
        if not 0 <= token_id < len(self._present) or not self._present[token_id]:
            return None
        return self._blob[self._offsets[token_id]:self._offsets[token_id + 1]].decode()

    def token_to_id(self, token: str) -> int | None:
        hit = self._added.get(token)
        if hit is not None:
            return hit
        raw = token.encode()
        at = self._blob.find(raw)
        while at >= 0:  # a token's bytes start at its offset and end at the next one
            i = int(np.searchsorted(self._offsets, at))
            if i < len(self._present) and self._offsets[i] == at and self._offsets[i + 1] == at + len(raw) \
                    and self._present[i]:
                return i
            at = self._blob.find(raw, at + 1)
        return None

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._vocab_len + (self._n_added_outside if with_added_tokens else 0)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        tokens = [t for i in ids if (t := self.id_to_token(i)) is not None
                  and not (skip_special_tokens and t in self._special)]
        return self._decoder.decode(tokens) if self._decoder is not None else " ".join(tokens)

    def to_str(self) -> str:
        """The tokenizer.json it was read from (what a grammar worker builds llguidance from)."""
        return self.path.read_text(encoding="utf-8")


class DecodeStream:
    """`tokenizers.decoders.DecodeStream` over a CompactBPE: the same steps (`step_decode_stream`:
    text is released once it grew and does not end in an incomplete character)."""

    def __init__(self, skip_special_tokens: bool) -> None:
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = ""
        self._prefix_index = 0

    def step(self, tok: CompactBPE, token_id: int) -> str | None:
        self._ids.append(token_id)
        text = tok.decode(self._ids, self._skip)
        if len(text.encode()) > len(self._prefix.encode()) and not text.endswith("\ufffd"):
            if not text.startswith(self._prefix):
                raise ValueError("the decoded text no longer starts with what was released")
            new = text[len(self._prefix):]
            index = len(self._ids) - self._prefix_index
            self._ids = self._ids[self._prefix_index:]
            self._prefix = tok.decode(self._ids, self._skip)
            self._prefix_index = index
            return new
        return None
