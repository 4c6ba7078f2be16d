/* Hybrid models' state mixers on the CPU, float32 (pagedllm/models/short_conv.py, mamba2.py).
 *
 * pl_causal_conv: the depthwise causal convolution of every request's segment of a flattened batch,
 *   continuing from the `width` inputs carried in the request's state slot, in one pass: per
 *   request and block of channels the window lives in a small local buffer, each token is one
 *   multiply-add per tap, and the new state is the window after the segment. Same definition as
 *   `causal_conv_step` (conv1d with width taps of padding over the whole sequence).
 * pl_ssd_scan: Mamba-2's SSM in its recurrent form over each request's segment (decodes and
 *   prefill chunks alike; transformers' `mamba2_selective_state_update` per token):
 *   dt = softplus(dt + dt_bias), state = state * exp(dt * A) + dt * B x, y = state . C + D x;
 *   one pass over each [d_head, d_state] state per token instead of seven tensor ops with
 *   temporaries (decode), or the chunked scan's matrix products (prefill: which pays is
 *   measured in benchmarks/hybrid_mixers.py).
 * Parallel over (request, channel block) and (request, head) with OpenMP, as cpu_kernels.c.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h" /* exp_approx */

#define CONV_BLOCK 64
#define CONV_MAX_WIDTH 16
#define STATE_PAR_MIN 32768

/* x [T, C]; qsl [R + 1]; init_slots [R] (-1: start from zeros); dest_slots [R];
 * cache [S, C, width] (oldest first), read at init_slots before dest_slots are written (a request
 * reads and writes its own window only); weight [C, width + 1]; bias [C] or NULL;
 * out [T, C]; silu: apply SiLU to the output (Mamba-2's input convolution);
 * ck_start [R + 1], ck_off, ck_slot [N]: request r's prefix-cache checkpoints are entries
 * ck_start[r] .. ck_start[r + 1] - 1, by offset: the window after ck_off tokens of its segment is
 * also written to slot ck_slot. */
/* One request's block of nc channels (c0 ..): inlined with a constant width for the common widths,
 * so the tap loops unroll and the channel loop vectorizes. */
static inline void conv_block(const float *x, long t0, long t1, long C, long c0, long nc, const float *init,
                              float *dest, const float *weight, const float *bias, float *out,
                              const int64_t *ck_off, const int64_t *ck_slot, long ck, long ck_end, float *cache,
                              const long width, int silu) {
    float win[CONV_MAX_WIDTH][CONV_BLOCK]; /* win[k][c]: the k-th oldest carried input */
    float wt[CONV_MAX_WIDTH + 1][CONV_BLOCK]; /* the taps, channel-minor */
    for (long c = 0; c < nc; c++) {
        for (long k = 0; k < width; k++) win[k][c] = init ? init[(c0 + c) * width + k] : 0.0f;
        for (long k = 0; k <= width; k++) wt[k][c] = weight[(c0 + c) * (width + 1) + k];
    }
    for (long t = t0; t < t1; t++) {
        const float *xt = x + t * C + c0;
        float *ot = out + t * C + c0;
#pragma omp simd
        for (long c = 0; c < nc; c++) {
            float acc = (bias ? bias[c0 + c] : 0.0f) + wt[width][c] * xt[c];
            for (long k = 0; k < width; k++) acc += wt[k][c] * win[k][c];
            for (long k = 0; k + 1 < width; k++) win[k][c] = win[k + 1][c];
            win[width - 1][c] = xt[c];
            ot[c] = silu ? acc / (1.0f + exp_approx(-acc)) : acc;
        }
        for (; ck < ck_end && ck_off[ck] == t - t0 + 1; ck++)
            for (long c = 0; c < nc; c++)
                for (long k = 0; k < width; k++) cache[(ck_slot[ck] * C + c0 + c) * width + k] = win[k][c];
    }
    for (long c = 0; c < nc; c++)
        for (long k = 0; k < width; k++) dest[(c0 + c) * width + k] = win[k][c];
}

/* x [T, C]; qsl [R + 1]; init_slots [R] (-1: start from zeros); dest_slots [R];
 * cache [S, C, width] (oldest first), read at init_slots before dest_slots are written (a request
 * reads and writes its own window only); weight [C, width + 1]; bias [C] or NULL;
 * out [T, C]; silu: apply SiLU to the output (Mamba-2's input convolution);
 * ck_start [R + 1], ck_off, ck_slot [N]: request r's prefix-cache checkpoints are entries
 * ck_start[r] .. ck_start[r + 1] - 1, by offset: the window after ck_off tokens of its segment is
 * also written to slot ck_slot. */
