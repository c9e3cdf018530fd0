"""The KV-cache manager: a fixed pool of blocks, reference counts, prefix caching, LRU eviction.

A full block's identity is `hash(parent_hash, token_ids)` (see `block_hash.py`). When a block's
reference count drops to zero it keeps its hash and stays findable until the pool needs it back;
the free list is ordered least-recently-freed first, so eviction is LRU. Blocks of one sequence
are freed tail first, so a prompt's deep blocks go before its shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenpath.engine.block_hash import hash_block_tokens
from tokenpath.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_hashes(self) -> set[int]:
        """Read from other threads (routers) while the step loop mutates the dict: retry the copy
        if it races with an insertion instead of taking a lock on the hot path."""
        for _ in range(5):
            try:
                return set(self.cached)
            except RuntimeError:  # dictionary changed size during iteration
                continue
        return set()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's /reset_prefix_cache), so a benchmark run starts cold.
        Blocks in use stay allocated; they are just no longer findable. One `dict.clear()`, atomic
        under the GIL, so it may be called from outside the step thread. Returns blocks forgotten."""
        n = len(self.cached)
        self.cached.clear()
        return n

    # ------------------------------------------------------------ allocation
    def lookup_prefix(self, seq: Sequence) -> None:
        """Give a waiting sequence the cached blocks of its longest cached prefix.

        At least one token is always left to compute: the step needs it to produce logits.
        """
        first_time = seq.num_cached_tokens < 0  # not after a preemption or a failed allocation
        if first_time:
            seq.num_cached_tokens = 0
        if not self.enable_prefix_caching or seq.block_table:
            return
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = seq.hash_root
        hits: list[int] = []
        hashes: list[int] = []
        for i in range(max_blocks):
            h = hash_block_tokens(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        if first_time:  # count each prompt once, as vLLM does
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        for block in hits:
            self._ref(block)
        seq.block_table = hits
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(hits) * self.block_size
        if first_time:
            seq.num_cached_tokens = seq.num_computed_tokens

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False (and no change) if
        the pool cannot."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            return False
        for _ in range(max(0, need)):
            block, _ = self.free.popitem(last=False)  # least recently freed
            old = self.block_hash[block]
            if old is not None:  # evict: it is no longer findable
                if self.cached.get(old) == block:
                    self.cached.pop(old, None)  # pop: `reset_prefix_cache` may have emptied it meanwhile
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """After a step: register newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        n_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
        for i in range(len(seq.block_hashes), n_full):
            h = hash_block_tokens(parent, seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = seq.block_table[i]
            seq.block_hashes.append(h)
            parent = h
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h

    def release(self, seq: Sequence) -> None:
        """Return every block of `seq` (finish, abort, error or preemption)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None  # most recently freed: evicted last
        seq.block_table = []
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
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                problems.append(f"cache maps {h} to block {b}, which holds {self.block_hash[b]}")
        for b in range(self.num_blocks):
            if (self.ref_counts[b] == 0) != (b in self.free):
                problems.append(f"block {b}: ref count {self.ref_counts[b]}, in free list {b in self.free}")
            if self.ref_counts[b] < 0:
                problems.append(f"block {b}: negative ref count")
        return problems
