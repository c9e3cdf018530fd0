// A step's activation rows and the GEMMs over them: included by forward.cpp inside its anonymous
// namespace, after Model and the team's helpers (team_for, grain_for). Which precision each row
// takes for each matmul is decided here: int8, int8 with residual bytes (Model::fine and the row's
// mask), float (exact, or float weights), bf16 on AMX tiles (Model::half; prompt rows of quantized
// weights, every row of BF16 ones).
#pragma once

QAct make_act(const Model& m, ActBuf& b, int rows, int K) {
    const int nb = (K + QK - 1) / QK;
    const size_t need = size_t(rows) * nb;
    grow(b.d, need), grow(b.s, need), grow(b.qsum, need), grow(b.qsum16, 2 * need), grow(b.q, need * QK);
    // Every matrix float (float_w 2): no int8 activations at all, quantize_row writes the float copies only.
    QAct a{m.float_w == 2 ? nullptr : b.q.data(), b.d.data(), b.s.data(), nb, b.qsum.data()};
    a.qsum16 = b.qsum16.data();
    if (m.exact || (m.float_w && !m.tiles_only)) {  // float activations: exact matmuls, F16/BF16/F32 weights
        grow(b.fs, need), grow(b.f, need * QK);
        a.f = b.f.data(), a.fs = b.fs.data();
    }
    if (m.fine) {  // callers switch a.q2 on per matmul (use_fine)
        grow(b.q2, need * QK), grow(b.q16, need * QK);
        a.q2 = b.q2.data(), a.q16 = b.q16.data();
    }
    if (m.half) {  // callers switch a.bf on per matmul (use_fine); tiles read 16 rows past any view
        const size_t bneed = (size_t(rows) + 16) * nb * QK;
        grow(b.bf, bneed);
        a.bf = b.bf.data();
    }
    return a;
}

// Activation rows `x` (sharing `all`'s buffers) for matmul `kind`: with residual bytes when its bit
// of Model::fine is set, with bf16 copies when its bit of Model::half is.
inline void use_fine(const Model& m, QAct& x, const QAct& all, int kind) {
    x.q2 = (m.fine >> kind) & 1 ? all.q2 : nullptr;
    x.bf = (m.half >> kind) & 1 ? all.bf : nullptr;
}

// Rows r.. of an activation buffer, as a QAct of its own (the layout of tp_kernels.h QAct).
inline QAct act_rows(const QAct& a, int r) {
    QAct v = a;
    const size_t nb = size_t(a.nb), off = size_t(r) * nb;
    if (v.q) v.q += off * QK;
    v.d += off, v.s += off, v.qsum += off;
    if (v.f) v.f += off * QK, v.fs += off;
    if (v.q2) v.q2 += off * QK;
    if (v.q16) v.q16 += off * QK;
    if (v.qsum16) v.qsum16 += 2 * off;
    if (v.bf) v.bf += off * QK;
    return v;
}

// Bit 7 of a row's mask (tp_model_forward's row_kinds): a prompt row. Its matmuls in Model::half,
// but for the head, take bf16 activations on AMX tiles where their weights are quantized
// (tile_pack.h); the head's prompt rows are one per sequence, too few to pay for its dequantization.
constexpr uint8_t kPromptTiles = 0x80;
constexpr int kHead = 4;

// The view that quantizes one row for matmul `kind`: `v` (with residual bytes when `kind` is
// fine), without them where the row's mask (Model::kinds) leaves `kind` out, and without the bf16
// copy where no tile reads it: a generated row of a model whose weights are all quantized (its
// tiles take prompt rows only; BF16 weights take every row).
inline QAct row_act(const Model& m, const QAct& v, uint8_t mask, int kind) {
    QAct r = v;
    if (!((mask >> kind) & 1)) r.q2 = nullptr;
    if (!(mask & kPromptTiles) && !m.float_w) r.bf = nullptr;
    return r;
}
// Row t's mask; without per-row masks every row takes the fine mask and none is a prompt row.
inline uint8_t row_mask(const uint8_t* kinds, int t) { return kinds ? kinds[t] : uint8_t(~kPromptTiles); }

// m.gemm over rows [0, M), as runs of consecutive rows that agree on residual bytes and on tiles for
// `kind` (kinds: each row's mask, nullptr for all alike). A run's weights are those the previous
// run just read, still in cache: a mixed step reads each chunk of the matrix from memory once.
// BF16 weights with bf16 activations (QAct::bf, Model::half) take the tiles in every row.
inline void gemm_runs(const Model& m, int wtype, const uint8_t* w, const QAct& a, int M, float* y, int ldy,
                      int n0, int n1, const float* bias, bool acc, bool exact, const uint8_t* kinds, int kind) {
    const bool all_tiles = a.bf && wtype == W_BF16X16;
    const bool tiles = a.bf && !all_tiles && kinds && kind != kHead && !exact;
    if (all_tiles || (!tiles && (!kinds || !a.q2 || exact))) {
        QAct v = a;
        if (!all_tiles) v.bf = nullptr;
        m.gemm(wtype, w, a.nb, v, M, y, ldy, n0, n1, bias, acc, exact);
        return;
    }
    auto key = [&](int t) {
        return (tiles && (kinds[t] & kPromptTiles) ? 2 : 0) | (a.q2 && ((kinds[t] >> kind) & 1) ? 1 : 0);
    };
    for (int s = 0; s < M;) {
        const int k = key(s);
        int e = s + 1;
        while (e < M && key(e) == k) ++e;
        QAct v = act_rows(a, s);
        if (!(k & 1)) v.q2 = nullptr;
        if (!(k & 2)) v.bf = nullptr;
        m.gemm(wtype, w, a.nb, v, e - s, y + size_t(s) * ldy, ldy, n0, n1, bias, acc, false);
        s = e;
    }
}

