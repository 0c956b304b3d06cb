/* Attention of one decode position over rows as they are stored (fp32, fp16 or bf16) and over
 * its own new position (fp32): the rows are widened to float a tile at a time inside the loops,
 * so no float copy of them is ever made, and each row is read once for its scores (K) and once
 * for the output (V). The softmax is exact: every score of a row (b, KV head) is kept.
 *
 * Rows r = (b, h) of B x H: keys and values at k + b*sb + h*sh + t*sn (elements; the d channels
 * of a position contiguous), t < n. q: [R][G][d] already multiplied by the attention scaling;
 * valid: [R][n] bytes or NULL (every row present); knew, vnew: [R][d], or both NULL for no new
 * position (a part of a softmax carried over several calls). probs: [G][n + 1] per row, at
 * probs + r * probs_stride (stride 0: one scratch for every row; else the weights, the new
 * position last); tile: ig_attend_scratch(d) floats of scratch; out: [R][G][d]; norm: NULL, or
 * [R][G][2] that receives each softmax's maximum score and its sum of exponentials about it (the
 * normalizer, which merges parts; -inf and 0, with a zero output, where nothing was attended).
 */
#include <stdint.h>
#include <string.h>

#include "numeric.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { ATT_TILE = 32, LANES = 8 };

static void widen_run(const void *src, int format, int64_t count, float *dst) {
    if (format == KEYS_F16) {
        const uint16_t *s = (const uint16_t *)src;
        int64_t i = 0;
#if defined(__F16C__) /* the CPU's own conversion where it has one (equal to widen_f16 on every non-NaN value) */
        for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < count; i++) dst[i] = widen_f16(s[i]);
    } else if (format == KEYS_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < count; i++) dst[i] = widen_bf16(s[i]);
    } else {
        memcpy(dst, src, (size_t)count * sizeof(float));
    }
}

/* m positions from `base` (stride sn elements) widened into dst [m][d]. */
static void widen_tile(const char *base, int format, int64_t sn, int64_t m, int64_t d, float *dst) {
    const int64_t size = format == KEYS_F32 ? 4 : 2;
    if (sn == d) {
        widen_run(base, format, m * d, dst);
    } else {
        for (int64_t i = 0; i < m; i++) widen_run(base + i * sn * size, format, d, dst + i * d);
    }
}

