/* InfiniGen's speculation and selection for one layer, one call: partial scores of a GQA
 * group's partial queries against the partial keys, aggregated per KV head, then the
 * threshold / cap / floor rule, written out as ascending positions.
 *
 * It computes exactly the rule of infinigen.speculate (aggregate_group + select_positions, and
 * top_up for a correction) in a few passes over the partial keys instead of a dozen tensor
 * operations; the Python side
 * falls back to those operations when this file cannot be compiled. Plain C99 without
 * intrinsics, written so that the compiler vectorizes every pass for the CPU it runs on
 * (no branches inside the position loops).
 *
 * Rows r = (batch, KV head). keys: channel-major [R][C][ld] (T columns used) in one of the key
 * formats below ([R][C/2][ld] bytes for packed 4-bit codes), scales: [R][ld] half floats for the
 * quantized formats (NULL otherwise), query: [R][G][C]
 * already multiplied by the attention scaling, bias: [R][G] added to every score of a head (the
 * query against the channel means of centered codes; NULL: none). valid: [R][T] bytes, or NULL
 * when every position exists.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "numeric.h"
#include "score.h"
#include "scratch.h"
#include "select.h"

enum { AGG_MAX = 0, AGG_UNION = 1, AGG_SUM = 2, AGG_MASS = 3 };
enum { TILE = 64, MAX_GROUP = 16 };

static inline float maxf(float a, float b) { return a > b ? a : b; }

/* log in float, branch-free (see exp_f in numeric.h); expects x > 0 (callers pass a sum that
 * holds at least exp(0) = 1). */
static inline float log_f(float x) {
    union { int32_t i; float f; } u = {.f = x};
    float e = (float)((u.i >> 23) - 126);
    u.i = (u.i & 0x007fffff) | 0x3f000000; /* mantissa in [0.5, 1) */
    float m = u.f;
    const int small = m < 0.707106781186547524f;
    e = small ? e - 1.0f : e;
    m = small ? m + m - 1.0f : m - 1.0f;
    const float z = m * m;
    float p = 7.0376836292e-2f;
    p = p * m - 1.1514610310e-1f;
    p = p * m + 1.1676998740e-1f;
    p = p * m - 1.2420140846e-1f;
    p = p * m + 1.4249322787e-1f;
    p = p * m - 1.6668057665e-1f;
    p = p * m + 2.0000714765e-1f;
    p = p * m - 2.4999993993e-1f;
    p = p * m + 3.3333331174e-1f;
    float y = m * z * p;
    y += -2.12194440e-4f * e;
    y += -0.5f * z;
    return m + y + 0.693359375f * e;
}

/* Floats as unsigned keys in the same order (-inf lowest; -0 just below +0, which compare equal
   as floats, so either is a correct cut); NaN never reaches here (the scores map it to -inf). */
static inline uint32_t order_key(float f) {
    union { float f; uint32_t i; } u = {.f = f};
    return u.i & 0x80000000u ? ~u.i : u.i | 0x80000000u;
}

static inline float key_float(uint32_t k) {
    union { float f; uint32_t i; } u = {.i = k & 0x80000000u ? k & 0x7fffffffu : ~k};
    return u.f;
}

/* Whether position t may be chosen: valid (vr NULL: all are) and not excluded (ex NULL: none is). */
static inline int open_at(const uint8_t *vr, const uint8_t *ex, int64_t t) {
    return (!vr || vr[t]) && !(ex && ex[t]);
}

/* The k-th largest (0-based) of the open positions' z (vr: valid bytes, ex: excluded bytes, either
   NULL; k below how many are open): a radix select on the floats' order keys, 11 + 11 + 10 bits,
   each pass a histogram and a compaction of the keys left in the chosen bucket; the first pass
   writes the keys (to `keys`, [T] scratch) as it counts them. Branch-free passes: a quickselect's
   data-dependent branches cost three times as much on a row of thousands of positions.
   *above: how many open positions lie strictly above the cut. */
static float kth_largest(const float *z, const uint8_t *vr, const uint8_t *ex, int64_t T, int64_t k, uint32_t *keys,
                         int64_t *above) {
    /* 11 + 11 + 10 bits for long rows; 8 bits a pass for short ones (whose histograms would cost
       more to clear and scan than their keys) */
    static const int wide[4] = {21, 10, 0, -1}, narrow[4] = {24, 16, 8, 0};
    const int small = T <= 4096;
    const int *shift = small ? narrow : wide, passes = small ? 4 : 3, top_shift = shift[0];
    const uint32_t first_buckets = small ? 256u : 2048u;
    uint32_t hist[2048];
    uint32_t prefix = 0;
    int64_t n = 0, greater = 0;
    for (uint32_t b = 0; b < first_buckets; b++) hist[b] = 0;
    if (!vr && !ex) {
        for (int64_t t = 0; t < T; t++) {
            const uint32_t key = order_key(z[t]);
            keys[t] = key;
            hist[key >> top_shift]++;
        }
        n = T;
    } else {
        for (int64_t t = 0; t < T; t++) {
            const uint32_t key = order_key(z[t]);
            const int open = open_at(vr, ex, t);
            keys[n] = key;
            hist[key >> top_shift] += (uint32_t)open;
            n += open;
        }
    }
    for (int p = 0; p < passes; p++) {
        const int sh = shift[p];
        const uint32_t nb = small ? 256u : (p < 2 ? 2048u : 1024u);
        if (p > 0) {
            for (uint32_t b = 0; b < nb; b++) hist[b] = 0;
            for (int64_t i = 0; i < n; i++) hist[(keys[i] >> sh) & (nb - 1)]++;
        }
        int64_t seen = 0;
        uint32_t b = nb;
        while (b-- > 0) {
            if (seen + hist[b] > k) break;
            seen += hist[b];
        }
        k -= seen;
        greater += seen;
        int64_t w = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t v = keys[i];
            keys[w] = v;
            w += ((v >> sh) & (nb - 1)) == b;
        }
        n = w;
        prefix |= b << sh;
    }
    *above = greater;
    return key_float(prefix);
}

