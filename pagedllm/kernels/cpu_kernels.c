/* pagedllm CPU kernels: float32, OpenMP, compiled at first use with -march=native.
 *
 * Why these exist: a decode step of a small model runs about forty torch ops per
 * layer, each a few microseconds of dispatch and a pass over memory. These kernels
 * fuse the elementwise chains (RMSNorm with the residual add, rotary embedding,
 * SiLU-and-multiply), write K/V into the paged cache, and compute decode attention
 * straight through the block tables, with no gathered copy of the context.
 *
 * Layouts (all float32, row-major, index arrays int64):
 *   KV cache per layer: [num_kv_heads, num_slots, head_dim], num_slots = num_blocks * block_size.
 *   Block tables: [num_decodes, table_stride], entries are block ids.
 * Exponentials use exp_approx (relative error below 2e-7) so loops vectorize without -ffast-math.
 */
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
#endif
#define VEC_LEN (VEC_BYTES / 4)
typedef float vec __attribute__((vector_size(VEC_BYTES)));

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

#define PAR_MIN_WORK 32768 /* below this many float ops a parallel region costs more than it saves */

/* exp(x) = 2^n * 2^f with y = x log2(e), n = round(y), f = y - n in [-0.5, 0.5]; x clamped to [-87, 88].
 * Written with arithmetic only (rounding by the 1.5 * 2^23 trick, the exponent through an int
 * conversion) so that loops calling it vectorize; needs IEEE float semantics (no -ffast-math). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float y = x * 1.44269504088896341f;
    float n = (y + 12582912.0f) - 12582912.0f;
    float f = y - n;
    /* Taylor series of 2^f = e^(f ln 2) to degree 6: relative error below 1.7e-7 on [-0.5, 0.5] */
    float p = 1.54035304e-4f;
    p = p * f + 1.33335581e-3f;
    p = p * f + 9.61812911e-3f;
    p = p * f + 5.55041087e-2f;
    p = p * f + 2.40226507e-1f;
    p = p * f + 6.93147181e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out[t] = w * normalize(src[t]); src = x, or residual after residual += x when residual != NULL. */
void pl_rms_norm(const float *x, float *residual, const float *w, float *out, long T, long H, float eps, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T * H >= PAR_MIN_WORK)
    for (long t = 0; t < T; t++) {
        const float *src = x + t * H;
        if (residual) {
            float *r = residual + t * H;
#pragma omp simd
            for (long h = 0; h < H; h++) r[h] += src[h];
            src = r;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (long h = 0; h < H; h++) ss += src[h] * src[h];
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        float *o = out + t * H;
#pragma omp simd
        for (long h = 0; h < H; h++) o[h] = w[h] * (src[h] * inv);
    }
}

/* Rotate, in place, the first nheads heads of each row (rotate-half convention of transformers'
 * Llama): x[i] = x[i] cos[i] - x[i + D/2] sin[i];  x[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]. */
