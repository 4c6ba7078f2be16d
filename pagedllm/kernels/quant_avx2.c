/* int8 activations x packed tiles on AVX2 and AVX-VNNI (issue 37): 32-byte vectors, so a tile's 16
 * rows are two halves of 8 lanes (rows 8h .. 8h + 7 = bytes 32h .. 32h + 31 of every 64-byte chunk),
 * one 32-bit lane per row as on AVX-512 (layouts and the two-level activations: quant_kernels.c).
 *
 * The byte dot product is the one difference between the two builds:
 * - AVX-VNNI (QI8_ISA 2): vpdpbusd on YMM, 4 unsigned x signed byte products summed into each int32
 *   lane, with no intermediate saturation.
 * - AVX2 (QI8_ISA 1): vpmaddubsw multiplies unsigned by signed bytes and sums adjacent pairs into
 *   int16 WITH saturation, then vpmaddwd by ones sums int16 pairs into int32. The unsigned operand
 *   is the weight: nibbles (0..15), Q5_1/Q5_K quants (0..31), and the small signed ones (Q5_0,
 *   Q6_K: -32..31) plus 32 (0..63), MXFP4's doubled e2m1 codes (-12..12) plus 12 (0..24: its decode
 *   products 1.9-2.2x the int16 path below); the activations are int8 (-127..127, the second level
 *   -128..127). A pair is then at most 2 * 63 * 128 = 16128, so 2 (offset quants), 4 (0..31: 7936
 *   each) or 8 (nibbles: 3840) vpmaddubsw results add up exactly in int16 before one vpmaddwd. The offset's
 *   share is subtracted once per group: off * (256 * sum q1 + sum q2) of the input row, precomputed
 *   when the row is quantized. Full-range int8 weights (Q8_0, int8 per channel, the IQ4 codebook
 *   values looked up from their nibbles with vpshufb) would saturate vpmaddubsw as unsigned; they are sign-extended to int16 instead and multiplied (vpmaddwd) with
 *   both levels at once, X = 256 q1 + q2 (|X| <= 32640 fits int16; the int32 sum is then exactly
 *   256 s1 + s2): half the instructions of moving the sign onto the activations (vpsignb) and
 *   multiplying each level apart. vpmaddwd leaves a row's sum in two lanes (weights 0-1 and 2-3 of
 *   a quad), joined per block with vphaddd.
 */
#include "quant_common.h"
#if QI8_ISA == 1 || QI8_ISA == 2
#include <immintrin.h>
#include <string.h>

/* One input row, quantized (x ~ dx * 256 * (q1 + q2 / 256) per 32-block): xq, xq2 [K] int8 levels;
 * dx [K/32] the block's step / 256 (the unit of 256 s1 + s2); sxd [K/32] the block's sum as
 * quantized (for the mins); c16 [K/16] 256 * sum q1 + sum q2 per 16 values (for the offsets). */
typedef struct {
    int8_t *xq, *xq2;
    float *dx, *sxd;
    int32_t *c16;
    int16_t *xw; /* [K] 256 q1 + q2 (full-range S8 on AVX2) */
} qrow;

