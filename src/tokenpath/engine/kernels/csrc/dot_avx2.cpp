// AVX2 + FMA kernels: the baseline every machine running the native path has.
#pragma GCC target("avx2,fma,f16c")
#define TP_VNNI 0
#define TP_NS tp::avx2
#include "dot_impl.h"
#include "stream_read.h"  // stream_xor: tp_stream_read's 256-bit read
