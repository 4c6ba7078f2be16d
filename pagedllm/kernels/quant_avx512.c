/* int8 activations x packed tiles with AVX-512 VNNI (issue 18; moved here from quant_kernels.c for
 * issue 37's per-instruction-set builds, unchanged): 64-byte vectors, one 32-bit lane per row of a
 * tile, one vpdpbusd per quad and level. Layouts and the two-level activation scheme: quant_kernels.c. */
#include "quant_common.h"
#if QI8_ISA == 3
#include <immintrin.h>
#include <string.h>

/* Every block gets a second int8 level for its rounding residual (about 15 bits in all). One level
 * (llama.cpp's Q8 activations) moved logprobs by ~0.1 on SmolLM2: the README's chat example sits
 * at a 0.08 near tie and its first token changed; the few huge channels of an MLP's intermediate
 * (hundreds to thousands of times the rest) also crushed their block's other values. With two
 * levels the logprobs are within ~0.001 of float32.
 * The residual of round-to-nearest is at most half a step (dx / 2), so the second level has the
 * fixed scale dx / 256 (|q2| <= 128, saturated to 127): both levels of a block then share one scale,
 * and their integer dot products combine exactly in int32 as 256 s1 + s2 (|s1| <= 32 * 255 * 128,
 * so 256 s1 stays far inside int32) before the one conversion to float and the one scale multiply. */

/* One input row, quantized: xq, xq2 [K] int8, the two levels (x ~ dx (q + q2 / 256) per 32-block);
 * dx [K/32] the blocks' scales / 256 (the combined dot's unit); sxd [K/32] = each block's sum as
 * quantized (both levels, for the mins); c16, c16_2 [K/16] = -128 * the sum of each 16 quants of
 * each level (the +128 offset of signed weight bytes read as unsigned). */
typedef struct {
    int8_t *xq, *xq2;
    float *dx, *sxd;
    int32_t *c16, *c16_2;
} qrow;

static size_t qrow_bytes(long K) { return 2 * K + (sizeof(float) * 2 + sizeof(int32_t) * 4) * (K / 32); }

static void quantize_row(const float *x, long K, uint8_t *mem, qrow *r, int lv) {
    (void)lv; /* always two levels here (QI8_ONE_LEVEL 0) */
    long nb = K / QBLOCK;
    r->xq = (int8_t *)mem;
    r->xq2 = r->xq + K;
    r->dx = (float *)(r->xq2 + K);
    r->sxd = r->dx + nb;
    r->c16 = (int32_t *)(r->sxd + nb);
    r->c16_2 = r->c16 + 2 * nb;
    for (long b = 0; b < nb; b++) {
        const float *xb = x + b * QBLOCK;
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float dx = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f, id2 = amax > 0.0f ? 256.0f / dx : 0.0f;
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        __m512 dxv = _mm512_set1_ps(dx), id2v = _mm512_set1_ps(id2);
        __m512 r0 = _mm512_sub_ps(v0, _mm512_mul_ps(_mm512_cvtepi32_ps(q0), dxv));
        __m512 r1 = _mm512_sub_ps(v1, _mm512_mul_ps(_mm512_cvtepi32_ps(q1), dxv));
        /* |q2| <= 128 (half a step, up to float rounding): clamp to int8, then narrow */
        const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-128);
        __m512i p0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(r0, id2v)), hi), lo);
        __m512i p1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(r1, id2v)), hi), lo);
        _mm_storeu_si128((__m128i *)(r->xq + b * QBLOCK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(r->xq + b * QBLOCK + 16), _mm512_cvtepi32_epi8(q1));
        _mm_storeu_si128((__m128i *)(r->xq2 + b * QBLOCK), _mm512_cvtepi32_epi8(p0));
        _mm_storeu_si128((__m128i *)(r->xq2 + b * QBLOCK + 16), _mm512_cvtepi32_epi8(p1));
        int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
        int t0 = _mm512_reduce_add_epi32(p0), t1 = _mm512_reduce_add_epi32(p1);
        r->dx[b] = dx / 256.0f;
        r->sxd[b] = r->dx[b] * (float)(256 * (s0 + s1) + t0 + t1);
        r->c16[2 * b] = -128 * s0;
        r->c16[2 * b + 1] = -128 * s1;
        r->c16_2[2 * b] = -128 * t0;
        r->c16_2[2 * b + 1] = -128 * t1;
    }
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* the 8 quads of a tile-block as unsigned bytes: quad i = weights 4i .. 4i + 3 of each row (lane) */
static inline __attribute__((always_inline)) void block_quads(int fmt, const uint8_t *tb, __m512i *w) {
    if (q_nib(fmt)) {
        const __m512i m4 = _mm512_set1_epi8(15);
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512(tb + 64 * c);
            w[2 * c] = _mm512_and_si512(v, m4);
            w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        if (q_code(fmt)) { /* codebook values + 128 (unsigned, as S8's flipped bytes) by vpshufb */
            __m512i cb = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q_codebook[q_base(fmt) - 5])),
                                          _mm512_set1_epi8((char)0x80));
            for (int q = 0; q < 8; q++) w[q] = _mm512_shuffle_epi8(cb, w[q]);
        }
    } else {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int c = 0; c < 8; c++) w[c] = _mm512_xor_si512(_mm512_loadu_si512(tb + 64 * c), flip);
    }
}