/* The largest of x[0..n) (-inf when n == 0), by lanes so that it vectorizes. */
static float max_of(const float *x, int64_t n) {
    float lane[TILE];
    for (int64_t i = 0; i < TILE; i++) lane[i] = -INFINITY;
    int64_t t = 0;
    for (; t + TILE <= n; t += TILE)
        for (int64_t i = 0; i < TILE; i++) lane[i] = maxf(x[t + i], lane[i]);
    float top = -INFINITY;
    for (; t < n; t++) top = maxf(x[t], top);
    for (int64_t i = 0; i < TILE; i++) top = maxf(lane[i], top);
    return top;
}

/* scores[g][t] = sum_c q[g][c] * k[c][t], one tile of positions at a time. The accumulator of one
 * query head stays in registers across the channels (the key tile, a few KiB, is re-read from L1
 * for each head of the group): keeping all heads' accumulators in memory instead made every
 * multiply-add a load and a store, several times slower. Sums run over c ascending either way. */
#define SCORE_ROW(NAME, KEY_T, WIDEN, SCALED)                                                       \
    static void NAME(const KEY_T *k, int64_t ld, const uint16_t *s, const float *q, int64_t G,      \
                     int64_t C, int64_t T, float *scores) {                                         \
        for (int64_t t0 = 0; t0 < T; t0 += TILE) {                                                  \
            const int64_t n = T - t0 < TILE ? T - t0 : TILE;                                        \
            float st[TILE];                                                                         \
            if (SCALED) {                                                                           \
                for (int64_t i = 0; i < n; i++) st[i] = widen_f16(s[t0 + i]);                       \
                for (int64_t i = n; i < TILE; i++) st[i] = 0.0f;                                    \
            }                                                                                       \
            for (int64_t g = 0; g < G; g++) {                                                       \
                float acc[TILE];                                                                    \
                for (int64_t i = 0; i < TILE; i++) acc[i] = 0.0f;                                   \
                if (n == TILE) {                                                                    \
                    for (int64_t c = 0; c < C; c++) {                                               \
                        const KEY_T *kc = k + c * ld + t0;                                          \
                        const float qc = q[g * C + c];                                              \
                        for (int64_t i = 0; i < TILE; i++) acc[i] += qc * WIDEN(kc[i]);             \
                    }                                                                               \
                } else {                                                                            \
                    for (int64_t c = 0; c < C; c++) {                                               \
                        const KEY_T *kc = k + c * ld + t0;                                          \
                        const float qc = q[g * C + c];                                              \
                        for (int64_t i = 0; i < n; i++) acc[i] += qc * WIDEN(kc[i]);                \
                    }                                                                               \
                }                                                                                   \
                float *out = scores + g * T + t0;                                                   \
                if (SCALED) for (int64_t i = 0; i < n; i++) out[i] = acc[i] * st[i];                \
                else memcpy(out, acc, (size_t)n * sizeof(float));                                   \
            }                                                                                       \
        }                                                                                           \
    }

static inline float widen_i8(int8_t x) { return (float)x; }

SCORE_ROW(score_row_f32, float, widen_f32, 0)
SCORE_ROW(score_row_f16, uint16_t, widen_f16, 0)
SCORE_ROW(score_row_bf16, uint16_t, widen_bf16, 0)
SCORE_ROW(score_row_i8, int8_t, widen_i8, 1) /* quantized codes: see below */

/* Quantized partial keys (infinigen.select.quantized): int8 codes [C][ld] per channel and position
 * and one half-float scale per position; the per-channel scale is folded into the query by the
 * caller: scores[g][t] = s[t] * sum_c q[g][c] * code[c][t], the codes widened exactly. Packed 4-bit
 * codes are scored in integers instead (score.c, `score_row_codes`).
 *
 * out[i] = keys[i] widened to float (the score pass's widening, exposed so that it can be
   checked against every 16-bit pattern). */
void ig_widen(const void *keys, int format, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++)
        out[i] = format == KEYS_F16    ? widen_f16(((const uint16_t *)keys)[i])
                 : format == KEYS_BF16 ? widen_bf16(((const uint16_t *)keys)[i])
                                       : ((const float *)keys)[i];
}

