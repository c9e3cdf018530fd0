"""The suffix proposer (vLLM's `{"method": "suffix"}`, after SuffixDecoding, arXiv 2411.04975, and
Arctic Inference's cache): drafts the most frequent continuation of the sequence's longest
matching suffix, looked up in two suffix tries of bounded depth, one over the request's own
prompt and output and one over recent requests' outputs. The second is what the n-gram proposer
cannot do: repeated agent traffic (the same tool-call JSON shape, the same file edited twice,
the same question asked again) drafts from what earlier requests produced.

A trie node is one string of at most `depth` tokens; it counts the string's occurrences and how
many of them were followed by a token (`cont`), its children count each such token. A sequence
is inserted by extending the nodes of its current suffixes (lengths 0 .. depth - 1) by each new
token: O(depth) dict operations a token, so the prompt costs depth x its length once and a step
depth x the tokens it gained. A lookup binary-searches the longest suffix of the sequence whose
node has an earlier continuation (the property is monotone: a shorter suffix occurs wherever a
longer one does), about depth x log2(depth) dict lookups, then walks the most frequent child,
each token's estimated probability the product of the shares so far, stopping below
`min_token_prob`, after `max_spec_factor` x the match length tokens, or at the trie's depth. A
match of one token drafts nothing (`MIN_MATCH`, as `prompt_lookup_min` 2 for the n-gram): measured
on the `free` workload (benchmarks/spec_decode.py, depth 64, factor 2), lone-token matches took
211 steps for 240 tokens where 2 took 182, their drafts mostly missing.
Between the request's trie and the global one the higher score (sum of probabilities) wins.

The global trie is bounded: two generations, each of at most half `max_cached_requests` requests
and `MAX_GLOBAL_NODES` nodes; when the newer one fills, the older one is dropped whole (a FIFO at
half granularity, with no per-request deletion and no rebuild stall). Nothing here changes what
is emitted: the drafts go through the same verification as the n-gram proposer's.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

# One generation of the global trie holds at most this many nodes. Measured (CPython 3.11, this
# file's layout: a dict entry with an int key and value, four 8-byte array slots): ~140 bytes a
# node (tracemalloc), so both generations stay under ~40 MiB whatever the traffic.
MAX_GLOBAL_NODES = 1 << 17
# A request's own trie starts at most this many tokens before the end of what it had when it first
# drafted (its prompt): ~35 us and ~140 bytes x depth a token in CPython, so a long prompt would
# otherwise cost a stall of ~0.15 s and ~14 MiB at depth 24 per 4096 tokens. Its output is all
# indexed.
MAX_OWN_PROMPT = 4096
MIN_MATCH = 2  # the shortest match drafted from (1: a lone token drafts, and misses)
_SHIFT = 32  # a child's key: parent << 32 | token (vocabularies are far below 2**32)


class SuffixTrie:
    """A suffix trie of bounded depth with occurrence counts; node 0 is the root (the empty string)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.child: dict[int, int] = {}
        self.count = array("q", [0])  # occurrences of the node's string
        self.cont = array("q", [0])  # of them, those a token followed
        self.best = array("q", [-1])  # the child with the highest count (-1: none yet)
        self.token = array("q", [-1])  # the token that leads into the node

    @property
    def size(self) -> int:
        return len(self.count)

    def extend(self, active: list[int], token: int) -> list[int]:
        """Append `token` to a sequence whose suffix nodes (lengths 0, 1, ... up to depth - 1) are
        `active`; the new suffix nodes, the same way."""
        child, count, cont, best = self.child, self.count, self.cont, self.best
        new = [0]
        for node in active:
            key = node << _SHIFT | token
            c = child.get(key)
            if c is None:
                c = child[key] = len(count)
                count.append(0)
                cont.append(0)
                best.append(-1)
                self.token.append(token)
            count[c] += 1
            cont[node] += 1
            b = best[node]
            if b < 0 or count[c] > count[b]:
                best[node] = c
            new.append(c)
        del new[self.depth :]
        return new

    def insert(self, tokens: list[int]) -> None:
        """Every suffix of `tokens` (an earlier request's output), up to the depth."""
        active = [0]
        for t in tokens:
            active = self.extend(active, t)

    def _find(self, tokens: list[int], m: int) -> int:
        """The node of the last `m` tokens, if it has an earlier continuation (-1 otherwise)."""
        node, child = 0, self.child
        for t in tokens[len(tokens) - m :]:
            node = child.get(node << _SHIFT | t, -1)
            if node < 0:
                return -1
        return node if self.cont[node] else -1

    def speculate(self, tokens: list[int], k: int, factor: float, min_prob: float) -> tuple[float, list[int]]:
        """(score, drafts): up to `k` tokens continuing `tokens`, from its longest suffix that
        occurred earlier with a continuation (score 0, no drafts: none did)."""
        lo, hi, node = 0, min(len(tokens), self.depth - 1), 0
        while lo < hi:  # the longest m whose node continues (monotone in m)
            mid = (lo + hi + 1) // 2
            found = self._find(tokens, mid)
            if found >= 0:
                lo, node = mid, found
            else:
                hi = mid - 1
        if lo < MIN_MATCH:
            return 0.0, []
        # The context to draft from: as long as matched, but leaving room below the depth for
        # the drafts its length allows (the trie stores nothing deeper).
        def limit(m: int) -> int:
            return min(k, int(factor * m) or 1, self.depth - m)

        m = lo
        while m > MIN_MATCH and limit(m) < limit(m - 1):  # (unimodal in m)
            m -= 1
        if m != lo:
            node = self._find(tokens, m)
        most = limit(m)
        count, cont, best, tok = self.count, self.cont, self.best, self.token
        drafts: list[int] = []
        prob, score = 1.0, 0.0
        while len(drafts) < most and cont[node]:
            c = best[node]
            prob *= count[c] / cont[node]
            if prob < min_prob:
                break
            drafts.append(tok[c])
            score += prob
            node = c
        return score, drafts


