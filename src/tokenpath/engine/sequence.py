"""A Sequence: one choice of one request, from arrival to finish.

The scheduling rule lives in two numbers: `num_computed_tokens` catches up to `num_tokens`.
Prefill, chunked prefill, a prefix-cache hit (which jumps `num_computed_tokens` ahead) and decode
(one token behind after each sample) are all the same thing to the scheduler.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from tokenpath.engine.rng import Generator
from tokenpath.engine.spec.state import DraftState
from tokenpath.engine.structured.masking import GrammarState
from tokenpath.protocol.lora import LoraRef
from tokenpath.protocol.outputs import EngineEvents
from tokenpath.protocol.sampling_params import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # choice index within the request (n > 1)
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    tenant: str = "anonymous"  # whose request (named when another request waits behind it)
    arrival_time: float = field(default_factory=time.monotonic)
    # The request's engine events, one object shared by its n choices (the first one to reach an
    # event stamps it): the engine's only timing record of a request.
    events: EngineEvents = field(default_factory=EngineEvents)
    leader: Sequence | None = None  # for n > 1: wait until the leader's prompt is cached, then share it
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    # One block table per KV-cache group (engine/kv_groups.py); empty while it holds no blocks.
    block_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks computed so far
    prompt_hashes: list[int] | None = None  # of the prompt's full blocks (the scheduler fills it in)
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (-1: not yet looked up)
    num_preemptions: int = 0
    # The request whose running slot this one took (`GenerateRequest.preempts`): it waits first,
    # ahead of every priority, until it runs (then None again), so the slot its victim gave up is
    # its own and not the next in line's.
    displaces: str | None = None
    # It runs in a slot the tenant share handed it (it displaced an over-share request): a KV
    # preemption takes it last within its priority, or the blocks it needs would go straight back
    # to the tenant its slot was taken from (in a flood that fills the pool, it was always the
    # latest arrival, so always the one preempted).
    share_slot: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: Generator | None = None
    grammar: GrammarState | None = None  # constrained decoding: this choice's own matcher
    lora: LoraRef | None = None  # the LoRA adapter it runs with
    hash_root: int | None = None  # its block hash chain's root (block_hash.lora_root; None: base)
    # The client's deadline in this process's clock (None: none): past it, a request never
    # scheduled yet leaves the waiting queue unprefilled (`Scheduler.expired`).
    deadline: float | None = None
    # Speculative decoding (engine/spec/): this step's draft tokens (computed after the last
    # known token, never in `token_ids` until accepted) and its proposer state (None until it
    # first decodes with speculation on).
    draft_ids: list[int] = field(default_factory=list)
    spec: DraftState | None = None

    @property
    def block_table(self) -> list[int]:
        """The first group's table (the full-attention one when the model has one); empty while
        the sequence holds no blocks."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Lower priority number first, then first come first served."""
        return (self.priority, self.arrival_time, self.seq_id)

    def victim_key(self) -> tuple[int, int, float, int]:
        """The KV preemption order (the greatest goes first): the lowest priority, then one not in
        a slot the tenant share handed it, then the latest arrival."""
        return (self.priority, 0 if self.share_slot else 1, self.arrival_time, self.seq_id)
