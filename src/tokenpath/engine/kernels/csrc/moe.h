// Mixture-of-experts MLPs (Qwen3-MoE, Mixtral) inside the fused forward: included by forward.cpp
// after its helpers (Model, team_for, rms_norm, silu_mul, make_act), and set up per sparse layer
// by tp_model_set_moe after tp_model_create.
//
// One sparse layer is 9 work phases of the step (all threads walk them alike):
//   norm        RMSNorm of each row into float rows (the router reads floats: routing is exact)
//   router      float32 router logits, items of (16 experts x 64 rows) so router rows stay in cache
//   route       per row: softmax in float32, top-k as torch.topk picks it on a CPU (so tied
//               experts go where transformers sends them: topk_select), renormalised when
//               norm_topk (Mixtral's softmax over the top-k logits is the same numbers)
//   plan        one item: the step's (row, expert) pairs grouped by expert (rows in step order),
//               and the GEMM work items: (expert, output-row chunk), busiest experts first
//   quantize    each pair's normed row, quantized at its place in its expert's group
//   gate_up     per item, the expert's gate or up rows times all the rows routed to it: an
//               expert's weights are read once per step whatever its number of tokens, and
//               experts nobody chose are not read at all
//   act         SiLU(gate) * up of each pair, quantized for down
//   down        per item, as gate_up
//   combine     x += sum of each row's experts' outputs times their weights, ascending expert
//               index (the order the torch path and transformers add them in)
// The plan phase also counts, cumulatively over the model's life (tp_model_moe_counters): the
// (row, expert) pairs routed, the experts read (those that got a row), and each layer's busiest
// expert's rows; with the sparse layer-steps, these say how much one weight read of an expert is
// shared by a step's tokens (pairs / reads: 1.0 when every token went to experts of its own) and
// how uneven the load was (the busiest expert against the mean of those read).
// Experts keep their own blocks: each of gate, up and down is one allocation holding every
// expert's rows (repacked 16 rows at a time like the dense matrices), expert e at e * stride.
#pragma once

#include <cstdint>
#include <utility>  // std::pair: topk_select

