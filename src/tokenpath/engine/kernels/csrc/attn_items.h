// A step's attention work (forward.cpp includes this after Model and step_acts.h): its tiles of
// rows, the work items the team claims, and the scratch one item needs.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>

// Row t is a prompt row whose attention runs on AMX tiles (attn_amx.cpp; Model::attn_tiles).
inline bool prompt_tile_row(const Model& m, int t) { return m.attn_tiles && m.kinds && (m.kinds[t] & kPromptTiles); }

// Fills m.tiles and m.items for a step of T rows; returns the number of items.
inline int plan_attention(Model& m, int T, const int32_t* row_table, const int32_t* pos, int nthreads) {
    const int rep = m.n_heads / m.n_kv;
    // Attention tiles: runs of up to kTileRows rows of one sequence at consecutive positions (a
    // prefill chunk's rows share every K/V read); a decode row is a tile of its own. Prompt rows
    // on AMX tiles make tiles of their own, of up to kPromptTileRows rows.
    m.tiles.clear();
    for (int t = 0; t < T; ++t) {
        const bool amx = prompt_tile_row(m, t);
        if (t == 0 || row_table[t] != row_table[t - 1] || pos[t] != pos[t - 1] + 1 || amx != prompt_tile_row(m, t - 1) ||
            t - m.tiles.back() == (amx ? paged::kPromptTileRows : paged::kTileRows))
            m.tiles.push_back(t);
    }
    m.tiles.push_back(T);
    const int ntiles = int(m.tiles.size()) - 1;
    // Work items (tile, first KV head, end): longest contexts first (items are claimed in order, so
    // short ones fill in at the end; later tiles are the prefill chunks). With enough tiles to keep
    // every thread busy, a decode row's item covers all its KV heads and reads each cache slot whole
    // (attention.h says why); prefill tiles, which reuse every K/V read across their rows, and
    // small batches keep one item per head for parallelism.
    const bool whole_rows = ntiles >= 4 * nthreads;
    // Too few items to share (one decode row has one per KV head: 3 on SmolLM2 for 2 threads, so
    // one thread did two; Gemma 3 270M's one KV head left a thread idle): each KV head's query
    // heads are split across items until there are two per thread. A query's arithmetic does not
    // depend on the heads beside it, so the bits are the same; each part reads the head's K/V.
    int hsplit = 1;
    while (!whole_rows && ntiles * m.n_kv * hsplit < 2 * nthreads && hsplit < rep) ++hsplit;
    m.items.clear();
    for (int ti = ntiles - 1; ti >= 0; --ti) {
        if (whole_rows && m.tiles[ti + 1] - m.tiles[ti] == 1) m.items.push_back({ti, 0, m.n_kv, 0, rep});
        else
            for (int g = 0; g < m.n_kv; ++g)
                for (int s = 0; s < hsplit; ++s) m.items.push_back({ti, g, g + 1, s * rep / hsplit, (s + 1) * rep / hsplit});
    }
    return int(m.items.size());
}

// Floats of per-thread scratch the largest item needs, on whichever kernel runs it.
inline size_t attention_scratch_floats(const Model& m) {
    const int rep = m.n_heads / m.n_kv;
    size_t n = paged::scratch_floats(m.n_kv * m.head_dim, rep * m.n_kv);
#ifndef TP_NO_AVX512
    if (m.attn_tiles) n = std::max(n, amx::attend_prompt_scratch_floats(m.head_dim, paged::kPromptTileRows * rep));
#endif
    return n;
}
