"""The scheduler: which sequences run this step, and how many tokens each.

One rule covers prefill, chunked prefill, prefix hits and decode: every sequence wants
`num_tokens - num_computed_tokens` more tokens computed, and each step grants
`{sequence: n}` under a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). Running sequences go first (so decodes are never starved by a long prompt,
which instead advances one chunk per step), then waiting ones by priority and the order they were
handed to the engine. Not by their arrival at the gateway: the gateway's fair queue chose that
order, and re-sorting by arrival undid it (a flooding tenant's older requests, dispatched one by one
as slots freed, each went back ahead of another tenant's newer request already in this queue, which
then waited until the flood's whole backlog had passed: 16.5 s of 19.3 s in
tests/reliability/test_stall_tenants.py). When the pool runs out of blocks, the lowest-priority,
latest-arrived running sequence is preempted by recompute (of the tenant furthest over its share of
the pool, when several tenants run: `kv_share`): its blocks are freed and it goes back to the front
of its priority (behind other tenants' requests while its own tenant is over its share). The
gateway's tenant share preempts the same way, for a slot rather than for blocks: a request that
arrives with `preempts` set (admission/preempt.py) pauses that running request and takes its slot,
ahead of the whole queue (`displace`); a KV preemption then takes such a request last within its
priority (`Sequence.victim_key`), so the blocks it needs do not go straight back to the tenant its
slot was taken from.

With `long_prefill_token_threshold`, one sequence's chunk is capped, so a short prompt that
arrives behind a long one is prefilled in the next step rather than after the whole long prompt.
A waiting prompt whose next uncached block is being prefilled right now by a running sequence
(two requests with one system prompt, arriving together) waits for those blocks to land in the
prefix cache instead of computing them a second time; later prompts may go ahead of it meanwhile.

LoRA: a waiting sequence whose adapter is still loading (off the step loop), or would be one
adapter more than the `max_loras` the running ones already hold, is passed over (later ones may
go ahead of it) until its adapter is in memory and a slot is free.

Deadlines: a request that has never been scheduled and whose client deadline has passed is taken
out of the waiting queue before it costs a prefill (`expired`; the engine ends it with the
gateway's deadline error). Once scheduled it is never cut by its deadline: its tokens flow, and a
preempted sequence back in the queue has been paid for already.
"""

from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass, field

from tokenpath.engine import kv_share
from tokenpath.engine.block_hash import block_hashes
from tokenpath.engine.block_manager import BlockManager
from tokenpath.engine.lora import LoraManager, lora_key
from tokenpath.engine.sequence import Sequence, Status
from tokenpath.engine.spec.decoder import SpecDecoder
from tokenpath.protocol.lora import LoraRef

