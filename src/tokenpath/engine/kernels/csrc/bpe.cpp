// BPE merges over words of initial symbols: `tokenizers`' Word::merge_all, for the compact
// tokenizer of engine/tokenizer_bpe.py (a large SentencePiece-style vocabulary kept as flat arrays
// rather than `tokenizers`' hash maps: issue 42, peak RSS). The Python loop it replaces ran ~6x
// slower than `tokenizers` and held the GIL; this one runs without it (ctypes releases it).
//
// The merge table, by left id: the merges whose left symbol is `a` are entries starts[a] ..
// starts[a + 1] - 1, their right ids ascending in `rights`, with `ranks` and `results` beside them
// (one or two cache lines per lookup: a binary search over all 515k pairs took ~20). A min-heap on (rank, position) pops merges; an entry is dropped when its symbol is gone,
// has no right neighbour, or the pair now there does not yield the entry's result (the check
// `tokenizers` makes: by result, not by pair). Identical output is the contract
// (tests/engine/test_tokenizer_bpe.py compares them token for token).
#include <algorithm>
#include <cstdint>
#include <queue>
#include <vector>

#include "tp_api.h"

namespace {

struct Table {
    const int32_t* starts;
    uint32_t n_vocab;
    const uint32_t* rights;
    const uint32_t* ranks;
    const uint32_t* results;
    // (rank, result) of the pair (a, b); false when it is not a merge.
    bool find(uint32_t a, uint32_t b, uint32_t& rank, uint32_t& result) const {
        if (a >= n_vocab) return false;
        const uint32_t *lo = rights + starts[a], *hi = rights + starts[a + 1];
        const uint32_t* at = std::lower_bound(lo, hi, b);
        if (at == hi || *at != b) return false;
        rank = ranks[at - rights], result = results[at - rights];
        return true;
    }
};

struct Merge {
    uint32_t rank;
    int32_t pos;
    uint32_t result;
    bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

// One word in place: c[0..n) holds its initial symbols; returns how many symbols remain, in order.
int merge_word(const Table& t, int32_t* c, int n, std::vector<int32_t>& prev, std::vector<int32_t>& next,
               std::vector<uint8_t>& gone, std::vector<Merge>& heap_store) {
    prev.resize(size_t(n)), next.resize(size_t(n)), gone.assign(size_t(n), 0);
    heap_store.clear();
    for (int i = 0; i < n; ++i) prev[size_t(i)] = i - 1, next[size_t(i)] = i + 1 < n ? i + 1 : -1;
    uint32_t rank, result;
    for (int i = 0; i + 1 < n; ++i)
        if (t.find(uint32_t(c[i]), uint32_t(c[i + 1]), rank, result)) heap_store.push_back({rank, i, result});
    std::priority_queue<Merge, std::vector<Merge>, std::greater<Merge>> heap(std::greater<Merge>(),
                                                                         std::move(heap_store));
    while (!heap.empty()) {
        const Merge top = heap.top();
        heap.pop();
        const int pos = top.pos, right = next[size_t(pos)];
        if (gone[size_t(pos)] || right == -1) continue;
        if (!t.find(uint32_t(c[pos]), uint32_t(c[right]), rank, result) || result != top.result) continue;
        c[pos] = int32_t(top.result);
        gone[size_t(right)] = 1;
        const int after = next[size_t(right)];
        next[size_t(pos)] = after;
        if (after != -1) prev[size_t(after)] = pos;
        const int left = prev[size_t(pos)];
        if (left >= 0 && t.find(uint32_t(c[left]), uint32_t(c[pos]), rank, result)) heap.push({rank, left, result});
        if (after != -1 && t.find(uint32_t(c[pos]), uint32_t(c[after]), rank, result)) heap.push({rank, pos, result});
    }
    int k = 0;
    for (int i = 0; i < n; ++i)
        if (!gone[size_t(i)]) c[k++] = c[i];
    return k;
}

}  // namespace

int tp_bpe_merge(const int32_t* starts, int n_vocab, const uint32_t* rights, const uint32_t* ranks,
                 const uint32_t* results, int32_t* syms, const int32_t* word_ends, int n_words, int32_t* out_ends) {
    const Table t{starts, uint32_t(n_vocab), rights, ranks, results};
    std::vector<int32_t> prev, next;
    std::vector<uint8_t> gone;
    std::vector<Merge> heap_store;
    int start = 0, w = 0;
    for (int i = 0; i < n_words; ++i) {
        const int n = word_ends[i] - start;
        const int k = merge_word(t, syms + start, n, prev, next, gone, heap_store);
        std::copy(syms + start, syms + start + k, syms + w);  // compacted to the front, words in order
        w += k;
        out_ends[i] = w;
        start = word_ends[i];
    }
    return w;
}