void pl_rope(float *x, long row_stride, long nheads, const int64_t *pos, const float *cos_t, const float *sin_t,
             long T, long D, int nt) {
    long half = D / 2;
#pragma omp parallel for num_threads(nt) schedule(static) if (T * nheads * D >= PAR_MIN_WORK)
    for (long t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;
        for (long h = 0; h < nheads; h++) {
            float *v = x + t * row_stride + h * D;
#pragma omp simd
            for (long i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* Copy each token's K and V heads into its cache slot; negative slots are skipped (padding). */
void pl_write_kv(const float *key, long k_ts, long k_hs, const float *value, long v_ts, long v_hs,
                 const int64_t *slots, float *kc, float *vc, long T, long KVH, long D, long num_slots) {
    for (long t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        for (long g = 0; g < KVH; g++) {
            memcpy(kc + (g * num_slots + slots[t]) * D, key + t * k_ts + g * k_hs, D * sizeof(float));
            memcpy(vc + (g * num_slots + slots[t]) * D, value + t * v_ts + g * v_hs, D * sizeof(float));
        }
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] for gu [T, 2I]. */
void pl_silu_mul(const float *gu, float *out, long T, long I, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (T * I >= PAR_MIN_WORK)
    for (long t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (long i = 0; i < I; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* Scores of one query head against a tile of QK_TILE keys: lane t of a[t] holds partial products
 * of key t; reduce_tile writes the QK_TILE totals. Summing all lanes of each vector separately costs
 * a shuffle chain per key; transposing the tile in registers shares it across the keys. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define QK_TILE 16
static inline void reduce_tile(const vec *a, float *dst) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* each 128-bit lane: keys 2i, 2i+1 interleaved, pairs of lanes summed */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps((__m512)a[2 * i], (__m512)a[2 * i + 1]),
                             _mm512_unpackhi_ps((__m512)a[2 * i], (__m512)a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* each 128-bit lane: keys 4i .. 4i+3, that lane's partial sums */
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* add 128-bit lanes in pairs */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1))));
}
#elif defined(__AVX2__)
#include <immintrin.h>
#define QK_TILE 8
static inline void reduce_tile(const vec *a, float *dst) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = _mm256_add_ps(_mm256_unpacklo_ps((__m256)a[2 * i], (__m256)a[2 * i + 1]),
                             _mm256_unpackhi_ps((__m256)a[2 * i], (__m256)a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
        c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20),
                                        _mm256_permute2f128_ps(c[0], c[1], 0x31)));
}
#else
#define QK_TILE 1
static inline void reduce_tile(const vec *a, float *dst) {
    float s = 0.0f;
    for (int i = 0; i < VEC_LEN; i++) s += a[0][i];
    dst[0] = s;
}
#endif

static inline const float *slot_row(const float *cache, const int64_t *table, long t, long block_size, long D) {
    return cache + (table[t / block_size] * block_size + t % block_size) * D;
}

/* Ask for the rows of keys [t, min(t + count, L)) ahead of use: blocks sit anywhere in the cache,
 * so the hardware prefetcher loses the stream at every block edge (measured: 64 decodes x 256
 * keys per layer, 2.2 ms without, 1.5 ms with, on shuffled blocks; 1.35 -> 0.93 ms on ordered ones). */
static inline void prefetch_rows(const float *cache, const int64_t *table, long t, long count, long L,
                                 long block_size, long D) {
    for (long i = t; i < t + count && i < L; i++) {
        const float *row = slot_row(cache, table, i, block_size, D);
        for (long d = 0; d < D; d += 64 / sizeof(float)) __builtin_prefetch(row + d);
    }
}

/* scores[j * n + i] = scale * q_j . k_(first + i) for the G heads of a group, n = L - first. */
static void group_scores(const float *q, long q_hs, const int64_t *table, long first, long L, const float *kc,
                         long block_size, long D, long G, float scale, float *scores) {
    long n = L - first;
    if (D % VEC_LEN != 0 || QK_TILE == 1) { /* plain dot products */
        for (long t = first; t < L; t++) {
            const float *k = slot_row(kc, table, t, block_size, D);
            for (long j = 0; j < G; j++) {
                const float *qj = q + j * q_hs;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (long d = 0; d < D; d++) s += qj[d] * k[d];
                scores[j * n + (t - first)] = s * scale;
            }
        }
        return;
    }
    for (long t0 = first; t0 < L; t0 += QK_TILE) {
        long m = L - t0 < QK_TILE ? L - t0 : QK_TILE;
        const float *k[QK_TILE];
        for (long i = 0; i < QK_TILE; i++) k[i] = slot_row(kc, table, t0 + (i < m ? i : 0), block_size, D);
        prefetch_rows(kc, table, t0 + QK_TILE, QK_TILE, L, block_size, D);
        for (long j = 0; j < G; j++) {
            const float *qj = q + j * q_hs;
            vec a[QK_TILE];
            float tile[QK_TILE];
            for (int i = 0; i < QK_TILE; i++) a[i] = (vec){0};
            for (long d = 0; d < D; d += VEC_LEN) {
                vec qv = load_vec(qj + d);
                for (int i = 0; i < QK_TILE; i++) a[i] += qv * load_vec(k[i] + d);
            }
            reduce_tile(a, tile);
            for (long i = 0; i < m; i++) scores[j * n + (t0 - first) + i] = tile[i] * scale;
        }
    }
}

/* One (decode, KV head) task: the G query heads of group g attend over keys [first, L). */
static void decode_task(const float *q, long q_hs, const int64_t *table, long first, long L, const float *kc,
                        const float *vc, long block_size, long D, long G, float scale, float softcap,
                        float *scores, float *out, long out_hs) {
    long n = L - first;
    group_scores(q, q_hs, table, first, L, kc, block_size, D, G, scale, scores);
    for (long j = 0; j < G; j++) {
        float *sj = scores + j * n, m = -INFINITY, sum = 0.0f;
        if (softcap > 0.0f)
            for (long i = 0; i < n; i++) sj[i] = softcap * tanhf(sj[i] / softcap);
        for (long i = 0; i < n; i++) m = sj[i] > m ? sj[i] : m;
#pragma omp simd reduction(+ : sum)
        for (long i = 0; i < n; i++) {
            sj[i] = exp_approx(sj[i] - m);
            sum += sj[i];
        }
        float inv = 1.0f / sum;
#pragma omp simd
        for (long i = 0; i < n; i++) sj[i] *= inv;
        memset(out + j * out_hs, 0, D * sizeof(float));
    }
    /* four keys per pass over each output row: a quarter of the output loads and stores */
    long t = first;
    for (; t + 4 <= L; t += 4) {
        const float *v0 = slot_row(vc, table, t, block_size, D), *v1 = slot_row(vc, table, t + 1, block_size, D);
        const float *v2 = slot_row(vc, table, t + 2, block_size, D), *v3 = slot_row(vc, table, t + 3, block_size, D);
        prefetch_rows(vc, table, t + 16, 4, L, block_size, D);
        for (long j = 0; j < G; j++) {
            const float *p = scores + j * n + (t - first);
            float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3], *o = out + j * out_hs;
#pragma omp simd
            for (long d = 0; d < D; d++) o[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d];
        }
    }
    for (; t < L; t++) {
        const float *v = slot_row(vc, table, t, block_size, D);
        for (long j = 0; j < G; j++) {
            float p = scores[j * n + (t - first)], *o = out + j * out_hs;
#pragma omp simd
            for (long d = 0; d < D; d++) o[d] += p * v[d];
        }
    }
}

/* Decode attention through the block tables.
 * q: query rows (row stride q_ts, head stride q_hs, H heads); rows[b] is decode b's row.
 * tables: [B, table_stride]; seq_lens[b]: context length including the new token.
 * out: [T, H, D] contiguous rows (row stride H * D), written at rows[b].
 * window > 0: keys j >= seq_len - window only (sliding window); softcap > 0: Gemma 2 capping. */
void pl_decode_attention(const float *q, long q_ts, long q_hs, const int64_t *rows, const int64_t *tables,
                         long table_stride, const int64_t *seq_lens, const float *kc, const float *vc,
                         long num_slots, long block_size, long B, long H, long KVH, long D, float scale,
                         long window, float softcap, float *out, int nt) {
    long G = H / KVH, max_len = 1, work = 0;
    for (long b = 0; b < B; b++) {
        max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
        work += seq_lens[b];
    }
    work *= H * D * 2;
#pragma omp parallel num_threads(nt) if (work >= PAR_MIN_WORK && B * KVH > 1)
    {
        float *scores = malloc(sizeof(float) * G * max_len);
#pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < B * KVH; task++) {
            long b = task / KVH, g = task % KVH, L = seq_lens[b];
            long first = (window > 0 && L > window) ? L - window : 0;
            decode_task(q + rows[b] * q_ts + g * G * q_hs, q_hs, tables + b * table_stride, first, L,
                        kc + g * num_slots * D, vc + g * num_slots * D, block_size, D, G, scale, softcap,
                        scores, out + rows[b] * H * D + g * G * D, D);
        }
        free(scores);
    }
}

