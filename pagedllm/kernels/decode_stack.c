/* pagedllm CPU kernels: batch-1 decode through a whole pre-norm decoder stack in one call
 * (pl_decode_stack), and the products it shares with the experts kernel (desc_matmul, act_mul). */
#include "cpu_common.h"

/* columns of the per-layer table handed to pl_decode_stack: six norm weights (0 = the layer has no
 * such norm), the layer's K/V cache, its rotary table index and sliding window, then MM_COLS columns
 * for each of seven matrix products */
enum { L_IN_NORM, L_POST_ATTN_NORM, L_PRE_FF_NORM, L_POST_FF_NORM, L_Q_NORM, L_K_NORM, L_KC, L_VC, L_ROPE,
       L_WINDOW, L_ROUTER, L_EXPERTS, L_NEXP, L_TOPK, L_NORM_TOPK, L_CHOSEN, L_MOE_I, L_ROUTER_B, L_SINKS, L_MM };
/* L_ROUTER != 0: the layer's MLP is a mixture of experts: router [NEXP, H] float32, softmax over the
 * experts, the TOPK largest (their weights renormalized to sum 1 when L_NORM_TOPK), then
 * pl_moe_experts over L_EXPERTS ([NEXP][2][5] descriptors, expert width L_MOE_I); L_CHOSEN: int64
 * [NEXP] counts of the choices (the routing histogram), or 0; L_ROUTER_B: the router's bias [NEXP]
 * float32, or 0 (gpt-oss). L_SINKS: the attention sinks' logits [NH] float32, or 0 (gpt-oss) */
/* the matrix products: q (with k and v absent: the fused q|k|v rows), k, v, o, gate (with up absent:
 * the fused gate|up rows), up, down; each {fmt, weight, d, m, bias}: fmt >= 0 a pl_qgemm layout with
 * its qs / d / m arrays in the weight / d / m columns; fmt -1 a float32 [N, K] weight; fmt -2 absent */
enum { MM_Q, MM_K, MM_V, MM_O, MM_GATE, MM_UP, MM_DOWN, MM_COUNT };
enum { MM_FMT, MM_W, MM_D, MM_M, MM_B, MM_COLS };
#define L_COUNT (L_MM + MM_COUNT * MM_COLS)
enum { ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_OAI };
static inline const float *addr(const int64_t *row, int col) { return (const float *)(intptr_t)row[col]; }

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

void desc_matmul(const int64_t *c, const float *x, long M, float *y, long N, long K, int nt, int fl) {
    const float *w = addr(c, MM_W), *b = addr(c, MM_B);
    if (c[MM_FMT] >= 0)
        pl_qgemm((int)c[MM_FMT] | fl, x, M, (const uint8_t *)w, addr(c, MM_D), addr(c, MM_M), b, y, N, K, nt);
    else if (M > 1 && K % VEC_LEN == 0)
        gemm_rows(x, M, w, b, y, N, K, nt);
    else
        for (long m = 0; m < M; m++) pl_gemv(x + m * K, w, b, y + m * N, N, K, nt);
}

/* y [M, N] = x [M, K] W^T (+ b) by matrix product `which` of the layer (packed or float32) */
static void layer_matmul(const int64_t *p, int which, const float *x, long M, float *y, long N, long K, int nt) {
    desc_matmul(p + L_MM + which * MM_COLS, x, M, y, N, K, nt, 0);
}

/* product `which` into columns [col0, col0 + N) of y [M, ld]; through tmp [M, N] when M > 1 */
static void matmul_cols(const int64_t *p, int which, const float *x, long M, float *y, long ld, long col0, long N,
                        long K, float *tmp, int nt) {
    if (M == 1) {
        layer_matmul(p, which, x, 1, y + col0, N, K, nt);
        return;
    }
    layer_matmul(p, which, x, M, tmp, N, K, nt);
    for (long m = 0; m < M; m++) memcpy(y + m * ld + col0, tmp + m * N, sizeof(float) * N);
}

static inline int absent(const int64_t *p, int which) { return p[L_MM + which * MM_COLS + MM_FMT] == -2; }

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

/* out[t, i] = gelu_tanh(gu[t, i]) * gu[t, I + i] (transformers' gelu_pytorch_tanh: Gemma) */
static void gelu_tanh_mul(const float *gu, float *out, long T, long I) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (long t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (long i = 0; i < I; i++) o[i] = 0.5f * g[i] * (1.0f + tanhf(c * (g[i] + 0.044715f * g[i] * g[i] * g[i]))) * u[i];
    }
}

/* out[t, i] = (clamp(u, -7, 7) + 1) * g' sigmoid(1.702 g'), g' = min(g, 7): gpt-oss's clamped SwiGLU
 * (transformers' GptOssExperts._apply_gate with its swiglu_alpha 1.702 and swiglu_limit 7) */
