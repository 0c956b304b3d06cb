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

#include "numeric.h"

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

/* The k-th largest (0-based) of the n keys in keys[] (n > k), which it overwrites: a radix
   select, 11 + 11 + 10 bits, each pass a histogram and a compaction of the keys left in the
   chosen bucket. Branch-free passes; a quickselect's data-dependent branches cost three times as
   much on a row of thousands of positions. */
static float kth_largest_key(uint32_t *keys, int64_t n, int64_t k) {
    static const int shift[3] = {21, 10, 0};
    uint32_t hist[2048];
    uint32_t prefix = 0;
    for (int p = 0; p < 3; p++) {
        const int sh = shift[p];
        const uint32_t nb = p < 2 ? 2048u : 1024u;
        for (uint32_t b = 0; b < nb; b++) hist[b] = 0;
        for (int64_t i = 0; i < n; i++) hist[(keys[i] >> sh) & (nb - 1)]++;
        int64_t seen = 0;
        uint32_t b = nb;
        while (b-- > 0) {
            if (seen + hist[b] > k) break;
            seen += hist[b];
        }
        k -= seen;
        int64_t w = 0;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t v = keys[i];
            keys[w] = v;
            w += ((v >> sh) & (nb - 1)) == b;
        }
        n = w;
        prefix |= b << sh;
    }
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
SCORE_ROW(score_row_i8, int8_t, widen_i8, 1) /* quantized codes: see score_row_i4 */

/* Quantized partial keys (infinigen.select.quantized): integer codes per channel and position
 * and one half-float scale per position; the per-channel scale is folded into the query by the
 * caller. scores[g][t] = s[t] * sum_c q[g][c] * code[c][t], the codes widened exactly. KEYS_I8:
 * int8 codes [C][ld]. KEYS_I4: two channels per byte, [C/2][ld], channel 2j in the low nibble and
 * 2j + 1 in the high one, each stored as code + 8 (C even: the caller pads a zero channel). */
static void score_row_i4(const uint8_t *k, int64_t ld, const uint16_t *s, const float *q, int64_t G, int64_t C,
                         int64_t T, float *scores) {
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const int64_t n = T - t0 < TILE ? T - t0 : TILE;
        float st[TILE];
        for (int64_t i = 0; i < n; i++) st[i] = widen_f16(s[t0 + i]);
        for (int64_t g = 0; g < G; g++) {
            float acc[TILE];
            for (int64_t i = 0; i < TILE; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j < C / 2; j++) {
                const uint8_t *kc = k + j * ld + t0;
                const float q0 = q[g * C + 2 * j], q1 = q[g * C + 2 * j + 1];
                if (n == TILE) {
                    for (int64_t i = 0; i < TILE; i++)
                        acc[i] += q0 * (float)((int)(kc[i] & 15) - 8) + q1 * (float)((int)(kc[i] >> 4) - 8);
                } else {
                    for (int64_t i = 0; i < n; i++)
                        acc[i] += q0 * (float)((int)(kc[i] & 15) - 8) + q1 * (float)((int)(kc[i] >> 4) - 8);
                }
            }
            for (int64_t i = 0; i < n; i++) scores[g * T + t0 + i] = acc[i] * st[i];
        }
    }
}

/* out[i] = keys[i] widened to float (the score pass's widening, exposed so that it can be
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
    else if (format == KEYS_I4) score_row_i4((const uint8_t *)keys + offset, ld, s, q, G, C, T, scores);
    else if (format == KEYS_F16) score_row_f16((const uint16_t *)keys + offset, ld, s, q, G, C, T, scores);
    else if (format == KEYS_BF16) score_row_bf16((const uint16_t *)keys + offset, ld, s, q, G, C, T, scores);
    else score_row_f32((const float *)keys + offset, ld, s, q, G, C, T, scores);
}

/* z[t]: the group's scores aggregated per position (see speculate.aggregate_group); -inf
   where not valid (the caller has set those scores to -inf). acc: [T] scratch. */
static void aggregate_row(float *scores, int64_t G, int64_t T, int mode, float *z, float *acc) {
    if (mode == AGG_UNION || mode == AGG_MASS) {
        for (int64_t g = 0; g < G; g++) {
            float *s = scores + g * T;
            const float top = max_of(s, T);
            if (mode == AGG_UNION) {
                const float off = top > -1e30f ? top : -1e30f; /* an all -inf row stays -inf */
                for (int64_t t = 0; t < T; t++) s[t] -= off;
            } else if (top > -INFINITY) { /* log_softmax over the valid positions */
                /* float lanes over runs of 64 tiles (vectorized), folded into a double sum */
                double sum = 0.0;
                int64_t t = 0;
                while (t + TILE <= T) {
                    float lane[TILE] = {0.0f};
                    for (int64_t run = 0; run < 64 && t + TILE <= T; run++, t += TILE)
                        for (int64_t i = 0; i < TILE; i++) lane[i] += exp_f(s[t + i] - top);
                    for (int64_t i = 0; i < TILE; i++) sum += lane[i];
                }
                for (; t < T; t++) sum += exp_f(s[t] - top);
                const float lse = top + log_f((float)sum);
                for (t = 0; t < T; t++) s[t] -= lse;
            }
        }
    }
    memcpy(z, scores, (size_t)T * sizeof(float));
    if (mode == AGG_MASS) {
        /* z = m + log sum_g exp(s_g - m), m the group's largest (the sum is then >= 1); one
           pass per head over the positions, so that each loop vectorizes */
        for (int64_t g = 1; g < G; g++)
            for (int64_t t = 0; t < T; t++) z[t] = maxf(scores[g * T + t], z[t]);
        for (int64_t t = 0; t < T; t++) acc[t] = 0.0f;
        for (int64_t g = 0; g < G; g++)
            for (int64_t t = 0; t < T; t++) {
                const float m = z[t] > -INFINITY ? z[t] : 0.0f;
                acc[t] += exp_f(scores[g * T + t] - m);
            }
        for (int64_t t = 0; t < T; t++) {
            const float lz = z[t] + log_f(acc[t] > 1.0f ? acc[t] : 1.0f);
            z[t] = z[t] > -INFINITY ? lz : -INFINITY;
        }
    } else if (mode == AGG_SUM) {
        for (int64_t g = 1; g < G; g++)
            for (int64_t t = 0; t < T; t++) z[t] += scores[g * T + t];
    } else {
        for (int64_t g = 1; g < G; g++)
            for (int64_t t = 0; t < T; t++) z[t] = maxf(scores[g * T + t], z[t]);
    }
}