static void score_row(const void *keys, int format, int64_t offset, int64_t ld, const uint16_t *s,
                      const float *q, int64_t G, int64_t C, int64_t T, float *scores) {
    if (format == KEYS_I8) score_row_i8((const int8_t *)keys + offset, ld, s, q, G, C, T, scores);
    else if (format == KEYS_F16) score_row_f16((const uint16_t *)keys + offset, ld, s, q, G, C, T, scores);
    else if (format == KEYS_BF16) score_row_bf16((const uint16_t *)keys + offset, ld, s, q, G, C, T, scores);
    else score_row_f32((const float *)keys + offset, ld, s, q, G, C, T, scores);
}

/* sum of exp_f(s[t] - top) over t < T: float lanes over runs of 64 tiles (vectorized), folded into
   a double sum; each exponential is also written to e[t]. */
static double exp_sum(const float *s, int64_t T, float top, float *e) {
    double sum = 0.0;
    int64_t t = 0;
    while (t + TILE <= T) {
        float lane[TILE] = {0.0f};
        for (int64_t run = 0; run < 64 && t + TILE <= T; run++, t += TILE)
            for (int64_t i = 0; i < TILE; i++) {
                e[t + i] = exp_f(s[t + i] - top);
                lane[i] += e[t + i];
            }
        for (int64_t i = 0; i < TILE; i++) sum += lane[i];
    }
    for (; t < T; t++) {
        e[t] = exp_f(s[t] - top);
        sum += e[t];
    }
    return sum;
}

/* z[t]: the group's scores aggregated per position (see speculate.aggregate_group); -inf
   where not valid (the caller has set those scores to -inf). e: [G][T] scratch.
   mass: z = log sum_g e_g[t] / S_g with e_g = exp(s_g - max s_g) and S_g its sum: one exponential
   per head and position and one log per position; where every head's exponential is below
   float's range, the same sum is taken in logs from the scores (exact where the other would be 0).
   rank: only the order of z will be read (no threshold, no units): mass skips the log and leaves
   the sum itself, which orders the positions as its log does; the positions below float's range
   keep their (negative) log, below every sum. */
static void aggregate_row(float *scores, int64_t G, int64_t T, int mode, int rank, float *z, float *e) {
    if (mode == AGG_UNION) {
        for (int64_t g = 0; g < G; g++) {
            float *s = scores + g * T;
            const float top = max_of(s, T);
            const float off = top > -1e30f ? top : -1e30f; /* an all -inf row stays -inf */
            for (int64_t t = 0; t < T; t++) s[t] -= off;
        }
    }
    if (mode == AGG_MASS) {
        float top[MAX_GROUP], inv[MAX_GROUP], lse[MAX_GROUP];
        for (int64_t g = 0; g < G; g++) {
            top[g] = max_of(scores + g * T, T);
            if (top[g] > -INFINITY) {
                const double sum = exp_sum(scores + g * T, T, top[g], e + g * T);
                inv[g] = (float)(1.0 / sum);
                lse[g] = top[g] + log_f((float)sum);
            } else { /* no valid position: this head adds nothing */
                memset(e + g * T, 0, (size_t)T * sizeof(float));
                inv[g] = 0.0f;
                lse[g] = INFINITY;
            }
        }
        for (int64_t t = 0; t < T; t++) z[t] = 0.0f;
        for (int64_t g = 0; g < G; g++)
            for (int64_t t = 0; t < T; t++) z[t] += e[g * T + t] * inv[g];
        int64_t deep = 0;
        for (int64_t t = 0; t < T; t++) deep += z[t] == 0.0f;
        if (rank) {
            for (int64_t t = 0; t < T; t++) z[t] = z[t] > 0.0f ? z[t] : -INFINITY;
        } else {
            for (int64_t t = 0; t < T; t++) {
                const float x = z[t], l = log_f(x > 0.0f ? x : 1.0f);
                z[t] = x > 0.0f ? l : -INFINITY;
            }
        }
        if (deep) /* positions every head puts below float's range: their log-sum-exp from the scores */
            for (int64_t t = 0; t < T; t++) {
                if (z[t] > -INFINITY) continue;
                float m = -INFINITY;
                for (int64_t g = 0; g < G; g++) m = maxf(scores[g * T + t] - lse[g], m);
                if (m == -INFINITY) continue; /* not valid */
                float acc = 0.0f;
                for (int64_t g = 0; g < G; g++) acc += exp_f(scores[g * T + t] - lse[g] - m);
                z[t] = m + log_f(acc > 1.0f ? acc : 1.0f);
            }
        return;
    }
    memcpy(z, scores, (size_t)T * sizeof(float));
    if (mode == AGG_SUM) {
        for (int64_t g = 1; g < G; g++)
            for (int64_t t = 0; t < T; t++) z[t] += scores[g * T + t];
    } else {
        for (int64_t g = 1; g < G; g++)
            for (int64_t t = 0; t < T; t++) z[t] = maxf(scores[g * T + t], z[t]);
    }
}