static void swiglu_oai_mul(const float *gu, float *out, long T, long I) {
    for (long t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        for (long i = 0; i < I; i++) {
            float a = g[i] < 7.0f ? g[i] : 7.0f, b = u[i] < -7.0f ? -7.0f : (u[i] > 7.0f ? 7.0f : u[i]);
            o[i] = (b + 1.0f) * (a / (1.0f + expf(-1.702f * a)));
        }
    }
}

void act_mul(int act, const float *gu, float *out, long T, long I) {
    if (act == ACT_SWIGLU_OAI)
        swiglu_oai_mul(gu, out, T, I);
    else if (act == ACT_GELU_TANH)
        gelu_tanh_mul(gu, out, T, I);
    else
        pl_silu_mul(gu, out, T, I, 1);
}

/* q|k|v of T tokens: the layer's products, q/k head norms (Qwen3, Gemma 3), rotary, and K/V into the cache */
static void layer_qkv(const int64_t *p, const float *h, float *qkv, float *tmp, long T, long H, long NH, long KVH,
                      long D, float eps, const float *cos_rows, const float *sin_rows, const int64_t *rows,
                      const int64_t *slots, long num_slots, int nt) {
    long nqkv = (NH + 2 * KVH) * D;
    if (absent(p, MM_K)) {
        layer_matmul(p, MM_Q, h, T, qkv, nqkv, H, nt);
    } else {
        matmul_cols(p, MM_Q, h, T, qkv, nqkv, 0, NH * D, H, tmp, nt);
        matmul_cols(p, MM_K, h, T, qkv, nqkv, NH * D, KVH * D, H, tmp, nt);
        matmul_cols(p, MM_V, h, T, qkv, nqkv, (NH + KVH) * D, KVH * D, H, tmp, nt);
    }
    const float *qn = addr(p, L_Q_NORM), *kn = addr(p, L_K_NORM);
    for (long t = 0; t < T; t++)
        for (long j = 0; j < NH + KVH; j++) {
            const float *w = j < NH ? qn : kn;
            float *v = qkv + t * nqkv + j * D;
            if (w) norm_row(v, w, v, D, eps);
        }
    long r = p[L_ROPE];
    pl_rope(qkv, nqkv, NH + KVH, rows, cos_rows + r * T * D, sin_rows + r * T * D, T, D, 1);
    float *kc = (float *)addr(p, L_KC), *vc = (float *)addr(p, L_VC);
    for (long t = 0; t < T; t++)
        for (long g = 0; g < KVH; g++) {
            memcpy(kc + (g * num_slots + slots[t]) * D, qkv + t * nqkv + (NH + g) * D, sizeof(float) * D);
            memcpy(vc + (g * num_slots + slots[t]) * D, qkv + t * nqkv + (NH + KVH + g) * D, sizeof(float) * D);
        }
}

/* A mixture-of-experts MLP on h [T, H] into x [T, H] (see L_ROUTER); -1 when out of memory */
static int moe_mlp(const int64_t *p, const float *h, float *x, long T, long H, int act, int nt) {
    long E = p[L_NEXP], k = p[L_TOPK];
    float *logits = malloc(sizeof(float) * (E + T * k));
    int64_t *idx = malloc(sizeof(int64_t) * T * k);
    if (!logits || !idx) {
        free(logits);
        free(idx);
        return -1;
    }
    float *w = logits + E;
    int64_t *chosen = (int64_t *)(intptr_t)p[L_CHOSEN];
    for (long t = 0; t < T; t++) {
        pl_gemv(h + t * H, addr(p, L_ROUTER), addr(p, L_ROUTER_B), logits, E, H, nt);
        float m = -INFINITY, sum = 0.0f, kept = 0.0f;
        for (long e = 0; e < E; e++) m = logits[e] > m ? logits[e] : m;
        for (long e = 0; e < E; e++) sum += (logits[e] = expf(logits[e] - m));
        for (long j = 0; j < k; j++) { /* the k largest, first index on ties (torch.topk's order here) */
            long best = -1;
            for (long e = 0; e < E; e++) {
                int taken = 0;
                for (long i = 0; i < j; i++) taken |= idx[t * k + i] == e;
                if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
            }
            idx[t * k + j] = best;
            w[t * k + j] = logits[best] / sum;
            kept += w[t * k + j];
            if (chosen) chosen[best]++;
        }
        if (p[L_NORM_TOPK])
            for (long j = 0; j < k; j++) w[t * k + j] /= kept;
    }
    /* decode steps: two activation levels */
    int rc = pl_moe_experts(T, k, idx, w, h, x, H, p[L_MOE_I], (const int64_t *)(intptr_t)p[L_EXPERTS], E, act, nt, 2);
    free(logits);
    free(idx);
    return rc;
}