/* z[t]: row r's aggregated group scores, -inf where not valid (vr: that row's valid bytes, or
   NULL) and where the aggregation gives NaN. bias: [G] added to each head's scores (the query
   against the channel means of centered codes), or NULL. Returns the row's context (its valid positions);
   z is not written when that is 0. */
static int64_t group_scores_row(const void *keys, int key_format, int64_t offset, int64_t ld, const uint16_t *s,
                                const float *q, const float *bias, int64_t G, int64_t C, int64_t T,
                                const uint8_t *vr, int mode, float *scores, float *z, float *tmp) {
    score_row(keys, key_format, offset, ld, s, q, G, C, T, scores);
    if (bias)
        for (int64_t g = 0; g < G; g++)
            for (int64_t t = 0; t < T; t++) scores[g * T + t] += bias[g];
    int64_t ctx = T;
    if (vr) {
        ctx = 0;
        for (int64_t t = 0; t < T; t++) ctx += vr[t] != 0;
        for (int64_t g = 0; g < G; g++)
            for (int64_t t = 0; t < T; t++) scores[g * T + t] = vr[t] ? scores[g * T + t] : -INFINITY;
    }
    if (ctx == 0) return 0;
    aggregate_row(scores, G, T, mode, z, tmp);
    for (int64_t t = 0; t < T; t++) z[t] = z[t] == z[t] ? z[t] : -INFINITY; /* a NaN never selects */
    return ctx;
}

/* Whether position t may be chosen: valid (vr NULL: all are) and not excluded (ex NULL: none is). */
static inline int open_at(const uint8_t *vr, const uint8_t *ex, int64_t t) {
    return (!vr || vr[t]) && !(ex && ex[t]);
}

/* The count-th largest z over the open positions (count >= 1, at most how many are open); tmp:
   [T] scratch, used as keys. */
static float cut_at(const float *z, const uint8_t *vr, const uint8_t *ex, int64_t T, int64_t count, float *tmp) {
    uint32_t *keys = (uint32_t *)tmp;
    int64_t n = 0;
    if (!vr && !ex) {
        for (int64_t t = 0; t < T; t++) keys[t] = order_key(z[t]);
        n = T;
    } else {
        for (int64_t t = 0; t < T; t++) {
            keys[n] = order_key(z[t]);
            n += open_at(vr, ex, t);
        }
    }
    return kth_largest_key(keys, n, count - 1);
}

/* Writes ascending the open positions above `cut`, and exact ties at the cut earliest first, up
   to `count`; returns how many it wrote. */
static int64_t emit_above(const float *z, const uint8_t *vr, const uint8_t *ex, int64_t T, int64_t count, float cut,
                          int64_t *out) {
    int64_t above = 0;
    for (int64_t t = 0; t < T; t++) above += open_at(vr, ex, t) && z[t] > cut;
    int64_t m = 0, ties = count - above;
    for (int64_t t = 0; t < T && m < count; t++) {
        if (!open_at(vr, ex, t)) continue;
        if (z[t] > cut) out[m++] = t;
        else if (z[t] == cut && ties > 0) { out[m++] = t; ties--; }
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
    const float thr = max_of(z, n) - alpha;
    int64_t kept = 0;
    if (vr) {
        for (int64_t t = 0; t < n; t++) kept += (vr[t] != 0) & (z[t] >= thr);
    } else {
        for (int64_t t = 0; t < n; t++) kept += z[t] >= thr;
    }
    int64_t cap = budget < 1.0 ? (int64_t)ceil((double)ctx * budget) : ctx;
    if (budget_tokens >= 0 && cap > budget_tokens) cap = budget_tokens;
    int64_t count = kept < cap ? kept : cap;
    const int64_t floor_ = ctx < min_tokens ? ctx : min_tokens;
    if (count < floor_) count = floor_;
    if (count > ctx) count = ctx;
    /* the count-th largest valid score becomes the threshold when the cap or floor moved it */
    const float cut = count != kept ? cut_at(z, vr, NULL, n, count, tmp) : thr;
    return emit_above(z, vr, NULL, n, count, cut, out);
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
                  int unit_rule, float *scores /* [G][T] */, float *z /* [T] */, float *tmp /* [T] */,
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
        out_count[r] = emit_above(z, vr, ex, T, count, cut_at(z, vr, ex, T, count, tmp), out_idx + r * T);
        if (out_count[r] > widest) widest = out_count[r];
    }
    pad_rows(R, T, out_count, widest, out_idx);
    return widest;
}
