"""Which tokenizer.json files the compact BPE (engine/tokenizer_bpe.py) reads: the shape it
encodes exactly, SentencePiece-converted BPE models with a large vocabulary (Gemma 2/3). Every
field that changes how `tokenizers` encodes is checked; anything else stays on `tokenizers`."""

from __future__ import annotations

from typing import Any

MIN_VOCAB = 100_000  # smaller vocabularies cost a few MiB in `tokenizers`: not worth a second encoder
SPACE = "\u2581"  # SentencePiece's space


def _is_space_replace(normalizer: Any) -> bool:  # noqa: ANN401 - a parsed JSON value
    return (isinstance(normalizer, dict) and normalizer.get("type") == "Replace"
            and normalizer.get("pattern") == {"String": " "} and normalizer.get("content") == SPACE)


def _split_on_space(pre: Any) -> bool:  # noqa: ANN401 - a parsed JSON value
    """A Split on " " (a no-op after the space was replaced by "▁")."""
    return (isinstance(pre, dict) and pre.get("type") == "Split" and pre.get("pattern") == {"String": " "}
            and pre.get("invert") is False)


def template(post: Any) -> list[list[int] | None] | None:  # noqa: ANN401 - a parsed JSON value
    """A TemplateProcessing's single-sequence items (ids of a special token, or None for the
    sequence), [None] without a post-processor; None: a shape this module does not read."""
    if post is None:
        return [None]
    if not isinstance(post, dict) or post.get("type") != "TemplateProcessing":
        return None
    items: list[list[int] | None] = []
    for item in post.get("single") or []:
        if "Sequence" in item and item["Sequence"].get("id") == "A":
            items.append(None)
        elif "SpecialToken" in item:
            special = (post.get("special_tokens") or {}).get(item["SpecialToken"].get("id"))
            if not special:
                return None
            items.append([int(i) for i in special["ids"]])
        else:
            return None
    return items if items.count(None) == 1 else None


def compact_spec(spec: dict[str, Any], min_vocab: int = MIN_VOCAB) -> bool:
    """Whether `spec` (a parsed tokenizer.json) is the shape `CompactBPE` encodes exactly, with at
    least `min_vocab` tokens."""
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return False
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or len(vocab) < min_vocab or not isinstance(merges, list):
        return False
    if set(map(type, merges)) != {list} or set(map(len, merges)) != {2}:  # (not the legacy "a b" strings)
        return False
    if (model.get("dropout") not in (None, 0.0) or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix") or model.get("ignore_merges") or not model.get("byte_fallback")):
        return False
    if any(f"<0x{b:02X}>" not in vocab for b in range(256)):
        return False
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return False
    if not _is_space_replace(spec.get("normalizer")):
        return False
    pre = spec.get("pre_tokenizer")
    if pre is not None and not _split_on_space(pre):
        return False
    added = spec.get("added_tokens") or []
    if any(t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return False
    return template(spec.get("post_processor")) is not None