/* y[n] = dot(W[n], x) + b[n] for rows n0 .. n0 + nr - 1 (nr <= GEMV_ROWS). */
static void gemv_rows(const float *x, const float *W, const float *b, float *y, long K, long n0, long nr) {
    vec acc[GEMV_ROWS];
    const float *w[GEMV_ROWS];
    for (int r = 0; r < GEMV_ROWS; r++) {
        acc[r] = (vec){0};
        w[r] = W + (n0 + (r < nr ? r : 0)) * K; /* rows past the end repeat row n0, unused */
    }
    long kv = K / VEC_LEN * VEC_LEN;
    for (long k = 0; k < kv; k += VEC_LEN) {
        vec xv = load_vec(x + k);
        for (int r = 0; r < GEMV_ROWS; r++) {
            __builtin_prefetch(w[r] + k + 16 * VEC_LEN);
            acc[r] += load_vec(w[r] + k) * xv;
        }
    }
    for (long r = 0; r < nr; r++) {
        float s = 0.0f;
        for (int i = 0; i < VEC_LEN; i++) s += acc[r][i];
        for (long k = kv; k < K; k++) s += w[r][k] * x[k];
        y[n0 + r] = b ? s + b[n0 + r] : s;
    }
}

/* Matrix-vector product y [N] = W [N, K] x [K] (+ b [N]), for batch-1 decode. The weight is read
 * once, in GEMV_ROWS-row panels split across threads; this is memory-bound, and on the machine it
 * was written on it streamed at 22-33 GB/s against 14-25 GB/s for oneDNN's prepacked kernel. */
void pl_gemv(const float *x, const float *W, const float *b, float *y, long N, long K, int nt) {
    long panels = (N + GEMV_ROWS - 1) / GEMV_ROWS;
#pragma omp parallel for num_threads(nt) schedule(static) if (N * K >= PAR_MIN_WORK)
    for (long i = 0; i < panels; i++) {
        long n0 = i * GEMV_ROWS;
        gemv_rows(x, W, b, y, K, n0, N - n0 < GEMV_ROWS ? N - n0 : GEMV_ROWS);
    }
}

/* ---- batch-1 decode through a whole Llama-family decoder stack in one call ---------------- */

/* columns of the per-layer address table handed to pl_decode_stack (0 = no bias) */
enum { L_IN_NORM, L_QKV_W, L_QKV_B, L_O_W, L_O_B, L_POST_NORM, L_GU_W, L_GU_B, L_DOWN_W, L_DOWN_B, L_KC, L_VC,
       L_QUANT, L_COUNT };
/* L_QUANT: 0 (every weight float32), or the address of int64 [4][4]: for the qkv, o, gate_up and down
 * weights in that order, {fmt (-1: float32, the weight column then holds it), qs, d, m} (pl_qgemm) */
enum { Q_QKV, Q_O, Q_GU, Q_DOWN };
static inline const float *addr(const int64_t *row, int col) { return (const float *)(intptr_t)row[col]; }

void pl_qgemm(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
              const float *bias, float *y, long N, long K, int nt);

#define QBLOCK 32
#define QGEMM_MAX_ROWS 16
#define QROWS 4 /* input rows per register group when M > 1 */
#define QTILE 4 /* output rows per task when M == 1: independent accumulators hide the FMA latency */

static inline float hsum(vec v) {
    float t[VEC_LEN];
    memcpy(t, &v, sizeof v);
    float s = 0.0f;
    for (int i = 0; i < VEC_LEN; i++) s += t[i];
    return s;
}

/* y [M, N] = x [M, K] W^T (+ b) for M <= QGEMM_MAX_ROWS rows of float32 weights: tiles of QTILE weight
 * rows times groups of up to QROWS input rows, in registers; each weight row is read once */