static size_t qrow_bytes(long K) {
    return 4 * K + (2 * sizeof(float) + 2 * sizeof(int32_t)) * (K / QBLOCK);
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static inline float hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* 32 int32 in four vectors (each within int8) -> 32 int8 at p, in order: the packs work within
 * 128-bit lanes, leaving 4-byte groups in the order 0 4 1 5 2 6 3 7 of the sources' halves */
static inline void store_i8(int8_t *p, const __m256i *v) {
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)p, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* The two levels of quant_avx512.c's quantize_row, the same numbers: round to nearest even, step
 * max|x| / 127, the residual at step / 256 clamped to -128..127; and X = 256 q1 + q2. lv 1: the
 * residual is left zero (one level, llama.cpp's precision: prefill-sized products, Q_LV1). */
static void quantize_row(const float *x, long K, uint8_t *mem, qrow *r, int lv) {
    long nb = K / QBLOCK;
    r->xq = (int8_t *)mem;
    r->xq2 = r->xq + K;
    r->dx = (float *)(r->xq2 + K);
    r->sxd = r->dx + nb;
    r->c16 = (int32_t *)(r->sxd + nb);
    r->xw = (int16_t *)(r->c16 + 2 * nb);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-128);
    for (long b = 0; b < nb; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + b * QBLOCK + 8 * j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        }
        float amax = hmax_ps(m);
        float dx = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f, id2 = amax > 0.0f ? 256.0f / dx : 0.0f;
        __m256i q[4], p[4];
        for (int j = 0; j < 4; j++) {
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
            __m256 res = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[j]), _mm256_set1_ps(dx), v[j]);
            p[j] = lv == 1 ? _mm256_setzero_si256()
                           : _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(res, _mm256_set1_ps(id2))), hi), lo);
        }
        store_i8(r->xq + b * QBLOCK, q);
        store_i8(r->xq2 + b * QBLOCK, p);
        for (int j = 0; j < 4; j += 2) { /* the packs interleave 128-bit lanes: vpermq puts them back */
            __m256i w0 = _mm256_add_epi32(_mm256_slli_epi32(q[j], 8), p[j]);
            __m256i w1 = _mm256_add_epi32(_mm256_slli_epi32(q[j + 1], 8), p[j + 1]);
            _mm256_storeu_si256((__m256i *)(r->xw + b * QBLOCK + 8 * j),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(w0, w1), _MM_SHUFFLE(3, 1, 2, 0)));
        }
        for (int g = 0; g < 2; g++)
            r->c16[2 * b + g] = 256 * hsum_i32(_mm256_add_epi32(q[2 * g], q[2 * g + 1])) +
                                hsum_i32(_mm256_add_epi32(p[2 * g], p[2 * g + 1]));
        r->dx[b] = dx / 256.0f;
        r->sxd[b] = r->dx[b] * (float)(r->c16[2 * b] + r->c16[2 * b + 1]);
    }
}

/* what this build adds to a format's quants to make them the unsigned operand (see the top) */
static inline int q_off(int fmt) {
    if (q_base(fmt) == 2 || q_base(fmt) == 3)
        return 32;
    if (q_u6(fmt)) /* U6H's quants are stored + 32 already */
        return 32;
    if (q_base(fmt) == 6 && QI8_ISA == 1) /* E2M1 (-12..12) + 12: vpmaddubsw, both levels */
        return 12;
    return (q_base(fmt) == 1 || q_code(fmt)) && QI8_ISA == 2 ? 128 : 0;
}

/* the formats whose bytes span int8 and so take the int16 product on AVX2 (s8_dot): S8 and IQ4's
 * codebook (its values reach -127 and 113) */
static inline int q_wide(int fmt) {
    return QI8_ISA == 1 && (q_base(fmt) == 1 || q_code(fmt)) && q_off(fmt) != 12;
}

/* scales i .. i + 7 (float32 or float16: quant_common.h Q_HALF) */
static inline __m256 ld_d(int fmt, const float *dt, long i) {
    return q_half(fmt) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)dt + i)))
                       : _mm256_loadu_ps(dt + i);
}

/* U6H's group g scales of block b, rows 8h .. 8h + 7: int8 scale times the super-block's d */
static inline __m256 u6_d(const uint8_t *tb, const float *dt, long b, int g, int h) {
    __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tb + U6_SC + 16 * g + 8 * h)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(sc), _mm256_loadu_ps(dt + b / 8 * QT + 8 * h));
}

/* The 8 quads of half h of a tile-block (quad q: weights 4q .. 4q + 3 of rows 8h .. 8h + 7): u[q]
 * the unsigned operand (not for full-range S8 on AVX2: s8_dot reads the tile itself). */
