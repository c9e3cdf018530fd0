"""From sampled tokens to what a client sees: text, stop conditions, logprobs, deltas.

Stop strings are not emitted (unless vLLM's `include_stop_str_in_output` asks for the matched one to
end the text): while streaming, the last `len(longest stop) - 1` characters are
held back until they can be ruled out. Text is produced by an incremental detokenizer that never
splits a multi-byte UTF-8 character.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenpath.engine.sequence import Sequence
from tokenpath.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tokenpath.protocol.outputs import (
    CompletionOutput,
    EngineEvents,
    GrammarStats,
    RequestOutput,
    TokenLogprob,
)
from tokenpath.protocol.sampling_params import SamplingParams


@dataclass
class ChoiceState:
    seq: Sequence
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_final: bool = False


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[ChoiceState]
    events: EngineEvents
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled by EngineCore._score_prompts
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.choices)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def process_token(self, choice: ChoiceState, token: int,
                      logprob: tuple[float, list[tuple[int, float]]] | None) -> str | None:
        """Account for one new token of `choice`; returns a finish reason or None."""
        seq, p = choice.seq, choice.seq.params
        if logprob is not None:
            lp, top = logprob
            text_of = self.tokenizer.token_text
            choice.logprobs.append(TokenLogprob(token, text_of(token), lp, [(t, text_of(t), v) for t, v in top]))
        n_out = seq.num_output_tokens
        may_stop = n_out >= p.min_tokens
        if may_stop and not p.ignore_eos and token == self.tokenizer.eos_token_id:
            return "stop"
        if may_stop and token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        before = len(choice.text)
        choice.text += choice.detok.step(token)
        if may_stop and p.stop:
            reason = self._check_stop_strings(choice, p, before)
            if reason:
                return reason
        if seq.grammar is not None and seq.grammar.terminated:
            # Complete (the grammar accepts nothing more but EOS): a whole JSON document, choice...
            # A matcher in its error state (a token it refused) ends the choice as an error.
            return "error" if seq.grammar.failed else "stop"
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _check_stop_strings(choice: ChoiceState, p: SamplingParams, before: int) -> str | None:
        # Only a match that ends in the new text is new; earlier text was checked already.
        window_start = max(0, before - max(len(s) for s in p.stop) + 1)
        best, end = -1, -1
        for s in p.stop:
            i = choice.text.find(s, window_start)
            if i != -1 and (best == -1 or i < best):
                best, end, choice.seq.stop_reason = i, i + len(s), s
        if best == -1:
            return None
        choice.text = choice.text[:end if p.include_stop_str_in_output else best]
        return "stop"

    def make_output(self, req: RequestState) -> RequestOutput | None:
        """The delta since the last call, or None when there is nothing new to say."""
        outs: list[CompletionOutput] = []
        for c in req.choices:
            seq, p = c.seq, c.seq.params
            hold = 0 if seq.is_finished or not p.stop else max(len(s) for s in p.stop) - 1
            end = max(c.sent_text, len(c.text) - hold)
            text = c.text[c.sent_text : end]
            toks = seq.token_ids[seq.num_prompt_tokens + c.sent_tokens :]  # (not a copy of all output first)
            lps = c.logprobs[c.sent_logprobs :] if p.logprobs is not None else None
            final = seq.is_finished and not c.sent_final
            if not text and not toks and not final:
                continue
            c.sent_text, c.sent_tokens, c.sent_logprobs = end, seq.num_output_tokens, len(c.logprobs)
            c.sent_final = c.sent_final or final
            outs.append(CompletionOutput(index=seq.index, text=text, token_ids=toks, logprobs=lps,
                                         finish_reason=seq.finish_reason if final else None,
                                         stop_reason=seq.stop_reason if final else None))
        if not outs:
            return None
        grammars = [c.seq.grammar for c in req.choices if c.seq.grammar is not None]
        stats = None
        if grammars and req.finished:
            steps = sum(g.masked_steps for g in grammars)
            stats = GrammarStats(compile_ms=round(1000 * sum(g.compile_seconds for g in grammars), 3),
                                 cache_hit=all(g.cache_hit for g in grammars),
                                 mask_us_per_token=round(1e6 * sum(g.mask_seconds for g in grammars) / steps, 2)
                                 if steps else 0.0)
        prompt_logprobs = None
        first = req.choices[0].seq
        # Complete once choice 0 has sampled (its prompt is computed), or whatever there is at its end.
        if req.prompt_logprobs is not None and not req.sent_prompt_logprobs and (first.num_output_tokens > 0
                                                                                 or first.is_finished):
            prompt_logprobs, req.sent_prompt_logprobs = req.prompt_logprobs, True
        # A matcher in its error state ends its choice with "error", which is no OpenAI finish reason:
        # the request fails with the library's message instead (an SSE error event, or a 500).
        failed = next((g.failed for o in outs if o.finish_reason == "error"
                       for g in [req.choices[o.index].seq.grammar] if g is not None and g.failed), None)
        return RequestOutput(request_id=req.request_id, outputs=outs, prompt_token_ids=req.prompt_token_ids,
                             num_cached_tokens=max(0, req.choices[0].seq.num_cached_tokens),
                             finished=req.finished, events=req.events.snapshot(),
                             num_preemptions=sum(c.seq.num_preemptions for c in req.choices),
                             grammar=stats, prompt_logprobs=prompt_logprobs,
                             error=None if failed is None else f"the output constraint failed in the engine: {failed}")