static void gemm_rows(const float *x, long M, const float *W, const float *b, float *y, long N, long K, int nt) {
    long tiles = (N + QTILE - 1) / QTILE;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (long t = 0; t < tiles; t++) {
        long n0 = t * QTILE, nc = N - n0 < QTILE ? N - n0 : QTILE;
        const float *wr[QTILE];
        for (int j = 0; j < QTILE; j++) wr[j] = W + (n0 + (j < nc ? j : 0)) * K;
        for (long r0 = 0; r0 < M; r0 += QROWS) {
            long rc = M - r0 < QROWS ? M - r0 : QROWS;
            const float *xr[QROWS];
            for (int i = 0; i < QROWS; i++) xr[i] = x + (r0 + (i < rc ? i : 0)) * K;
            vec acc[QTILE][QROWS] = {};
            for (long k = 0; k < K; k += VEC_LEN) {
                vec xv[QROWS];
                for (int i = 0; i < QROWS; i++) xv[i] = load_vec(xr[i] + k);
                for (int j = 0; j < QTILE; j++) {
                    vec wv = load_vec(wr[j] + k);
                    for (int i = 0; i < QROWS; i++) acc[j][i] += wv * xv[i];
                }
            }
            for (long i = 0; i < rc; i++)
                for (long j = 0; j < nc; j++)
                    y[(r0 + i) * N + n0 + j] = hsum(acc[j][i]) + (b ? b[n0 + j] : 0.0f);
        }
    }
}

/* y [M, N] = x [M, K] W^T (+ b): the layer's packed weight (pl_qgemm) or its float32 one */
static void layer_matmul(const int64_t *p, int which, int wcol, int bcol, const float *x, long M, float *y, long N,
                         long K, int nt) {
    const int64_t *q = (const int64_t *)(intptr_t)p[L_QUANT];
    if (q && q[which * 4] >= 0)
        pl_qgemm((int)q[which * 4], x, M, (const uint8_t *)(intptr_t)q[which * 4 + 1],
                 (const float *)(intptr_t)q[which * 4 + 2], (const float *)(intptr_t)q[which * 4 + 3],
                 addr(p, bcol), y, N, K, nt);
    else if (M > 1 && K % VEC_LEN == 0)
        gemm_rows(x, M, addr(p, wcol), addr(p, bcol), y, N, K, nt);
    else
        for (long m = 0; m < M; m++) pl_gemv(x + m * K, addr(p, wcol), addr(p, bcol), y + m * N, N, K, nt);
}


static void norm_row(const float *src, const float *w, float *out, long H, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (long h = 0; h < H; h++) ss += src[h] * src[h];
    float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
    for (long h = 0; h < H; h++) out[h] = w[h] * (src[h] * inv);
}

static void add_row(float *acc, const float *x, long H) {
#pragma omp simd
    for (long h = 0; h < H; h++) acc[h] += x[h];
}

/* The last T (<= QGEMM_MAX_ROWS) tokens of one sequence through n_layers decoder layers (pre-norm,
 * rotary, grouped-query attention over the paged cache, SwiGLU MLP), the same math as
 * LlamaDecoderLayer with the kernels above, without returning to Python between operations:
 * batch-1 decode (T = 1) and the verification of speculative draft tokens (T = 1 + drafts).
 * x [T, H]: in, the tokens' embeddings; out, the last layer's MLP output. residual [T, H]: out, the
 * residual stream, so the final hidden state is residual + x. layers: [n_layers, L_COUNT]
 * addresses. cos_rows, sin_rows [T, D]: the rotary tables at the tokens' positions, seq_len - T ..
 * seq_len - 1. table: the sequence's block table; the tokens' K/V go to their slots, and token t
 * attends to the first seq_len - T + t + 1 positions (causal).
 * Returns 0, or -1 when scratch memory could not be allocated (nothing written then). */
