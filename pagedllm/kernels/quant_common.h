/* Shared by the quantized-weight kernels: quant_kernels.c (float32 activations, dispatch, dequant),
 * quant_avx512.c and quant_avx2.c (int8 activations; layouts in quant_kernels.c).
 *
 * Every source file is compiled once per instruction-set build (kernels/cpu.py ISA_FLAGS); QI8_ISA
 * says which int8-activation kernels this build holds, from the compiler's own target macros:
 *   3 AVX-512 VNNI (quant_avx512.c), 2 AVX-VNNI and 1 AVX2 (quant_avx2.c: the same code, only the
 *   byte dot product differs), 0 none (float32 activations only).
 */
#ifndef PL_QUANT_COMMON_H
#define PL_QUANT_COMMON_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QBLOCK 32
#define QT 16 /* output rows per tile (one per 32-bit lane of a 64-byte chunk) */
#define PF_BYTES 2048 /* software prefetch distance along a tile's bytes (the hardware prefetchers alone
                         left batch-1 products far below the memory bandwidth) */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QI8_ISA 3
#elif defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__)
#define QI8_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define QI8_ISA 1
#else
#define QI8_ISA 0
#endif

/* fmt codes (kernels/cpu.py QUANT_LAYOUTS): 0 U4M, 1 S8, 2 S6 (S8 whose quants are all in
 * -32..31: Q5_0; the AVX2 kernels may add 32 to make them unsigned without vpmaddubsw saturating),
 * 3 S8H, 4 S8M, 5 IQ4 and 6 E2M1 (U4M's nibbles as indices into a 16-value codebook, q_codebook:
 * IQ4_NL / IQ4_XS's, MXFP4's e2m1 values doubled; one d per 32, no min), 7 U6H (Q6_K's 6 bits kept
 * 6 bits: U4M's nibbles, a 2-bit plane and int8 group scales in the tile-block, d per 256;
 * quant_kernels.c).
 * fmt | Q_HALF (of S8, S6, IQ4, E2M1): the scales d are float16, not float32 (gguf_blocks.to_tiles stores
 * them so when every one is exact in float16: Q8_0's, Q5_0's and IQ4_NL's fp16 d, MXFP4's powers of two):
 * Q8_0 then reads its file's 34 bytes per 32 weights, not 36, MXFP4 18 instead of 20. */
#define Q_HALF 8
/* fmt | Q_LV1 (pl_qgemm's callers, prefill-sized products): one-level int8 activations, the residual
 * level dropped (quant_avx2.c only: AVX-512 VNNI keeps two levels, its prefill is compute-cheap). */
#define Q_LV1 16
static inline int q_base(int fmt) { return fmt & 7; }
static inline int q_half(int fmt) { return (fmt & Q_HALF) != 0; }
static inline int q_code(int fmt) { return q_base(fmt) == 5 || q_base(fmt) == 6; }
static inline int q_u6(int fmt) { return q_base(fmt) == 7; }
static inline int q_nib(int fmt) { return q_base(fmt) == 0 || q_code(fmt) || q_u6(fmt); } /* U4M's nibble chunks */
static inline int q_min(int fmt) { return q_base(fmt) == 0 || q_base(fmt) == 4; }
/* bytes per tile-block; U6H: 256 of nibbles, 128 of 2-bit highs (U6_HIGH), 32 of int8 scales (U6_SC) */
#define U6_HIGH 256
#define U6_SC 384
static inline long q_tb(int fmt) { return q_u6(fmt) ? 416 : q_nib(fmt) ? 256 : 512; }
static inline int q_two_groups(int fmt) { return q_base(fmt) == 3 || q_u6(fmt); } /* a scale per 16 weights */
/* the codebooks of fmt 5 and 6 (llama.cpp's ggml-common.h kvalues_iq4nl and kvalues_mxfp4) */
static const int8_t q_codebook[2][16] = {
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}};
/* entries of d per row and tile lane: U6H's one d per 256 (its group scales are in the tiles) */
static inline long q_groups(int fmt, long nb) { return q_u6(fmt) ? nb / 8 : q_base(fmt) == 3 ? 2 * nb : nb; }
/* the scales from entry i on, and entry i as float (float32 or float16 arrays alike) */
static inline const float *q_dat(int fmt, const float *d, long i) {
    return (const float *)((const char *)d + i * (q_half(fmt) ? 2 : 4));
}
static inline float q_dval(int fmt, const float *d, long i) {
    if (!q_half(fmt)) return d[i];
    _Float16 h;
    memcpy(&h, (const char *)d + 2 * i, 2);
    return (float)h;
}


/* y [M, N] = x W^T (+ bias): float32 activations (quant_kernels.c; any build) */
void pl_qgemm_f32(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
                  const float *bias, float *y, long N, long K, int nt) __attribute__((visibility("hidden")));
#if QI8_ISA > 0
/* the same with int8 activations (quant_avx512.c or quant_avx2.c); lv: 1 or 2 activation levels */
void pl_qgemm_i8(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
                 const float *bias, float *y, long N, long K, int nt, int lv) __attribute__((visibility("hidden")));
#endif
#endif
