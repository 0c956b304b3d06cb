/* What the kernels share: float exp without libm, and the 16-bit storage formats widened to
 * float exactly. Everything here is branch-free so that the loops calling it vectorize. */
#ifndef INFINIGEN_NUMERIC_H
#define INFINIGEN_NUMERIC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp in float, branch-free so that the position loops vectorize (libm's exp and log
 * are scalar calls). Cephes' single-precision polynomials: relative error about 2e-7 over the
 * range used here. exp_f(-inf) is 0 and exp_f saturates instead of overflowing. */
static inline float exp_f(float x) {
    const float c = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = floorf(c * 1.44269504088896341f + 0.5f);
    const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* Key formats: the partial keys are kept at the KV's storage precision (a 16-bit format
 * halves what stays with the compute) and widened to float here, tile by tile. The widenings
 * are integer operations only (no F16C or AVX-512 BF16 needed), so they vectorize everywhere. */
enum { KEYS_F32 = 0, KEYS_F16 = 1, KEYS_BF16 = 2, KEYS_I8 = 3, KEYS_I4 = 4 };

static inline float widen_f32(float x) { return x; }

static inline float widen_bf16(uint16_t h) {
    union { uint32_t i; float f; } u = {.i = (uint32_t)h << 16};
    return u.f;
}

/* IEEE half to float, exactly, branch-free. With the sign dropped, the exponent and mantissa
 * shifted to float's places give 2^(e-15+112) * 1.m once the exponent is rebiased by 224, so a
 * multiply by 2^-112 lands normals (and carries infinities and NaNs, exponent 31 -> 255);
 * subnormals (exponent 0) are m * 2^-24 = (0.5 + m * 2^-24) - 0.5, built as a float in [0.5, 1). */
static inline float widen_f16(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t body = w + w; /* exponent in bits 31..27, mantissa below */
    union { uint32_t i; float f; } normal = {.i = (body >> 4) + (224u << 23)};
    union { uint32_t i; float f; } sub = {.i = (body >> 17) | (126u << 23)};
    union { uint32_t i; float f; } out;
    out.f = body < (1u << 27) ? sub.f - 0.5f : normal.f * 0x1.0p-112f;
    out.i |= w & 0x80000000u;
    return out.f;
}

/* float to IEEE half, rounding to nearest even as torch's conversion does (overflow to
 * infinity, NaN kept quiet). Scalar: one per position and row. */
static inline uint16_t narrow_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds past 65504 */
    if (ax < 0x38800000u) {                                   /* below 2^-14: a subnormal half */
        float a;
        memcpy(&a, &ax, sizeof a);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f)); /* exact product, then RNE */
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry moves into the exponent */
    return (uint16_t)(sign | h);
}

/* float to bfloat16, rounding to nearest even as torch's conversion does (NaN kept quiet). */
static inline uint16_t narrow_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#endif