int pl_decode_stack(long n_layers, long T, const int64_t *layers, float *x, float *residual, long H, long NH, long KVH,
                    long D, long I, float eps, const float *cos_rows, const float *sin_rows, long num_slots,
                    long block_size, const int64_t *table, long seq_len, float scale, int nt) {
    long G = NH / KVH, nqkv = (NH + 2 * KVH) * D, pos0 = seq_len - T;
    float *h = malloc(sizeof(float) * (T * (H + nqkv + NH * D + 3 * I) + KVH * G * seq_len));
    int64_t *slots = malloc(sizeof(int64_t) * 2 * T);
    if (!h || !slots) {
        free(h);
        free(slots);
        return -1;
    }
    int64_t *rows = slots + T;
    for (long t = 0; t < T; t++) {
        long pos = pos0 + t;
        slots[t] = table[pos / block_size] * block_size + pos % block_size;
        rows[t] = t;
    }
    float *qkv = h + T * H, *attn = qkv + T * nqkv, *gu = attn + T * NH * D, *act = gu + T * 2 * I,
          *scores = act + T * I;
    for (long l = 0; l < n_layers; l++) {
        const int64_t *p = layers + l * L_COUNT;
        for (long t = 0; t < T; t++) {
            if (l == 0)
                memcpy(residual + t * H, x + t * H, sizeof(float) * H);
            else
                add_row(residual + t * H, x + t * H, H);
            norm_row(residual + t * H, addr(p, L_IN_NORM), h + t * H, H, eps);
        }
        layer_matmul(p, Q_QKV, L_QKV_W, L_QKV_B, h, T, qkv, nqkv, H, nt);
        pl_rope(qkv, nqkv, NH + KVH, rows, cos_rows, sin_rows, T, D, 1);
        float *kc = (float *)addr(p, L_KC), *vc = (float *)addr(p, L_VC);
        for (long t = 0; t < T; t++)
            for (long g = 0; g < KVH; g++) {
                memcpy(kc + (g * num_slots + slots[t]) * D, qkv + t * nqkv + (NH + g) * D, sizeof(float) * D);
                memcpy(vc + (g * num_slots + slots[t]) * D, qkv + t * nqkv + (NH + KVH + g) * D, sizeof(float) * D);
            }
        for (long t = 0; t < T; t++) {
            long L = pos0 + t + 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (L * NH * D >= PAR_MIN_WORK && KVH > 1)
            for (long g = 0; g < KVH; g++)
                decode_task(qkv + t * nqkv + g * G * D, D, table, 0, L, kc + g * num_slots * D,
                            vc + g * num_slots * D, block_size, D, G, scale, 0.0f, scores + g * G * seq_len,
                            attn + t * NH * D + g * G * D, D);
        }
        layer_matmul(p, Q_O, L_O_W, L_O_B, attn, T, x, H, NH * D, nt);
        for (long t = 0; t < T; t++) {
            add_row(residual + t * H, x + t * H, H);
            norm_row(residual + t * H, addr(p, L_POST_NORM), h + t * H, H, eps);
        }
        layer_matmul(p, Q_GU, L_GU_W, L_GU_B, h, T, gu, 2 * I, H, nt);
        pl_silu_mul(gu, act, T, I, 1);
        layer_matmul(p, Q_DOWN, L_DOWN_W, L_DOWN_B, act, T, x, H, I, nt);
    }
    free(h);
    free(slots);
    return 0;
}

/* Structured outputs: set logits of tokens a grammar disallows to -inf, in place.
 * logits rows rows[r] (row stride `stride` floats) of width V; mask [R, W] int32 in llguidance's
 * layout (bit t % 32 of word t / 32 set when token t is allowed; tokens past 32 * W are not).
 * Whole words of 0 or ~0 (most of a JSON mask) take one branch per 32 tokens. */
void pl_apply_bitmask(float *logits, long stride, const int64_t *rows, long R, const int32_t *mask, long W,
                      long V, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (long r = 0; r < R; r++) {
        float *row = logits + rows[r] * stride;
        const uint32_t *m = (const uint32_t *)(mask + r * W);
        for (long w = 0; w * 32 < V; w++) {
            long t0 = w * 32, n = V - t0 < 32 ? V - t0 : 32;
            uint32_t word = w < W ? m[w] : 0u;
            if (word == 0xFFFFFFFFu) continue;
            for (long k = 0; k < n; k++)
                if (!((word >> k) & 1u)) row[t0 + k] = -INFINITY;
        }
    }
}

/* ---- GGUF quantized weights, kept packed (issue 18) ----------------------------------------
 * Layouts after the load-time repack (models/gguf_blocks.py), per weight matrix [N, K], K % 32 == 0,
 * groups of 32 weights along K unless said:
 *   0 U4M: qs uint8 [N, K/2] (group b of row n: 16 bytes, byte j = weight j (low nibble) and
 *          weight j + 16 (high nibble), GGUF's order), d, m float32 [N, K/32]: w = q * d + m (Q4_1, Q4_K);
 *   1 S8:  qs int8 [N, K], d float32 [N, K/32]: w = q * d (Q8_0, Q5_0, int8 per channel);
 *   2 U4:  as U4M without m: w = (q - 8) * d (Q4_0);
 *   3 S8H: qs int8 [N, K], d float32 [N, K/16] (groups of 16): w = q * d (Q6_K);
 *   4 S8M: qs int8 [N, K], d, m float32 [N, K/32]: w = q * d + m (Q5_1, Q5_K).
 * Activations stay float32: each group is dequantized into registers and multiplied in float32,
 * so results equal gguf's dequantization followed by a float32 matmul up to rounding. */


/* Block unpacking in vector registers (GCC vector extensions: the compiler picks the AVX2 or
 * AVX-512 instructions of the machine the library is built on). VEC_LEN nibble bytes widen to
 * int32 lanes, mask or shift, convert to float, then scale (and shift by the min). */
typedef int32_t i32v __attribute__((vector_size(VEC_BYTES)));

/* GCC 12 lowers __builtin_convertvector from 8-bit lanes to scalar code, so the widening is
 * written with the AVX-512 / AVX2 sign- and zero-extension intrinsics */
static inline i32v widen_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    return (i32v)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#else
    return (i32v)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#endif
}

static inline vec widen_s8(const int8_t *p) {
#if defined(__AVX512F__)
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}

static inline vec i32_to_f(i32v v) {
#if defined(__AVX512F__)
    return (vec)_mm512_cvtepi32_ps((__m512i)v);
#else
    return (vec)_mm256_cvtepi32_ps((__m256i)v);
#endif
}


