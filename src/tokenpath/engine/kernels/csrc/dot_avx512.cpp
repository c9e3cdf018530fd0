// AVX-512 VL + VNNI kernels (256-bit vpdpbusd), chosen at run time when the CPU has them.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define TP_VNNI 1
#define TP_NS tp::avx512
#include "dot_impl.h"
