// AVX-512 VL + VNNI kernels, chosen at run time when the CPU has them: 512-bit vpdpbusd on the
// repacked weights (packed_impl.h), 256-bit on GGUF layouts (dot_impl.h).
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
// GCC 12's 512-bit conversion intrinsics pass _mm512_undefined_ps() as their unused merge source,
// which -Wmaybe-uninitialized reports at every use: a false positive, silenced for this file only.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define TP_VNNI 1
#define TP_NS tp::avx512
#include "amx_tiles.h"  // amx_int8.h: the tile configuration
#include "dot_impl.h"
#include "stream_read.h"  // stream_xor: tp_stream_read's 512-bit read