/* the QBLOCK weights of block i as QBLOCK / VEC_LEN vectors, in order */
static inline void q_unpack_vec(int fmt, const uint8_t *qs, const float *d, const float *mn, long i, vec *w) {
    if (fmt == 1 || fmt == 3 || fmt == 4) {
        const int8_t *q = (const int8_t *)qs + i * QBLOCK;
        if (fmt == 1) {
            vec dv = (vec){} + d[i];
            for (int c = 0; c < QBLOCK / VEC_LEN; c++) w[c] = widen_s8(q + c * VEC_LEN) * dv;
        } else if (fmt == 3) { /* S8H: two scales per block, one per 16 weights */
            for (int c = 0; c < QBLOCK / VEC_LEN; c++)
                w[c] = widen_s8(q + c * VEC_LEN) * ((vec){} + d[2 * i + c * VEC_LEN / 16]);
        } else {
            vec dv = (vec){} + d[i], off = (vec){} + mn[i];
            for (int c = 0; c < QBLOCK / VEC_LEN; c++) w[c] = widen_s8(q + c * VEC_LEN) * dv + off;
        }
        return;
    }
    vec dv = (vec){} + d[i];
    const uint8_t *q = qs + i * (QBLOCK / 2);
    vec off = (vec){} + (fmt == 0 ? mn[i] : -8.0f * d[i]);
    for (int c = 0; c < QBLOCK / 2 / VEC_LEN; c++) {
        i32v v = widen_u8(q + c * VEC_LEN);
        w[c] = i32_to_f(v & 15) * dv + off;
        w[c + QBLOCK / 2 / VEC_LEN] = i32_to_f(v >> 4) * dv + off;
    }
}

/* Weight bytes stream from memory once per step: each row's stream is prefetched PF_BYTES ahead
 * (the hardware prefetchers alone left batch-1 products at about a third of the memory bandwidth). */
#define PF_BYTES 2048
static inline void prefetch_block(int fmt, const uint8_t *qs, long i) {
    __builtin_prefetch(qs + i * (fmt == 0 || fmt == 2 ? QBLOCK / 2 : QBLOCK) + PF_BYTES, 0, 3);
}

/* ---- int8 activations with VNNI integer dot products (batch-1 decode) ------------------------
 * Where the CPU has AVX-512 VNNI (vpdpbusd: 32 unsigned x signed byte products summed into 8 int32
 * lanes per 256-bit op), the input row is quantized to int8 per 32-block (xq = round(x / dx),
 * dx = max|x| / 127, as llama.cpp's Q8 activations) and each weight block is multiplied as bytes:
 * about half the instructions of widening it to float32. Weight bytes go in as unsigned: the
 * nibble layouts are 0..15 already; signed int8 (S8*) is offset by +128 (an XOR); those byte offsets
 * start each lane's accumulator (qgemv_i8), and the mins of U4M / S8M are one dot product per row
 * with the blocks' activation sums. Outlier blocks get a second level (quantize_row_i8). Not
 * bitwise float32: tests bound it against the exact product of the quantized row, and perplexity
 * within 1% of float32. Opt-in:
 * pl_set_int8_activations(1) (PAGEDLLM_INT8_ACTIVATIONS=1). */
static int int8_activations = 0; /* set from PAGEDLLM_INT8_ACTIVATIONS at load (kernels/cpu.py) */
void pl_set_int8_activations(int on) { int8_activations = on; }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
int pl_has_vnni(void) { return 1; }

/* 32 floats -> int8 with scale amax / 127 (round to nearest even); returns the scale, *sum = sum(q) */
static inline float quantize_block_i8(const float *x, int8_t *q, int *sum) {
    __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(q1));
    *sum = _mm512_reduce_add_epi32(q0) + _mm512_reduce_add_epi32(q1);
    return amax / 127.0f;
}

/* Blocks whose max |x| is past I8_OUTLIER times the row's mean block max (the few huge channels
 * of an MLP's intermediate activation: SmolLM2's reach hundreds) get a second int8 level for the
 * rounding residual, about 15 bits: one level there crushed the block's other 31 values and moved
 * SmolLM2's perplexity by 1.4%; two levels keep it within 0.1% (tests/kernels/test_quant_kernels). */
#define I8_OUTLIER 4.0f

/* x [K] -> xq int8 [K], dx [K/32], sxd [K/32] = the block's sum as quantized; blocks flagged in
 * two [K/32] (>= 0: index into xq2 [.., 32] / dx2 of their residual level); returns the count */
static long quantize_row_i8(const float *x, long K, int8_t *xq, float *dx, float *sxd, int *two, int8_t *xq2,
                            float *dx2) {
    long nb = K / QBLOCK, n2 = 0;
    float mean = 0.0f;
    for (long b = 0; b < nb; b++) {
        int sum;
        dx[b] = quantize_block_i8(x + b * QBLOCK, xq + b * QBLOCK, &sum);
        sxd[b] = dx[b] * (float)sum;
        mean += dx[b] / (float)nb;
    }
    for (long b = 0; b < nb; b++) {
        two[b] = -1;
        if (dx[b] <= I8_OUTLIER * mean) continue;
        float r[QBLOCK];
        for (int c = 0; c < QBLOCK; c++) r[c] = x[b * QBLOCK + c] - (float)xq[b * QBLOCK + c] * dx[b];
        int sum;
        dx2[n2] = quantize_block_i8(r, xq2 + n2 * QBLOCK, &sum);
        sxd[b] += dx2[n2] * (float)sum;
        two[b] = (int)n2++;
    }
    return n2;
}

