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

#include "cpu_common.h"

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
void decode_task(const float *q, long q_hs, const int64_t *table, long first, long L, const float *kc,
                        const float *vc, long block_size, long D, long G, float scale, float softcap,
                        const float *sinks, float *scores, float *out, long out_hs) {
    long n = L - first;
    group_scores(q, q_hs, table, first, L, kc, block_size, D, G, scale, scores);
    for (long j = 0; j < G; j++) {
        float *sj = scores + j * n, m = -INFINITY, sum = 0.0f;
        if (softcap > 0.0f)
            for (long i = 0; i < n; i++) sj[i] = softcap * tanhf(sj[i] / softcap);
        for (long i = 0; i < n; i++) m = sj[i] > m ? sj[i] : m;
        if (sinks) m = sinks[j] > m ? sinks[j] : m; /* a sink: one more logit, with no value (gpt-oss) */
#pragma omp simd reduction(+ : sum)
        for (long i = 0; i < n; i++) {
            sj[i] = exp_approx(sj[i] - m);
            sum += sj[i];
        }
        if (sinks) sum += exp_approx(sinks[j] - m);
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
 * window > 0: keys j >= seq_len - window only (sliding window); softcap > 0: Gemma 2 capping;
 * sinks: NULL, or [H] per-head sink logits joining each softmax's denominator (gpt-oss). */
void pl_decode_attention(const float *q, long q_ts, long q_hs, const int64_t *rows, const int64_t *tables,
                         long table_stride, const int64_t *seq_lens, const float *kc, const float *vc,
                         long num_slots, long block_size, long B, long H, long KVH, long D, float scale,
                         long window, float softcap, const float *sinks, float *out, int nt) {
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
                        sinks ? sinks + g * G : NULL, scores, out + rows[b] * H * D + g * G * D, D);
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

/* y [M, N] = x [M, K] W^T (+ b) for a 16-bit weight W (bfloat16 when bf16, else IEEE half), M small:
 * each weight row is converted to float32 once (a thread's buffer) and multiplied by every input row.
 * The half conversion is the compiler's (F16C's vcvtph2ps in the builds that have it).
 * Returns 0, or -1 when a thread's row buffer could not be allocated (y incomplete then). */
int pl_gemm16(const float *x, long M, const uint16_t *W, int bf16, const float *b, float *y, long N, long K, int nt) {
    int failed = 0;
#pragma omp parallel num_threads(nt) if (N * K >= PAR_MIN_WORK)
    {
        float *row = malloc(sizeof(float) * K);
        if (!row) failed = 1; /* every writer stores the same value */
#pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            const uint16_t *w = W + n * K;
            if (!row) continue;
            if (bf16) {
#pragma omp simd
                for (long k = 0; k < K; k++) {
                    uint32_t u = (uint32_t)w[k] << 16;
                    memcpy(row + k, &u, 4);
                }
            } else {
                const _Float16 *h = (const _Float16 *)w;
#pragma omp simd
                for (long k = 0; k < K; k++) row[k] = (float)h[k];
            }
            for (long m = 0; m < M; m++) {
                const float *xm = x + m * K;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (long k = 0; k < K; k++) s += row[k] * xm[k];
                y[m * N + n] = s + (b ? b[n] : 0.0f);
            }
        }
        free(row);
    }
    return failed ? -1 : 0;
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

/* The quantized-weight kernels (pl_qgemm, pl_qdequant, ...) are in quant_kernels.c. */