static inline __attribute__((always_inline)) void half_quads(int fmt, const uint8_t *tb, int h, __m256i *u) {
    if (q_u6(fmt)) { /* nibble | high pair << 4: quad q's pair is bits 2 (q % 4) of high chunk q / 4 */
        const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
        for (int c2 = 0; c2 < 2; c2++) {
            __m256i hb = _mm256_loadu_si256((const __m256i *)(tb + U6_HIGH + 64 * c2 + 32 * h));
            __m256i hi[4] = {_mm256_and_si256(_mm256_slli_epi16(hb, 4), m30), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30),
                             _mm256_and_si256(hb, m30), _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)};
            for (int cc = 0; cc < 2; cc++) {
                int c = 2 * c2 + cc;
                __m256i v = _mm256_loadu_si256((const __m256i *)(tb + 64 * c + 32 * h));
                u[2 * c] = _mm256_or_si256(_mm256_and_si256(v, m4), hi[2 * cc]);
                u[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), hi[2 * cc + 1]);
            }
        }
        return;
    }
    if (q_nib(fmt)) {
        const __m256i m4 = _mm256_set1_epi8(15);
        for (int c = 0; c < 4; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(tb + 64 * c + 32 * h));
            u[2 * c] = _mm256_and_si256(v, m4);
            u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        }
        if (q_code(fmt)) { /* the codebook's values by vpshufb: signed (AVX2), + 128 (AVX-VNNI) */
            __m256i cb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q_codebook[q_base(fmt) - 5]));
            if (q_off(fmt) == 128) cb = _mm256_xor_si256(cb, _mm256_set1_epi8((char)0x80));
            if (q_off(fmt) == 12) cb = _mm256_add_epi8(cb, _mm256_set1_epi8(12));
            for (int q = 0; q < 8; q++) u[q] = _mm256_shuffle_epi8(cb, u[q]);
        }
        return;
    }
    int off = q_off(fmt);
    if (q_base(fmt) == 1 && QI8_ISA == 1)
        return;
    for (int c = 0; c < 8; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(tb + 64 * c + 32 * h));
        if (off == 128)
            u[c] = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
        else
            u[c] = off ? _mm256_add_epi8(v, _mm256_set1_epi8((char)off)) : v;
    }
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* per lane (row): sum over quads [q0, q1) of u[q] . x[4q .. 4q + 3], in int32 */
static inline __attribute__((always_inline)) __m256i quads_dot(int fmt, const __m256i *u, const int8_t *x, int q0,
                                                               int q1) {
#if QI8_ISA == 2
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256(); /* two chains: vpdpbusd's latency */
    for (int q = q0; q < q1; q += 2) {
        a = _mm256_dpbusd_avx_epi32(a, u[q], bcast4(x + 4 * q));
        b = _mm256_dpbusd_avx_epi32(b, u[q + 1], bcast4(x + 4 * q + 4));
    }
    (void)fmt;
    return _mm256_add_epi32(a, b);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    int chain = q_base(fmt) == 0 ? 8 : q_base(fmt) == 4 ? 4 : 2; /* exact int16 sums (see the top) */
    __m256i acc = _mm256_setzero_si256();
    for (int q = q0; q < q1; q += chain) {
        __m256i p = _mm256_setzero_si256();
        for (int j = q; j < q + chain; j++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[j], bcast4(x + 4 * j)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
    return acc;
#endif
}

/* full-range S8 on AVX2, rows 8h .. 8h + 7 of tile-block tb: 256 s1 + s2 per lane (see the top) */
static inline __attribute__((always_inline)) __m256i s8_dot(const uint8_t *tb, int h, const int16_t *xw) {
    __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
    for (int q = 0; q < 8; q++) {
        const uint8_t *p = tb + 64 * q + 32 * h;
        int64_t x4;
        memcpy(&x4, xw + 4 * q, 8);
        __m256i xb = _mm256_set1_epi64x(x4);
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)), xb));
        c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16))), xb));
    }
    /* a: rows 0-3, c: rows 4-7, two lanes each; vphaddd leaves rows 0 1 4 5 | 2 3 6 7 */
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a, c), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

/* s8_dot over quads already in registers (a codebook format's values, signed bytes) */
static inline __attribute__((always_inline)) __m256i s8_dot_u(const __m256i *u, const int16_t *xw) {
    __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
    for (int q = 0; q < 8; q++) {
        int64_t x4;
        memcpy(&x4, xw + 4 * q, 8);
        __m256i xb = _mm256_set1_epi64x(x4);
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(u[q])), xb));
        c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(u[q], 1)), xb));
    }
    return _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a, c), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

