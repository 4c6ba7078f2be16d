/* pagedllm CPU kernels: the experts of a mixture-of-experts layer in one call (pl_moe_experts).
 *
 * Why: a token reads only its top-k experts. transformers' experts loop (and a Python one over the
 * active experts) costs a dozen torch calls per active expert; here the (token, expert) pairs are
 * grouped by expert with a counting sort, and each active expert's packed (or float32) gate|up and
 * down weights are read once per MOE_ROWS of its tokens. */
#include "cpu_common.h"

#define MOE_ROWS 16 /* rows per product (pl_qgemm's float32 register path takes up to 16) */

/* out [T, H] = sum over j < k of w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = idx[t, j]
 * (pairs with e outside 0..E-1 are skipped: another rank's experts). experts: [E][2][5] descriptors
 * {fmt, weight, d, m, bias} (desc_matmul) of each expert's fused gate|up [2I, H] and down [H, I]
 * products. act: 0 SiLU, 1 tanh-GELU. Returns 0, or -1 when scratch memory could not be allocated
 * (out untouched then). */
int pl_moe_experts(long T, long k, const int64_t *idx, const float *w, const float *x, float *out, long H, long I,
                   const int64_t *experts, long E, int act, int nt) {
    long P = T * k;
    long *start = calloc(E + 1, sizeof(long)), *order = malloc(sizeof(long) * (P ? P : 1));
    float *buf = malloc(sizeof(float) * MOE_ROWS * (2 * H + 3 * I));
    if (!start || !order || !buf) {
        free(start);
        free(order);
        free(buf);
        return -1;
    }
    float *xg = buf, *gu = xg + MOE_ROWS * H, *h = gu + MOE_ROWS * 2 * I, *y = h + MOE_ROWS * I;
    for (long p = 0; p < P; p++)
        if (idx[p] >= 0 && idx[p] < E) start[idx[p] + 1]++;
    for (long e = 0; e < E; e++) start[e + 1] += start[e];
    long *fill = malloc(sizeof(long) * (E ? E : 1));
    if (!fill) {
        free(start);
        free(order);
        free(buf);
        return -1;
    }
    memcpy(fill, start, sizeof(long) * E);
    for (long p = 0; p < P; p++) /* stable: an expert's pairs keep token order */
        if (idx[p] >= 0 && idx[p] < E) order[fill[idx[p]]++] = p;
    free(fill);
    memset(out, 0, sizeof(float) * T * H);
    for (long e = 0; e < E; e++) {
        const int64_t *gate_up = experts + e * 10, *down = gate_up + 5;
        for (long p0 = start[e]; p0 < start[e + 1]; p0 += MOE_ROWS) {
            long m = start[e + 1] - p0 < MOE_ROWS ? start[e + 1] - p0 : MOE_ROWS;
            for (long r = 0; r < m; r++) memcpy(xg + r * H, x + (order[p0 + r] / k) * H, sizeof(float) * H);
            desc_matmul(gate_up, xg, m, gu, 2 * I, H, nt);
            act_mul(act, gu, h, m, I);
            desc_matmul(down, h, m, y, H, I, nt);
            for (long r = 0; r < m; r++) {
                long p = order[p0 + r];
                float wt = w[p], *o = out + (p / k) * H, *yr = y + r * H;
#pragma omp simd
                for (long c = 0; c < H; c++) o[c] += wt * yr[c];
            }
        }
    }
    free(start);
    free(order);
    free(buf);
    return 0;
}