static inline float lane_sum(const float *lane) {
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

/* sum_c a[c] * b[c], d a multiple of LANES, in LANES partial sums (a fixed order, which the
 * compiler maps onto vector registers). */
static inline float dot(const float *a, const float *b, int64_t d) {
    float lane[LANES] = {0};
    for (int64_t c = 0; c < d; c += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += a[c + j] * b[c + j];
    return lane_sum(lane);
}

/* dot(a, b + i * d) for i < 4 at once: four independent chains keep the multiply-adds in flight. */
static inline void dot4(const float *a, const float *b, int64_t d, float *out) {
    float l0[LANES] = {0}, l1[LANES] = {0}, l2[LANES] = {0}, l3[LANES] = {0};
    for (int64_t c = 0; c < d; c += LANES)
        for (int j = 0; j < LANES; j++) {
            l0[j] += a[c + j] * b[c + j];
            l1[j] += a[c + j] * b[d + c + j];
            l2[j] += a[c + j] * b[2 * d + c + j];
            l3[j] += a[c + j] * b[3 * d + c + j];
        }
    out[0] = lane_sum(l0), out[1] = lane_sum(l1), out[2] = lane_sum(l2), out[3] = lane_sum(l3);
}

/* The largest of x[0..n) and `start`, in LANES partial maxima (vectorizable). */
static float max_from(const float *x, int64_t n, float start) {
    float lane[LANES];
    for (int j = 0; j < LANES; j++) lane[j] = start;
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES)
        for (int j = 0; j < LANES; j++) lane[j] = x[t + j] > lane[j] ? x[t + j] : lane[j];
    for (; t < n; t++) lane[0] = x[t] > lane[0] ? x[t] : lane[0];
    float top = lane[0];
    for (int j = 1; j < LANES; j++) top = lane[j] > top ? lane[j] : top;
    return top;
}

static float sum_of(const float *x, int64_t n) {
    float lane[LANES] = {0};
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += x[t + j];
    for (; t < n; t++) lane[0] += x[t];
    return lane_sum(lane);
}

/* The floats of scratch `tile` that ig_attend needs for head dim d, or 0 when it cannot read d
 * (not a multiple of LANES): the one place these rules live. */
int64_t ig_attend_scratch(int64_t d) { return d > 0 && d % LANES == 0 ? 2 * ATT_TILE * d : 0; }

void ig_attend(const void *k, const void *v, int format, int64_t B, int64_t H, int64_t sb, int64_t sh, int64_t sn,
               int64_t G, int64_t n, int64_t d, const float *q, const uint8_t *valid, const float *knew,
               const float *vnew, float *probs, int64_t probs_stride, float *tile, float *out, float *norm) {
    const int64_t size = format == KEYS_F32 ? 4 : 2, T = n + 1;
    float *kt = tile, *vt = tile + ATT_TILE * d;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t r = b * H + h;
            const char *kr = (const char *)k + (b * sb + h * sh) * size;
            const char *vr = (const char *)v + (b * sb + h * sh) * size;
            const float *qr = q + r * G * d;
            const uint8_t *ok = valid ? valid + r * n : NULL;
            float *p = probs + r * probs_stride, *o = out + r * G * d;
            for (int64_t t0 = 0; t0 < n; t0 += ATT_TILE) { /* scores */
                const int64_t m = n - t0 < ATT_TILE ? n - t0 : ATT_TILE;
                widen_tile(kr + t0 * sn * size, format, sn, m, d, kt);
                for (int64_t g = 0; g < G; g++) {
                    float *pg = p + g * T + t0;
                    int64_t i = 0;
                    for (; i + 4 <= m; i += 4) dot4(qr + g * d, kt + i * d, d, pg + i);
                    for (; i < m; i++) pg[i] = dot(qr + g * d, kt + i * d, d);
                }
            }
            for (int64_t g = 0; g < G; g++) { /* softmax, and the new position's part of the output */
                float *pg = p + g * T, *og = o + g * d;
                pg[n] = knew ? dot(qr + g * d, knew + r * d, d) : -INFINITY;
                if (ok)
                    for (int64_t t = 0; t < n; t++) pg[t] = ok[t] ? pg[t] : -INFINITY;
                const float top = max_from(pg, n, pg[n]);
                if (top == -INFINITY) { /* nothing to attend (no new position, no valid row) */
                    memset(pg, 0, (size_t)T * sizeof(float));
                    memset(og, 0, (size_t)d * sizeof(float));
                    if (norm) norm[2 * (r * G + g)] = -INFINITY, norm[2 * (r * G + g) + 1] = 0.0f;
                    continue;
                }
                for (int64_t t = 0; t < T; t++) pg[t] = exp_f(pg[t] - top);
                const float total = sum_of(pg, T), inv = 1.0f / total;
                for (int64_t t = 0; t < T; t++) pg[t] *= inv;
                for (int64_t c = 0; c < d; c++) og[c] = knew ? pg[n] * vnew[r * d + c] : 0.0f;
                if (norm) norm[2 * (r * G + g)] = top, norm[2 * (r * G + g) + 1] = total;
            }
            for (int64_t t0 = 0; t0 < n; t0 += ATT_TILE) { /* the rows' part of the output */
                const int64_t m = n - t0 < ATT_TILE ? n - t0 : ATT_TILE;
                widen_tile(vr + t0 * sn * size, format, sn, m, d, vt);
                for (int64_t g = 0; g < G; g++) {
                    float *og = o + g * d;
                    const float *pg = p + g * T + t0;
                    for (int64_t i = 0; i < m; i++) {
                        const float w = pg[i];
                        const float *vi = vt + i * d;
                        for (int64_t c = 0; c < d; c++) og[c] += w * vi[c];
                    }
                }
            }
        }
    }
}
