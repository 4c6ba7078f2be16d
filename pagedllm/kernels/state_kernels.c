/* Hybrid models' state mixers on the CPU, float32 (pagedllm/models/short_conv.py, mamba2.py).
 *
 * pl_causal_conv: the depthwise causal convolution of every request's segment of a flattened batch,
 *   continuing from the `width` inputs carried in the request's state slot, in one pass: per
 *   request and block of channels the window lives in a small local buffer, each token is one
 *   multiply-add per tap, and the new state is the window after the segment. Same definition as
 *   `causal_conv_step` (conv1d with width taps of padding over the whole sequence).
 * pl_ssd_decode: Mamba-2's recurrent update of one token per request (transformers'
 *   `mamba2_selective_state_update`, torch path): dt = softplus(dt + dt_bias),
 *   state = state * exp(dt * A) + dt * B x, y = state . C + D x; one pass over each
 *   [d_head, d_state] state instead of seven tensor ops with temporaries.
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

/* state [S, nh, hd, ns]; init_slots [B] (-1: zeros); dest_slots [B]; x [B, nh * hd]; dt [B, nh];
 * A [nh] (already -exp(A_log)); Bm, Cm [B, ng * ns]; D, dt_bias [nh]; y [B, nh * hd]. */
void pl_ssd_decode(float *state, const int64_t *init_slots, const int64_t *dest_slots, const float *x,
                   const float *dt, const float *A, const float *Bm, const float *Cm, const float *D,
                   const float *dt_bias, float *y, long B, long nh, long hd, long ns, long ng, int nt) {
    long per_group = nh / ng;
#pragma omp parallel for collapse(2) num_threads(nt) schedule(static) if (B * nh * hd * ns >= STATE_PAR_MIN)
    for (long b = 0; b < B; b++) {
        for (long h = 0; h < nh; h++) {
            float d = dt[b * nh + h] + dt_bias[h];
            d = d > 20.0f ? d : log1pf(expf(d)); /* torch's softplus (threshold 20) */
            float da = expf(d * A[h]);
            long g = h / per_group;
            const float *bb = Bm + (b * ng + g) * ns, *cc = Cm + (b * ng + g) * ns;
            const float *src = init_slots[b] < 0 ? NULL : state + ((init_slots[b] * nh + h) * hd) * ns;
            float *dst = state + ((dest_slots[b] * nh + h) * hd) * ns;
            for (long p = 0; p < hd; p++) {
                float xv = x[(b * nh + h) * hd + p], dx = d * xv, acc = 0.0f;
                const float *s = src ? src + p * ns : NULL;
                float *o = dst + p * ns;
#pragma omp simd reduction(+ : acc)
                for (long n = 0; n < ns; n++) {
                    float v = (s ? s[n] * da : 0.0f) + dx * bb[n];
                    o[n] = v;
                    acc += v * cc[n];
                }
                y[(b * nh + h) * hd + p] = acc + D[h] * xv;
            }
        }
    }
}
