/* Shared by the float32 CPU kernels (cpu_kernels.c, decode_stack.c, moe_kernels.c): the vector type
 * of the build and the functions one file defines for the others. */
#ifndef PL_CPU_COMMON_H
#define PL_CPU_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* weight rows per matrix-vector task: one accumulator register each (32 vector registers with
 * AVX-512, 16 with AVX2), and as many streams for the hardware prefetchers */
#if defined(__AVX512F__)
#define VEC_BYTES 64
#define GEMV_ROWS 16
#else
#define VEC_BYTES 32
#define GEMV_ROWS 8
/* moe_kernels.c */
int pl_moe_experts(long T, long k, const int64_t *idx, const float *w, const float *x, float *out, long H, long I,
                   const int64_t *experts, long E, int act, int nt, int lv);
#endif
#define VEC_LEN (VEC_BYTES / 4)
typedef float vec __attribute__((vector_size(VEC_BYTES)));

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

#define PAR_MIN_WORK 32768 /* below this many float ops a parallel region costs more than it saves */

#include "vec_math.h" /* exp_approx */


#define HIDDEN __attribute__((visibility("hidden")))
/* cpu_kernels.c */
void decode_task(const float *q, long q_hs, const int64_t *table, long first, long L, const float *kc,
                 const float *vc, long block_size, long D, long G, float scale, float softcap,
                 const float *sinks, float *scores, float *out, long out_hs) HIDDEN;
void pl_rope(float *x, long row_stride, long nheads, const int64_t *pos, const float *cos_t, const float *sin_t,
             long T, long D, int nt);
void pl_silu_mul(const float *gu, float *out, long T, long I, int nt);
void pl_gemv(const float *x, const float *W, const float *b, float *y, long N, long K, int nt);
/* quant_kernels.c */
void pl_qgemm(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
              const float *bias, float *y, long N, long K, int nt);
/* decode_stack.c: y [M, N] = x [M, K] W^T (+ b) for a weight described by {fmt, weight, d, m, bias}
 * (fmt >= 0: pl_qgemm's layout and arrays, fl OR-ed into it (0, or Q_LV1: one-level activations);
 * -1: float32 [N, K]) */
void desc_matmul(const int64_t *desc, const float *x, long M, float *y, long N, long K, int nt, int fl) HIDDEN;
void act_mul(int act, const float *gu, float *out, long T, long I) HIDDEN; /* 0 silu, 1 tanh-GELU, 2 gpt-oss */
/* moe_kernels.c */
int pl_moe_experts(long T, long k, const int64_t *idx, const float *w, const float *x, float *out, long H, long I,
                   const int64_t *experts, long E, int act, int nt, int lv);
#endif