/* z[t]: a row's group scores (G rows of T, bias included) aggregated, -inf where not valid (vr:
   that row's valid bytes, or NULL) and where the aggregation gives NaN. Returns the row's context
   (its valid positions); z is not written when that is 0. */
static int64_t aggregate_scored(float *scores, int64_t G, int64_t T, const uint8_t *vr, int mode, int rank,
                                float *z, float *e) {
    int64_t ctx = T;
    if (vr) {
        ctx = 0;
        for (int64_t t = 0; t < T; t++) ctx += vr[t] != 0;
        for (int64_t g = 0; g < G; g++)
            for (int64_t t = 0; t < T; t++) scores[g * T + t] = vr[t] ? scores[g * T + t] : -INFINITY;
    }
    if (ctx == 0) return 0;
    aggregate_row(scores, G, T, mode, rank, z, e);
    for (int64_t t = 0; t < T; t++) z[t] = z[t] == z[t] ? z[t] : -INFINITY; /* a NaN never selects */
    return ctx;
}

/* Packed 4-bit codes [C/2][ld] of one row scored with integer dot products (score.c): the query
   [G][C] quantized to int8 per head first. */
static void score_row_codes(const uint8_t *k, int64_t ld, const uint16_t *s, const float *q, const float *bias,
                            int64_t G, int64_t C, int64_t T, float *scores) {
    const int64_t pairs = C / 2, quads = (pairs + 1) / 2;
    int32_t q4[MAX_GROUP * (SCORE_MAX_CHANNELS / 4)], qsum[MAX_GROUP];
    float qscale[MAX_GROUP];
    ig_quantize_query(q, G, C, quads, q4, qsum, qscale);
    const ig_code_row row = {k, (const uint8_t *)s, NULL, 0, 0, ld > 0 ? ld : 1, ld, pairs};
    const ig_int_query iq = {G, quads, q4, qsum, qscale, bias};
    ig_score_row(&row, 0, T, &iq, scores, T, ig_isa());
}

/* z[t]: row r's aggregated group scores, -inf where not valid (vr: that row's valid bytes, or
   NULL) and where the aggregation gives NaN. bias: [G] added to each head's scores (the query
   against the channel means of centered codes), or NULL. Returns the row's context (its valid positions);
   z is not written when that is 0. */
static int64_t group_scores_row(const void *keys, int key_format, int64_t offset, int64_t ld, const uint16_t *s,
                                const float *q, const float *bias, int64_t G, int64_t C, int64_t T,
                                const uint8_t *vr, int mode, float *scores, float *z, float *tmp) {
    if (key_format == KEYS_I4) {
        score_row_codes((const uint8_t *)keys + offset, ld, s, q, bias, G, C, T, scores);
    } else {
        score_row(keys, key_format, offset, ld, s, q, G, C, T, scores);
        if (bias)
            for (int64_t g = 0; g < G; g++)
                for (int64_t t = 0; t < T; t++) scores[g * T + t] += bias[g];
    }
    (void)tmp;
    return aggregate_scored(scores, G, T, vr, mode, 0, z, scores + G * T); /* scores: [2G][T] */
}

static __thread arena cand_arena;

enum { SAMPLE = 16, VEC_SLACK = 16 };

/* Open positions of [t0, T) with z >= lo, in order: values to val, positions to pos; returns how many. */
static int64_t collect_portable(const float *z, const uint8_t *vr, const uint8_t *ex, int64_t t0, int64_t T, float lo,
                                float *val, int64_t *pos) {
    int64_t n = 0;
    for (int64_t t = t0; t < T; t++) {
        val[n] = z[t];
        pos[n] = t;
        n += open_at(vr, ex, t) & (z[t] >= lo);
    }
    return n;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The same with AVX-512 compressions in registers (each store writes a whole vector: the buffers
   have VEC_SLACK elements of room past the last candidate). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static int64_t collect_512(const float *z, const uint8_t *vr,
                                                                                const uint8_t *ex, int64_t T, float lo,
                                                                                float *val, int64_t *pos) {
    int64_t n = 0, t = 0;
    const __m512 vlo = _mm512_set1_ps(lo);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; t + 16 <= T; t += 16) {
        const __m512 v = _mm512_loadu_ps(z + t);
        __mmask16 m = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ);
        if (vr) m &= _mm512_test_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(vr + t))),
                                            _mm512_set1_epi32(0xff));
        if (ex) m &= _mm512_testn_epi32_mask(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ex + t))),
                                             _mm512_set1_epi32(0xff));
        if (!m) continue;
        _mm512_storeu_ps(val + n, _mm512_maskz_compress_ps(m, v));
        const __m512i idx = _mm512_maskz_compress_epi32(m, _mm512_add_epi32(_mm512_set1_epi32((int)t), iota));
        _mm512_storeu_si512((void *)(pos + n), _mm512_cvtepi32_epi64(_mm512_castsi512_si256(idx)));
        _mm512_storeu_si512((void *)(pos + n + 8), _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(idx, 1)));
        n += __builtin_popcount((unsigned)m);
    }
    return n + collect_portable(z, vr, ex, t, T, lo, val + n, pos + n);
}
#endif

