"""Constrained decoding: a request's JSON schema, regex, choice list or Lark grammar, compiled with
llguidance for this engine's tokenizer, masks the logits of its rows in the sampler.

Why llguidance (xgrammar and outlines-core were measured too): it refuses the schema features it
cannot enforce instead of dropping them, and compiles in about a millisecond; figures in
benchmarks/structured_output.md.

The masking names are imported on first use: the gateway's grammar worker process
(api/grammar_worker.py) imports `grammar` alone, so it starts in a second, not three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenpath.engine.structured.grammar import GrammarCache, GrammarError, compile_grammar, grammar_text

if TYPE_CHECKING:
    from tokenpath.engine.structured.masking import GrammarState, apply_grammar_masks

__all__ = ["GrammarCache", "GrammarError", "GrammarState", "apply_grammar_masks", "compile_grammar", "grammar_text"]


def __getattr__(name: str) -> Any:
    if name in ("GrammarState", "apply_grammar_masks"):
        from tokenpath.engine.structured import masking

        return getattr(masking, name)
    raise AttributeError(name)