// A decode GEMM phase's chunks (output rows, multiples of 16: each weight byte streams from memory
// once). Equal chunks of >= 128 KB left a thread spinning at the phase's end whenever its partner
// came late or read slower: SmolLM2's 576-wide matrices (qkv 345 KB, o 207 KB, down 553 KB of Q4_1)
// were one or two chunks a thread, and ~7% of its decode step was that wait. Smaller equal chunks
// cost more than they saved (12-35 KB: each claim's atomic trips a cache line between the cores, and
// a stream restarts cold, since the software prefetch runs ahead within a chunk, not into the next
// claim; benchmarks/results/decode_chunks.md). So the chunks shrink as the work runs out (guided,
// as OpenMP's schedule): each claim takes 1/threads of what is left, down to kDecodeTailBytes (at 2
// threads SmolLM2's 30 MB head is 11 chunks, the last two 29 KB; only where that would overflow the
// table, many threads on a large matrix, no claim is under 1/kMaxDecodeChunks of the matrix); a
// phase is a few large claims that end on smaller ones. Decode step 0.88-0.97x the equal chunks' time
// on the four GGUFs of the benchmarks (2 threads; 1/(2 x threads) per claim: 1.05-1.07x on SmolLM2).
constexpr size_t kDecodeTailBytes = 32 * 1024;
constexpr int kMaxDecodeChunks = 96;
struct DecodeChunks {
    int n = 0;
    int end[kMaxDecodeChunks];  // chunk c is rows [c ? end[c - 1] : 0, end[c])
};
inline DecodeChunks decode_chunks(const Mat& w, int N, int nb, int nthreads) {
    size_t bytes = 0;  // (a part not repacked is a row kernel's type: nb blocks of block_bytes a row)
    for (int p = 0; p < w.parts; ++p) {
        const int t = w.type[p];
        bytes += size_t(w.rows[p]) * nb * (is_packed(t) ? group_block_bytes(t) : kGroupRows * block_bytes(t)) / kGroupRows;
    }
    DecodeChunks dc;
    const int groups = (N + kGroupRows - 1) / kGroupRows;
    if (groups == 0) return dc;
    const size_t per_group = std::max<size_t>(bytes / size_t(groups), 1);
    const int tail = int(std::clamp<size_t>(kDecodeTailBytes / per_group, 1, size_t(groups)));
    auto cut = [&](int floor) {  // claims of 1/nthreads of what is left, none under `floor` groups
        dc.n = 0;
        int done = 0;
        while (done < groups && dc.n < kMaxDecodeChunks) {
            done += std::min(groups - done, std::max(floor, (groups - done) / nthreads));
            dc.end[dc.n++] = std::min(done * kGroupRows, N);
        }
        return done == groups;
    };
    // Claims end on the tail's size unless that needs more chunks than the table holds (many threads
    // on a large matrix): then no claim is smaller than 1/kMaxDecodeChunks of the matrix, which
    // kMaxDecodeChunks claims always cover (tests/engine/test_kernels.py, tp_decode_chunks).
    if (!cut(tail)) cut(std::max(tail, (groups + kMaxDecodeChunks - 1) / kMaxDecodeChunks));
    return dc;
}

// y[T, N] (+)= W x over the team: chunks of output rows (multiples of 16) are claimed dynamically.
// Each claimed chunk [n0, n1) is split at the matrix's part boundaries.
void gemm_team(const Model& m, PhaseCursor& pc, int nthreads, int kind, const Mat& w, int N, const QAct& a,
               int T, float* y, int ldy, const float* bias, bool acc, const uint8_t* kinds) {
    const bool exact = (m.exact >> kind) & 1;
    auto rows = [&](int n0, int n1) {
        for (int p = 0, r0 = 0; p < w.parts && r0 < n1; r0 += w.rows[p], ++p) {
            const int lo = std::max(n0, r0) - r0, hi = std::min(n1, r0 + w.rows[p]) - r0;
            if (lo < hi)
                gemm_runs(m, w.type[p], w.w[p], a, T, y + r0, ldy, lo, hi, bias ? bias + r0 : nullptr, acc, exact,
                          kinds, kind);
        }
    };
    if (T > kOwnRowsMax) return team_for(pc, N, grain_for(N, nthreads, 16), rows);
    const DecodeChunks dc = decode_chunks(w, N, a.nb, nthreads);
    team_chunks(pc, dc.n, [&](int c) { rows(c ? dc.end[c - 1] : 0, dc.end[c]); });
}

// Where a step's qkv [T, W], attention [T, nq] and gate/up [T, 2I] outputs lie, in m.work. With the
// rows shared among the threads (every per-row phase a team_for, which returns once the whole phase
// is done), gate/up overlays qkv and attention: their last reader (the o projection's input
// quantization, and its LoRA delta) finishes before the gate/up GEMM writes, and the next layer's
// qkv GEMM starts after the last read of gate/up (the GLU phase). That halves the step's largest
// buffers at a prefill's peak RSS (SmolLM2, 512 rows: 12 MiB -> 6). With own_rows (decode: each
// thread runs the per-row phases on its own, without waiting for the others) one thread can reach
// the next layer's qkv GEMM while another still reads gate/up, so the three stay apart; at a few
// rows that costs nothing.
void step_buffers(Model& m, int T, int W, int nq, int gu_w, bool own_rows, float*& qkv, float*& attn, float*& gu) {
    const size_t qa = size_t(T) * (W + nq), g = size_t(T) * gu_w;
    const size_t need = own_rows ? qa + g : std::max(qa, g);
    grow(m.work, need);
    qkv = m.work.data(), attn = qkv + size_t(T) * W, gu = own_rows ? qkv + qa : qkv;
}
