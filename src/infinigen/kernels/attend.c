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
#include <stdlib.h>
#include <string.h>

#include "attend.h"
#include "numeric.h"
#include "scratch.h"

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

/* dot and dot4 in 16 partial sums, for a d that is a multiple of 16 (a 512-bit vector's floats):
 * half the multiply-add instructions of LANES where the CPU has the registers. */
static inline float lane_sum16(const float *l) {
    float a[LANES];
    for (int j = 0; j < LANES; j++) a[j] = l[j] + l[j + LANES];
    return lane_sum(a);
}

static inline float dot16(const float *a, const float *b, int64_t d) {
    float lane[16] = {0};
    for (int64_t c = 0; c < d; c += 16)
        for (int j = 0; j < 16; j++) lane[j] += a[c + j] * b[c + j];
    return lane_sum16(lane);
}

static inline void dot4_16(const float *a, const float *b, int64_t d, float *out) {
    float l0[16] = {0}, l1[16] = {0}, l2[16] = {0}, l3[16] = {0};
    for (int64_t c = 0; c < d; c += 16)
        for (int j = 0; j < 16; j++) {
            l0[j] += a[c + j] * b[c + j];
            l1[j] += a[c + j] * b[d + c + j];
            l2[j] += a[c + j] * b[2 * d + c + j];
            l3[j] += a[c + j] * b[3 * d + c + j];
        }
    out[0] = lane_sum16(l0), out[1] = lane_sum16(l1), out[2] = lane_sum16(l2), out[3] = lane_sum16(l3);
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

/* out[c] += sum_i w[i] * rows[i][c] for c < d (a multiple of LANES): each run of 64 (else LANES)
 * channels is summed in registers over the rows, in the rows' order (a sum into memory, row after
 * row, would wait on its own store at every row). */
static inline void weighted_sum(float *out, const float *w, const float *rows, int64_t n, int64_t d) {
    int64_t c0 = 0;
    for (; c0 + 64 <= d; c0 += 64) {
        float a[64];
        memcpy(a, out + c0, sizeof a);
        for (int64_t i = 0; i < n; i++) {
            const float wi = w[i], *ri = rows + i * d + c0;
            for (int c = 0; c < 64; c++) a[c] += wi * ri[c];
        }
        memcpy(out + c0, a, sizeof a);
    }
    for (; c0 + LANES <= d; c0 += LANES) {
        float a[LANES];
        memcpy(a, out + c0, sizeof a);
        for (int64_t i = 0; i < n; i++) {
            const float wi = w[i], *ri = rows + i * d + c0;
            for (int c = 0; c < LANES; c++) a[c] += wi * ri[c];
        }
        memcpy(out + c0, a, sizeof a);
    }
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
                for (int64_t g = 0; g < G; g++) weighted_sum(o + g * d, p + g * T + t0, vt, m, d);
            }
        }
    }
}

/* ------------------------------------------------------------------ rows read where they lie
 * A decode step's attention over the chosen positions of each (request, KV head) row, read by
 * position from where the tier keeps them (vLLM's blocks through its block tables, or the
 * library's buffers): no gather into a step buffer. The rows are split into pieces of positions
 * over `nthreads` threads of torch's own OpenMP pool; each piece is an exact softmax part (its
 * maximum, its sum of exponentials, its weighted values), merged with the new position's. */

static __thread arena piece_arena, merge_arena;

/* Where position p of row (r, h) lies (elements). A block of a power-of-two size (vLLM's) is found
 * by a shift: a 64-bit division per row would cost more than reading the row. */
static inline int64_t kv_offset(const ig_kv_rows *kv, int64_t r, int64_t h, int64_t p) {
    if (!kv->tables) return r * kv->request + h * kv->head + p * kv->row;
    const int64_t bs = kv->block;
    const int64_t blk = (bs & (bs - 1)) == 0 ? p >> __builtin_ctzll((unsigned long long)bs) : p / bs;
    return h * kv->head + kv->tables[r * kv->table_ld + blk] * kv->block_stride + (p - blk * bs) * kv->row;
}

