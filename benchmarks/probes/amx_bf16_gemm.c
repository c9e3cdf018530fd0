// AMX-BF16 GEMM probe (issue 42: the bf16 safetensors path against vLLM CPU on an AMX host).
// C[M][N] = A[M][K] (bf16) x B[K][N] (bf16, pre-packed as 16 x 64-byte tiles: k-pairs of 16 columns),
// float32 out, one thread, 2 x 2 tiles of 16 x 16 outputs per step, K in steps of 32. Not product
// code: it measures what a tile GEMM does on this CPU, to set against the kernels' BF16X16 FMA GEMM
// (benchmarks/probes/amx_probe.py runs both). Needs a CPU with amx_bf16 and Linux >= 5.16.
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
typedef struct { uint8_t palette; uint8_t start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int M=atoi(argv[1]),N=atoi(argv[2]),K=atoi(argv[3]);
  syscall(SYS_arch_prctl, 0x1023, 18);
  uint16_t*A=aligned_alloc(64,(size_t)M*K*2); uint16_t*B=aligned_alloc(64,(size_t)K*N*2); float*C=aligned_alloc(64,(size_t)M*N*4);
  for(size_t i=0;i<(size_t)M*K;i++)A[i]=0x3f80; for(size_t i=0;i<(size_t)K*N;i++)B[i]=0x3f80;
  cfg_t c; memset(&c,0,sizeof c); c.palette=1;
  for(int t=0;t<8;t++){c.rows[t]=16;c.colsb[t]=64;}
  _tile_loadconfig(&c);
  // B packed: for each n-block of 16 cols, each k-block of 32: 16 rows x 64 bytes contiguous (1 KiB)
  int reps=20; double t0=now();
  for(int r=0;r<reps;r++){
   for(int n0=0;n0<N;n0+=32){
    for(int m0=0;m0<M;m0+=32){
      _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
      for(int k0=0;k0<K;k0+=32){
        _tile_loadd(4, A+(size_t)m0*K+k0, K*2);
        _tile_loadd(5, A+(size_t)(m0+16)*K+k0, K*2);
        const uint16_t*b0=B+((size_t)(n0/16)*(K/32)+k0/32)*512;
        const uint16_t*b1=B+((size_t)(n0/16+1)*(K/32)+k0/32)*512;
        _tile_loadd(6, b0, 64); _tile_loadd(7, b1, 64);
        _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);
      }
      _tile_stored(0, C+(size_t)m0*N+n0, N*4); _tile_stored(1, C+(size_t)m0*N+n0+16, N*4);
      _tile_stored(2, C+(size_t)(m0+16)*N+n0, N*4); _tile_stored(3, C+(size_t)(m0+16)*N+n0+16, N*4);
    }}
  }
  double dt=(now()-t0)/reps; _tile_release();
  printf("M=%d N=%d K=%d: %.3f ms, %.1f GFLOP/s (1 thread), C[0]=%.0f (expect %d)\n",M,N,K,dt*1e3,2.0*M*N*K/dt/1e9,C[0],K);
}