/* The last T (<= QGEMM_MAX_ROWS) tokens of one sequence through n_layers pre-norm decoder layers
 * (Llama, Mistral, Qwen2/3, Phi-3, Gemma 3, gpt-oss: optional q/k head norms and post-attention / post-MLP
 * "sandwich" norms, SiLU or tanh-GELU gated MLP, a rotary table and sliding window per layer,
 * grouped-query attention over the paged cache), without returning to Python between operations:
 * batch-1 decode (T = 1) and the verification of speculative draft tokens (T = 1 + drafts).
 * x [T, H]: in, the tokens' embeddings; out, the last layer's (normed) MLP output. residual [T, H]:
 * out, the residual stream, so the final hidden state is residual + x. layers: [n_layers, L_COUNT].
 * cos_rows, sin_rows [R, T, D]: the rotary tables at the tokens' positions (seq_len - T ..
 * seq_len - 1), one per rotary kind a layer's L_ROPE picks. table: the sequence's block table; the
 * tokens' K/V go to their slots; token t attends to the first seq_len - T + t + 1 positions (the
 * last L_WINDOW of them when that is > 0). act: ACT_SILU or ACT_GELU_TANH. softcap > 0: score capping.
 * Returns 0, or -1 when scratch memory could not be allocated (nothing written then). */
int pl_decode_stack(long n_layers, long T, const int64_t *layers, float *x, float *residual, long H, long NH, long KVH,
                    long D, long I, float eps, const float *cos_rows, const float *sin_rows, long num_slots,
                    long block_size, const int64_t *table, long seq_len, float scale, int act, float softcap, int nt) {
    long G = NH / KVH, nqkv = (NH + 2 * KVH) * D, pos0 = seq_len - T, wide = nqkv > 2 * I ? nqkv : 2 * I;
    float *h = malloc(sizeof(float) * (T * (H + nqkv + NH * D + 3 * I + wide) + KVH * G * seq_len));
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
    float *qkv = h + T * H, *attn = qkv + T * nqkv, *gu = attn + T * NH * D, *mlp = gu + T * 2 * I,
          *tmp = mlp + T * I, *scores = tmp + T * wide;
    for (long l = 0; l < n_layers; l++) {
        const int64_t *p = layers + l * L_COUNT;
        for (long t = 0; t < T; t++) {
            if (l == 0)
                memcpy(residual + t * H, x + t * H, sizeof(float) * H);
            else
                add_row(residual + t * H, x + t * H, H);
            norm_row(residual + t * H, addr(p, L_IN_NORM), h + t * H, H, eps);
        }
        layer_qkv(p, h, qkv, tmp, T, H, NH, KVH, D, eps, cos_rows, sin_rows, rows, slots, num_slots, nt);
        float *kc = (float *)addr(p, L_KC), *vc = (float *)addr(p, L_VC);
        for (long t = 0; t < T; t++) {
            long L = pos0 + t + 1, first = (p[L_WINDOW] > 0 && L > p[L_WINDOW]) ? L - p[L_WINDOW] : 0;
#pragma omp parallel for num_threads(nt) schedule(static) if ((L - first) * NH * D >= PAR_MIN_WORK && KVH > 1)
            for (long g = 0; g < KVH; g++)
                decode_task(qkv + t * nqkv + g * G * D, D, table, first, L, kc + g * num_slots * D,
                            vc + g * num_slots * D, block_size, D, G, scale, softcap,
                            addr(p, L_SINKS) ? addr(p, L_SINKS) + g * G : NULL, scores + g * G * seq_len,
                            attn + t * NH * D + g * G * D, D);
        }
        layer_matmul(p, MM_O, attn, T, x, H, NH * D, nt);
        for (long t = 0; t < T; t++) {
            if (addr(p, L_POST_ATTN_NORM)) norm_row(x + t * H, addr(p, L_POST_ATTN_NORM), x + t * H, H, eps);
            add_row(residual + t * H, x + t * H, H);
            norm_row(residual + t * H, addr(p, L_PRE_FF_NORM), h + t * H, H, eps);
        }
        if (p[L_ROUTER]) {
            if (moe_mlp(p, h, x, T, H, act, nt) != 0) {
                free(h);
                free(slots);
                return -1;
            }
        } else if (absent(p, MM_UP)) {
            layer_matmul(p, MM_GATE, h, T, gu, 2 * I, H, nt);
        } else {
            matmul_cols(p, MM_GATE, h, T, gu, 2 * I, 0, I, H, tmp, nt);
            matmul_cols(p, MM_UP, h, T, gu, 2 * I, I, I, H, tmp, nt);
        }
        if (!p[L_ROUTER]) {
            act_mul(act, gu, mlp, T, I);
            layer_matmul(p, MM_DOWN, mlp, T, x, H, I, nt);
        }
        if (addr(p, L_POST_FF_NORM))
            for (long t = 0; t < T; t++) norm_row(x + t * H, addr(p, L_POST_FF_NORM), x + t * H, H, eps);
    }
    free(h);
    free(slots);
    return 0;
}

