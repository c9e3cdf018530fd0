"""Offline inference: `LLM(model=...).generate(prompts, params)` and `LLM.chat(messages, params)`.

Drives the same `EngineCore` as the server, synchronously: every prompt is submitted at once and
continuous batching does the rest. The engine sees token ids only, so each result's `prompt` (the
text, for a prompt given as text) is put on here, from the prompts this class was handed, as the
server's replica boundary does from the gateway's `Submission`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from typing import cast

from tokenpath.config import EngineConfig
from tokenpath.engine.core import EngineCore
from tokenpath.protocol import CompletionOutput, GenerateRequest, RequestOutput, SamplingParams
from tokenpath.protocol.lora import LoraRef

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: object) -> None:
        if model is not None:
            engine_kwargs["model"] = model
        self.config = EngineConfig.coerce(engine_kwargs)  # (an unknown keyword: a ValueError naming it)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 priority: Seq[int] | None = None,
                 lora: LoraRef | None | Seq[LoraRef | None] = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._expand(params, len(prompts))
        ids: list[str] = []
        texts: dict[str, str] = {}
        loras: list[LoraRef | None] = [lora] * len(prompts) if lora is None or isinstance(lora, LoraRef) else list(lora)
        for i, (prompt, p) in enumerate(zip(prompts, params_list, strict=True)):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(GenerateRequest(rid, token_ids, p, priority=priority[i] if priority else 0,
                                                    lora=loras[i]))
            ids.append(rid)
            if isinstance(prompt, str):
                texts[rid] = prompt
        return self._run(ids, texts)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        # One conversation (its first item a message dict) or several; mypy cannot narrow a list
        # by its first item, so the check is stated as a cast.
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast("list[list[dict]]", [messages] if one else messages)
        return self.generate([self.tokenizer.apply_chat_template(c) for c in conversations], params)

    @staticmethod
    def _expand(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return list(params)

    def _run(self, ids: list[str], texts: dict[str, str]) -> list[RequestOutput]:
        """Step until every request finishes; accumulate deltas into whole completions, each with
        its prompt's text (`texts`, by request id) when it was given as text."""
        results: dict[str, RequestOutput] = {}
        while self.engine.has_work():
            deltas = self.engine.step()
            if self.engine.rejected:  # an adapter that failed to load
                raise self.engine.rejected.pop()[1]
            if not self.engine.last_scheduled:
                time.sleep(0.002)  # waiting for an adapter to load
            for delta in deltas:
                acc = results.get(delta.request_id)
                if acc is None:
                    acc = results[delta.request_id] = RequestOutput(
                        delta.request_id, [], delta.prompt_token_ids, delta.num_cached_tokens, False,
                        delta.events, delta.num_preemptions, texts.get(delta.request_id))
                _merge(acc, delta)
        return [results[i] for i in ids]


def _merge(acc: RequestOutput, delta: RequestOutput) -> None:
    by_index = {c.index: c for c in acc.outputs}
    for d in delta.outputs:
        c = by_index.get(d.index)
        if c is None:
            c = CompletionOutput(index=d.index, logprobs=[] if d.logprobs is not None else None)
            acc.outputs.append(c)
            by_index[d.index] = c
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None and c.logprobs is not None:
            c.logprobs.extend(d.logprobs)
        c.finish_reason = d.finish_reason or c.finish_reason
        c.stop_reason = d.stop_reason if d.stop_reason is not None else c.stop_reason
    acc.outputs.sort(key=lambda c: c.index)
    acc.finished = delta.finished
    acc.events = delta.events
    acc.num_preemptions = delta.num_preemptions
    acc.num_cached_tokens = delta.num_cached_tokens
    acc.grammar = delta.grammar or acc.grammar
    acc.prompt_logprobs = delta.prompt_logprobs or acc.prompt_logprobs