static int64_t collect(const float *z, const uint8_t *vr, const uint8_t *ex, int64_t T, float lo, float *val,
                       int64_t *pos) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (ig_isa() >= ISA_AVX512 && T < (1LL << 31)) return collect_512(z, vr, ex, T, lo, val, pos);
#endif
    return collect_portable(z, vr, ex, 0, T, lo, val, pos);
}

/* Writes ascending the open positions above the count-th largest z over the open positions
   (count >= 1, at most how many are open), and exact ties at that cut earliest first, up to
   `count`; returns how many it wrote. tmp: [T] scratch.
   The cut is found among candidates: every SAMPLE-th open position is sampled, a bound `lo` set
   safely below where the count-th largest should lie by the samples, and the positions at or above
   it collected in one pass (vectorized); their radix select gives the cut, and they are emitted.
   Where the bound falls short (fewer candidates than `count`), or the row is short, every open
   position is ranked instead: the same positions either way. */
static int64_t emit_top(const float *z, const uint8_t *vr, const uint8_t *ex, int64_t T, int64_t count, float *tmp,
                        int64_t *out) {
    int64_t above;
    if (T >= 16 * SAMPLE && 4 * count <= T) {
        const int64_t ns_cap = T / SAMPLE + 1;
        char *w = scratch(&cand_arena, (size_t)(ns_cap * 2 + T + VEC_SLACK) * sizeof(float) +
                                           (size_t)(T + VEC_SLACK) * sizeof(int64_t));
        if (w) {
            float *samples = (float *)w, *val = samples + ns_cap;
            uint32_t *skeys = (uint32_t *)(val + T + VEC_SLACK);
            int64_t *pos = (int64_t *)(skeys + ns_cap);
            int64_t ns = 0, open = 0;
            for (int64_t t = SAMPLE / 2; t < T; t += SAMPLE) {
                samples[ns] = z[t];
                ns += open_at(vr, ex, t);
            }
            for (int64_t t = 0; t < T; t++) open += open_at(vr, ex, t);
            /* the samples' rank that should leave a quarter more than `count` above it, and some */
            const int64_t ks = (int64_t)ceil((double)count * ns / (double)(open > 0 ? open : 1) * 1.25) + 4;
            if (ks < ns) {
                int64_t unused;
                const float lo = kth_largest(samples, NULL, NULL, ns, ks, skeys, &unused);
                const int64_t nc = collect(z, vr, ex, T, lo, val, pos);
                if (nc >= count) {
                    const float cut = kth_largest(val, NULL, NULL, nc, count - 1, (uint32_t *)tmp, &above);
                    int64_t m = 0, ties = count - above;
                    for (int64_t i = 0; i < nc; i++) {
                        const int tie = val[i] == cut, take = (val[i] > cut) | (tie & (ties > 0));
                        ties -= tie & take;
                        out[m] = pos[i];
                        m += take;
                    }
                    return m;
                }
            }
        }
    }
    const float cut = kth_largest(z, vr, ex, T, count - 1, (uint32_t *)tmp, &above);
    int64_t m = 0, ties = count - above;
    for (int64_t t = 0; t < T; t++) {
        const int open = open_at(vr, ex, t), tie = open & (z[t] == cut);
        const int take = (open & (z[t] > cut)) | (tie & (ties > 0));
        ties -= tie & take;
        out[m] = t;
        m += take;
    }
    return m;
}

/* Writes ascending every open position whose z is at least thr (alpha's threshold; all of them for
   thr = -inf): `count` of them, counted by the caller. */
static int64_t emit_at_least(const float *z, const uint8_t *vr, int64_t T, float thr, int64_t *out) {
    int64_t m = 0;
    for (int64_t t = 0; t < T; t++) {
        out[m] = t;
        m += open_at(vr, NULL, t) & (z[t] >= thr);
    }
    return m;
}

/* Padding slots (past each row's count, up to the widest) hold position 0. */
static void pad_rows(int64_t R, int64_t T, const int64_t *count, int64_t widest, int64_t *out_idx) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t m = count[r]; m < widest; m++) out_idx[r * T + m] = 0;
}

/* The rule over one row of scores z[0..n) (vr: which exist, NULL: all; ctx: how many do):
   the threshold alpha below the best, the cap (budget of ctx, at most budget_tokens when >= 0),
   the floor min_tokens; writes the chosen ascending to out and returns how many. */
