"""The KV-cache manager: a fixed pool of blocks, reference counts, prefix caching, LRU eviction.

A full block's identity is `hash(parent_hash, token_ids)` (see `block_hash.py`). When a block's
reference count drops to zero it keeps its hash and stays findable until the pool needs it back;
the free list is ordered least-recently-freed first, so eviction is LRU. Blocks of one sequence
are freed tail first, so a prompt's deep blocks go before its shared prefix.

KV-cache groups (`kv_groups.py`): each sequence has one block table per group, all drawn from the
one pool. A sliding-window group gives back, before each allocation, the blocks that fell wholly
behind its window (`_drop_out_of_window`): their table entries become NULL_BLOCK, so a long
request holds at most ceil((W - 1 + chunk) / block) + 1 blocks of such a group.

Prefix caching with windows (the rule, vLLM's): each group has its own hash -> block index. A
prompt whose first h blocks match may skip them only if every full group still holds all h blocks
and every window group holds the blocks the next query reads (those from position h * block - W + 1
on); the longest h that passes wins, shorter than the full groups' match when a window group's
blocks were evicted. Blocks behind the window of a hit are not needed, so they are not looked for.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

from tokenpath.engine.block_hash import hash_block_tokens
from tokenpath.engine.kv_groups import NULL_BLOCK
from tokenpath.engine.sequence import Sequence

# KV events (vLLM's AllBlocksCleared, BlockStored, BlockRemoved), as `EngineState.kv_events` spells them.
KV_CLEARED, KV_STORED, KV_REMOVED = 0, 1, 2


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Seq[int | None] = (None,), max_chunk: int | None = None) -> None:
        """`windows`: per KV-cache group, its sliding window (None: full attention). `max_chunk`:
        the most tokens one step computes for a sequence (the scheduler's budget), which bounds
        what a window group holds at once (`max_blocks_needed`)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.any_window = any(w is not None for w in self.windows)  # no window: allocate drops nothing
        self.max_chunk = max_chunk
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_group = [0] * num_blocks  # the group whose index holds block_hash[b]
        self.group_cached: list[dict[int, int]] = [{} for _ in self.windows]  # per group: hash -> block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Blocks ever handed out. Never-used blocks leave the free list in id order (freed ones go
        # to its front or end, never between them), so the used ones are exactly [0, touched): the
        # pages of an unwritten pool (the native kernels') that are resident, whatever is in use now.
        self.touched = 0
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache
        # KV events of group 0's index, for whoever subscribed (`subscribe`: an engine link's
        # gateway): (kind, hash), kind KV_CLEARED / KV_STORED / KV_REMOVED. No subscriber, no cost
        # but an empty loop per new block.
        self.kv_sinks: list[deque[tuple[int, int]]] = []

    # ------------------------------------------------------------ queries
    @property
    def cached(self) -> dict[int, int]:
        """Group 0's index (the full-attention table when the model has one): what the scheduler
        and prefix-aware routers consult to predict hits."""
        return self.group_cached[0]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_needed(self, num_tokens: int) -> int:
        """The most blocks, all groups together, one sequence of `num_tokens` ever holds at once:
        whether a request can run on this pool at all."""
        full = self.blocks_needed(num_tokens)
        total = 0
        for window in self.windows:
            if window is None or self.max_chunk is None:
                total += full
            else:
                total += min(full, self.blocks_needed(window - 1 + self.max_chunk) + 1)
        return total

    def held_blocks(self, seq: Sequence) -> list[int]:
        """Blocks `seq` holds, per group (a window group's freed entries not counted)."""
        return [sum(b != NULL_BLOCK for b in table) for table in seq.block_tables]

    def cached_hashes(self) -> set[int]:
        """Read from other threads (routers) while the step loop mutates the dict: retry the copy
        if it races with an insertion instead of taking a lock on the hot path."""
        for _ in range(5):
            try:
                return set(self.cached)
            except RuntimeError:  # dictionary changed size during iteration
                continue
        return set()

    def subscribe(self) -> deque[tuple[int, int]]:
        """A new KV-event feed: a clear, then every block group 0 holds now, then each change as it
        happens (from the step thread; deque appends and pops are atomic, so another thread may
        drain it). Registered before the snapshot is read, so no change between them is lost."""
        sink: deque[tuple[int, int]] = deque([(KV_CLEARED, 0)])
        self.kv_sinks = [*self.kv_sinks, sink]  # (a new list: the step thread may be iterating the old)
        sink.extend((KV_STORED, h) for h in self.cached_hashes())
        return sink

    def unsubscribe(self, sink: deque[tuple[int, int]]) -> None:
        self.kv_sinks = [s for s in self.kv_sinks if s is not sink]

    def _event(self, kind: int, h: int) -> None:
        for sink in self.kv_sinks:
            sink.append((kind, h))

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's /reset_prefix_cache), so a benchmark run starts cold.
        Blocks in use stay allocated; they are just no longer findable. One `dict.clear()` per
        group, atomic under the GIL, so it may be called from outside the step thread. Returns
        blocks forgotten."""
        n = 0
        for index in self.group_cached:
            n += len(index)
            index.clear()
        self._event(KV_CLEARED, 0)
        return n

    # ------------------------------------------------------------ allocation
    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block of `group` that a query at position `num_computed` (or later) reads."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def lookup_prefix(self, seq: Sequence) -> None:
        """Give a waiting sequence the cached blocks of its longest cached prefix (the module
        docstring's rule with windows).

        At least one token is always left to compute: the step needs it to produce logits.
        """
        first_time = seq.num_cached_tokens < 0  # not after a preemption or a failed allocation
        if first_time:
            seq.num_cached_tokens = 0
        if not self.enable_prefix_caching or seq.block_table or (seq.params.prompt_logprobs is not None
                                                                 and seq.index == 0):
            return  # (prompt logprobs need every prompt position's logits: computed, not cached)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        has_full = any(w is None for w in self.windows)
        parent = seq.hash_root  # (an adapter's root: its blocks are never shared with another's)
        hashes: list[int] = []
        for i in range(max_blocks):
            h = hash_block_tokens(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            if has_full and any(h not in self.group_cached[g] for g, w in enumerate(self.windows) if w is None):
                break  # a full group misses it: no longer hit is possible
            hashes.append(h)
            parent = h
        hit = self._longest_window_hit(hashes)
        if first_time:  # count each prompt once, as vLLM does
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += hit * self.block_size
        seq.block_tables = []
        for g, index in enumerate(self.group_cached):
            first = self._first_needed(g, hit * self.block_size)
            table = [NULL_BLOCK] * first + [index[h] for h in hashes[first:hit]]
            for block in table[first:]:
                self._ref(block)
            seq.block_tables.append(table)
        seq.block_hashes = hashes[:hit]
        seq.num_computed_tokens = hit * self.block_size
        if first_time:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _longest_window_hit(self, hashes: list[int]) -> int:
        """The longest h <= len(hashes) whose blocks every window group still holds from its
        first needed block to h (full groups hold all of `hashes`: lookup_prefix stopped there)."""
        hit = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None or hit == 0:
                continue
            index = self.group_cached[g]
            run = [0] * (hit + 1)  # run[i]: cached blocks of this group ending just before block i
            for i in range(hit):
                run[i + 1] = run[i] + 1 if hashes[i] in index else 0
            while hit > 0 and run[hit] < hit - self._first_needed(g, hit * self.block_size):
                hit -= 1
        return hit

    def _drop_out_of_window(self, seq: Sequence) -> None:
        """Give back the blocks of window groups that no query of `seq` reads any more."""
        for g, table in enumerate(seq.block_tables):
            for i in range(min(self._first_needed(g, seq.num_computed_tokens), len(table))):
                block = table[i]
                if block == NULL_BLOCK:
                    continue
                table[i] = NULL_BLOCK
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self._give_back(block)  # keeps its hash: a later prompt may still hit it

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block tables to hold `num_new_tokens` more tokens; False (and no change but
        out-of-window blocks given back) if the pool cannot."""
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        if self.any_window:
            self._drop_out_of_window(seq)
        want = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        need = sum(max(0, want - len(table)) for table in seq.block_tables)
        if need > len(self.free):
            return False
        for table in seq.block_tables:
            for _ in range(max(0, want - len(table))):
                block, _ = self.free.popitem(last=False)  # least recently freed
                old = self.block_hash[block]
                if old is not None:  # evict: it is no longer findable
                    index = self.group_cached[self.block_group[block]]
                    if index.get(old) == block:
                        index.pop(old, None)  # pop: `reset_prefix_cache` may have emptied it meanwhile
                        if self.kv_sinks and self.block_group[block] == 0:
                            self._event(KV_REMOVED, old)
                    self.block_hash[block] = None
                self.ref_counts[block] = 1
                self.touched = max(self.touched, block + 1)
                table.append(block)
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """After a step: register newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        n_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
        for i in range(len(seq.block_hashes), n_full):
            h = hash_block_tokens(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            seq.block_hashes.append(h)
            parent = h
            for g, table in enumerate(seq.block_tables):
                block = table[i]
                if block != NULL_BLOCK and h not in self.group_cached[g] and self.block_hash[block] is None:
                    self.group_cached[g][h] = block
                    self.block_hash[block] = h
                    self.block_group[block] = g
                    if g == 0 and self.kv_sinks:
                        self._event(KV_STORED, h)

    def trim(self, seq: Sequence) -> None:
        """Give back the tail blocks `seq` holds beyond its tokens (speculative decoding: blocks
        only rejected drafts used). They were never full of computed tokens, so they carry no
        hash; they go to the front of the free list, reused before any cached block is evicted."""
        keep = self.blocks_needed(seq.num_tokens)
        for table in seq.block_tables:
            while len(table) > keep:
                block = table.pop()
                if block == NULL_BLOCK:
                    continue
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)

    def _give_back(self, block: int) -> None:
        """A block whose count reached zero, onto the free list. One with a hash goes to the end
        (most recently freed: evicted last, LRU). One without (prefix caching off, a prompt's
        partial last block, a decode's) holds nothing a later prompt can find: it goes to the
        front and is reused first, so cached blocks are evicted later and the pool's pages are
        touched only as far as the most tokens ever held at once (a 512-token pool run by turns
        touched every block before: +0.7 MiB of SmolLM2's offline peak, issue 42)."""
        self.free[block] = None
        if self.block_hash[block] is None:
            self.free.move_to_end(block, last=False)

    def release(self, seq: Sequence) -> None:
        """Return every block of `seq` (finish, abort, error or preemption)."""
        for table in seq.block_tables:
            for block in reversed(table):
                if block == NULL_BLOCK:
                    continue
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self._give_back(block)
        seq.block_tables = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    # ------------------------------------------------------------ checks
    def check_consistency(self) -> list[str]:
        """Invariants a test can assert after any mix of finishes, aborts and preemptions."""
        problems = []
        for g, index in enumerate(self.group_cached):
            for h, b in index.items():
                if self.block_hash[b] != h or self.block_group[b] != g:
                    problems.append(f"group {g} maps {h} to block {b}, which holds {self.block_hash[b]} "
                                    f"of group {self.block_group[b]}")
        for b in range(self.num_blocks):
            if (self.ref_counts[b] == 0) != (b in self.free):
                problems.append(f"block {b}: ref count {self.ref_counts[b]}, in free list {b in self.free}")
            if self.ref_counts[b] < 0:
                problems.append(f"block {b}: negative ref count")
        return problems