/* the 32 weights of block i as unsigned bytes in weight order (S8*: q + 128) */
static inline __m256i block_u8(int fmt, const uint8_t *qs, long i) {
    if (fmt == 0 || fmt == 2) {
        __m128i q = _mm_loadu_si128((const __m128i *)(qs + i * (QBLOCK / 2))), m = _mm_set1_epi8(15);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
    }
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qs + i * QBLOCK)), _mm256_set1_epi8((char)0x80));
}

/* sum over b < n of a[b] * c[b] (the block mins against the blocks' activation sums) */
static inline float dot_f32(const float *a, const float *c, long n) {
    __m512 s = _mm512_setzero_ps();
    for (long b = 0; b < n; b += 16) {
        __mmask16 m = n - b >= 16 ? 0xFFFF : (__mmask16)((1u << (n - b)) - 1);
        s = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + b), _mm512_maskz_loadu_ps(m, c + b), s);
    }
    return _mm512_reduce_add_ps(s);
}

/* Per input row, once: each int32 lane of a block's byte dot product covers 4 weights, and the
 * unsigned weight bytes carry a constant offset (+128 for S8*, +8 for U4, none for U4M); the lane's
 * start value -offset * (sum of its 4 activation bytes) cancels it, so the inner loop does no
 * offset work. Per tile row: the block scales d * dx in a small array, read as broadcasts. */
static void qgemv_i8(int fmt, const float *x, const uint8_t *qs, const float *d, const float *mn,
                     const float *bias, float *y, long N, long K, int nt) {
    long nb = K / QBLOCK, ns = fmt == 3 ? 2 * nb : nb; /* scales per row */
    int8_t *xq = malloc(2 * K + sizeof(int32_t) * (K / 2) + sizeof(float) * 3 * nb + sizeof(int) * nb);
    int32_t *corr = (int32_t *)(xq + 2 * K), *corr2 = corr + K / 4;
    float *dx = (float *)(corr2 + K / 4), *sxd = dx + nb, *dx2 = sxd + nb;
    int *two = (int *)(dx2 + nb);
    int8_t *xq2 = xq + K;
    long n2 = quantize_row_i8(x, K, xq, dx, sxd, two, xq2, dx2);
    char off = fmt == 0 ? 0 : fmt == 2 ? 8 : (char)0x80;
    for (long k = 0; k < K + n2 * QBLOCK; k += 32) /* offset * sum4(xq) per lane; 0x80 read unsigned is 128 */
        _mm256_storeu_si256((__m256i *)(corr + k / 4),
                            _mm256_sub_epi32(_mm256_setzero_si256(),
                                             _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(off),
                                                                 _mm256_loadu_si256((const __m256i *)(xq + k)))));
    long tiles = (N + QTILE - 1) / QTILE;
    #pragma omp parallel num_threads(nt)
    {
        float *dd = malloc(sizeof(float) * QTILE * ns);
        #pragma omp for schedule(static)
        for (long t = 0; t < tiles; t++) {
            long n0 = t * QTILE, nc = N - n0 < QTILE ? N - n0 : QTILE;
            long rows[QTILE];
            for (int j = 0; j < QTILE; j++) { /* a short tile repeats its first row */
                rows[j] = n0 + (j < nc ? j : 0);
                const float *dr = d + rows[j] * ns;
                for (long s = 0; s < ns; s++) dd[j * ns + s] = dr[s] * dx[fmt == 3 ? s / 2 : s];
            }
            __m256 acc[QTILE];
            for (int j = 0; j < QTILE; j++) acc[j] = _mm256_setzero_ps();
            for (long b = 0; b < nb; b++) {
                for (int j = 0; j < QTILE; j++) prefetch_block(fmt, qs, rows[j] * nb + b);
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * QBLOCK));
                __m256i cv = _mm256_loadu_si256((const __m256i *)(corr + b * 8));
                for (int j = 0; j < QTILE; j++) {
                    __m256i wv = block_u8(fmt, qs, rows[j] * nb + b);
                    __m256i dot = _mm256_dpbusd_epi32(cv, wv, xv);
                    const float *sc = dd + j * ns;
                    __m256 scale = fmt == 3 ? _mm256_set_m128(_mm_broadcast_ss(sc + 2 * b + 1), _mm_broadcast_ss(sc + 2 * b))
                                            : _mm256_broadcast_ss(sc + b);
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[j]);
                    if (two[b] >= 0) { /* the residual level: same weight bytes, scales times dx2 / dx */
                        long r = two[b];
                        __m256i dot2 = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)(corr + (nb + r) * 8)), wv,
                                                           _mm256_loadu_si256((const __m256i *)(xq2 + r * QBLOCK)));
                        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot2), _mm256_mul_ps(scale, _mm256_set1_ps(dx2[r] / dx[b])),
                                                 acc[j]);
                    }
                }
            }
            for (long j = 0; j < nc; j++) {
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                float v = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
                if (fmt == 0 || fmt == 4) v += dot_f32(mn + (n0 + j) * nb, sxd, nb);
                y[n0 + j] = v + (bias ? bias[n0 + j] : 0.0f);
            }
        }
        free(dd);
    }
    free(xq);
}
#else
int pl_has_vnni(void) { return 0; }
#endif