static int64_t choose(const float *z, const uint8_t *vr, int64_t n, int64_t ctx, float alpha, double budget,
                      int64_t budget_tokens, int64_t min_tokens, float *tmp, int64_t *out) {
    /* alpha = inf (the default) keeps every valid position before the cap: no pass needed */
    const float thr = alpha == INFINITY ? -INFINITY : max_of(z, n) - alpha;
    int64_t kept = ctx;
    if (thr > -INFINITY) {
        kept = 0;
        if (vr) {
            for (int64_t t = 0; t < n; t++) kept += (vr[t] != 0) & (z[t] >= thr);
        } else {
            for (int64_t t = 0; t < n; t++) kept += z[t] >= thr;
        }
    }
    int64_t cap = budget < 1.0 ? (int64_t)ceil((double)ctx * budget) : ctx;
    if (budget_tokens >= 0 && cap > budget_tokens) cap = budget_tokens;
    int64_t count = kept < cap ? kept : cap;
    const int64_t floor_ = ctx < min_tokens ? ctx : min_tokens;
    if (count < floor_) count = floor_;
    if (count > ctx) count = ctx;
    if (count <= 0) return 0;
    /* the count-th largest valid score becomes the threshold when the cap or floor moved it */
    return count != kept ? emit_top(z, vr, NULL, n, count, tmp, out) : emit_at_least(z, vr, n, thr, out);
}

/* A unit's score from its valid scores z[start..end) (speculate.unit_scores): rule 0 its best,
   1 the log of their summed exponentials (mass, in the kernels' float exp and log), 2 the mean of its two best (one valid: itself).
   -INFINITY when none is valid; *any says whether one is. */
static float unit_score(const float *z, const uint8_t *vr, int64_t start, int64_t end, int rule, uint8_t *any) {
    float best = -INFINITY, second = -INFINITY;
    uint8_t seen = 0;
    for (int64_t t = start; t < end; t++) {
        if (vr && !vr[t]) continue;
        seen = 1;
        if (z[t] > best) { second = best; best = z[t]; }
        else if (z[t] > second) second = z[t];
    }
    *any = seen;
    if (!seen || rule == 0 || best == -INFINITY) return best;
    if (rule == 2) return second == -INFINITY ? best : 0.5f * (best + second);
    float sum = 0.0f;
    for (int64_t t = start; t < end; t++) sum += (!vr || vr[t]) ? exp_f(z[t] - best) : 0.0f;
    return best + log_f(sum);
}

/* The rule applied to aligned units of `block` positions (speculate.select_blocks): a unit is
   scored by `rule` (unit_score) and exists when it holds a valid position; budget_tokens and
   min_tokens count units (at least one); every valid position of a chosen unit is written,
   ascending. zb, bidx: [nb] scratch, bv: [nb] bytes. Returns how many positions it wrote. */
static int64_t choose_blocks(const float *z, const uint8_t *vr, int64_t T, int64_t block, int rule, float alpha,
                             double budget, int64_t budget_tokens, int64_t min_tokens, float *zb, uint8_t *bv,
                             int64_t *bidx, float *tmp, int64_t *out) {
    const int64_t nb = (T + block - 1) / block;
    int64_t cb = 0;
    for (int64_t j = 0; j < nb; j++) {
        const int64_t end = (j + 1) * block < T ? (j + 1) * block : T;
        zb[j] = unit_score(z, vr, j * block, end, rule, &bv[j]);
        cb += bv[j];
    }
    const int64_t bt = budget_tokens < 0 ? -1 : (budget_tokens / block > 1 ? budget_tokens / block : 1);
    const int64_t bf = (min_tokens + block - 1) / block > 1 ? (min_tokens + block - 1) / block : 1;
    const int64_t chosen = choose(zb, bv, nb, cb, alpha, budget, bt, bf, tmp, bidx);
    int64_t m = 0;
    for (int64_t i = 0; i < chosen; i++) {
        const int64_t start = bidx[i] * block, end = start + block < T ? start + block : T;
        for (int64_t t = start; t < end; t++)
            if (!vr || vr[t]) out[m++] = t;
    }
    return m;
}

/* Returns the largest count over rows (the width of the selection); -1 for a group wider than
   MAX_GROUP, -2 when block scratch cannot be allocated. block: 1 selects positions, more selects
   aligned units of that many, scored by unit_rule (unit_score). */
int64_t ig_select(const void *keys, int key_format, int64_t key_row_stride, int64_t ld, const uint16_t *scales,
                  const float *query, const float *bias /* [R][G] or NULL */,
                  int64_t R, int64_t G, int64_t C, int64_t T, const uint8_t *valid, int mode,
                  float alpha, double budget, int64_t budget_tokens, int64_t min_tokens, int64_t block,
                  int unit_rule, float *scores /* [2G][T] */, float *z /* [T] */, float *tmp /* [T] */,
                  int64_t *out_idx /* [R][T] */, int64_t *out_count /* [R] */) {
    if (G > MAX_GROUP) return -1;
    const int64_t nb = block > 1 ? (T + block - 1) / block : 0;
    float *zb = NULL;
    uint8_t *bv = NULL;
    int64_t *bidx = NULL;
    if (nb) {
        zb = malloc((size_t)nb * sizeof(float));
        bv = malloc((size_t)nb);
        bidx = malloc((size_t)nb * sizeof(int64_t));
        if (!zb || !bv || !bidx) {
            free(zb); free(bv); free(bidx);
            return -2;
        }
    }
    int64_t widest = 0;
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *vr = valid ? valid + r * T : NULL;
        out_count[r] = 0;
        const int64_t ctx = group_scores_row(keys, key_format, r * key_row_stride, ld, scales ? scales + r * ld : NULL,
                                             query + r * G * C, bias ? bias + r * G : NULL, G, C, T, vr, mode,
                                             scores, z, tmp);
        if (ctx == 0) continue;
        out_count[r] = nb ? choose_blocks(z, vr, T, block, unit_rule, alpha, budget, budget_tokens, min_tokens, zb, bv, bidx,
                                          tmp, out_idx + r * T)
                          : choose(z, vr, T, ctx, alpha, budget, budget_tokens, min_tokens, tmp, out_idx + r * T);
        if (out_count[r] > widest) widest = out_count[r];
    }
    free(zb); free(bv); free(bidx);
    pad_rows(R, T, out_count, widest, out_idx);
    return widest;
}

