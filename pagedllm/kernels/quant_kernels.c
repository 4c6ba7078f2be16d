/* pagedllm quantized-weight kernels (issue 18): products with GGUF blocks kept packed.
 *
 * Weights are repacked once at load (models/gguf_blocks.py: to_tiles) into tiles of QT = 16
 * output rows: within a tile, each 32-weight block of the 16 rows is stored together, arranged so
 * that one 64-byte load holds 4 consecutive weights ("a quad") of each of the 16 rows, one row per
 * 32-bit lane. A product then works on all 16 rows of a tile at once, lane by lane: no horizontal
 * sums, one scale multiply per 16 blocks, and the quads are what VNNI's vpdpbusd multiplies.
 *
 * Formats (fmt codes of kernels/cpu.py QUANT_LAYOUTS; w = q * d (+ m) per group of 32 weights,
 * of 16 for S8H):
 *   0 U4M: nibbles 0..15, d and m (Q4_1, Q4_K; Q4_0 as m = -8 d). A tile-block is 256 bytes, 4
 *          chunks of 64: chunk c, lane n, byte j holds weight 8c + j (low nibble) and 8c + 4 + j
 *          (high nibble) of row n.
 *   1 S8:  int8 q, d (Q8_0, Q5_0, int8 per channel). A tile-block is 512 bytes, 8 chunks of 64:
 *          chunk c, lane n, byte j holds weight 4c + j of row n.
 *   3 S8H: as S8 with two scales per block, one per 16 weights (Q6_K).
 *   4 S8M: as S8 with d and m (Q5_1, Q5_K).
 * qs: [tiles][K/32][bytes per tile-block]; d, m: [tiles][groups per row][16] float32 (lane n = row
 * 16 t + n). N is padded to a multiple of 16 with zero rows.
 *
 * Two ways to multiply, chosen at run time:
 * - float32 activations: each quad is widened to float32 in registers, scaled (and shifted by the
 *   min), and multiplied with the input in float32: results equal gguf's dequantization followed
 *   by a float32 matmul up to rounding (the reference, and the only path without AVX-512 VNNI);
 * - int8 activations (AVX-512 VNNI, on unless PAGEDLLM_INT8_ACTIVATIONS=0): every input row is
 *   quantized to int8 per 32-block in two levels (the value, then its rounding residual), and each
 *   quad is two vpdpbusd (64 byte products summed into 16 int32 lanes) per input row; every row of every product
 *   (decode, batches, prefill) goes through the same code, so a row's result does not depend on
 *   what else is in the batch.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QBLOCK 32
#define QT 16 /* output rows per tile (one per 32-bit lane of a 64-byte vector) */
#define PF_BYTES 2048 /* software prefetch distance along a tile's bytes (the hardware prefetchers alone
                         left batch-1 products far below the memory bandwidth) */

typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));

static inline int q_nib(int fmt) { return fmt == 0; }
static inline int q_min(int fmt) { return fmt == 0 || fmt == 4; }
static inline long q_tb(int fmt) { return fmt == 0 ? 256 : 512; }        /* bytes per tile-block */
static inline long q_groups(int fmt, long nb) { return fmt == 3 ? 2 * nb : nb; } /* scales per row */

