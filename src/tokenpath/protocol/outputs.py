"""What an engine hands back: per-request output deltas with the engine's event times, and its state.

`EngineEvents` is the engine's side of a request's timing: when it was queued in the engine,
first scheduled, produced its first token and finished, in the clock of the process that ran
it. The replica boundary translates them into the gateway's clock and stamps them onto the
request's Timeline, the one per-request timing record (`tokenpath.replica.events`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (token_id, token text, logprob)
    rank: int | None = None  # of the token in its distribution, 1 = most likely (prompt logprobs)


@dataclass
class CompletionOutput:
    """One choice. From `AsyncEngine.generate` the fields are *deltas* since the previous yield;
    from `LLM.generate` they are the whole completion."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass
class EngineEvents:
    """Monotonic seconds (the engine process's clock) of one request's engine events, and the
    facts that explain them (`tokenpath.telemetry.causes` turns them into the request's causes).

    The facts are recorded where the engine sees them, only when they happen (a request that
    never waited, never shared a step with a prefill and was never preempted carries empty
    lists), so a calm engine pays nothing per token for them."""

    queued: float | None = None  # entered the engine's queue
    scheduled: float | None = None  # first scheduled (any choice)
    first_token: float | None = None  # first token sampled (any choice)
    finished: float | None = None  # every choice finished
    # (end of step, tokens) of each prefill chunk of choice 0, for the trace's prefill span events.
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)
    # Who held the engine when it arrived full: [request id, tenant, tokens left, "running"|"waiting"].
    behind: list[list] = field(default_factory=list)
    freed_by: str | None = None  # the request whose end gave this one its slot
    # Decode steps of choice 0 that also ran other requests' prefill chunks:
    # [end of step, step seconds, [[request id, prefill tokens], ...]] (at most MAX_STALLS).
    stalls: list[list] = field(default_factory=list)
    # Each preemption: [at, the request whose allocation forced it ("" = its own), tokens thrown
    # away, when it had recomputed them (None until then)].
    preempted: list[list] = field(default_factory=list)
    # The engine's process exported this request's engine spans itself (an engine process or Ray
    # actor with tracing on), so the gateway must not rebuild them: each span has one owner.
    traced: bool = False
    # The LoRA adapter load this request waited for: [started, ended, from disk (True) or not].
    lora_load: list | None = None
    # Speculative decoding (engine/spec/): [steps that drafted, draft tokens, accepted tokens].
    spec: list[int] | None = None

    def shifted(self, by: float) -> EngineEvents:
        """The same events in another clock (`by` = that clock minus this one)."""
        f = lambda t: None if t is None else t + by  # noqa: E731
        return EngineEvents(f(self.queued), f(self.scheduled), f(self.first_token), f(self.finished),
                            [(t + by, n) for t, n in self.prefill_chunks], [list(b) for b in self.behind],
                            self.freed_by, [[t + by, s, list(o)] for t, s, o in self.stalls],
                            [[t + by, who, n, f(done)] for t, who, n, done in self.preempted], self.traced,
                            None if self.lora_load is None else [self.lora_load[0] + by, self.lora_load[1] + by,
                                                                 self.lora_load[2]],
                            None if self.spec is None else list(self.spec))

    def snapshot(self) -> EngineEvents:
        """A copy the engine thread will not change afterwards (taken with every output delta, so
        kept cheap: `behind` and `stalls` records are never changed once added, a preemption's
        record is closed later, so only those are copied one by one)."""
        return EngineEvents(self.queued, self.scheduled, self.first_token, self.finished, list(self.prefill_chunks),
                            list(self.behind), self.freed_by, list(self.stalls),
                            [list(p) for p in self.preempted] if self.preempted else [], self.traced,
                            self.lora_load, None if self.spec is None else list(self.spec))


MAX_STALLS = 64  # stall records kept per request: enough to explain its slow gaps, bounded