namespace {

constexpr int kMoePhases = 9;
constexpr int kRouterExperts = 16, kRouterRows = 64;  // one router work item

struct MoeLayer {
    int layer, E, k, ff, norm_topk;
    const float* router;  // [E, hidden] float32
    int type[3];          // gate, up, down: kernel types
    const uint8_t* w[3];  // every expert's rows, expert e at w + e * stride
    size_t stride[3];
};

struct MoeItem {
    int e, n0, n1;  // expert, output rows [n0, n1)
};

// Step buffers for the sparse layers, grown on demand (moe_prepare) and reused.
struct MoeBuf {
    std::vector<float> xn, probs, wts, gu, yd;
    std::vector<int> sel, at, tok, counts, offs, order, next;
    std::vector<uint8_t> kinds;  // per expert-ordered row: its token's Model::kinds mask
    std::vector<MoeItem> gu_items, dn_items;
    // Per layer, this step's counts of gate_up and down items. A thread that was descheduled may
    // enter a phase after the others have finished it and gone on to the next sparse layer's plan,
    // which rewrites the item lists: the count it reads on entry must still be this layer's (it
    // then claims nothing; a wrong count would leave it waiting for items that never come).
    std::vector<int> n_items;
    uint64_t counters[4] = {0, 0, 0, 0};  // pairs routed, experts read, busiest experts' rows, layer-steps
    ActBuf act;
    QAct view;  // over `act`: T * top-k rows of max(hidden, ff) values
};

inline float dot_f32(const float* a, const float* b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    alignas(32) float p[8];
    _mm256_store_ps(p, acc);
    float s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

// The k largest of p[0..E) in torch.topk's order (largest, sorted), as its CPU kernel picks them
// (aten/src/ATen/native/TopKImpl.h, topk_impl_loop): (value, index) pairs, std::partial_sort when
// k * 64 <= E, else std::nth_element at k - 1 and a std::sort of the first k - 1, each comparing
// values only (NaN first). Which of tied experts wins is what those algorithms leave where, not the
// lower index (topk of [0, 0, 0, 1, 0, 1, 0, 0] is expert 5), and the same libstdc++ algorithms
// over the same comparisons leave them in the same places here.
inline void topk_select(const float* p, int E, int k, int* sel) {
    using elem = std::pair<float, int>;
    thread_local std::vector<elem> q;
    q.resize(size_t(E));
    for (int e = 0; e < E; ++e) q[size_t(e)] = {p[e], e};
    auto larger = [](const elem& x, const elem& y) {
        return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
    };
    if (int64_t(k) * 64 <= E) {
        std::partial_sort(q.begin(), q.begin() + k, q.end(), larger);
    } else {
        std::nth_element(q.begin(), q.begin() + (k - 1), q.end(), larger);
        std::sort(q.begin(), q.begin() + (k - 1), larger);
    }
    for (int j = 0; j < k; ++j) sel[j] = q[size_t(j)].second;
}

// Softmax over E logits (in place, float32), then the top k: sel/w ordered by expert index
// ascending, each chosen expert's probability (renormalised to sum 1 when norm).
inline void route_row(float* p, int E, int k, bool norm, int* sel, float* w) {
    float mx = p[0];
    for (int e = 1; e < E; ++e) mx = std::max(mx, p[e]);
    float sum = 0.f;
    for (int e = 0; e < E; ++e) sum += (p[e] = std::exp(p[e] - mx));
    for (int e = 0; e < E; ++e) p[e] /= sum;
    topk_select(p, E, k, sel);
    float tot = 0.f;
    for (int j = 0; j < k; ++j) tot += p[sel[j]];  // in topk's order, as weights.sum() adds them
    std::sort(sel, sel + k);
    for (int j = 0; j < k; ++j) w[j] = norm ? p[sel[j]] / tot : p[sel[j]];
}

// Sizes the step's buffers (before the parallel region).
void moe_prepare(Model& m, int T) {
    if (m.moes.empty()) return;
    MoeBuf& b = *m.moe_buf;
    int E = 0, k = 0, ff = 0;
    for (const auto& L : m.moes) E = std::max(E, L->E), k = std::max(k, L->k), ff = std::max(ff, L->ff);
    const size_t P = size_t(T) * k, H = size_t(m.hidden);
    if (b.xn.size() < T * H) b.xn.resize(T * H);
    if (b.probs.size() < size_t(T) * E) b.probs.resize(size_t(T) * E);
    if (b.sel.size() < P) b.sel.resize(P), b.wts.resize(P), b.at.resize(P), b.tok.resize(P);
    if (b.kinds.size() < P) b.kinds.resize(P);
    if (b.gu.size() < P * 2 * ff) b.gu.resize(P * 2 * ff);
    if (b.yd.size() < P * H) b.yd.resize(P * H);
    if (b.counts.size() < size_t(E) + 1) b.counts.resize(E + 1), b.offs.resize(E + 1), b.order.resize(E), b.next.resize(E);
    b.view = make_act(m, b.act, int(P), std::max(int(H), ff));
    b.n_items.assign(2 * size_t(m.n_layers), 0);
}

// Appends (expert, row chunk) items over N output rows for every expert that got rows, busiest first.
void moe_items(std::vector<MoeItem>& items, const MoeBuf& b, int E, int N, int nthreads, int T) {
    items.clear();
    int active = 0;
    for (int e = 0; e < E; ++e) active += b.counts[e] > 0;
    const int g = grain_for(active * N, T <= kOwnRowsMax ? 4 * nthreads : nthreads, 16);
    for (int i = 0; i < E && b.counts[b.order[i]] > 0; ++i)
        for (int n0 = 0; n0 < N; n0 += g) items.push_back({b.order[i], n0, std::min(n0 + g, N)});
}

// The sparse MLP of one layer over the step's T rows: x += MoE(RMSNorm(x)). `tmp`: this thread's
// scratch of at least hidden floats.
void moe_ffn(Model& m, PhaseCursor& pc, int nthreads, const float* norm_w, const MoeLayer& L, int T, float* x,
             float* tmp) {
    MoeBuf& b = *m.moe_buf;
    const int H = m.hidden, E = L.E, k = L.k, ff = L.ff, P = T * k;
    float *xn = b.xn.data(), *probs = b.probs.data(), *gu = b.gu.data(), *yd = b.yd.data();
    team_for(pc, T, grain_for(T, nthreads, 1), [&](int t0, int t1) {
        for (int t = t0; t < t1; ++t) rms_norm(x + size_t(t) * H, norm_w, H, m.eps, xn + size_t(t) * H);
    });
    const int eblocks = (E + kRouterExperts - 1) / kRouterExperts, rtiles = (T + kRouterRows - 1) / kRouterRows;
    team_for(pc, eblocks * rtiles, 1, [&](int i, int) {
        const int e0 = (i / rtiles) * kRouterExperts, e1 = std::min(E, e0 + kRouterExperts);
        const int t0 = (i % rtiles) * kRouterRows, t1 = std::min(T, t0 + kRouterRows);
        for (int t = t0; t < t1; ++t)
            for (int e = e0; e < e1; ++e)
                probs[size_t(t) * E + e] = dot_f32(xn + size_t(t) * H, L.router + size_t(e) * H, H);
    });
    team_for(pc, T, grain_for(T, nthreads, 1), [&](int t0, int t1) {
        for (int t = t0; t < t1; ++t)
            route_row(probs + size_t(t) * E, E, k, L.norm_topk, b.sel.data() + size_t(t) * k, b.wts.data() + size_t(t) * k);
    });
    team_for(pc, 1, 1, [&](int, int) {  // group the pairs by expert
        std::fill(b.counts.begin(), b.counts.begin() + E + 1, 0);
        for (int p = 0; p < P; ++p) ++b.counts[b.sel[p]];
        b.offs[0] = 0;
        for (int e = 0; e < E; ++e) b.offs[e + 1] = b.offs[e] + b.counts[e];
        for (int e = 0; e < E; ++e) b.order[e] = e;
        std::stable_sort(b.order.begin(), b.order.begin() + E, [&](int a, int c) { return b.counts[a] > b.counts[c]; });
        for (int e = 0; e < E; ++e) b.next[e] = b.offs[e];
        for (int p = 0; p < P; ++p) {  // rows in step order within each expert's group
            const int r = b.next[b.sel[p]]++;
            b.at[p] = r, b.tok[r] = p / k;
            if (m.kinds) b.kinds[r] = m.kinds[p / k];
        }
        int read = 0;
        for (int e = 0; e < E; ++e) read += b.counts[e] > 0;
        b.counters[0] += uint64_t(P), b.counters[1] += uint64_t(read), b.counters[2] += uint64_t(b.counts[b.order[0]]);
        b.counters[3] += 1;
        moe_items(b.gu_items, b, E, 2 * ff, nthreads, T);
        moe_items(b.dn_items, b, E, H, nthreads, T);
        b.n_items[2 * L.layer] = int(b.gu_items.size()), b.n_items[2 * L.layer + 1] = int(b.dn_items.size());
    });
    const int kind_gu = 2, kind_dn = 3;
    QAct ain = b.view, amid = b.view;
    ain.nb = (H + QK - 1) / QK, amid.nb = (ff + QK - 1) / QK;
    ain.q2 = (m.fine >> kind_gu) & 1 ? b.view.q2 : nullptr;
    amid.q2 = (m.fine >> kind_dn) & 1 ? b.view.q2 : nullptr;
    ain.bf = (m.half >> kind_gu) & 1 ? b.view.bf : nullptr;  // BF16 experts on AMX tiles (amx_bf16.cpp)
    amid.bf = (m.half >> kind_dn) & 1 ? b.view.bf : nullptr;
    team_for(pc, P, grain_for(P, nthreads, 1), [&](int r0, int r1) {
        for (int r = r0; r < r1; ++r) {
            QAct v = row_act(m, ain, row_mask(m.kinds ? b.kinds.data() : nullptr, r), kind_gu);
            m.quant(xn + size_t(b.tok[r]) * H, H, v, r);
        }
    });
    const bool ex_gu = (m.exact >> kind_gu) & 1, ex_dn = (m.exact >> kind_dn) & 1;
    team_for(pc, b.n_items[2 * L.layer], 1, [&](int i, int) {
        const MoeItem it = b.gu_items[i];
        const int r = b.offs[it.e], M = b.offs[it.e + 1] - r;
        const QAct a = act_rows(ain, r);
        const uint8_t* kinds = m.kinds ? b.kinds.data() + r : nullptr;
        float* y = gu + size_t(r) * 2 * ff;
        if (it.n0 < ff)  // gate rows
            gemm_runs(m, L.type[0], L.w[0] + it.e * L.stride[0], a, M, y, 2 * ff, it.n0, std::min(it.n1, ff),
                      nullptr, false, ex_gu, kinds, kind_gu);
        if (it.n1 > ff)  // up rows
            gemm_runs(m, L.type[1], L.w[1] + it.e * L.stride[1], a, M, y + ff, 2 * ff, std::max(it.n0, ff) - ff,
                      it.n1 - ff, nullptr, false, ex_gu, kinds, kind_gu);
    });
    team_for(pc, P, grain_for(P, nthreads, 1), [&](int r0, int r1) {
        for (int r = r0; r < r1; ++r) {
            float* g = gu + size_t(r) * 2 * ff;
            if (m.gelu) gelu_mul(g, g + ff, g, ff);  // in place: each lane is read before it is written
            else silu_mul(g, g + ff, g, ff);
            QAct v = row_act(m, amid, row_mask(m.kinds ? b.kinds.data() : nullptr, r), kind_dn);
            m.quant(g, ff, v, r);
        }
    });
    team_for(pc, b.n_items[2 * L.layer + 1], 1, [&](int i, int) {
        const MoeItem it = b.dn_items[i];
        const int r = b.offs[it.e], M = b.offs[it.e + 1] - r;
        gemm_runs(m, L.type[2], L.w[2] + it.e * L.stride[2], act_rows(amid, r), M, yd + size_t(r) * H, H, it.n0,
                  it.n1, nullptr, false, ex_dn, m.kinds ? b.kinds.data() + r : nullptr, kind_dn);
    });
    team_for(pc, T, grain_for(T, nthreads, 1), [&](int t0, int t1) {
        for (int t = t0; t < t1; ++t) {
            for (int j = 0; j < k; ++j) {
                const float w = b.wts[size_t(t) * k + j], *y = yd + size_t(b.at[size_t(t) * k + j]) * H;
                if (j == 0)
                    for (int i = 0; i < H; ++i) tmp[i] = w * y[i];
                else
                    for (int i = 0; i < H; ++i) tmp[i] += w * y[i];
            }
            float* xt = x + size_t(t) * H;
            for (int i = 0; i < H; ++i) xt[i] += tmp[i];
        }
    });
}

}  // namespace

extern "C" {

// Makes layer `layer` a sparse one. dims: experts, top-k, expert FFN rows, norm_topk; router:
// [experts, hidden] float32; types and ptrs: gate, up, down (kernel type; every expert's rows),
// then ptrs[3..6) the bytes between consecutive experts. Returns 0, or 1 for arguments out of range.
int tp_model_set_moe(void* handle, int layer, const int32_t* dims, const float* router, const int32_t* types,
                     const uint64_t* ptrs) {
    Model& m = *static_cast<Model*>(handle);
    m.tiles_only = false;  // the experts' GEMMs have their own activation paths
    if (layer < 0 || layer >= m.n_layers || dims[0] < 1 || dims[1] < 1 || dims[1] > dims[0] || dims[2] < 1)
        return 1;
    auto L = std::make_unique<MoeLayer>();
    L->layer = layer, L->E = dims[0], L->k = dims[1], L->ff = dims[2], L->norm_topk = dims[3];
    L->router = router;
    for (int j = 0; j < 3; ++j)
        L->type[j] = types[j], L->w[j] = reinterpret_cast<const uint8_t*>(ptrs[j]), L->stride[j] = size_t(ptrs[3 + j]);
    m.layers[layer].moe = L.get();
    m.moes.push_back(std::move(L));
    if (!m.moe_buf) m.moe_buf = std::make_unique<MoeBuf>();
    return 0;
}

// The cumulative expert counters (MoeBuf::counters) into out[0..4); zeros for a dense model.
void tp_model_moe_counters(void* handle, uint64_t* out) {
    const Model& m = *static_cast<const Model*>(handle);
    for (int i = 0; i < 4; ++i) out[i] = m.moe_buf ? m.moe_buf->counters[i] : 0;
}

}  // extern "C"
