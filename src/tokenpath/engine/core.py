"""The engine core: the step loop that ties scheduler, KV cache, runner, sampler and outputs.

Synchronous and single-threaded on purpose: `LLM` drives it directly, `AsyncEngine` drives it
from one background thread. Requests enter through `add_request` (validated already, at the API
edge; a request that could never fit this engine still fails at submission, never hangs) and leave through `step` outputs or `abort`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from tokenpath.config import EngineConfig, SpeculativeConfig
from tokenpath.engine.block_hash import lora_root
from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.heap import trim_heap
from tokenpath.engine.loader import load_model
from tokenpath.engine.lora import LoraManager, lora_key
from tokenpath.engine.output_processor import ChoiceState, OutputProcessor, RequestState
from tokenpath.engine.rng import Generator
from tokenpath.engine.runner import ModelRunner
from tokenpath.engine.sampler import Sampler, SampleResult, log_softmax, topk
from tokenpath.engine.scheduler import Scheduler
from tokenpath.engine.sequence import Sequence
from tokenpath.engine.spec.decoder import SpecDecoder, SpecStats
from tokenpath.engine.spec.verify import verify
from tokenpath.engine.structured import GrammarState
from tokenpath.engine.tokenizer import Tokenizer
from tokenpath.errors import (
    ContextLengthError,
    DeadlineExceededError,
    DuplicateRequestIdError,
    ModelLoadError,
)
from tokenpath.protocol import GenerateRequest
from tokenpath.protocol.outputs import MAX_STALLS, EngineEvents, EngineState, RequestOutput, TokenLogprob
from tokenpath.protocol.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from tokenpath.engine.spec.draft_model import DraftModel

Logprob = tuple[float, list[tuple[int, float]]] | None  # one token's (logprob, top ones), or None

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
        self.tokenizer = Tokenizer(loaded.tokenizer_source, config.chat_template)
        self.max_model_len = min(config.max_model_len or MAX_CONTEXT_DEFAULT, loaded.config.max_position_embeddings)
        self.runner = ModelRunner(loaded, config, self.max_model_len)
        del loaded  # the GGUF mapping and the loader's tensors: the runner holds its own copy
        # The load's reference cycles (the tokenizer's and loader's parse objects) go now, not at some
        # later collection: their arenas and heap pages are then free for the trim (~1 MiB of SmolLM2's peak).
        gc.collect()
        trim_heap()
        # LoRA adapters, loaded on first use off the step loop; `wake` is the step loop's (AsyncEngine).
        self.loras = LoraManager(self.model_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                 native=self.runner.native is not None)
        self.runner.loras = self.loras
        # Requests that failed outside a step (their adapter did not load, their deadline passed
        # while they waited): (request id, error), taken by the driver (AsyncEngine) after each step.
        self.rejected: list[tuple[str, Exception]] = []
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                   windows=self.runner.layout.windows,
                                   max_chunk=min(config.max_num_batched_tokens,
                                                 config.long_prefill_token_threshold or config.max_num_batched_tokens))
        spec = config.speculative_config
        self.spec = None if spec is None else SpecDecoder(spec, self.max_model_len, self._drafter(spec))
        self.scheduler = Scheduler(self.blocks, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.long_prefill_token_threshold, loras=self.loras, spec=self.spec)
        self.sampler = Sampler(self.tokenizer.eos_token_id, config.seed, grammar_vocab=self.tokenizer.vocab_size)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.failed_steps = 0
        self._step_started = 0.0
        self.step_tokens = 0  # tokens scheduled in the step running now, or the last one (liveness)
        # Called after every step with (scheduled [(seq, n_tokens)], start, end): telemetry's view
        # of step time, batch size and prefill chunks, without the engine knowing about metrics.
        self.step_observers: list[Callable[[list[tuple[Sequence, int]], float, float], None]] = []
        self._lora_waiters: set[str] = set()  # requests whose adapter was not in memory when they came
        self.last_scheduled = 0  # sequences the last step ran (0: nothing could run)
        if config.warmup:
            self._warm_up()

    def _drafter(self, spec: SpeculativeConfig) -> DraftModel | None:
        """The draft model of method draft_model (spec/draft_model.py), its KV pool indexed by the
        target's blocks; None for the n-gram proposer."""
        if spec.method != "draft_model" or spec.model is None:
            return None
        if self.runner.native is None:
            raise ModelLoadError("speculative_config: a draft model needs the target on the native CPU kernels")
        from tokenpath.engine.spec.draft_model import DraftModel

        return DraftModel(spec.model, self.config, num_blocks=self.runner.num_blocks,
                          target_vocab=self.model_config.vocab_size, target_groups=self.runner.layout.num_groups,
                          max_model_len=self.max_model_len)

    def _warm_up(self) -> None:
        """One short greedy request (8 prompt tokens, 2 generated) run before the engine serves,
        as llama.cpp's `--warmup` does: the first prefill and decode steps pay one-time costs (the
        kernels' threads, first touches of pages, lazy set-up along the step), which otherwise land
        on the first user's TTFT: a cold catalog load's first request was ~35 ms slower than a
        warm one (benchmarks/model_load.py). Its blocks leave the prefix cache and the counters
        start from zero after it, so a served engine looks unused."""
        ids = (self.tokenizer.encode("The engine warms up before it serves.") * 8)[:8] or [0] * 8
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        try:
            self.add_request(GenerateRequest("tokenpath-warmup", ids, params))
        except ContextLengthError:  # (a context or KV cache under 10 tokens: it serves unwarmed)
            return
        while self.has_work():
            self.step()
        self.prompt_tokens = self.generation_tokens = self.steps = 0
        self.blocks.reset_prefix_cache()
        self.blocks.prefix_queries = self.blocks.prefix_hits = 0
        if self.spec is not None:
            self.spec.stats = SpecStats()
            if self.spec.suffix is not None:  # (the warm-up's output is no request's)
                self.spec.suffix.clear()

    # ------------------------------------------------------------ requests
    def _runnable_params(self, request: GenerateRequest) -> SamplingParams:
        """The engine's one check on a request: an invariant, not input validation (the API layer
        validated prompt, vocabulary, context length and caps once, in `api/inputs.py`). A request
        that could never finish here, past the context length or bigger than the whole KV cache,
        would wait forever, so it fails at once instead. An unset `max_tokens` (offline `LLM` use)
        means up to the context length."""
        n = len(request.prompt_token_ids)
        params, limit = request.params, self.max_model_len
        max_tokens = limit - n if params.max_tokens is None else params.max_tokens
        need = self.blocks.max_blocks_needed(n + max(max_tokens, 0))  # all KV-cache groups at their peak
        if n == 0 or max_tokens < 1 or n + max_tokens > limit or need > self.blocks.num_blocks:
            raise ContextLengthError(
                f"this engine cannot run {n} prompt + {max_tokens} completion tokens: its context length is "
                f"{limit} tokens and its KV cache {self.blocks.num_blocks} blocks ({need} needed)", param="max_tokens")
        return params if params.max_tokens is not None else replace(params, max_tokens=max_tokens)

    def add_request(self, request: GenerateRequest) -> None:
        """Queue one request (all its choices). Its `arrival` and `deadline` are this process's
        clock (the engine link rebuilds them so, `protocol.wire.decode_request`)."""
        request_id, prompt_token_ids = request.request_id, request.prompt_token_ids
        if request_id in self.requests:
            raise DuplicateRequestIdError(f"request id '{request_id}' is already running")
        params = self._runnable_params(request)
        arrival = request.arrival
        events = EngineEvents(queued=time.monotonic())
        if self.scheduler.is_full():  # it will wait: remember behind whom (its queued_behind cause)
            events.behind = self.scheduler.holders()
        choices: list[ChoiceState] = []
        leader: Sequence | None = None
        lora = request.lora
        root = None if lora is None else lora_root(lora.name, lora.path)
        # Reading it from disk starts now, on the loader thread; the request waits for it in the queue.
        waits = lora is not None and not self.loras.ready(lora)
        for i in range(params.n):
            seq = Sequence(request_id=request_id, index=i, token_ids=list(prompt_token_ids),
                           num_prompt_tokens=len(prompt_token_ids), params=params, priority=request.priority,
                           tenant=request.tenant, arrival_time=arrival, events=events,
                           leader=leader if self.config.enable_prefix_caching else None)
            seq.lora, seq.hash_root, seq.deadline = lora, root, request.deadline
            if params.seed is not None:
                seq.generator = Generator((params.seed + i) % 2**64)
            if params.structured is not None:
                seq.grammar = self._grammar(params.structured)
            leader = leader or seq
            choices.append(ChoiceState(seq=seq, detok=self.tokenizer.detokenizer(params.skip_special_tokens)))
            self.scheduler.add(seq)
        self.prompt_tokens += len(prompt_token_ids)
        victim = self.requests.get(request.preempts) if request.preempts else None
        # The gateway's share preemption: this request takes the victim's running slot.
        if victim is not None and self.scheduler.displace([c.seq for c in victim.choices], [c.seq for c in choices]):
            events.behind = []  # it waits for nobody's end: its slot is the paused one's
        self.requests[request_id] = RequestState(request_id, list(prompt_token_ids), params, choices, events)
        if waits:
            self._lora_waiters.add(request_id)
        if params.prompt_logprobs is not None:
            self.requests[request_id].prompt_logprobs = [None] * len(prompt_token_ids)

    def _grammar(self, spec: StructuredOutput) -> GrammarState:
        """A fresh matcher for one choice, from the tokenizer's cache (the API compiled the spec once
        already, bounded in time, so a miss here costs milliseconds; an in-process engine shares the
        API's cache and hits). An engine process reads the vocabulary into llguidance (about a
        second, GIL held) at start-up (server/engine_process.py), not on its first structured request."""
        found = self.tokenizer.grammars.get(spec)
        return GrammarState(found.matcher, found.compile_seconds, found.hit)

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

    def release_step_buffers(self) -> int:
        """Give the step buffers back to the OS (the target's kernels and a draft model's); the
        bytes released. The engine calls it when it goes idle: they are sized to the widest step
        since the last release (a flood's 1024-row recompute prefills: ~30 MiB for SmolLM2, where a
        one-sequence decode needs ~1 MiB), and a process that keeps the high-water mark of every
        burst looks, to its RSS, like a leak. The first step after costs their page faults once
        (well under a millisecond for a decode-sized step); steps in between allocate nothing."""
        natives = [] if self.runner.native is None else [self.runner.native]
        if self.spec is not None and self.spec.drafter is not None:
            natives.append(self.spec.drafter.native)
        freed = 0
        for native in natives:
            freed += native.step_buffer_bytes()
            native.step_buffer_bytes(release=True)
        return freed

    # ------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One batch forward and one token per sampling sequence.

        A step that raises (a kernel fault, a bug, an out-of-memory) fails only the requests that
        were in it: each ends with finish_reason "error" and an `error` message, their blocks are
        freed, and the engine keeps serving. One bad request must never take the model down."""
        started = self._step_started = time.monotonic()
        if self.loras.failed:
            self._fail_lora_waiters()
        if late := self.scheduler.expired(started):
            self._expire(late)
        sched = self.scheduler.schedule()
        self.last_scheduled = len(sched.scheduled)
        if not sched.scheduled:
            return []
        if self._lora_waiters:
            self._note_lora_loads(sched.scheduled)
        self.step_tokens = sum(n for _, n in sched.scheduled)
        # (Read before the step moves them; only where the cost draft policy keeps prices.)
        priced = self.spec is not None and self.spec.keeps_prices and \
            all(seq.num_computed_tokens >= seq.num_prompt_tokens for seq, _ in sched.scheduled)
        try:
            outs = self._run_step(sched.scheduled)
        except Exception as exc:
            log.exception("engine step failed; failing the %d requests in it", len(sched.scheduled))
            return self._fail_step(sched.scheduled, exc)
        if priced and self.spec is not None:  # the prices of verification rows (spec/cost.py)
            self.spec.observe_step(self.step_tokens, time.monotonic() - started)
        for observe in self.step_observers:
            observe(sched.scheduled, started, time.monotonic())
        return outs

    def _fail_lora_waiters(self) -> None:
        """Requests whose adapter failed to load end with its 400 (through `rejected`)."""
        failures = self.loras.take_failures()
        waiting = {s.request_id: s.lora for s in self.scheduler.waiting if s.lora is not None}
        for rid, lora in waiting.items():
            error = failures.get(lora_key(lora))
            if error is not None:
                self.abort(rid, reason="error")
                self.rejected.append((rid, error))

    def _expire(self, request_ids: list[str]) -> None:
        """Requests whose deadline passed before any step scheduled them leave the queue now,
        before they cost a prefill (they hold no KV blocks yet), with the gateway's own deadline
        error (through `rejected`): their client has given up on them."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            waited = time.monotonic() - (req.events.queued or 0.0)
            self.abort(rid)
            self.rejected.append((rid, DeadlineExceededError(
                f"request passed its deadline after {waited:.1f}s in the engine's queue, before it was scheduled",
                code="deadline_exceeded")))

    def _note_lora_loads(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """A request that waited for its adapter keeps that load's times (its trace shows them)."""
        for seq, _ in scheduled:
            if seq.request_id in self._lora_waiters and seq.lora is not None:
                self._lora_waiters.discard(seq.request_id)
                rec = self.loras.records.get(lora_key(seq.lora))
                if rec is not None:
                    seq.events.lora_load = [rec.started, rec.ended, rec.cold]

    def _fail_step(self, scheduled: list[tuple[Sequence, int]], exc: Exception) -> list[RequestOutput]:
        message = f"the engine failed while computing this request: {type(exc).__name__}: {exc}"
        for seq, _ in scheduled:
            seq.draft_ids = []
        outs = []
        for rid in dict.fromkeys(seq.request_id for seq, _ in scheduled):
            out = self.abort(rid, reason="error")
            if out is not None:
                out.error = message
                outs.append(out)
        self.failed_steps += 1
        return outs

    def _run_step(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        self.sampler.prefetch_masks([seq for seq, n in scheduled if seq.grammar is not None
                                     and seq.num_computed_tokens + n == seq.num_tokens])
        logits, sampling, prompt_rows = self.runner.execute(scheduled)
        drafting = self.spec is not None and any(seq.draft_ids for seq in sampling)
        rows = len(sampling) + (sum(len(seq.draft_ids) for seq in sampling) if drafting else 0)
        if prompt_rows:
            self._score_prompts(logits[rows:], prompt_rows)
            logits = logits[:rows]
        self.steps += 1
        prefills: list[list] | None = None
        caching = self.blocks.enable_prefix_caching  # (off: no call per sequence)
        for seq, n in scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                (prefills := prefills or []).append([seq.request_id, n])
            seq.num_computed_tokens += n - len(seq.draft_ids)  # drafts count once accepted
            if caching:
                self.blocks.commit_computed(seq)
            if seq.events.preempted:
                self._note_recovered(seq)
        token_logprobs: list[list[Logprob]] | None = None  # (drafting: one per emitted token)
        if drafting:
            tokens, token_logprobs = self._verify(logits, sampling)
            logprobs: list[Logprob] = []
        else:
            result = self.sampler(logits, sampling) if sampling else SampleResult([], [])
            tokens, logprobs = [[t] for t in result.token_ids], result.logprobs
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for i, seq in enumerate(sampling):
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            if seq.events.first_token is None:
                seq.events.first_token = now
            walk = seq.grammar if drafting and seq.draft_ids else None  # (the sampler advanced the others)
            for k, token in enumerate(tokens[i]):
                seq.token_ids.append(token)
                if walk is not None:
                    walk.accept(token)  # before process_token, which asks whether the grammar completed
                self.generation_tokens += 1
                lp = logprobs[i] if token_logprobs is None else token_logprobs[i][k]
                reason = self.outputs.process_token(req.choices[seq.index], token, lp)
                if reason is not None:
                    seq.finish_reason = reason
                    self._finish(seq, now)
                    break
            if seq.draft_ids:
                self._settle_drafts(seq, len(tokens[i]) - 1)
        if prefills is not None and sampling:
            self._note_stalls(sampling, prefills, now)
        outs = []
        for req in touched.values():
            out = self.outputs.make_output(req)
            if out is not None:
                outs.append(out)
            if req.finished:
                self._retire(req)
        return outs

    def _verify(self, logits: np.ndarray, sampling: list[Sequence]) -> tuple[list[list[int]], list[list[Logprob]]]:
        """A step with draft tokens: the plain rows sample as always (one batch through the
        sampler), each drafting sequence's 1 + K rows are processed as plain decoding would
        process each (`Sampler.draft_rows`: penalties, logit_bias, min_tokens, grammar) and
        verified (`spec.verify`). Logprobs, one per emitted token: a drafting sequence's come from
        its raw rows (before penalties and masks), row j for the token emitted at j, as plain
        decoding reports them."""
        starts, row = [], 0
        for seq in sampling:
            starts.append(row)
            row += 1 + len(seq.draft_ids)
        plain = [i for i, seq in enumerate(sampling) if not seq.draft_ids]
        result = (self.sampler(logits[[starts[i] for i in plain]], [sampling[i] for i in plain]) if plain
                  else SampleResult([], []))
        tokens: list[list[int]] = [[] for _ in sampling]
        logprobs: list[list[Logprob]] = [[None] for _ in sampling]
        for j, i in enumerate(plain):
            tokens[i], logprobs[i] = [result.token_ids[j]], [result.logprobs[j]]
        raw = {i: log_softmax(logits[starts[i] : starts[i] + 1 + len(seq.draft_ids)])
               for i, seq in enumerate(sampling) if seq.draft_ids and seq.params.logprobs is not None}
        # (after the plain rows: the sampler has collected the grammar masks it prefetched)
        logits = self.sampler.draft_rows(logits, [(starts[i], seq) for i, seq in enumerate(sampling) if seq.draft_ids])
        for i, seq in enumerate(sampling):
            if seq.draft_ids:
                tokens[i] = verify(logits[starts[i] : starts[i] + 1 + len(seq.draft_ids)], seq,
                                   self.sampler.generator)
                rows, top = raw.get(i), seq.params.logprobs
                logprobs[i] = ([None] * len(tokens[i]) if rows is None else
                               [(float(rows[j][t]), topk(rows[j], top) if top else []) for j, t in enumerate(tokens[i])])
        return tokens, logprobs

    def _settle_drafts(self, seq: Sequence, accepted: int) -> None:
        """After verification: the accepted drafts' KV counts as computed, the blocks only the
        rejected ones used go back to the pool (no copy: their slots are simply overwritten
        later), and the counters (engine-wide and the request's) take the step."""
        proposed = len(seq.draft_ids)
        seq.draft_ids = []
        if self.spec is not None:
            self.spec.settle(seq, proposed, accepted)
        ev = seq.events
        if ev.spec is None:
            ev.spec = [0, 0, 0]
        ev.spec[0] += 1
        ev.spec[1] += proposed
        ev.spec[2] += accepted
        if seq.is_finished:
            return
        seq.num_computed_tokens += accepted
        self.blocks.trim(seq)
        self.blocks.commit_computed(seq)

    def _score_prompts(self, logits: np.ndarray, prompt_rows: list[tuple[Sequence, int, int]]) -> None:
        """Prompt logprobs (SamplingParams.prompt_logprobs) from the logits of prompt positions: the
        raw distribution's logprob and rank of each next prompt token, and the top ones asked for.
        A position computed twice (after a preemption) keeps its first value."""
        logprobs = log_softmax(logits)
        text_of = self.tokenizer.token_text
        row = 0
        for seq, first, count in prompt_rows:
            block = logprobs[row : row + count]
            row += count
            req = self.requests.get(seq.request_id)
            if req is None or req.prompt_logprobs is None:
                continue
            targets = np.asarray(seq.token_ids[first + 1 : first + 1 + count], dtype=np.int64)
            chosen = np.take_along_axis(block, targets[:, None], axis=1)
            ranks = (block > chosen).sum(axis=1) + 1
            k = seq.params.prompt_logprobs or 0
            tops: list[list[tuple[int, float]]] = [topk(r, k) if k else [] for r in block]
            for j, (token, value, rank) in enumerate(zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
                                                        strict=True)):
                if req.prompt_logprobs[first + 1 + j] is not None:
                    continue
                top = [(t, text_of(t), v) for t, v in tops[j]]
                req.prompt_logprobs[first + 1 + j] = TokenLogprob(token, text_of(token), value, top, rank)

    def _note_stalls(self, sampling: list[Sequence], prefills: list[list], now: float) -> None:
        """A step that ran prefill chunks also held back the decodes in it: each decoding request
        (choice 0) remembers the step's time and whose prefill shared it (its
        decode_stalled_by_prefill cause). Only such mixed steps cost anything here."""
        took = now - self._step_started
        own = {p[0] for p in prefills}
        for seq in sampling:
            ev = seq.events
            if seq.index or len(ev.stalls) >= MAX_STALLS or seq.num_output_tokens <= 1:
                continue  # (a first token is this request's own prefill, not a stalled decode)
            # One shared list for every decode in the step (never changed once recorded).
            others = prefills if seq.request_id not in own else [p for p in prefills if p[0] != seq.request_id]
            if others:
                ev.stalls.append([now, took, others])

    @staticmethod
    def _note_recovered(seq: Sequence) -> None:
        """A preempted sequence has recomputed what it lost: close its preemption record."""
        last = seq.events.preempted[-1]
        if last[3] is None and seq.num_computed_tokens >= last[2]:
            last[3] = time.monotonic()

    def _finish(self, seq: Sequence, now: float) -> None:
        self.scheduler.remove(seq)
        if self.spec is not None:
            self.spec.finished(seq)
        if all(c.seq.is_finished for c in self.requests[seq.request_id].choices):
            seq.events.finished = now

    def _retire(self, req: RequestState) -> None:
        self.requests.pop(req.request_id, None)
        self._lora_waiters.discard(req.request_id)
        if req.events.finished is None:
            req.events.finished = time.monotonic()

    # ------------------------------------------------------------ state
    def state(self) -> EngineState:
        return EngineState(
            waiting=len(self.scheduler.waiting),
            waiting_deferred=min(self.scheduler.deferred, len(self.scheduler.waiting)),
            waiting_preempted=sum(1 for s in list(self.scheduler.waiting) if s.num_preemptions),
            running=len(self.scheduler.running),
            kv_usage=self.blocks.usage,
            kv_resident_bytes=self.runner.kv_resident_bytes(self.blocks.touched),
            num_blocks=self.blocks.num_blocks,
            block_size=self.blocks.block_size,
            prefix_cache_queries=self.blocks.prefix_queries,
            prefix_cache_hits=self.blocks.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            steps=self.steps,
            loras=list(self.loras.names()),
            running_loras=list(dict.fromkeys(s.lora.name for s in list(self.scheduler.running) if s.lora)),
            waiting_loras=list(dict.fromkeys(s.lora.name for s in list(self.scheduler.waiting) if s.lora)),
            max_loras=self.loras.max_loras,
            spec_decode=[] if self.spec is None else self.spec.stats.as_list(self.spec.k),
            moe_experts=self.runner.moe_counters(),
        )

