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
 *   1 S8:  int8 q, d (Q8_0, int8 per channel). A tile-block is 512 bytes, 8 chunks of 64:
 *          chunk c, lane n, byte j holds weight 4c + j of row n.
 *   2 S6:  as S8, every q in -32..31 (Q5_0): the AVX2 kernels may offset it into unsigned bytes.
 *   3 S8H: as S8 with two scales per block, one per 16 weights (Q6_K).
 *   4 S8M: as S8 with d and m (Q5_1, Q5_K).
 *   5 IQ4, 6 E2M1: U4M's nibbles as indices into a codebook (quant_common.h q_codebook), w = cb[q] d
 *          (IQ4_NL, IQ4_XS; MXFP4): the file's 4 bits per weight stay 4 bits in memory.
 *   7 U6H: Q6_K in 6 bits (0.83 bytes per weight, as the file; S8H's bytes took 1.25): u = q + 32
 *          in 0..63, its low nibbles as U4M's (256 bytes), then 128 bytes of high 2-bit pairs (chunk
 *          c2 = 0, 1, lane n, byte j: bits 2k, 2k + 1 hold weight 16 c2 + 4 k + j's), then the two
 *          groups' int8 scales (32 bytes: group g, lane n at byte 16 g + n); d holds the float32
 *          super-block scale per 256 weights: w = (u - 32) sc d, the file's numbers exactly.
 * qs: [tiles][K/32][bytes per tile-block]; d, m: [tiles][groups per row][16] float32 (lane n = row
 * 16 t + n; U6H: [tiles][K/256][16]). N is padded to a multiple of 16 with zero rows.
 *
 * Every source is compiled once per instruction set (kernels/cpu.py ISA_FLAGS; the build is
 * chosen at run time from cpuid and XCR0, kernels/cpu_isa.c). Two ways to multiply, chosen at run time:
 * - float32 activations (this file, every build): each quad is widened to float32 in registers,
 *   scaled (and shifted by the min), and multiplied with the input in float32: results equal gguf's
 *   dequantization followed by a float32 matmul up to rounding (the reference);
 * - int8 activations (the avx2, avxvnni and avx512vnni builds, on unless
 *   PAGEDLLM_INT8_ACTIVATIONS=0): every input row is quantized to int8 per 32-block in two levels
 *   (the value, then its rounding residual at step / 256), and each quad is multiplied with byte
 *   dot products: vpdpbusd on 16 lanes (quant_avx512.c), or on 8 lanes twice per chunk with
 *   AVX-VNNI's vpdpbusd or AVX2's vpmaddubsw + vpmaddwd (quant_avx2.c); every row of every product
 *   (decode, batches, prefill) goes through the same code, so a row's result does not depend on
 *   what else is in the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_common.h"

typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));

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

/* scales i .. i + 15 as float32 (quant_common.h Q_HALF: float16 arrays converted) */
static inline f16v load_d(int fmt, const float *dt, long i) {
    if (!q_half(fmt)) return load16(dt + i);
    f16v v;
    for (int l = 0; l < 16; l++) v[l] = q_dval(fmt, dt, i + l);
    return v;
}

