/* InfiniGen's speculation and selection for one layer, one call: partial scores of a GQA
 * group's partial queries against the partial keys, aggregated per KV head, then the
 * threshold / cap / floor rule, written out as ascending positions.
 *
 * It computes exactly the rule of infinigen.speculate (aggregate_group + select_positions) in
 * a few passes over the partial keys instead of a dozen tensor operations; the Python side
 * falls back to those operations when this file cannot be compiled. Plain C99 without
 * intrinsics, written so that the compiler vectorizes every pass for the CPU it runs on
 * (no branches inside the position loops).
 *
 * Rows r = (batch, KV head). keys: channel-major [R][C][ld] (T columns used), query: [R][G][C]
 * already multiplied by the attention scaling. valid: [R][T] bytes, or NULL when every
 * position exists.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { AGG_MAX = 0, AGG_UNION = 1, AGG_SUM = 2, AGG_MASS = 3 };
enum { TILE = 64, MAX_GROUP = 16 };

static inline float maxf(float a, float b) { return a > b ? a : b; }

static void swapf(float *a, float *b) { float t = *a; *a = *b; *b = t; }

/* The k-th largest (0-based) of x[0..n), n > k; reorders x. */
static float kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = x[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) { swapf(&x[i], &x[j]); i++; j--; }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return x[k];
    }
    return x[k];
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

/* scores[g][t] = sum_c q[g][c] * k[c][t]: every key tile is read once for the whole group. */
static void score_row(const float *k, int64_t ld, const float *q, int64_t G, int64_t C, int64_t T,
                      float *scores) {
    for (int64_t t0 = 0; t0 < T; t0 += TILE) {
        const int64_t n = T - t0 < TILE ? T - t0 : TILE;
        float acc[MAX_GROUP][TILE];
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < TILE; i++) acc[g][i] = 0.0f;
        for (int64_t c = 0; c < C; c++) {
            float kt[TILE];
            const float *kc = k + c * ld + t0;
            for (int64_t i = 0; i < n; i++) kt[i] = kc[i];
            for (int64_t i = n; i < TILE; i++) kt[i] = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                const float qc = q[g * C + c];
                for (int64_t i = 0; i < TILE; i++) acc[g][i] += qc * kt[i];
            }
        }
        for (int64_t g = 0; g < G; g++) memcpy(scores + g * T + t0, acc[g], (size_t)n * sizeof(float));
    }
}

/* z[t]: the group's scores aggregated per position (see speculate.aggregate_group); -inf
   where not valid (the caller has set those scores to -inf). */
static void aggregate_row(float *scores, int64_t G, int64_t T, int mode, float *z) {
    if (mode == AGG_UNION || mode == AGG_MASS) {
        for (int64_t g = 0; g < G; g++) {
            float *s = scores + g * T;
            const float top = max_of(s, T);
            if (mode == AGG_UNION) {
                const float off = top > -1e30f ? top : -1e30f; /* an all -inf row stays -inf */
                for (int64_t t = 0; t < T; t++) s[t] -= off;
            } else { /* log_softmax over the valid positions */
                double sum = 0.0;
                for (int64_t t = 0; t < T; t++) sum += exp((double)(s[t] - top));
                const float lse = top + (float)log(sum);
                for (int64_t t = 0; t < T; t++) s[t] -= lse;
            }
        }
    }
    memcpy(z, scores, (size_t)T * sizeof(float));
    if (mode == AGG_MASS) {
        for (int64_t t = 0; t < T; t++) {
            float m = scores[t];
            for (int64_t g = 1; g < G; g++) m = maxf(scores[g * T + t], m);
            if (m == -INFINITY) { z[t] = -INFINITY; continue; }
            double e = 0.0;
            for (int64_t g = 0; g < G; g++) e += exp((double)(scores[g * T + t] - m));
            z[t] = m + (float)log(e);
        }
    } else if (mode == AGG_SUM) {
        for (int64_t g = 1; g < G; g++)
            for (int64_t t = 0; t < T; t++) z[t] += scores[g * T + t];
    } else {
        for (int64_t g = 1; g < G; g++)
            for (int64_t t = 0; t < T; t++) z[t] = maxf(scores[g * T + t], z[t]);
    }
}

/* Returns the largest count over rows (the width of the selection). */
int64_t ig_select(const float *keys, int64_t key_row_stride, int64_t ld, const float *query,
                  int64_t R, int64_t G, int64_t C, int64_t T, const uint8_t *valid, int mode,
                  float alpha, double budget, int64_t budget_tokens, int64_t min_tokens,
                  float *scores /* [G][T] */, float *z /* [T] */, float *tmp /* [T] */,
                  int64_t *out_idx /* [R][T] */, int64_t *out_count /* [R] */) {
    if (G > MAX_GROUP) return -1;
    int64_t widest = 0;
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *vr = valid ? valid + r * T : NULL;
        score_row(keys + r * key_row_stride, ld, query + r * G * C, G, C, T, scores);
        int64_t ctx = T;
        if (vr) {
            ctx = 0;
            for (int64_t t = 0; t < T; t++) ctx += vr[t] != 0;
            for (int64_t g = 0; g < G; g++)
                for (int64_t t = 0; t < T; t++) scores[g * T + t] = vr[t] ? scores[g * T + t] : -INFINITY;
        }
        out_count[r] = 0;
        if (ctx == 0) continue;
        aggregate_row(scores, G, T, mode, z);
        for (int64_t t = 0; t < T; t++) z[t] = z[t] == z[t] ? z[t] : -INFINITY; /* a NaN never selects */

        /* threshold, cap, floor */
        const float thr = max_of(z, T) - alpha;
        int64_t kept = 0;
        if (vr) {
            for (int64_t t = 0; t < T; t++) kept += (vr[t] != 0) & (z[t] >= thr);
        } else {
            for (int64_t t = 0; t < T; t++) kept += z[t] >= thr;
        }
        int64_t cap = budget < 1.0 ? (int64_t)ceil((double)ctx * budget) : ctx;
        if (budget_tokens >= 0 && cap > budget_tokens) cap = budget_tokens;
        int64_t count = kept < cap ? kept : cap;
        const int64_t floor_ = ctx < min_tokens ? ctx : min_tokens;
        if (count < floor_) count = floor_;
        if (count > ctx) count = ctx;
        float cut = thr;
        if (count != kept) { /* the count-th largest valid score becomes the threshold */
            int64_t n = 0;
            for (int64_t t = 0; t < T; t++) if (!vr || vr[t]) tmp[n++] = z[t];
            cut = kth_largest(tmp, n, count - 1);
        }
        int64_t *out = out_idx + r * T, m = 0;
        for (int64_t t = 0; t < T && m < count; t++)
            if ((!vr || vr[t]) && z[t] >= cut) out[m++] = t;
        out_count[r] = m;
        if (m > widest) widest = m;
    }
    for (int64_t r = 0; r < R; r++) /* padding slots hold position 0 */
        for (int64_t m = out_count[r]; m < widest; m++) out_idx[r * T + m] = 0;
    return widest;
}