# Prompt tokens per step of a prompt_logprobs request: 256 rows of logits are 256 MiB at Gemma 3's
# 262k vocabulary, 48 MiB at SmolLM2's.
PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 long_prefill_token_threshold: int = 0, loras: LoraManager | None = None,
                 spec: SpecDecoder | None = None) -> None:
        self.blocks = blocks
        self.spec = spec  # speculative decoding (None: off)
        self.loras = loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by _wait_key
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        # Waiting sequences the last step passed over for a reason of their own (an adapter loading
        # or its slot held, a leader's or another sequence's prefix blocks in flight) rather than
        # for capacity: vLLM's `deferred` waiting reason (num_requests_waiting_by_reason).
        self.deferred = 0
        self.last_freed: str | None = None  # the request whose end last gave a slot back
        # (deadline, seq id, seq) of never-scheduled sequences with a deadline; entries of ones
        # scheduled or finished since are dropped lazily, when their deadline comes up.
        self._deadlines: list[tuple[float, int, Sequence]] = []

    # ------------------------------------------------------------ membership
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        bisect.insort(self.waiting, seq, key=self._wait_key)
        if seq.deadline is not None and seq.events.scheduled is None:  # (not a preempted one)
            if len(self._deadlines) > 2 * len(self.waiting) + 64:  # mostly stale: keep it bounded
                self._deadlines = [e for e in self._deadlines if self._expirable(e[2])]
                heapq.heapify(self._deadlines)
            heapq.heappush(self._deadlines, (seq.deadline, seq.seq_id, seq))

    @staticmethod
    def _expirable(seq: Sequence) -> bool:
        return seq.status is Status.WAITING and seq.events.scheduled is None

    def expired(self, now: float) -> list[str]:
        """The requests past their deadline that no step has scheduled yet (no choice of them):
        the caller ends them before this step's schedule, so they never cost a prefill. Costs
        nothing while no deadline has passed (one heap peek)."""
        late: dict[str, None] = {}
        while self._deadlines and self._deadlines[0][0] <= now:
            seq = heapq.heappop(self._deadlines)[2]
            if self._expirable(seq):
                late[seq.request_id] = None
        return list(late)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out wherever it is and give back its blocks (finish, abort, error)."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.last_freed = seq.request_id
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def _wait_key(seq: Sequence) -> tuple:
        # One that took a paused request's slot (`displace`) goes first; a preempted sequence
        # returns to the front of its priority band; the rest keep the order they were added in
        # (`seq_id`: the gateway's dispatch order; see the module docstring).
        return (0 if seq.displaces else 1, seq.priority, 0 if seq.num_preemptions else 1, seq.seq_id)

    def displace(self, victims: list[Sequence], takers: list[Sequence]) -> int:
        """The gateway's share preemption (`GenerateRequest.preempts`): `takers` (a request just
        added) take the running slots of `victims` (another tenant's request over its share).
        Each running victim, up to one per taker, is paused by recompute as a KV preemption is
        (blocks freed, back to the front of its band, its stream resumes later where it stopped);
        the takers go to the head of the queue, so the next schedule runs them in those slots.
        Called between steps. Returns the slots freed (0: the victim was not running, finished,
        or never here: the takers still go first, into the next slot that frees)."""
        for seq in takers:
            if seq.status is Status.WAITING and seq in self.waiting:
                self.waiting.remove(seq)
                seq.displaces = victims[0].request_id if victims else ""
                bisect.insort(self.waiting, seq, key=self._wait_key)
        freed, now = 0, time.monotonic()
        for seq in victims:
            if freed >= len(takers):
                break
            if seq.status is Status.RUNNING:
                seq.events.preempted.append([now, takers[0].request_id, seq.num_computed_tokens, None])
                self._pause(seq)
                freed += 1
        return freed

    def holders(self, limit: int = 8) -> list[list]:
        """Who holds the engine now (a request arriving to a full engine waits behind them):
        [request id, tenant, tokens left, "running"|"waiting"], most work left first. Called only
        when the engine is full, so an idle engine pays nothing for it."""
        out: dict[str, list] = {}
        for state, seqs in (("running", self.running), ("waiting", self.waiting)):
            for seq in seqs:
                left = seq.num_tokens - seq.num_computed_tokens + max(0, (seq.params.max_tokens or 0)
                                                                      - seq.num_output_tokens)
                if seq.request_id not in out:
                    out[seq.request_id] = [seq.request_id, seq.tenant, left, state]
        return sorted(out.values(), key=lambda h: -h[2])[:limit]

    def is_full(self) -> bool:
        return bool(self.waiting) or len(self.running) >= self.max_num_seqs

    # ------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        decoding = self._decoding() if self.spec is not None else 0  # (speculation off: not counted)
        spec = self.spec if self.spec is not None and self.spec.allowed(decoding) else None
        rows = decoding  # the step's decode rows so far: a draft's price depends on them (spec/cost.py)
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self._cap(seq))
            if n <= 0:
                continue
            if spec is not None and n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                drafted = self._draft(spec, seq, budget - 1, rows)
                n += drafted
                rows += drafted
            if not self._make_room(seq, n, out):
                continue  # seq itself was preempted
            out.scheduled.append((seq, n))
            budget -= n
        self.deferred = 0
        if not out.preempted and self.waiting:  # (the in-flight blocks only matter to waiting ones)
            self._admit_waiting(out, budget, self._prefilling_hashes())
        now = time.monotonic()
        for seq, _ in out.scheduled:
            if seq.events.scheduled is None:
                seq.events.scheduled = now
        return out

    def _decoding(self) -> int:
        return sum(1 for s in self.running if s.num_computed_tokens >= s.num_prompt_tokens)

    def _draft(self, spec: SpecDecoder, seq: Sequence, budget: int, rows: int) -> int:
        """Give a decoding `seq` this step's draft tokens (`seq.draft_ids`) when the pool has the
        room for them without preempting anybody, in a step of `rows` decode rows so far; returns
        how many."""
        k = spec.draft_len(seq, budget, max(1, rows))
        drafts: list[int] = []
        if k and spec.writes_kv:  # a draft model writes its KV in the drafted rows' slots: room first
            if self.blocks.allocate(seq, 1 + k):
                drafts = spec.propose(seq, k)
        elif k:
            drafts = spec.propose(seq, k)
            if drafts and not self.blocks.allocate(seq, 1 + len(drafts)):
                drafts = []
        seq.draft_ids = drafts
        return len(drafts)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, prefilling: set[int]) -> None:
        i = 0
        adapters = self.running_adapters()
        # (A copy when tenants over their KV share wait beside others: `kv_share.admission_order`.)
        queue = kv_share.admission_order(self.waiting, self.running, self.blocks.num_blocks)
        j = 0  # (the position in `queue`; `i` counts the ones passed over)
        while j < len(queue) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = queue[j]
            if seq.lora is not None and not self._lora_admissible(seq.lora, adapters):
                i, j = i + 1, j + 1  # its adapter is loading, or every slot is held by running requests
                continue
            if seq.leader is not None and self._leader_prefilling(seq.leader):
                i, j = i + 1, j + 1  # n > 1: wait for the leader's prompt blocks, then share them
                continue
            if prefilling and not seq.block_table and self._next_block_in_flight(seq, prefilling):
                i, j = i + 1, j + 1  # its prefix is being computed by another sequence: share it once cached
                continue
            if not seq.block_table:
                self.blocks.lookup_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self._cap(seq))
            if not self.blocks.allocate(seq, n):
                self.blocks.release(seq)  # do not pin its prefix hits while it waits
                break  # FCFS within the band: do not let later, smaller requests jump ahead
            if queue is self.waiting:
                self.waiting.pop(j)
            else:
                self.waiting.remove(seq)
                j += 1
            if seq.displaces:  # it has the slot it took: held against KV preemption (`victim_key`)
                seq.displaces, seq.share_slot = None, True
            if seq.events.behind and seq.events.freed_by is None:
                seq.events.freed_by = self.last_freed
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
            if self.blocks.enable_prefix_caching:
                prefilling.update(self._prompt_hashes(seq)[len(seq.block_hashes):])
        self.deferred = i  # the ones passed over, each for a reason of its own (admitted ones left the queue)

    def running_adapters(self) -> set[str]:
        """The adapters (`lora_key`) of the running sequences: they hold their slots."""
        return {lora_key(s.lora) for s in self.running if s.lora is not None}

    def _lora_admissible(self, lora: LoraRef, adapters: set[str]) -> bool:
        key = lora_key(lora)
        if self.loras is None or (key not in adapters and len(adapters) >= self.loras.max_loras):
            return False
        if not self.loras.activate(lora, adapters):
            return False
        adapters.add(key)
        return True

    def _cap(self, seq: Sequence) -> int:
        """Most tokens of `seq` one step computes: a prompt_logprobs prompt returns every row's
        logits (rows x vocabulary floats), so its chunks stay at PROMPT_LOGPROBS_CHUNK."""
        if seq.params.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
            return min(self.chunk_cap, PROMPT_LOGPROBS_CHUNK)
        return self.chunk_cap

    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        """The chained hashes of the prompt's full blocks, computed once per sequence."""
        if seq.prompt_hashes is None:
            seq.prompt_hashes = block_hashes(seq.token_ids[: seq.num_prompt_tokens], self.blocks.block_size,
                                             root=seq.hash_root)
        return seq.prompt_hashes

    def _prefilling_hashes(self) -> set[int]:
        """Prompt blocks that running sequences are computing and have not cached yet."""
        if not self.blocks.enable_prefix_caching:
            return set()
        out: set[int] = set()
        for seq in self.running:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                out.update(self._prompt_hashes(seq)[len(seq.block_hashes):])
        return out

    def _next_block_in_flight(self, seq: Sequence, prefilling: set[int]) -> bool:
        """Is the first prompt block of `seq` missing from the cache one that is being computed?
        (Only blocks a prefix hit can cover: the last prompt token is always computed.)"""
        usable = (seq.num_tokens - 1) // self.blocks.block_size
        for h in self._prompt_hashes(seq)[:usable]:
            if h not in self.blocks.cached:
                return h in prefilling
        return False

    @staticmethod
    def _leader_prefilling(leader: Sequence) -> bool:
        return not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for `seq`, preempting victims until it fits. False if `seq` itself went."""
        while not self.blocks.allocate(seq, n):
            # The lowest priority, then the tenant furthest over its share of the pool, then the
            # latest arrival (`kv_share`).
            victim = kv_share.victim(self.running, self.blocks.num_blocks)
            victim.events.preempted.append([time.monotonic(), self._forced_by(seq, victim),
                                            victim.num_computed_tokens, None])
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _forced_by(self, seq: Sequence, victim: Sequence) -> str:
        """Whose blocks a preemption is owed to (its cause's culprit): the request that needed room,
        or, when the victim is that request itself (it could not grow and is the latest arrival),
        the other request holding the most of the pool. Which of two growing requests crosses a
        block boundary first in a step is timing; the pool they share is not. "": nobody else."""
        if victim is not seq:
            return seq.request_id
        holder = max((s for s in self.running if s.request_id != seq.request_id),
                     key=lambda s: len(s.block_table), default=None)
        return "" if holder is None else holder.request_id

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self._pause(seq)
        out.preempted.append(seq)
        # It may already be in this step's grants (a decode scheduled before the victim search).
        out.scheduled = [(s, k) for s, k in out.scheduled if s is not seq]

    def _pause(self, seq: Sequence) -> None:
        """Preempt by recompute: free its blocks, back to waiting (its tokens kept, recomputed on
        its return, so its stream resumes with nothing lost or repeated)."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.draft_ids = []
        if seq.spec is not None:  # its blocks, and a draft model's KV in them, are gone
            seq.spec.forget_draft_kv()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