/* a += w (unsigned bytes) . the 4 signed bytes at p, broadcast to every lane: the broadcast is the
 * instruction's own memory operand ({1to16}); written as asm because GCC otherwise materialised
 * every broadcast in a register and spilled them to the stack, one store and one reload each */
#define DPB(a, w, p) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a) : "v"(w), "m"(*(const int32_t *)(p)))

/* both levels over the quads [q0, q1): 256 (w . q) + (w . q2) per lane in int32, then float; two
 * accumulators per level so that a single row is not bound by vpdpbusd's latency */
static inline __attribute__((always_inline)) __m512 levels_dot(const __m512i *w, const int8_t *x1, const int8_t *x2,
                                                                int q0, int q1, int32_t start1, int32_t start2) {
    __m512i a = _mm512_set1_epi32(start1), c = _mm512_set1_epi32(start2);
    __m512i a2 = _mm512_setzero_si512(), c2 = _mm512_setzero_si512();
    for (int q = q0; q < q1; q += 2) {
        DPB(a, w[q], x1 + 4 * q);
        DPB(c, w[q], x2 + 4 * q);
        DPB(a2, w[q + 1], x1 + 4 * q + 4);
        DPB(c2, w[q + 1], x2 + 4 * q + 4);
    }
    a = _mm512_add_epi32(a, a2);
    c = _mm512_add_epi32(c, c2);
    return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(a, 8), c));
}

/* scales i .. i + 15 (float32 or float16: quant_common.h Q_HALF) */
static inline __m512 ld_d(int fmt, const float *dt, long i) {
    return q_half(fmt) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)dt + i)))
                       : _mm512_loadu_ps(dt + i);
}

/* acc + (row n of block b) . (an input row's block b, both levels) * its scales, per lane n */
static inline __attribute__((always_inline)) __m512 block_acc(int fmt, int plain, const __m512i *w, const float *dt,
                                                               long b, const qrow *r, __m512 acc) {
    const int8_t *x1 = r->xq + b * QBLOCK, *x2 = r->xq2 + b * QBLOCK;
    const int32_t *c1 = r->c16 + 2 * b, *c2 = r->c16_2 + 2 * b;
    __m512 dxv = _mm512_set1_ps(r->dx[b]);
    if (q_base(fmt) == 3) { /* two scale groups of 16 weights */
        acc = _mm512_fmadd_ps(levels_dot(w, x1, x2, 0, 4, c1[0], c2[0]),
                              _mm512_mul_ps(ld_d(fmt, dt, 2 * b * QT), dxv), acc);
        return _mm512_fmadd_ps(levels_dot(w, x1, x2, 4, 8, c1[1], c2[1]),
                               _mm512_mul_ps(ld_d(fmt, dt, (2 * b + 1) * QT), dxv), acc);
    }
    return _mm512_fmadd_ps(levels_dot(w, x1, x2, 0, 8, plain ? 0 : c1[0] + c1[1], plain ? 0 : c2[0] + c2[1]),
                           _mm512_mul_ps(ld_d(fmt, dt, b * QT), dxv), acc);
}

/* acc[i] (lane n) += row n of block b . row i's activations (both levels), i < R */
#define QI_MAXR 8 /* rows per pass over a tile: 16 spilled accumulators on the 4-bit formats */
static inline __attribute__((always_inline)) void tile_block_i8(int fmt, const uint8_t *tb, const float *dt,
                                                                const float *mt, long b, const qrow *xr, int R,
                                                                __m512 *acc) {
    __m512i w[8];
    block_quads(fmt, tb, w);
    int plain = q_base(fmt) == 0; /* U4M's nibbles are the unsigned operand as they are: no +128 to take off */
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) {
        acc[i] = block_acc(fmt, plain, w, dt, b, xr + i, acc[i]);
        if (q_min(fmt)) acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(mt + b * QT), _mm512_set1_ps(xr[i].sxd[b]), acc[i]);
    }
}

static inline __attribute__((always_inline)) void tile_i8(int fmt, const uint8_t *tq, const float *dt,
                                                          const float *mt, long nb, const qrow *xr, int R,
                                                          float out[QI_MAXR][QT]) {
    __m512 acc[QI_MAXR];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    long tbb = q_tb(fmt);
    for (long b = 0; b < nb; b++) {
        for (long c = 0; c < tbb; c += 64) __builtin_prefetch(tq + b * tbb + PF_BYTES + c, 0, 3);
        tile_block_i8(fmt, tq + b * tbb, dt, mt, b, xr, R, acc);
    }
    for (int i = 0; i < R; i++) _mm512_storeu_ps(out[i], acc[i]);
}

#define QI8_ONE_LEVEL 0
#include "quant_i8_driver.h"
#endif