/* Speculate, then correct: per row, the want[r] best positions by the same group scores (from
   layer i's own query) among the valid ones that `chosen` [R][T] (bytes) does not hold, fewer
   when fewer are open. Same rule for ties as ig_select; returns the widest row. */
int64_t ig_top_up(const void *keys, int key_format, int64_t key_row_stride, int64_t ld, const uint16_t *scales,
                  const float *query, const float *bias,
                  int64_t R, int64_t G, int64_t C, int64_t T, const uint8_t *valid, int mode, const uint8_t *chosen,
                  const int64_t *want, float *scores, float *z, float *tmp, int64_t *out_idx, int64_t *out_count) {
    if (G > MAX_GROUP) return -1;
    int64_t widest = 0;
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *vr = valid ? valid + r * T : NULL, *ex = chosen + r * T;
        out_count[r] = 0;
        int64_t open = 0;
        for (int64_t t = 0; t < T; t++) open += open_at(vr, ex, t);
        const int64_t count = want[r] < open ? want[r] : open;
        if (count <= 0) continue;
        group_scores_row(keys, key_format, r * key_row_stride, ld, scales ? scales + r * ld : NULL, query + r * G * C,
                         bias ? bias + r * G : NULL, G, C, T, vr, mode, scores, z, tmp);
        out_count[r] = emit_top(z, vr, ex, T, count, tmp, out_idx + r * T);
        if (out_count[r] > widest) widest = out_count[r];
    }
    pad_rows(R, T, out_count, widest, out_idx);
    return widest;
}

/* ------------------------------------------------------------------ codes read where they lie
 * The selection of every (request, KV head) row of a step in one call, over packed 4-bit codes
 * read in place (vLLM's pages through its block tables, or the library's buffers), on `nthreads`
 * threads of the OpenMP pool torch itself runs on (so that the two never compete for a core).
 * Each row's codes are read once for its speculated query heads and, with a correction, its own
 * query heads together: the speculation chooses by the rule, the own query tops the choice up. */

static __thread arena row_arena, call_arena;

static ig_code_row code_row(const ig_codes *k, int64_t r, int64_t h) {
    const int64_t cr = k->tables ? 0 : r * k->code_request, sr = k->tables ? 0 : r * k->scale_request;
    ig_code_row row = {k->codes + cr + h * k->code_head, k->scales + sr + h * k->scale_head,
                       k->tables ? k->tables + r * k->table_ld : NULL, k->code_block, k->scale_block,
                       k->block, k->ld, k->pairs};
    return row;
}

/* Bytes of one row's selection scratch: scores [Q][T], exponentials [G][T], z, tmp [T], unit
   scratch, chosen bytes. */
static size_t row_scratch_bytes(int64_t Q, int64_t G, int64_t T) {
    const int64_t n = T > 0 ? T : 1;
    return (size_t)((Q + G) * n + 3 * n) * sizeof(float) + (size_t)n * (sizeof(int64_t) + 2);
}

/* One row from its scores (Q = G, or 2G with the own query's heads after the speculation's). */
static void choose_row(float *scores, int64_t G, int own, int64_t T, const uint8_t *vr, const ig_rule *rule,
                       float *e, float *z, float *tmp, float *zb, uint8_t *bv, int64_t *bidx, uint8_t *chosen,
                       int64_t *out, int64_t *count, int64_t *extra) {
    *count = 0;
    if (extra) *extra = 0;
    /* with no threshold and no units only the order of the scores counts (and the top-up ranks) */
    const int rank = rule->alpha == INFINITY && rule->unit <= 1;
    const int64_t ctx = aggregate_scored(scores, G, T, vr, (int)rule->mode, rank, z, e);
    if (ctx == 0) return;
    *count = rule->unit > 1
                 ? choose_blocks(z, vr, T, rule->unit, (int)rule->unit_rule, (float)rule->alpha, rule->budget,
                                 rule->budget_tokens, rule->min_tokens, zb, bv, bidx, tmp, out)
                 : choose(z, vr, T, ctx, (float)rule->alpha, rule->budget, rule->budget_tokens, rule->min_tokens, tmp,
                          out);
    if (!own || !extra || rule->correction <= 0.0) return;
    memset(chosen, 0, (size_t)T);
    for (int64_t i = 0; i < *count; i++) chosen[out[i]] = 1;
    aggregate_scored(scores + G * T, G, T, vr, (int)rule->mode, 1, z, e);
    int64_t open = 0;
    for (int64_t t = 0; t < T; t++) open += open_at(vr, chosen, t);
    int64_t want = (int64_t)ceil((double)ctx * rule->correction);
    want = want < open ? want : open;
    if (want > 0) *extra = emit_top(z, vr, chosen, T, want, tmp, out + *count);
}