static inline f16v load16(const float *p) {
    f16v v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline i16v load16i(const uint8_t *p) {
    i16v v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline f16v i2f(i16v v) { return __builtin_convertvector(v, f16v); }

/* the 8 (nibbles) or 4 (bytes) weight vectors of chunk c of a tile-block, as q (unscaled float) */
static inline __attribute__((always_inline)) int chunk_q(int fmt, const uint8_t *tb, int c, f16v *w) {
    i16v v = load16i(tb + 64 * c);
    if (q_nib(fmt)) {
        for (int j = 0; j < 4; j++) {
            w[j] = i2f((v >> (8 * j)) & 15);
            w[4 + j] = i2f((v >> (8 * j + 4)) & 15);
        }
        return 8;
    }
    for (int j = 0; j < 4; j++) w[j] = i2f((v << (24 - 8 * j)) >> 24);
    return 4;
}

/* Weights k .. k + 8 of a tile-block chunk: nibble chunk c covers k = 8c .. 8c + 7; byte chunk c
 * covers 4c .. 4c + 3; chunks align with S8H's groups of 16. */
static inline int chunk_k0(int fmt, int c) { return q_nib(fmt) ? 8 * c : 4 * c; }
static inline int chunk_count(int fmt) { return q_nib(fmt) ? 4 : 8; }

/* acc[i] (lane n) += row n of block b of the tile . x_i[block b], i < R: float32 activations.
 * The scale is applied once per group (d * sum q x) and the min once per block (m * sum x, from
 * xs_i[b]); P partial sums per row keep enough independent FMA chains when R is small. */
#define QF_MAXR 8
static inline __attribute__((always_inline)) void tile_block_f32(int fmt, const uint8_t *tb, const float *dt,
                                                                 const float *mt, long b, const float *const *xr,
                                                                 const float *const *xs, int R, int P, f16v *acc) {
    int ngrp = fmt == 3 ? 2 : 1, per = chunk_count(fmt) / ngrp;
    for (int g = 0; g < ngrp; g++) {
        f16v accq[QF_MAXR][4] = {};
        for (int c = g * per; c < (g + 1) * per; c++) {
            f16v w[8];
            int nw = chunk_q(fmt, tb, c, w), k0 = chunk_k0(fmt, c);
            for (int i = 0; i < R; i++) {
                const float *xp = xr[i] + b * QBLOCK + k0;
                for (int j = 0; j < nw; j++) accq[i][j % P] += w[j] * xp[j];
            }
        }
        f16v dv = load16(dt + (fmt == 3 ? 2 * b + g : b) * QT);
        for (int i = 0; i < R; i++) {
            f16v sq = accq[i][0];
            for (int p = 1; p < P; p++) sq += accq[i][p];
            acc[i] += sq * dv;
        }
    }
    if (q_min(fmt)) {
        f16v mv = load16(mt + b * QT);
        for (int i = 0; i < R; i++) acc[i] += mv * xs[i][b];
    }
}

/* y rows xr[0..R) x tile t, written to out[i][0..16) */
static inline __attribute__((always_inline)) void tile_f32(int fmt, const uint8_t *tq, const float *dt,
                                                           const float *mt, long nb, const float *const *xr,
                                                           const float *const *xs, int R, int P,
                                                           float out[QF_MAXR][QT]) {
    f16v acc[QF_MAXR] = {};
    long tbb = q_tb(fmt);
    for (long b = 0; b < nb; b++) {
        __builtin_prefetch(tq + b * tbb + PF_BYTES, 0, 3);
        __builtin_prefetch(tq + b * tbb + PF_BYTES + 128, 0, 3);
        tile_block_f32(fmt, tq + b * tbb, dt, mt, b, xr, xs, R, P, acc);
    }
    for (int i = 0; i < R; i++) memcpy(out[i], &acc[i], sizeof acc[i]);
}

static inline __attribute__((always_inline)) void qgemm_f32_body(int fmt, const float *x, long M, const uint8_t *qs,
                                                                 const float *d, const float *mn, const float *bias,
                                                                 float *y, long N, long K, int nt) {
    long nb = K / QBLOCK, tiles = (N + QT - 1) / QT, ng = q_groups(fmt, nb), tbb = q_tb(fmt);
    /* the input rows' block sums (for the mins): on the stack for decode-sized products */
    float small[1024], *sums = M * nb <= 1024 ? small : malloc(sizeof(float) * M * nb);
    if (!sums) { /* out of memory: row by row, each row's sums fit the stack when K <= 32768 */
        for (long i = 0; i < M && nb <= 1024; i++)
            qgemm_f32_body(fmt, x + i * K, 1, qs, d, mn, bias, y + i * N, N, K, nt);
        return;
    }
    for (long i = 0; i < M * nb; i++) {
        float s = 0.0f;
        for (int c = 0; c < QBLOCK; c++) s += x[i * QBLOCK + c];
        sums[i] = s;
    }
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (long t = 0; t < tiles; t++) {
        const uint8_t *tq = qs + t * nb * tbb;
        const float *dt = d + t * ng * QT, *mt = mn ? mn + t * nb * QT : NULL;
        long n0 = t * QT, nc = N - n0 < QT ? N - n0 : QT;
        for (long r0 = 0; r0 < M; r0 += QF_MAXR) {
            long rc = M - r0 < QF_MAXR ? M - r0 : QF_MAXR;
            const float *xr[QF_MAXR], *xs[QF_MAXR];
            for (int i = 0; i < QF_MAXR; i++) {
                long r = r0 + (i < rc ? i : rc - 1);
                xr[i] = x + r * K, xs[i] = sums + r * nb;
            }
            float out[QF_MAXR][QT];
            /* constant R and P per call: the accumulators stay in registers */
            switch (rc) {
            case 1: tile_f32(fmt, tq, dt, mt, nb, xr, xs, 1, 4, out); break;
            case 2: tile_f32(fmt, tq, dt, mt, nb, xr, xs, 2, 2, out); break;
            case 3: case 4: tile_f32(fmt, tq, dt, mt, nb, xr, xs, 4, 1, out); break;
            default: tile_f32(fmt, tq, dt, mt, nb, xr, xs, 8, 1, out); break;
            }
            for (long i = 0; i < rc; i++)
                for (long j = 0; j < nc; j++) y[(r0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
        }
    }
    if (sums != small) free(sums);
}

/* one instantiation per format: the format's branches fold away in the inner loops */
#define QFMT_DISPATCH(body)                                                                        \
    switch (fmt) {                                                                                 \
    case 0: body(0, x, M, qs, d, mn, bias, y, N, K, nt); break;                                    \
    case 1: body(1, x, M, qs, d, mn, bias, y, N, K, nt); break;                                    \
    case 3: body(3, x, M, qs, d, mn, bias, y, N, K, nt); break;                                    \
    default: body(4, x, M, qs, d, mn, bias, y, N, K, nt); break;                                   \
    }

static void qgemm_f32(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
                      const float *bias, float *y, long N, long K, int nt) {
    QFMT_DISPATCH(qgemm_f32_body)
}

/* ---- int8 activations with VNNI integer dot products ----------------------------------------- */
static int int8_activations = 0; /* set by kernels/cpu.py (PAGEDLLM_INT8_ACTIVATIONS, default on with VNNI) */
void pl_set_int8_activations(int on) { int8_activations = on; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
int pl_has_vnni(void) { return 1; }

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

static void quantize_row(const float *x, long K, uint8_t *mem, qrow *r) {
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

/* acc + (row n of block b) . (an input row's block b, both levels) * its scales, per lane n */
static inline __attribute__((always_inline)) __m512 block_acc(int fmt, int nib, const __m512i *w, const float *dt,
                                                               long b, const qrow *r, __m512 acc) {
    const int8_t *x1 = r->xq + b * QBLOCK, *x2 = r->xq2 + b * QBLOCK;
    const int32_t *c1 = r->c16 + 2 * b, *c2 = r->c16_2 + 2 * b;
    __m512 dxv = _mm512_set1_ps(r->dx[b]);
    if (fmt == 3) { /* two scale groups of 16 weights */
        acc = _mm512_fmadd_ps(levels_dot(w, x1, x2, 0, 4, c1[0], c2[0]),
                              _mm512_mul_ps(_mm512_loadu_ps(dt + 2 * b * QT), dxv), acc);
        return _mm512_fmadd_ps(levels_dot(w, x1, x2, 4, 8, c1[1], c2[1]),
                               _mm512_mul_ps(_mm512_loadu_ps(dt + (2 * b + 1) * QT), dxv), acc);
    }
    return _mm512_fmadd_ps(levels_dot(w, x1, x2, 0, 8, nib ? 0 : c1[0] + c1[1], nib ? 0 : c2[0] + c2[1]),
                           _mm512_mul_ps(_mm512_loadu_ps(dt + b * QT), dxv), acc);
}

/* acc[i] (lane n) += row n of block b . row i's activations (both levels), i < R */
#define QI_MAXR 8 /* rows per pass over a tile: 16 spilled accumulators on the 4-bit formats */
static inline __attribute__((always_inline)) void tile_block_i8(int fmt, const uint8_t *tb, const float *dt,
                                                                const float *mt, long b, const qrow *xr, int R,
                                                                __m512 *acc) {
    __m512i w[8];
    block_quads(fmt, tb, w);
    int nib = q_nib(fmt);
#pragma GCC unroll 16
    for (int i = 0; i < R; i++) {
        acc[i] = block_acc(fmt, nib, w, dt, b, xr + i, acc[i]);
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

static inline __attribute__((always_inline)) void qgemm_i8_body(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
                     const float *bias, float *y, long N, long K, int nt) {
    long nb = K / QBLOCK, tiles = (N + QT - 1) / QT, ng = q_groups(fmt, nb), tbb = q_tb(fmt);
    size_t rb = (qrow_bytes(K) + 63) & ~(size_t)63;
    uint8_t *mem = malloc(rb * M);
    qrow *rows = malloc(sizeof(qrow) * M);
    if (!mem || !rows) { /* out of memory: the float32 path needs no scratch */
        free(mem);
        free(rows);
        qgemm_f32(fmt, x, M, qs, d, mn, bias, y, N, K, nt);
        return;
    }
    /* a few rows (decode) are quantized by this thread before the team starts: a barrier costs more */
    if (M <= 4)
        for (long i = 0; i < M; i++) quantize_row(x + i * K, K, mem + i * rb, rows + i);
    #pragma omp parallel num_threads(nt)
    {
        if (M > 4) {
            #pragma omp for schedule(static)
            for (long i = 0; i < M; i++) quantize_row(x + i * K, K, mem + i * rb, rows + i);
        }
        #pragma omp for schedule(static)
        for (long t = 0; t < tiles; t++) {
            const uint8_t *tq = qs + t * nb * tbb;
            const float *dt = d + t * ng * QT, *mt = mn ? mn + t * nb * QT : NULL;
            long n0 = t * QT, nc = N - n0 < QT ? N - n0 : QT;
            for (long r0 = 0; r0 < M; r0 += QI_MAXR) {
                long rc = M - r0 < QI_MAXR ? M - r0 : QI_MAXR;
                float out[QI_MAXR][QT];
                const qrow *xr = rows + r0;
                switch (rc) { /* constant R per call: the accumulators stay in registers */
#define QI_CASE(r) case r: tile_i8(fmt, tq, dt, mt, nb, xr, r, out); break;
                QI_CASE(1) QI_CASE(2) QI_CASE(3) QI_CASE(4) QI_CASE(5) QI_CASE(6) QI_CASE(7)
                default: tile_i8(fmt, tq, dt, mt, nb, xr, 8, out); break;
#undef QI_CASE
                }
                for (long i = 0; i < rc; i++)
                    for (long j = 0; j < nc; j++)
                        y[(r0 + i) * N + n0 + j] = out[i][j] + (bias ? bias[n0 + j] : 0.0f);
            }
        }
    }
    free(mem);
    free(rows);
}
static void qgemm_i8(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
                     const float *bias, float *y, long N, long K, int nt) {
    QFMT_DISPATCH(qgemm_i8_body)
}
#else
int pl_has_vnni(void) { return 0; }
#endif

/* y [M, N] = x [M, K] W^T (+ bias) with a tiled packed weight (layouts above); any M. */
void pl_qgemm(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
              const float *bias, float *y, long N, long K, int nt) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (int8_activations) {
        qgemm_i8(fmt, x, M, qs, d, mn, bias, y, N, K, nt);
        return;
    }
#endif
    qgemm_f32(fmt, x, M, qs, d, mn, bias, y, N, K, nt);
}

/* weight row n (of the tiled matrix) as float32, into out [K] */
static void dequant_row(int fmt, const uint8_t *qs, const float *d, const float *mn, long n, long K, float *out) {
    long nb = K / QBLOCK, t = n / QT, lane = n % QT, ng = q_groups(fmt, nb), tbb = q_tb(fmt);
    const uint8_t *tq = qs + t * nb * tbb;
    const float *dt = d + t * ng * QT, *mt = mn ? mn + t * nb * QT : NULL;
    for (long b = 0; b < nb; b++)
        for (int c = 0; c < chunk_count(fmt); c++) {
            f16v w[8];
            int nw = chunk_q(fmt, tq + b * tbb, c, w), k0 = chunk_k0(fmt, c);
            long g = fmt == 3 ? 2 * b + (c >= 4) : b;
            for (int j = 0; j < nw; j++) /* the products' arithmetic: q * d (+ m), exact for every format */
                out[b * QBLOCK + k0 + j] = q_min(fmt) ? w[j][lane] * dt[g * QT + lane] + mt[b * QT + lane]
                                                      : w[j][lane] * dt[g * QT + lane];
        }
}

/* out [N, K] float32 = rows 0 .. N of the tiled weight (prefill multiplies it with oneDNN/MKL):
 * each chunk is unpacked once for its tile's 16 rows. */
void pl_qdequant(int fmt, const uint8_t *qs, const float *d, const float *mn, float *out, long N, long K, int nt) {
    long nb = K / QBLOCK, tiles = (N + QT - 1) / QT, ng = q_groups(fmt, nb), tbb = q_tb(fmt);
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (long t = 0; t < tiles; t++) {
        const uint8_t *tq = qs + t * nb * tbb;
        const float *dt = d + t * ng * QT, *mt = mn ? mn + t * nb * QT : NULL;
        long n0 = t * QT, nc = N - n0 < QT ? N - n0 : QT;
        for (long b = 0; b < nb; b++)
            for (int c = 0; c < chunk_count(fmt); c++) {
                f16v w[8];
                int nw = chunk_q(fmt, tq + b * tbb, c, w), k0 = chunk_k0(fmt, c);
                f16v dv = load16(dt + (fmt == 3 ? 2 * b + (c >= 4) : b) * QT);
                for (int j = 0; j < nw; j++) { /* the products' arithmetic: q * d (+ m), exact for every format */
                    f16v v = q_min(fmt) ? w[j] * dv + load16(mt + b * QT) : w[j] * dv;
                    for (long lane = 0; lane < nc; lane++) out[(n0 + lane) * K + b * QBLOCK + k0 + j] = v[lane];
                }
            }
    }
}

/* out [R, K] float32 = weight rows rows[0 .. R) (an embedding lookup from a packed table) */
void pl_qdequant_rows(int fmt, const uint8_t *qs, const float *d, const float *mn, const int64_t *rows, long R,
                      float *out, long K, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static) if (R > 8)
    for (long r = 0; r < R; r++) dequant_row(fmt, qs, d, mn, rows[r], K, out + r * K);
}