/* the 8 (nibbles) or 4 (bytes) weight vectors of chunk c of a tile-block, as q (unscaled float) */
static inline __attribute__((always_inline)) int chunk_q(int fmt, const uint8_t *tb, int c, f16v *w) {
    i16v v = load16i(tb + 64 * c);
    if (q_code(fmt)) {
        i16v cb;
        for (int i = 0; i < 16; i++) cb[i] = q_codebook[q_base(fmt) - 5][i];
        for (int j = 0; j < 4; j++) {
            w[j] = i2f(__builtin_shuffle(cb, (v >> (8 * j)) & 15));
            w[4 + j] = i2f(__builtin_shuffle(cb, (v >> (8 * j + 4)) & 15));
        }
        return 8;
    }
    if (q_u6(fmt)) { /* quads 2c and 2c + 1: pairs k = 2c % 4 and k + 1 of high chunk c / 2 */
        i16v hb = load16i(tb + U6_HIGH + 64 * (c / 2));
        int k = 2 * (c % 2);
        for (int j = 0; j < 4; j++) {
            w[j] = i2f(((v >> (8 * j)) & 15) | (((hb >> (8 * j + 2 * k)) & 3) << 4)) - 32.0f;
            w[4 + j] = i2f(((v >> (8 * j + 4)) & 15) | (((hb >> (8 * j + 2 * k + 2)) & 3) << 4)) - 32.0f;
        }
        return 8;
    }
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
/* the scale group of chunk c (the two-group formats: the first 16 weights, then the next) */
static inline int chunk_group(int fmt, int c) { return q_two_groups(fmt) ? c >= chunk_count(fmt) / 2 : 0; }

/* group g's scales of block b, lanes 0 .. 15: U6H's int8 scale times the super-block's d (exact in
 * float32: 8 + 11 significant bits), the others' d entry */
static inline f16v group_d(int fmt, const uint8_t *tb, const float *dt, long b, int g) {
    if (q_u6(fmt)) {
        f16v s;
        for (int l = 0; l < 16; l++) s[l] = (float)(int8_t)tb[U6_SC + 16 * g + l];
        return s * load16(dt + b / 8 * QT);
    }
    return load_d(fmt, dt, (q_two_groups(fmt) ? 2 * b + g : b) * QT);
}

/* acc[i] (lane n) += row n of block b of the tile . x_i[block b], i < R: float32 activations.
 * The scale is applied once per group (d * sum q x) and the min once per block (m * sum x, from
 * xs_i[b]); P partial sums per row keep enough independent FMA chains when R is small. */
#define QF_MAXR 8
static inline __attribute__((always_inline)) void tile_block_f32(int fmt, const uint8_t *tb, const float *dt,
                                                                 const float *mt, long b, const float *const *xr,
                                                                 const float *const *xs, int R, int P, f16v *acc) {
    int ngrp = q_two_groups(fmt) ? 2 : 1, per = chunk_count(fmt) / ngrp;
    /* unrolled: S8H's two groups otherwise kept their accumulators on the stack (7x slower) */
#pragma GCC unroll 2
    for (int g = 0; g < ngrp; g++) {
        f16v accq[QF_MAXR][4] = {};
#pragma GCC unroll 8
        for (int c = g * per; c < (g + 1) * per; c++) {
            f16v w[8];
            int nw = chunk_q(fmt, tb, c, w), k0 = chunk_k0(fmt, c);
            for (int i = 0; i < R; i++) {
                const float *xp = xr[i] + b * QBLOCK + k0;
                for (int j = 0; j < nw; j++) accq[i][j % P] += w[j] * xp[j];
            }
        }
        f16v dv = group_d(fmt, tb, dt, b, g);
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

/* y rows [0, M) x tile t (output rows n0 .. n0 + nc) of format fmt, a constant once inlined */
static inline __attribute__((always_inline)) void f32_tile_rows(int fmt, const uint8_t *tq, const float *dt,
                                                                const float *mt, long nb, const float *x,
                                                                const float *sums, long M, long K, const float *bias,
                                                                float *y, long N, long n0) {
    long nc = N - n0 < QT ? N - n0 : QT;
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

/* The format's switch sits below the parallel region (as in quant_i8_driver.h): GCC outlines an
 * OpenMP region before it inlines, so a format passed into it stays a run-time value there. S6
 * (code 2) is S8 here: the bytes are int8 alike. */
static void f32_tile_rows_fmt(int fmt, const uint8_t *tq, const float *dt, const float *mt, long nb, const float *x,
                              const float *sums, long M, long K, const float *bias, float *y, long N, long n0) {
    switch (fmt) {
    case 0: f32_tile_rows(0, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    case 1: case 2: f32_tile_rows(1, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    case 1 | Q_HALF: case 2 | Q_HALF: f32_tile_rows(1 | Q_HALF, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    case 5 | Q_HALF: f32_tile_rows(5 | Q_HALF, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    case 6 | Q_HALF: f32_tile_rows(6 | Q_HALF, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    case 3: f32_tile_rows(3, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    case 5: f32_tile_rows(5, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    case 6: f32_tile_rows(6, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    case 7: f32_tile_rows(7, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    default: f32_tile_rows(4, tq, dt, mt, nb, x, sums, M, K, bias, y, N, n0); break;
    }
}

void pl_qgemm_f32(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
                  const float *bias, float *y, long N, long K, int nt) {
    long nb = K / QBLOCK, tiles = (N + QT - 1) / QT, ng = q_groups(fmt, nb), tbb = q_tb(fmt);
    /* the input rows' block sums (for the mins): on the stack for decode-sized products */
    float small[1024], *sums = M * nb <= 1024 ? small : malloc(sizeof(float) * M * nb);
    if (!sums) { /* out of memory: row by row, each row's sums fit the stack when K <= 32768 */
        for (long i = 0; i < M && nb <= 1024; i++)
            pl_qgemm_f32(fmt, x + i * K, 1, qs, d, mn, bias, y + i * N, N, K, nt);
        return;
    }
    for (long i = 0; i < M * nb; i++) {
        float s = 0.0f;
        for (int c = 0; c < QBLOCK; c++) s += x[i * QBLOCK + c];
        sums[i] = s;
    }
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (long t = 0; t < tiles; t++)
        f32_tile_rows_fmt(fmt, qs + t * nb * tbb, q_dat(fmt, d, t * ng * QT), mn ? mn + t * nb * QT : NULL, nb, x, sums, M, K,
                          bias, y, N, t * QT);
    if (sums != small) free(sums);
}

/* ---- which product: set by kernels/cpu.py ----------------------------------------------------- */
static int int8_activations = 0; /* PAGEDLLM_INT8_ACTIVATIONS, default on where this build has int8 kernels */
void pl_set_int8_activations(int on) { int8_activations = on && QI8_ISA > 0; }

/* the instruction set this build was compiled for (quant_common.h QI8_ISA: 0 generic, 1 avx2,
 * 2 avxvnni, 3 avx512vnni); kernels/cpu.py checks it against the build it asked for */
int pl_isa(void) { return QI8_ISA; }

/* y [M, N] = x [M, K] W^T (+ bias) with a tiled packed weight (layouts above); any M. fmt | Q_LV1:
 * one-level int8 activations where the build has them (quant_common.h), else ignored. */
void pl_qgemm(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
              const float *bias, float *y, long N, long K, int nt) {
    int lv = fmt & Q_LV1 ? 1 : 2;
    fmt &= ~Q_LV1;
#if QI8_ISA > 0
    /* U6H has no AVX-512 VNNI kernel yet: kernels/cpu.py keeps Q6_K as S8H on that build */
    if (int8_activations && !(QI8_ISA == 3 && q_u6(fmt))) {
        pl_qgemm_i8(fmt, x, M, qs, d, mn, bias, y, N, K, nt, lv);
        return;
    }
#else
    (void)lv;
#endif
    pl_qgemm_f32(fmt, x, M, qs, d, mn, bias, y, N, K, nt);
}

/* weight row n (of the tiled matrix) as float32, into out [K] */
static void dequant_row(int fmt, const uint8_t *qs, const float *d, const float *mn, long n, long K, float *out) {
    long nb = K / QBLOCK, t = n / QT, lane = n % QT, ng = q_groups(fmt, nb), tbb = q_tb(fmt);
    const uint8_t *tq = qs + t * nb * tbb;
    const float *dt = q_dat(fmt, d, t * ng * QT), *mt = mn ? mn + t * nb * QT : NULL;
    for (long b = 0; b < nb; b++)
        for (int c = 0; c < chunk_count(fmt); c++) {
            f16v w[8];
            int nw = chunk_q(fmt, tq + b * tbb, c, w), k0 = chunk_k0(fmt, c);
            float dv = group_d(fmt, tq + b * tbb, dt, b, chunk_group(fmt, c))[lane];
            for (int j = 0; j < nw; j++) /* the products' arithmetic: q * d (+ m), exact for every format */
                out[b * QBLOCK + k0 + j] = q_min(fmt) ? w[j][lane] * dv + mt[b * QT + lane] : w[j][lane] * dv;
        }
}

/* out [N, K] float32 = rows 0 .. N of the tiled weight (prefill multiplies it with oneDNN/MKL):
 * each chunk is unpacked once for its tile's 16 rows. */
static inline __attribute__((always_inline)) void dequant_tile(int fmt, const uint8_t *tq, const float *dt,
                                                               const float *mt, long nb, long nc, long K, float *out) {
    long tbb = q_tb(fmt);
    for (long b = 0; b < nb; b++)
        for (int c = 0; c < chunk_count(fmt); c++) {
            f16v w[8];
            int nw = chunk_q(fmt, tq + b * tbb, c, w), k0 = chunk_k0(fmt, c);
            f16v dv = group_d(fmt, tq + b * tbb, dt, b, chunk_group(fmt, c));
            for (int j = 0; j < nw; j++) { /* the products' arithmetic: q * d (+ m), exact for every format */
                f16v v = q_min(fmt) ? w[j] * dv + load16(mt + b * QT) : w[j] * dv;
                for (long lane = 0; lane < nc; lane++) out[lane * K + b * QBLOCK + k0 + j] = v[lane];
            }
        }
}

/* the format's switch below the parallel region (see f32_tile_rows_fmt) */
static void dequant_tile_fmt(int fmt, const uint8_t *tq, const float *dt, const float *mt, long nb, long nc, long K,
                             float *out) {
    switch (fmt) {
    case 0: dequant_tile(0, tq, dt, mt, nb, nc, K, out); break;
    case 1: case 2: dequant_tile(1, tq, dt, mt, nb, nc, K, out); break;
    case 1 | Q_HALF: case 2 | Q_HALF: dequant_tile(1 | Q_HALF, tq, dt, mt, nb, nc, K, out); break;
    case 5 | Q_HALF: dequant_tile(5 | Q_HALF, tq, dt, mt, nb, nc, K, out); break;
    case 6 | Q_HALF: dequant_tile(6 | Q_HALF, tq, dt, mt, nb, nc, K, out); break;
    case 3: dequant_tile(3, tq, dt, mt, nb, nc, K, out); break;
    case 5: dequant_tile(5, tq, dt, mt, nb, nc, K, out); break;
    case 6: dequant_tile(6, tq, dt, mt, nb, nc, K, out); break;
    case 7: dequant_tile(7, tq, dt, mt, nb, nc, K, out); break;
    default: dequant_tile(4, tq, dt, mt, nb, nc, K, out); break;
    }
}

void pl_qdequant(int fmt, const uint8_t *qs, const float *d, const float *mn, float *out, long N, long K, int nt) {
    long nb = K / QBLOCK, tiles = (N + QT - 1) / QT, ng = q_groups(fmt, nb), tbb = q_tb(fmt);
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (long t = 0; t < tiles; t++)
        dequant_tile_fmt(fmt, qs + t * nb * tbb, q_dat(fmt, d, t * ng * QT), mn ? mn + t * nb * QT : NULL, nb,
                         N - t * QT < QT ? N - t * QT : QT, K, out + t * QT * K);
}

/* out [R, K] float32 = weight rows rows[0 .. R) (an embedding lookup from a packed table) */
void pl_qdequant_rows(int fmt, const uint8_t *qs, const float *d, const float *mn, const int64_t *rows, long R,
                      float *out, long K, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static) if (R > 8)
    for (long r = 0; r < R; r++) dequant_row(fmt, qs, d, mn, rows[r], K, out + r * K);
}