int64_t ig_select_codes(const ig_codes *k, int64_t R, int64_t Hkv, int64_t G, int64_t C, const int64_t *lengths,
                        const uint8_t *valid, int64_t ldv, const float *spec, const float *spec_bias, const float *own,
                        const float *own_bias, const ig_rule *rule, int64_t *out, int64_t ldo, int64_t *counts,
                        int64_t *extra, int nthreads) {
    if (G > MAX_GROUP || C > SCORE_MAX_CHANNELS || C > 4 * ((k->pairs + 1) / 2)) return -1;
    const int with_own = own != NULL && extra != NULL && rule->correction > 0.0;
    const int64_t rows = R * Hkv, Q = with_own ? 2 * G : G, quads = (k->pairs + 1) / 2;
    int64_t T = 0;
    for (int64_t r = 0; r < R; r++) T = lengths[r] > T ? lengths[r] : T;
    if (T > ldo) return -3;
    /* the queries in int8, every row's, in the calling thread (a few hundred numbers each) */
    const size_t qbytes = (size_t)rows * Q * (quads * 4 + 8);
    const int split = nthreads > 1 && rows < 2 * nthreads;
    const size_t shared = split ? (size_t)rows * Q * (T > 0 ? T : 1) * sizeof(float) : 0;
    char *base = scratch(&call_arena, qbytes + shared + 64);
    if (!base) return -2;
    int32_t *q4 = (int32_t *)base, *qsum = q4 + rows * Q * quads;
    float *qscale = (float *)(qsum + rows * Q), *bias = qscale + rows * Q;
    float *prescored = split ? bias + rows * Q : NULL;
    for (int64_t i = 0; i < rows; i++) {
        float *b = bias + i * Q;
        ig_quantize_query(spec + i * G * C, G, C, quads, q4 + i * Q * quads, qsum + i * Q, qscale + i * Q);
        for (int64_t g = 0; g < G; g++) b[g] = spec_bias ? spec_bias[i * G + g] : 0.0f;
        if (with_own) {
            ig_quantize_query(own + i * G * C, G, C, quads, q4 + (i * Q + G) * quads, qsum + i * Q + G, qscale + i * Q + G);
            for (int64_t g = 0; g < G; g++) b[G + g] = own_bias ? own_bias[i * G + g] : 0.0f;
        }
    }
    const int isa = ig_isa();
    int failed = 0;
    if (split) { /* few rows: each row's positions scored in pieces on every thread first */
        const int64_t pieces = (2 * nthreads + rows - 1) / rows;
        const int64_t span = ((T + pieces - 1) / pieces + 63) / 64 * 64;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t item = 0; item < rows * pieces; item++) {
            const int64_t i = item / pieces, r = i / Hkv, h = i % Hkv;
            const int64_t start = (item % pieces) * span, stop = start + span < lengths[r] ? start + span : lengths[r];
            if (start >= stop) continue;
            const ig_code_row row = code_row(k, r, h);
            const ig_int_query iq = {Q, quads, q4 + i * Q * quads, qsum + i * Q, qscale + i * Q, bias + i * Q};
            ig_score_row(&row, start, stop, &iq, prescored + i * Q * T, lengths[r], isa);
        }
    }
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t i = 0; i < rows; i++) {
        const int64_t r = i / Hkv, h = i % Hkv, t = lengths[r];
        char *w = scratch(&row_arena, row_scratch_bytes(Q, G, t));
        if (!w) {
            failed = 1;
            continue;
        }
        const int64_t n = t > 0 ? t : 1;
        float *scores = prescored ? prescored + i * Q * T : (float *)w;
        float *e = (float *)w + Q * n, *z = e + G * n, *tmp = z + n, *zb = tmp + n;
        int64_t *bidx = (int64_t *)(zb + n);
        uint8_t *bv = (uint8_t *)(bidx + n), *chosen = bv + n;
        if (!prescored && t > 0) {
            const ig_code_row row = code_row(k, r, h);
            const ig_int_query iq = {Q, quads, q4 + i * Q * quads, qsum + i * Q, qscale + i * Q, bias + i * Q};
            ig_score_row(&row, 0, t, &iq, scores, t, isa);
        }
        choose_row(scores, G, with_own, t, valid ? valid + i * ldv : NULL, rule, e, z, tmp, zb, bv, bidx, chosen,
                   out + i * ldo, counts + i, extra ? extra + i : NULL);
    }
    if (failed) return -2;
    int64_t widest = 0;
    for (int64_t i = 0; i < rows; i++) {
        const int64_t n = counts[i] + (extra ? extra[i] : 0);
        widest = n > widest ? n : widest;
    }
    return widest;
}