/* One piece: positions [a, b) of row (r, h) (pos: its positions, or NULL: a..b themselves). part:
 * [G][d + 2] = weighted values, then the maximum and the sum of exponentials. */
/* Asks for the rows of positions [t0, t1) of the piece ahead of their use (they lie anywhere: the
 * hardware's stream prefetcher cannot guess them). */
static inline void prefetch_rows(const ig_kv_rows *kv, const void *base, int64_t r, int64_t h, const int64_t *pos,
                                 int64_t a, int64_t t0, int64_t t1, int64_t bytes) {
    for (int64_t t = t0; t < t1; t++) {
        const int64_t at = pos ? pos[a + t] : a + t;
        const char *row = (const char *)base + kv_offset(kv, r, h, at) * (kv->format == KEYS_F32 ? 4 : 2);
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
    }
}

static void attend_piece(const ig_kv_rows *kv, int64_t r, int64_t h, int64_t G, int64_t d, const float *q,
                         const int64_t *pos, int64_t a, int64_t b, float *part, float *work) {
    const int64_t size = kv->format == KEYS_F32 ? 4 : 2, m = b - a, bytes = d * size;
    float *p = work, *tile = work + G * m; /* scores [G][m], then a tile of rows [ATT_TILE][d] */
    prefetch_rows(kv, kv->k, r, h, pos, a, 0, m < ATT_TILE ? m : ATT_TILE, bytes);
    for (int64_t t0 = 0; t0 < m; t0 += ATT_TILE) {
        const int64_t n = m - t0 < ATT_TILE ? m - t0 : ATT_TILE;
        const int64_t ahead = t0 + ATT_TILE + ATT_TILE < m ? t0 + 2 * ATT_TILE : m;
        if (t0 + ATT_TILE < m) prefetch_rows(kv, kv->k, r, h, pos, a, t0 + ATT_TILE, ahead, bytes);
        else prefetch_rows(kv, kv->v, r, h, pos, a, 0, m < ATT_TILE ? m : ATT_TILE, bytes);
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = pos ? pos[a + t0 + i] : a + t0 + i;
            widen_run((const char *)kv->k + kv_offset(kv, r, h, at) * size, (int)kv->format, d, tile + i * d);
        }
        for (int64_t g = 0; g < G; g++) {
            float *pg = p + g * m + t0;
            int64_t i = 0;
            if (d % 16 == 0) {
                for (; i + 4 <= n; i += 4) dot4_16(q + g * d, tile + i * d, d, pg + i);
                for (; i < n; i++) pg[i] = dot16(q + g * d, tile + i * d, d);
            } else {
                for (; i + 4 <= n; i += 4) dot4(q + g * d, tile + i * d, d, pg + i);
                for (; i < n; i++) pg[i] = dot(q + g * d, tile + i * d, d);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *pg = p + g * m, *acc = part + g * (d + 2);
        const float top = max_from(pg, m, -INFINITY);
        for (int64_t t = 0; t < m; t++) pg[t] = exp_f(pg[t] - top);
        acc[d] = top;
        acc[d + 1] = sum_of(pg, m);
        memset(acc, 0, (size_t)d * sizeof(float));
    }
    for (int64_t t0 = 0; t0 < m; t0 += ATT_TILE) {
        const int64_t n = m - t0 < ATT_TILE ? m - t0 : ATT_TILE;
        if (t0 + ATT_TILE < m)
            prefetch_rows(kv, kv->v, r, h, pos, a, t0 + ATT_TILE, t0 + 2 * ATT_TILE < m ? t0 + 2 * ATT_TILE : m, bytes);
        for (int64_t i = 0; i < n; i++) {
            const int64_t at = pos ? pos[a + t0 + i] : a + t0 + i;
            widen_run((const char *)kv->v + kv_offset(kv, r, h, at) * size, (int)kv->format, d, tile + i * d);
        }
        for (int64_t g = 0; g < G; g++) weighted_sum(part + g * (d + 2), p + g * m + t0, tile, n, d);
    }
}

/* Returns 0, -1 for a head dim it does not read, -2 when scratch cannot be allocated. */
int64_t ig_attend_rows(const ig_kv_rows *kv, int64_t R, int64_t Hkv, int64_t G, int64_t d, const float *q,
                       const int64_t *positions, const int64_t *counts, int64_t ldp, const int64_t *lengths,
                       const float *knew, const float *vnew, float *out, int nthreads) {
    if (ig_attend_scratch(d) == 0) return -1;
    const int64_t rows = R * Hkv;
    int64_t total = 0;
    for (int64_t i = 0; i < rows; i++) total += positions ? counts[i] : lengths[i / Hkv];
    /* pieces: enough for every thread several times over, none below 64 positions */
    int64_t span = total / (4 * (nthreads > 0 ? nthreads : 1));
    span = span < 64 ? 64 : (span > 2048 ? 2048 : span);
    int64_t items = 0;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t n = positions ? counts[i] : lengths[i / Hkv];
        items += (n + span - 1) / span;
    }
    char *base = scratch(&merge_arena, (size_t)(items + 1) * 2 * sizeof(int64_t) +
                                               (size_t)(items + 1) * G * (d + 2) * sizeof(float));
    if (!base) return -2;
    int64_t *first = (int64_t *)base, *owner = first + items + 1;
    float *parts = (float *)(owner + items + 1);
    int64_t it = 0;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t n = positions ? counts[i] : lengths[i / Hkv];
        for (int64_t a = 0; a < n; a += span, it++) first[it] = a, owner[it] = i;
    }
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t j = 0; j < items; j++) {
        const int64_t i = owner[j], r = i / Hkv, h = i % Hkv, a = first[j];
        const int64_t n = positions ? counts[i] : lengths[r], b = a + span < n ? a + span : n;
        float *work = scratch(&piece_arena, (size_t)(G * span + ATT_TILE * d) * sizeof(float));
        if (!work) {
            failed = 1;
            continue;
        }
        attend_piece(kv, r, h, G, d, q + i * G * d, positions ? positions + i * ldp : NULL, a, b,
                     parts + j * G * (d + 2), work);
    }
    if (failed) return -2;
    /* merge each row's pieces and its new position (pieces of a row are consecutive items) */
    int64_t j0 = 0;
    for (int64_t i = 0; i < rows; i++) {
        int64_t j1 = j0;
        while (j1 < items && owner[j1] == i) j1++;
        for (int64_t g = 0; g < G; g++) {
            const float *qg = q + (i * G + g) * d;
            float *o = out + (i * G + g) * d;
            const float snew = knew ? dot(qg, knew + i * d, d) : -INFINITY;
            float top = snew;
            for (int64_t j = j0; j < j1; j++) {
                const float mj = parts[(j * G + g) * (d + 2) + d];
                top = mj > top ? mj : top;
            }
            if (top == -INFINITY) {
                memset(o, 0, (size_t)d * sizeof(float));
                continue;
            }
            float total_w = 0.0f;
            const float wnew = knew ? exp_f(snew - top) : 0.0f;
            for (int64_t c = 0; c < d; c++) o[c] = knew ? wnew * vnew[i * d + c] : 0.0f;
            total_w += wnew;
            for (int64_t j = j0; j < j1; j++) {
                const float *pj = parts + (j * G + g) * (d + 2);
                const float w = pj[d] == -INFINITY ? 0.0f : exp_f(pj[d] - top);
                for (int64_t c = 0; c < d; c++) o[c] += w * pj[c];
                total_w += w * pj[d + 1];
            }
            const float inv = 1.0f / total_w;
            for (int64_t c = 0; c < d; c++) o[c] *= inv;
        }
        j0 = j1;
    }
    return 0;
}
