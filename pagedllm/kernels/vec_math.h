/* Scalar math written so that loops calling it vectorize; shared by the CPU kernels' sources
 * (pagedllm/kernels/cpu.py hashes this header with them). */
#ifndef PAGEDLLM_VEC_MATH_H
#define PAGEDLLM_VEC_MATH_H
#include <stdint.h>
#include <string.h>

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

#endif