void pl_causal_conv(const float *x, const int64_t *qsl, const int64_t *init_slots, const int64_t *dest_slots,
                    float *cache, const float *weight, const float *bias, float *out, const int64_t *ck_start,
                    const int64_t *ck_off, const int64_t *ck_slot, long R, long C, long width, int silu, int nt) {
    long nblk = (C + CONV_BLOCK - 1) / CONV_BLOCK;
    long work = qsl[R] * C * (width + 1);
#pragma omp parallel for collapse(2) num_threads(nt) schedule(static) if (work >= STATE_PAR_MIN)
    for (long r = 0; r < R; r++) {
        for (long b = 0; b < nblk; b++) {
            long c0 = b * CONV_BLOCK, nc = C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK;
            const float *init = init_slots[r] < 0 ? NULL : cache + init_slots[r] * C * width;
            float *dest = cache + dest_slots[r] * C * width;
#define CONV_ARGS x, qsl[r], qsl[r + 1], C, c0, nc, init, dest, weight, bias, out, ck_off, ck_slot, \
                  ck_start[r], ck_start[r + 1], cache
            switch (width) { /* constant widths: LFM2's 2, Mamba's 3 */
            case 2: conv_block(CONV_ARGS, 2, silu); break;
            case 3: conv_block(CONV_ARGS, 3, silu); break;
            default: conv_block(CONV_ARGS, width, silu);
            }
#undef CONV_ARGS
        }
    }
}

/* Mamba-2's SSM over every request's segment, token by token (the recurrent form of SSD):
 * state [S, nh, hd, ns], read at init_slots [R] (-1: zeros) and written at dest_slots [R];
 * qsl [R + 1]; x [T, nh * hd]; dt [T, nh] (before dt_bias and softplus, then clamped to
 * request r's [dt_lim[2r], dt_lim[2r + 1]]); A [nh] (already -exp(A_log)); Bm, Cm [T, ng * ns]; D, dt_bias [nh];
 * y [T, nh * hd]; checkpoints as in pl_causal_conv (the state after ck_off tokens also goes to
 * ck_slot). A request's head is one task: its [hd, ns] state stays in cache while its tokens run. */
/* Tokens t0 .. t1 - 1 of one request's head h (group g) through its [hd, ns] state `st`, in place.
 * Kept out of line so that one compiled body serves every piece (pl_ssd_scan cuts a segment at its
 * checkpoints). */
__attribute__((noinline)) static void ssd_tokens(float *restrict st, long t0, long t1, long h, long g, const float *x,
                                                 const float *dt, float a, const float *Bm, const float *Cm, float dd,
                                                 float dt_bias, float dt_lo, float dt_hi, float *y, long nh, long hd,
                                                 long ns, long ng) {
    for (long t = t0; t < t1; t++) {
        float d = dt[t * nh + h] + dt_bias;
        d = d > 20.0f ? d : log1pf(expf(d)); /* torch's softplus (threshold 20) */
        d = d < dt_lo ? dt_lo : (d > dt_hi ? dt_hi : d);
        float da = expf(d * a);
        const float *restrict bb = Bm + (t * ng + g) * ns, *restrict cc = Cm + (t * ng + g) * ns;
        for (long p = 0; p < hd; p++) {
            float xv = x[(t * nh + h) * hd + p], dx = d * xv, acc = 0.0f;
            float *restrict o = st + p * ns;
#pragma omp simd reduction(+ : acc)
            for (long n = 0; n < ns; n++) {
                float v = o[n] * da + dx * bb[n];
                o[n] = v;
                acc += v * cc[n];
            }
            y[(t * nh + h) * hd + p] = acc + dd * xv;
        }
    }
}

void pl_ssd_scan(float *state, const int64_t *init_slots, const int64_t *dest_slots, const int64_t *qsl,
                 const float *x, const float *dt, const float *A, const float *Bm, const float *Cm, const float *D,
                 const float *dt_bias, const float *dt_lim, float *y, const int64_t *ck_start,
                 const int64_t *ck_off, const int64_t *ck_slot, long R, long nh, long hd, long ns, long ng, int nt) {
    long per_group = nh / ng, hs = hd * ns;
#pragma omp parallel for collapse(2) num_threads(nt) schedule(static) if (qsl[R] * nh * hs >= STATE_PAR_MIN)
    for (long r = 0; r < R; r++) {
        for (long h = 0; h < nh; h++) {
            float *st = state + (dest_slots[r] * nh + h) * hs;
            if (init_slots[r] < 0) memset(st, 0, hs * sizeof(float));
            else if (init_slots[r] != dest_slots[r]) memcpy(st, state + (init_slots[r] * nh + h) * hs, hs * sizeof(float));
            long t = qsl[r];
            for (long ck = ck_start[r]; ck <= ck_start[r + 1]; ck++) { /* pieces ending at the checkpoints, then the rest */
                long end = ck < ck_start[r + 1] ? qsl[r] + ck_off[ck] : qsl[r + 1];
                ssd_tokens(st, t, end, h, h / per_group, x, dt, A[h], Bm, Cm, D[h], dt_bias[h], dt_lim[2 * r],
                           dt_lim[2 * r + 1], y, nh, hd, ns, ng);
                t = end;
                if (ck < ck_start[r + 1]) memcpy(state + (ck_slot[ck] * nh + h) * hs, st, hs * sizeof(float));
            }
        }
    }
}
