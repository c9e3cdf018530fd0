// tp_stream_read (forward.cpp includes this): the machine's read bandwidth as the kernels see it,
// on their own OpenMP team of the engine's thread count. benchmarks/engine_vs_llamacpp.py takes
// it as the bound a decode's weight bytes per token x tok/s is measured against.
#pragma once

#include <omp.h>

#include <algorithm>
#include <limits>
#include <vector>

extern "C" {

// Reads buf[0, mib MiB) `reps` times: each of `nthreads` threads XORs its own contiguous slice
// (stream_xor, the kernel set `isa`), all starting together. seconds: the fastest rep, from the
// team's common start to its last thread's end; checksum: the XOR of every 64-bit word of the
// buffer (whatever the split), so a caller can check that every byte was read.
void tp_stream_read(int isa, const uint8_t* buf, int mib, int nthreads, int reps, double* seconds,
                    uint64_t* checksum) {
    using StreamFn = uint64_t (*)(const uint8_t*, size_t);
#ifdef TP_NO_AVX512
    (void)isa;
    const StreamFn fn = avx2::stream_xor;
#else
    const StreamFn fn = isa == 2 ? avx512::stream_xor : avx2::stream_xor;
#endif
    const size_t units = size_t(mib > 0 ? mib : 0) << 12;  // 256-byte units
    if (nthreads < 1) nthreads = 1;
    std::vector<uint64_t> part(size_t(nthreads), 0);
    double best = std::numeric_limits<double>::infinity(), t0 = 0;
    uint64_t sum = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num();
        const size_t n = size_t(omp_get_num_threads()), u0 = units * t / n, u1 = units * (t + 1) / n;
        for (int r = 0; r < reps; ++r) {
#pragma omp barrier
#pragma omp single
            t0 = omp_get_wtime();  // single's own barrier: nobody starts before the clock does
            part[size_t(t)] = fn(buf + u0 * 256, (u1 - u0) * 256);
#pragma omp barrier
#pragma omp single
            {
                best = std::min(best, omp_get_wtime() - t0);
                sum = 0;
                for (uint64_t v : part) sum ^= v;
            }
        }
    }
    *seconds = best;
    *checksum = sum;
}

}  // extern "C"