@dataclass
class GrammarStats:
    """What constrained decoding cost one request in its engine: the grammar compile (0 and
    `cache_hit` when the engine had it compiled already) and the mean mask time per token."""

    compile_ms: float
    cache_hit: bool
    mask_us_per_token: float


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool
    events: EngineEvents = field(default_factory=EngineEvents)
    num_preemptions: int = 0
    # The prompt's text, echoed for the caller. An engine sees token ids only and leaves it None;
    # whoever holds the text sets it: the replica boundary from the gateway's `Submission`, the
    # offline `LLM` from its own prompts.
    prompt: str | None = None
    # Set when the engine failed this request (a step raised): the request ends here, on this
    # replica, and must not be retried elsewhere, since it may be what broke the step.
    error: str | None = None
    grammar: GrammarStats | None = None  # on the final output of a structured request
    # SamplingParams.prompt_logprobs: one per prompt token, the first None; on one delta only
    # (the first after the prompt is computed).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EngineState:
    """What routers, admission control and /metrics read (vLLM-compatible meanings). Also the
    engine link's `state` message (`protocol.link`), which adds the step histograms."""

    waiting: int = 0
    running: int = 0
    # Of `waiting`, those the last step passed over for a reason of their own (an adapter not
    # ready, shared prefix blocks in flight), not for capacity: vLLM's `deferred` waiting reason.
    waiting_deferred: int = 0
    # Of `waiting`, those preempted (by the KV pool or the gateway's share) and back in the queue:
    # the gateway already counts them in flight, and leaves them out of its engine-queue room test
    # (`ReplicaHandle.has_room`). An older engine does not send it (0: every waiting one counts).
    waiting_preempted: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    # Bytes of the KV pool in this process's memory: the blocks ever written on the native kernels
    # (their pool's pages become resident only as used, and stay so), the whole pool elsewhere. What
    # of the engine's RSS is its configured KV budget rather than weights and buffers (issue 42).
    kv_resident_bytes: int = 0
    num_blocks: int = 0
    block_size: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which were served from it
    num_preemptions: int = 0
    prompt_tokens: int = 0  # total prompt tokens computed or cached
    generation_tokens: int = 0
    healthy: bool = True
    steps: int = 0
    # The engine's cumulative step histograms (`telemetry.engine_steps.StepStats.snapshot`), filled
    # by the engine link's end for the gateway's /metrics; None in process.
    step_stats: dict[str, list] | None = None
    # LoRA: adapters resident in the engine (ready for a step), those its running and waiting
    # requests use (vLLM's lora_requests_info labels), and how many one step may hold.
    # They cross the engine link under these names like every field here (lists: what msgpack
    # gives back, so a state decodes equal to the one sent).
    loras: list[str] = field(default_factory=list)
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)
    max_loras: int = 0
    # KV events since this link's last state (vLLM's, for group 0's prefix index): [kind, block
    # hash] pairs, kind 0 all blocks cleared (hash 0), 1 stored, 2 removed. A link's first state
    # starts with a clear and then every block held, so a gateway that (re)connects is exact.
    kv_events: list[list[int]] = field(default_factory=list)
    # Speculative decoding's counters (vLLM's spec_decode_* metrics): [drafts, draft tokens,
    # accepted tokens, accepted at position 0, 1, ...]; empty when the engine does not speculate.
    spec_decode: list[int] = field(default_factory=list)
    # Mixture-of-experts counters (`telemetry.engine_steps.MOE_COUNTERS`: pairs routed, experts
    # read, the busiest expert's rows, sparse layer-steps); empty for a dense model.
    moe_experts: list[int] = field(default_factory=list)
    # The step thread, for the replica's liveness (`replica.liveness`: one rule in the gateway for
    # an engine in its process and one behind the link): how long it had been in its current step
    # when this state was taken (0 while it waits for work), and how long a normal step of this
    # engine may take (`AsyncEngine.step_beat`; None before its first step has ended). A step
    # thread can hang (a stuck kernel, a deadlock) while the process, and so its link, lives on.
    # `step_age_s` None: not reported (an embedding engine; an engine of an older version).
    # Not compared: a state is pushed when it changed, and these move with the clock (the
    # heartbeat carries them).
    step_age_s: float | None = field(default=None, compare=False)
    step_allowance_s: float | None = field(default=None, compare=False)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
