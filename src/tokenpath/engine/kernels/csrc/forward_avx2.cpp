// The forward of the _native_avx2 object (setup.py): forward.cpp without the AVX-512 kernels'
// dispatch, so that object links without dot_avx512.cpp. The other sources compile the same for
// both objects (setup.py compiles each of them once).
#define TP_NO_AVX512 1
#include "forward.cpp"