@dataclass
class SuffixCache:
    """The engine's global trie over recent requests' outputs, in two generations (module
    docstring). `max_cached_requests` 0: no global trie, each request drafts from its own."""

    depth: int
    max_cached_requests: int
    max_nodes: int = MAX_GLOBAL_NODES
    tries: list[SuffixTrie] = field(default_factory=list)  # oldest first, at most two
    _requests: int = 0  # in the newest generation

    def add(self, output: list[int]) -> None:
        """Remember a finished request's output."""
        if self.max_cached_requests <= 0 or not output:
            return
        half = max(1, self.max_cached_requests // 2)
        if not self.tries or self._requests >= half or self.tries[-1].size >= self.max_nodes:
            self.tries = [*self.tries[-1:], SuffixTrie(self.depth)]
            self._requests = 0
        self.tries[-1].insert(output)
        self._requests += 1

    def clear(self) -> None:
        self.tries, self._requests = [], 0

    @property
    def num_nodes(self) -> int:
        return sum(t.size for t in self.tries)


@dataclass
class SuffixProposer:
    """One sequence's proposer: its own trie (prompt and output) and the engine's global one."""

    cache: SuffixCache
    max_spec_factor: float
    min_token_prob: float
    own: SuffixTrie = field(init=False)
    active: list[int] = field(default_factory=lambda: [0])
    upto: int = -1  # tokens inserted into `own` (-1: none yet)

    def __post_init__(self) -> None:
        self.own = SuffixTrie(self.cache.depth)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` draft tokens for what follows `tokens` (empty: nothing matched)."""
        if self.upto < 0:
            self.upto = max(0, len(tokens) - MAX_OWN_PROMPT)
        own, active = self.own, self.active
        for t in tokens[self.upto :]:
            active = own.extend(active, t)
        self.active, self.upto = active, len(tokens)
        score, drafts = own.speculate(tokens, k, self.max_spec_factor, self.min_token_prob)
        for trie in self.cache.tries:
            s, d = trie.speculate(tokens, k, self.max_spec_factor, self.min_token_prob)
            if s > score:
                score, drafts = s, d
        return drafts