/* out[j][i] = weight row n0 + j (a short tile repeats row n0) . input row xr[i], i < R, over nb blocks */
static inline __attribute__((always_inline)) void qtile_rows(int fmt, const uint8_t *qs, const float *d,
                                                             const float *mn, long n0, long nc, long nb,
                                                             const float *const *xr, int R, float out[QTILE][QROWS]) {
    vec acc[QTILE][QROWS] = {};
    for (long b = 0; b < nb; b++) {
        vec w[QTILE][QBLOCK / VEC_LEN];
        for (int j = 0; j < QTILE; j++) {
            long row = n0 + (j < nc ? j : 0);
            prefetch_block(fmt, qs, row * nb + b);
            q_unpack_vec(fmt, qs, d, mn, row * nb + b, w[j]);
        }
        for (int i = 0; i < R; i++)
            for (int c = 0; c < QBLOCK / VEC_LEN; c++) {
                vec xv = load_vec(xr[i] + b * QBLOCK + c * VEC_LEN);
                for (int j = 0; j < QTILE; j++) acc[j][i] += w[j][c] * xv;
            }
    }
    for (int j = 0; j < QTILE; j++)
        for (int i = 0; i < R; i++) out[j][i] = hsum(acc[j][i]);
}

/* y [M, N] = x [M, K] W^T (+ bias), M <= QGEMM_MAX_ROWS: each weight block is unpacked once and
 * used for every row (decode and small batches read the packed bytes once per step). */
void pl_qgemm(int fmt, const float *x, long M, const uint8_t *qs, const float *d, const float *mn,
              const float *bias, float *y, long N, long K, int nt) {
    long nb = K / QBLOCK;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (M == 1 && int8_activations) {
        qgemv_i8(fmt, x, qs, d, mn, bias, y, N, K, nt);
        return;
    }
#endif
    if (M == 1) {
        long tiles = N / QTILE;
        /* full tiles: a constant trip count keeps the QTILE accumulators in registers */
        #pragma omp parallel for num_threads(nt) schedule(static)
        for (long t = 0; t < tiles; t++) {
            long n0 = t * QTILE;
            vec acc[QTILE] = {}, w[QBLOCK / VEC_LEN];
            for (long b = 0; b < nb; b++) {
                const float *xb = x + b * QBLOCK;
                vec xv[QBLOCK / VEC_LEN];
                for (int c = 0; c < QBLOCK / VEC_LEN; c++) xv[c] = load_vec(xb + c * VEC_LEN);
                for (int j = 0; j < QTILE; j++) {
                    prefetch_block(fmt, qs, (n0 + j) * nb + b);
                    q_unpack_vec(fmt, qs, d, mn, (n0 + j) * nb + b, w);
                    for (int c = 0; c < QBLOCK / VEC_LEN; c++) acc[j] += w[c] * xv[c];
                }
            }
            for (int j = 0; j < QTILE; j++) y[n0 + j] = hsum(acc[j]) + (bias ? bias[n0 + j] : 0.0f);
        }
        for (long n = tiles * QTILE; n < N; n++) { /* the last N % QTILE rows */
            vec acc = {}, w[QBLOCK / VEC_LEN];
            for (long b = 0; b < nb; b++) {
                q_unpack_vec(fmt, qs, d, mn, n * nb + b, w);
                for (int c = 0; c < QBLOCK / VEC_LEN; c++) acc += w[c] * load_vec(x + b * QBLOCK + c * VEC_LEN);
            }
            y[n] = hsum(acc) + (bias ? bias[n] : 0.0f);
        }
        return;
    }
    /* M > 1 (small batches, speculative verification): per tile of QTILE weight rows and group of up
     * to QROWS input rows, each block is unpacked into registers once and multiplied with every row
     * of the group (qtile_rows, specialised per group size so a short group costs only its rows). */
    long tiles = (N + QTILE - 1) / QTILE;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (long t = 0; t < tiles; t++) {
        long n0 = t * QTILE, nc = N - n0 < QTILE ? N - n0 : QTILE;
        for (long r0 = 0; r0 < M; r0 += QROWS) {
            long rc = M - r0 < QROWS ? M - r0 : QROWS;
            const float *xr[QROWS];
            for (int i = 0; i < QROWS; i++) xr[i] = x + (r0 + (i < rc ? i : 0)) * K;
            float out[QTILE][QROWS];
            switch (rc) {
            case 1: qtile_rows(fmt, qs, d, mn, n0, nc, nb, xr, 1, out); break;
            case 2: qtile_rows(fmt, qs, d, mn, n0, nc, nb, xr, 2, out); break;
            case 3: qtile_rows(fmt, qs, d, mn, n0, nc, nb, xr, 3, out); break;
            default: qtile_rows(fmt, qs, d, mn, n0, nc, nb, xr, 4, out); break;
            }
            for (long i = 0; i < rc; i++)
                for (long jj = 0; jj < nc; jj++)
                    y[(r0 + i) * N + n0 + jj] = out[jj][i] + (bias ? bias[n0 + jj] : 0.0f);
        }
    }
}

/* out [N, K] float32 = the dequantized weight (prefill-sized inputs multiply it with oneDNN/MKL). */
void pl_qdequant(int fmt, const uint8_t *qs, const float *d, const float *mn, float *out, long N, long K, int nt) {
    long nb = K / QBLOCK;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (long n = 0; n < N; n++)
        for (long b = 0; b < nb; b++) {
            vec w[QBLOCK / VEC_LEN];
            q_unpack_vec(fmt, qs, d, mn, n * nb + b, w);
            memcpy(out + n * K + b * QBLOCK, w, sizeof w);
        }
}
