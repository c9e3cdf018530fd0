"""The engine core: the step loop that ties scheduler, KV cache, runner, sampler and outputs.

Synchronous and single-threaded on purpose: `LLM` drives it directly, `AsyncEngine` drives it
from one background thread. Requests enter through `add_request` (validated there, so a prompt
that can never fit fails at submission, never hangs) and leave through `step` outputs or `abort`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from tokenpath.config import EngineConfig
from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.loader import load_model
from tokenpath.engine.output_processor import ChoiceState, OutputProcessor, RequestState
from tokenpath.engine.runner import ModelRunner
from tokenpath.engine.sampler import Sampler
from tokenpath.engine.scheduler import Scheduler
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.errors import ContextLengthError, InvalidRequestError
from tokenpath.protocol import GenerateRequest
from tokenpath.protocol.outputs import EngineEvents, EngineState, RequestOutput
from tokenpath.protocol.sampling_params import SamplingParams

MAX_CONTEXT_DEFAULT = 8192

log = logging.getLogger("tokenpath.engine")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        loaded = load_model(config.model)
        self.model_config = loaded.config
        self.model_name = config.served_model_name or (
            config.model if "/" not in config.model and not config.model.endswith(".gguf") else loaded.path.stem
        )
        self.tokenizer = Tokenizer(loaded.tokenizer_source)
        self.max_model_len = min(config.max_model_len or MAX_CONTEXT_DEFAULT, loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded, config, self.max_model_len)
        del loaded
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.long_prefill_token_threshold)
        self.sampler = Sampler(self.tokenizer.eos_token_id, config.seed)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.failed_steps = 0
        # Called after every step with (scheduled [(seq, n_tokens)], start, end): telemetry's view
        # of step time, batch size and prefill chunks, without the engine knowing about metrics.
        self.step_observers: list[Callable[[list[tuple[Sequence, int]], float, float], None]] = []

    # ------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Reject what can never run; fill in max_tokens. Pure: safe to call from another thread."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        limit = self.max_model_len
        if params.max_tokens is None:
            if n >= limit:
                raise ContextLengthError(f"This model's maximum context length is {limit} tokens; "
                                         f"the prompt has {n} tokens, leaving no room to generate.")
            params = replace(params, max_tokens=limit - n)
        elif n + params.max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} for the completion). "
                f"Please reduce the prompt or max_tokens.", param="max_tokens")
        need = self.blocks.blocks_needed(n + params.max_tokens)
        if need > self.blocks.num_blocks:
            raise ContextLengthError(
                f"the request needs {need} KV blocks ({n} prompt + {params.max_tokens} completion tokens) "
                f"but the KV cache only has {self.blocks.num_blocks}; it could never be scheduled",
                param="max_tokens")
        return params

    def add_request(self, request: GenerateRequest) -> None:
        """Queue one request (all its choices). Its `arrival` is this process's clock."""
        request_id, prompt_token_ids = request.request_id, request.prompt_token_ids
        if request_id in self.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already running")
        params = self.validate(prompt_token_ids, request.params)
        arrival = request.arrival
        events = EngineEvents(queued=time.monotonic())
        choices: list[ChoiceState] = []
        leader: Sequence | None = None
        for i in range(params.n):
            seq = Sequence(request_id=request_id, index=i, token_ids=list(prompt_token_ids),
                           num_prompt_tokens=len(prompt_token_ids), params=params, priority=request.priority,
                           arrival_time=arrival, events=events,
                           leader=leader if self.config.enable_prefix_caching else None)
            if params.seed is not None:
                seq.generator = torch.Generator().manual_seed((params.seed + i) % 2**64)
            leader = leader or seq
            choices.append(ChoiceState(seq=seq, detok=self.tokenizer.detokenizer(params.skip_special_tokens)))
            self.scheduler.add(seq)
        self.prompt_tokens += len(prompt_token_ids)
        self.requests[request_id] = RequestState(request_id, list(prompt_token_ids), params, choices, events,
                                                 request.prompt)

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        now = time.monotonic()
        for c in req.choices:
            if not c.seq.is_finished:
                c.seq.finish_reason = reason
                self._finish(c.seq, now)
        out = self.outputs.make_output(req)
        self._retire(req)
        return out

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One batch forward and one token per sampling sequence.

        A step that raises (a kernel fault, a bug, an out-of-memory) fails only the requests that
        were in it: each ends with finish_reason "error" and an `error` message, their blocks are
        freed, and the engine keeps serving. One bad request must never take the model down."""
        started = time.monotonic()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        try:
            outs = self._run_step(sched.scheduled)
        except Exception as exc:
            log.exception("engine step failed; failing the %d requests in it", len(sched.scheduled))
            return self._fail_step(sched.scheduled, exc)
        for observe in self.step_observers:
            observe(sched.scheduled, started, time.monotonic())
        return outs

    def _fail_step(self, scheduled: list[tuple[Sequence, int]], exc: Exception) -> list[RequestOutput]:
        message = f"the engine failed while computing this request: {type(exc).__name__}: {exc}"
        outs = []
        for rid in dict.fromkeys(seq.request_id for seq, _ in scheduled):
            out = self.abort(rid, reason="error")
            if out is not None:
                out.error = message
                outs.append(out)
        self.failed_steps += 1
        return outs

    def _run_step(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        logits, sampling = self.runner.execute(scheduled)
        self.steps += 1
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.blocks.commit_computed(seq)
        result = self.sampler(logits, sampling) if sampling else None
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for i, seq in enumerate(sampling):
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            token = result.token_ids[i]
            seq.token_ids.append(token)
            self.generation_tokens += 1
            if seq.events.first_token is None:
                seq.events.first_token = now
            reason = self.outputs.process_token(req.choices[seq.index], token, result.logprobs[i])
            if reason is not None:
                seq.finish_reason = reason
                self._finish(seq, now)
        outs = []
        for req in touched.values():
            out = self.outputs.make_output(req)
            if out is not None:
                outs.append(out)
            if req.finished:
                self._retire(req)
        return outs

    def _finish(self, seq: Sequence, now: float) -> None:
        self.scheduler.remove(seq)
        if all(c.seq.is_finished for c in self.requests[seq.request_id].choices):
            seq.events.finished = now

    def _retire(self, req: RequestState) -> None:
        self.requests.pop(req.request_id, None)
        if req.events.finished is None:
            req.events.finished = time.monotonic()

    # ------------------------------------------------------------ state
    def state(self) -> EngineState:
        return EngineState(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_usage=self.blocks.usage,
            num_blocks=self.blocks.num_blocks,
            block_size=self.blocks.block_size,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            steps=self.steps,
        )

