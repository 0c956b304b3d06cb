/* The partial keys of new positions quantized and written into their growing buffers in one
 * call: the rule of infinigen.select.quantized.quantize, operation for operation in float32, so
 * that the codes and scales are bit-identical to the tensor path's. At decode it runs once per
 * layer and token on the compute thread, where a dozen tiny tensor operations each paid for
 * their dispatch and for the interpreter lock shared with the prefetch thread.
 *
 * Rows r = (batch, KV head). keys: [R][n][C] float32 (projected partial keys); mu, sigma:
 * [R][C] float32 (the channel means and scales fixed at the prefill). Per position:
 * x = (k - mu) / sigma; scale = half(max|x| / levels); code = clamp(rint(x / scale), +-levels),
 * a zero scale dividing by 1. codes: [R][CC][ld] int8 (CC = C), or packed 4-bit (CC = ceil(C/2):
 * channel 2j in the low nibble, 2j + 1 in the high one, each stored as code + 8, an odd C padded
 * with a zero code); scales: [R][ld] half floats. Columns [at, at + n) are written.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "numeric.h"

enum { QUANT_I8 = 3, QUANT_I4 = 4, MAX_CHANNELS = 1024 };

static float widen_half(uint16_t h) { /* exact; the scale as stored is what the codes round against */
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    float f;
    if (e == 0) f = (float)m * 0x1.0p-24f;
    else if (e == 31) {
        const uint32_t bits = 0x7f800000u | (m << 13);
        memcpy(&f, &bits, sizeof f);
    } else {
        const uint32_t bits = ((e + 112u) << 23) | (m << 13);
        memcpy(&f, &bits, sizeof f);
    }
    uint32_t out;
    memcpy(&out, &f, sizeof out);
    out |= sign;
    memcpy(&f, &out, sizeof f);
    return f;
}

/* One position's partial key k [C] quantized about mu, sigma [C]: its codes q [C] (clamped to
 * +-levels) and its float16 scale. */
void ig_quantize_position(const float *k, const float *mu, const float *sigma, int64_t C, float levels, int32_t *q,
                          uint16_t *scale) {
    float x[MAX_CHANNELS];
    float top = 0.0f;
    for (int64_t c = 0; c < C; c++) {
        x[c] = (k[c] - mu[c]) / sigma[c];
        const float a = fabsf(x[c]);
        top = a > top ? a : top;
    }
    const uint16_t half = narrow_f16(top / levels);
    const float s = widen_half(half);
    const float by = s > 0.0f ? s : 1.0f;
    for (int64_t c = 0; c < C; c++) {
        const float v = nearbyintf(x[c] / by);
        q[c] = (int32_t)(v < -levels ? -levels : (v > levels ? levels : v));
    }
    *scale = half;
}

/* Returns 0, or -1 for a format or channel count it does not take (nothing written). */
int64_t ig_quantize_keys(const float *keys, const float *mu, const float *sigma, int64_t R, int64_t n, int64_t C,
                         int format, void *codes, uint16_t *scales, int64_t ld, int64_t at) {
    if ((format != QUANT_I8 && format != QUANT_I4) || C < 1 || C > MAX_CHANNELS) return -1;
    const float levels = format == QUANT_I8 ? 127.0f : 7.0f;
    const int64_t cc = format == QUANT_I8 ? C : (C + 1) / 2;
    int32_t q[MAX_CHANNELS + 1];
    for (int64_t r = 0; r < R; r++) {
        for (int64_t t = 0; t < n; t++) {
            ig_quantize_position(keys + (r * n + t) * C, mu + r * C, sigma + r * C, C, levels, q, scales + r * ld + at + t);
            q[C] = 0; /* the padding channel of an odd count */
            if (format == QUANT_I8) {
                int8_t *out = (int8_t *)codes + r * cc * ld + at + t;
                for (int64_t c = 0; c < C; c++) out[c * ld] = (int8_t)q[c];
            } else {
                uint8_t *out = (uint8_t *)codes + r * cc * ld + at + t;
                for (int64_t j = 0; j < cc; j++)
                    out[j * ld] = (uint8_t)((q[2 * j] + 8) | ((q[2 * j + 1] + 8) << 4));
            }
        }
    }
    return 0;
}
