/* pagedllm CPU kernels: the experts of a mixture-of-experts layer in one call (pl_moe_experts).
 *
 * Why: a token reads only its top-k experts. transformers' experts loop (and a Python one over the
 * active experts) costs a dozen torch calls per active expert; here the (token, expert) pairs are
 * grouped by expert with a counting sort, and each active expert's packed (or float32) gate|up and
 * down weights are read once per MOE_ROWS of its tokens. */
#include "cpu_common.h"
#include "quant_common.h" /* Q_LV1 */
#include <omp.h>

#define MOE_ROWS 16       /* rows per product (pl_qgemm's float32 register path takes up to 16) */
/* up to this many (token, expert) pairs (decode batches), with two active experts per thread or more,
 * the experts are split across the threads (each product on one core): no fork and join per product.
 * Prefill-sized calls split each product instead (splitting experts measured 10% slower there). */
#define MOE_SPLIT_PAIRS 256

/* y [m, H] = down_e(act(gate_e(x rows)) * up_e(...)) for the m (<= MOE_ROWS) pairs order[0..m) */
static void expert_rows(const int64_t *desc, const long *order, long m, long k, const float *x, float *y, long H,
                        long I, int act, float *scratch, int nt, int fl) {
    float *xg = scratch, *gu = xg + MOE_ROWS * H, *h = gu + MOE_ROWS * 2 * I;
    for (long r = 0; r < m; r++) memcpy(xg + r * H, x + (order[r] / k) * H, sizeof(float) * H);
    desc_matmul(desc, xg, m, gu, 2 * I, H, nt, fl);
    act_mul(act, gu, h, m, I);
    desc_matmul(desc + 5, h, m, y, H, I, nt, fl);
}

/* out [T, H] = sum over j < k of w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = idx[t, j]
 * (pairs with e outside 0..E-1 are skipped: another rank's experts). experts: [E][2][5] descriptors
 * {fmt, weight, d, m, bias} (desc_matmul) of each expert's fused gate|up [2I, H] and down [H, I]
 * products. act: 0 SiLU, 1 tanh-GELU, 2 gpt-oss clamped SwiGLU (act_mul). lv: the packed products'
 * int8 activation levels, 2, or 1 for a prefill-sized call (Q_LV1; kernels/cpu.py decides by T, so a
 * row's result depends on its step's size only as the dense products' does). The sum runs in expert order.
 * Returns 0, or -1 when scratch memory could not be allocated (out untouched then). */
int pl_moe_experts(long T, long k, const int64_t *idx, const float *w, const float *x, float *out, long H, long I,
                   const int64_t *experts, long E, int act, int nt, int lv) {
    int fl = lv == 1 ? Q_LV1 : 0;
    long P = T * k, per = MOE_ROWS * (H + 3 * I);
    long *start = calloc(E + 1, sizeof(long)), *order = malloc(sizeof(long) * (P ? P : 1));
    long *fill = malloc(sizeof(long) * (E ? E : 1));
    float *ys = malloc(sizeof(float) * (P <= MOE_SPLIT_PAIRS && P > MOE_ROWS ? P * H : MOE_ROWS * H));
    float *scratch = malloc(sizeof(float) * per * nt);
    if (!start || !order || !fill || !ys || !scratch) {
        free(start), free(order), free(fill), free(ys), free(scratch);
        return -1;
    }
    for (long p = 0; p < P; p++)
        if (idx[p] >= 0 && idx[p] < E) start[idx[p] + 1]++;
    long active = 0;
    for (long e = 0; e < E; e++) {
        active += start[e + 1] > 0;
        start[e + 1] += start[e];
    }
    int split = nt > 1 && P <= MOE_SPLIT_PAIRS && active >= 2 * nt;
    memcpy(fill, start, sizeof(long) * E);
    for (long p = 0; p < P; p++) /* stable: an expert's pairs keep token order */
        if (idx[p] >= 0 && idx[p] < E) order[fill[idx[p]]++] = p;
    memset(out, 0, sizeof(float) * T * H);
    if (split) {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (long e = 0; e < E; e++)
            for (long p0 = start[e]; p0 < start[e + 1]; p0 += MOE_ROWS) {
                long m = start[e + 1] - p0 < MOE_ROWS ? start[e + 1] - p0 : MOE_ROWS;
                expert_rows(experts + e * 10, order + p0, m, k, x, ys + p0 * H, H, I, act,
                            scratch + per * omp_get_thread_num(), 1, fl);
            }
    }
    for (long e = 0; e < E; e++)
        for (long p0 = start[e]; p0 < start[e + 1]; p0 += MOE_ROWS) {
            long m = start[e + 1] - p0 < MOE_ROWS ? start[e + 1] - p0 : MOE_ROWS;
            float *y = split ? ys + p0 * H : ys;
            if (!split) expert_rows(experts + e * 10, order + p0, m, k, x, y, H, I, act, scratch, nt, fl);
            for (long r = 0; r < m; r++) {
                long p = order[p0 + r];
                float wt = w[p], *o = out + (p / k) * H, *yr = y + r * H;
#pragma omp simd
                for (long c = 0; c < H; c++) o[c] += wt * yr[c];
            }
        }
    free(start), free(order), free(fill), free(ys), free(scratch);
    return 0;
}