/* the group scales of half h of block b: ds[g], g < 2 (a format's one group: ds[0]) */
static inline __attribute__((always_inline)) void half_scales(int fmt, const uint8_t *tb, const float *dt, long b,
                                                              int h, __m256 *ds) {
    int ng = q_two_groups(fmt) ? 2 : 1;
    for (int g = 0; g < ng; g++)
        ds[g] = q_u6(fmt) ? u6_d(tb, dt, b, g, h) : ld_d(fmt, dt, (ng == 2 ? 2 * b + g : b) * QT + 8 * h);
}

/* acc + (rows 8h .. 8h + 7 of block b) . (row r's block b, both levels; fmt | Q_LV1: the first) x
 * scales ds (+ min x block sum): 256 s1 + s2 - off * c combined exactly in int32, then one
 * conversion and one scale per group */
static inline __attribute__((always_inline)) __m256 half_block(int fmt, const __m256i *u, const uint8_t *tb,
                                                               const __m256 *ds, const float *mt, long b, int h,
                                                               const qrow *r, __m256 acc) {
    const int8_t *x1 = r->xq + b * QBLOCK, *x2 = r->xq2 + b * QBLOCK;
    const int32_t *c = r->c16 + 2 * b;
    __m256 dxv = _mm256_set1_ps(r->dx[b]);
    int off = q_off(fmt), ng = q_two_groups(fmt) ? 2 : 1, per = 8 / ng;
    for (int g = 0; g < ng; g++) {
        __m256i v;
        if (q_wide(fmt))
            v = q_code(fmt) ? s8_dot_u(u, r->xw + b * QBLOCK) : s8_dot(tb, h, r->xw + b * QBLOCK);
        else if (fmt & Q_LV1) /* one level: the residual is zero, half the byte products */
            v = _mm256_slli_epi32(quads_dot(fmt, u, x1, g * per, (g + 1) * per), 8);
        else
            v = _mm256_add_epi32(_mm256_slli_epi32(quads_dot(fmt, u, x1, g * per, (g + 1) * per), 8),
                                 quads_dot(fmt, u, x2, g * per, (g + 1) * per));
        if (off)
            v = _mm256_sub_epi32(v, _mm256_set1_epi32(off * (ng == 2 ? c[g] : c[0] + c[1])));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(ds[g], dxv), acc);
    }
    if (q_min(fmt))
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(mt + b * QT + 8 * h), _mm256_set1_ps(r->sxd[b]), acc);
    return acc;
}

/* Several rows (batches, prefill) of the byte formats: the weights sign-extended to int16 once per
 * quad and shared by the R rows, each row's two levels at once (X = 256 q1 + q2, as s8_dot): fewer
 * instructions per row than vpmaddubsw per level (measured 10-25% faster products). The integer sums are the same exact numbers as
 * the one-row path's, scaled in the same order, so a row's result does not depend on R. */
#if QI8_ISA == 2
#define DOT16(acc, w, x) _mm256_dpwssd_avx_epi32(acc, w, x)
#else
#define DOT16(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
#endif
#define QI_MAXR 6 /* rows per pass: 2 int32 and 1 float accumulators each, 2 weight vectors (one-level:
                     * 6 float accumulators beside the 8 quads; 4: 7% slower, 8: spilled) */
static inline __attribute__((always_inline)) void half_block_rows(int fmt, const uint8_t *tb, int h, const float *dt,
                                                                  const float *mt, long b, const qrow *xr, int R,
                                                                  __m256 *acc) {
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    int ng = q_base(fmt) == 3 ? 2 : 1, per = 8 / ng;
    for (int g = 0; g < ng; g++) {
        __m256i a[QI_MAXR], c[QI_MAXR];
        for (int i = 0; i < R; i++) a[i] = c[i] = _mm256_setzero_si256();
        for (int q = g * per; q < (g + 1) * per; q++) {
            const uint8_t *p = tb + 64 * q + 32 * h;
            __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
            __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
            for (int i = 0; i < R; i++) {
                int64_t x4;
                memcpy(&x4, xr[i].xw + b * QBLOCK + 4 * q, 8);
                __m256i xb = _mm256_set1_epi64x(x4);
                a[i] = DOT16(a[i], wa, xb);
                c[i] = DOT16(c[i], wb, xb);
            }
        }
        __m256 dv = ld_d(fmt, dt, (ng == 2 ? 2 * b + g : b) * QT + 8 * h);
        for (int i = 0; i < R; i++) {
            __m256i v = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a[i], c[i]), order);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dv, _mm256_set1_ps(xr[i].dx[b])), acc[i]);
        }
    }
    if (q_min(fmt))
        for (int i = 0; i < R; i++)
            acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(mt + b * QT + 8 * h), _mm256_set1_ps(xr[i].sxd[b]), acc[i]);
}

/* out[i] = tile . input row i, i < R. One row (decode), and the nibble format (whose int16 widening
 * costs more than it saves: measured), take both halves per block with half_block, so the tile
 * streams by once; several rows of the byte formats take one half at a time (half_block_rows; the
 * second pass finds the tile in L1/L2), so that their accumulators fit the 16 registers. Several rows
 * in one level (fmt | Q_LV1, any format but the int16 ones) take one half at a time with half_block. */
static inline __attribute__((always_inline)) void tile_i8(int fmt, const uint8_t *tq, const float *dt,
                                                          const float *mt, long nb, const qrow *xr, int R,
                                                          float out[QI_MAXR][QT]) {
    long tbb = q_tb(fmt);
    if ((fmt & Q_LV1) && R > 1) { /* one level: vpmaddubsw, one half at a time (R accumulators live) */
        for (int h = 0; h < 2; h++) {
            __m256 acc[QI_MAXR];
            for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
            for (long b = 0; b < nb; b++) {
                const uint8_t *tb = tq + b * tbb;
                if (h == 0)
                    for (long c = 0; c < tbb; c += 64) __builtin_prefetch(tb + PF_BYTES + c, 0, 3);
                __m256i u[8];
                __m256 ds[2];
                half_quads(fmt, tb, h, u);
                half_scales(fmt, tb, dt, b, h, ds); /* once for the R rows */
                for (int i = 0; i < R; i++) acc[i] = half_block(fmt, u, tb, ds, mt, b, h, xr + i, acc[i]);
            }
            for (int i = 0; i < R; i++) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);
        }
        return;
    }
    if (R == 1 || q_nib(fmt)) {
        __m256 acc[QI_MAXR][2];
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (long b = 0; b < nb; b++) {
            const uint8_t *tb = tq + b * tbb;
            for (long c = 0; c < tbb; c += 64) __builtin_prefetch(tb + PF_BYTES + c, 0, 3);
            for (int h = 0; h < 2; h++) {
                __m256i u[8];
                __m256 ds[2];
                half_quads(fmt, tb, h, u);
                half_scales(fmt, tb, dt, b, h, ds);
                for (int i = 0; i < R; i++) acc[i][h] = half_block(fmt, u, tb, ds, mt, b, h, xr + i, acc[i][h]);
            }
        }
        for (int i = 0; i < R; i++) {
            _mm256_storeu_ps(out[i], acc[i][0]);
            _mm256_storeu_ps(out[i] + 8, acc[i][1]);
        }
        return;
    }
    for (int h = 0; h < 2; h++) {
        __m256 acc[QI_MAXR];
        for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
        for (long b = 0; b < nb; b++) {
            if (h == 0)
                for (long c = 0; c < tbb; c += 64) __builtin_prefetch(tq + b * tbb + PF_BYTES + c, 0, 3);
            half_block_rows(fmt, tq + b * tbb, h, dt, mt, b, xr, R, acc);
        }
        for (int i = 0; i < R; i++) _mm256_storeu_ps(out[i] + 8 * h, acc[i]);
    }
}

#define QI8_ONE_LEVEL 1
#include "quant_i8_driver.h"
#endif
