/* One decode layer of a batch of requests over an engine's paged KV (vLLM's), in one call: the new
 * tokens' K and V into the slow tier, their partial keys as codes into the page, the speculated
 * and own queries onto the partial channels, the selection over the page's codes in place
 * (select.c), and the attention over the chosen rows where the tier keeps them (attend.c). The
 * interpreter pays one call per layer instead of a hundred tensor operations.
 *
 * The tier: [blocks][Hkv][2 * bs][d], a block's keys (bs rows of d) then its values. The page:
 * [blocks][Hkv][bs * page_row] bytes, a block's codes as `pairs` rows of bs bytes (channel-pair
 * rows, as score.h describes) then its bs float16 scales. A layer without a page (the first,
 * dense layers; full fetch) attends every row.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"
#include "numeric.h"
#include "score.h"
#include "select.h"

enum { PAGED_MAX_DIM = 1024 };

typedef struct { /* every field 8 bytes (ctypes mirrors it) */
    int64_t R, H, Hkv, d, C, pairs, bs;
    const int64_t *rows;    /* [R] each request's token row in q, k, v and out */
    const void *q, *k, *v;  /* [N][H or Hkv][d] as the engine computed them (post-RoPE) */
    void *out;              /* [N][H][d] */
    int64_t q_row, k_row, v_row, out_row; /* element strides between token rows */
    int64_t io_format;      /* KEYS_F32, KEYS_F16 or KEYS_BF16 */
    const int64_t *slots;   /* [R] the new tokens' slots (block * bs + offset) */
    const int64_t *lengths; /* [R] positions before the new token */
    const int32_t *tables;  /* [R][table_ld] */
    int64_t table_ld;
    void *store;            /* the layer's tier */
    int64_t store_format;
    uint8_t *page;          /* NULL: attend every row */
    int64_t page_row;       /* page bytes per (block, head, position) */
    const float *proj;      /* [Hkv][d][C] the skewed partial channels */
    const float *mu, *sigma; /* request r's head h's C channels at + r * stats_stride + h * stats_head */
    int64_t stats_stride, stats_head;
    const float *spec;      /* [R][H][d] speculated queries: post-RoPE, or pre-RoPE when cos_sin is set */
    const float *cos_sin;   /* NULL, or the rotary table [positions][rot]: cos then sin, rot / 2 each */
    int64_t rot, neox;      /* rotated dims per head; 1: halves rotate together (NeoX), 0: pairs (GPT-J) */
    double scaling;
    ig_rule rule;
    int64_t *positions, *counts, *extra; /* [R * Hkv][ldp], [R * Hkv], [R * Hkv]: the selection */
    int64_t ldp;
    float *work;            /* 4 [R][H][d] + 2 [R][Hkv][d] + 2 [R][H][C] + 2 [R][H] floats (`paged_work`) */
    int64_t threads;
    int64_t write_kv;       /* 0: the engine wrote the new K and V into the tier already */
    int64_t attended;       /* out: the rows the selection chose, summed over the batch (top-ups included) */
} ig_paged_step;

void ig_quantize_position(const float *k, const float *mu, const float *sigma, int64_t C, float levels, int32_t *q,
                          uint16_t *scale);

static void widen_vec(const void *src, int64_t format, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = format == KEYS_BF16  ? widen_bf16(((const uint16_t *)src)[i])
                 : format == KEYS_F16 ? widen_f16(((const uint16_t *)src)[i])
                                      : ((const float *)src)[i];
}

static void narrow_vec(const float *src, int64_t n, void *dst, int64_t format) {
    for (int64_t i = 0; i < n; i++) {
        if (format == KEYS_BF16) ((uint16_t *)dst)[i] = narrow_bf16(src[i]);
        else if (format == KEYS_F16) ((uint16_t *)dst)[i] = narrow_f16(src[i]);
        else ((float *)dst)[i] = src[i];
    }
}

static inline int64_t fmt_size(int64_t format) { return format == KEYS_F32 ? 4 : 2; }

/* partial [C] = x [d] @ proj [d][C] */
static void project(const float *x, const float *proj, int64_t d, int64_t C, float *partial) {
    for (int64_t c = 0; c < C; c++) partial[c] = 0.0f;
    for (int64_t j = 0; j < d; j++) {
        const float xj = x[j];
        const float *pj = proj + j * C;
        for (int64_t c = 0; c < C; c++) partial[c] += xj * pj[c];
    }
}

/* Scaled partial queries with the channel scales folded in, and their biases (the query against
 * the channel means): what the selection multiplies the codes by (select.quantized's rule). */
static void partial_queries(const ig_paged_step *s, const float *queries, float *kq, float *bias) {
    const int64_t G = s->H / s->Hkv, C = s->C;
    float qp[SCORE_MAX_CHANNELS];
    for (int64_t r = 0; r < s->R; r++)
        for (int64_t hq = 0; hq < s->H; hq++) {
            const int64_t h = hq / G;
            project(queries + (r * s->H + hq) * s->d, s->proj + h * s->d * C, s->d, C, qp);
            const int64_t at = r * s->stats_stride + h * s->stats_head;
            const float *mu = s->mu + at, *sigma = s->sigma + at;
            float b = 0.0f;
            for (int64_t c = 0; c < C; c++) {
                const float q = qp[c] * (float)s->scaling;
                kq[(r * s->H + hq) * C + c] = q * sigma[c];
                b += q * mu[c];
            }
            bias[r * s->H + hq] = b;
        }
}

/* The rotary embedding of the new tokens' positions (lengths[r]) applied to the speculated queries, as
 * the engine applies its own (vLLM's RotaryEmbedding.forward_static), into out [R][H][d]. */
static void rotate(const ig_paged_step *s, float *out) {
    const int64_t half = s->rot / 2;
    for (int64_t r = 0; r < s->R; r++) {
        const float *cs = s->cos_sin + s->lengths[r] * s->rot, *sn = cs + half;
        for (int64_t hq = 0; hq < s->H; hq++) {
            const float *x = s->spec + (r * s->H + hq) * s->d;
            float *y = out + (r * s->H + hq) * s->d;
            memcpy(y, x, (size_t)s->d * sizeof(float));
            for (int64_t i = 0; i < half; i++) {
                const int64_t a = s->neox ? i : 2 * i, b = s->neox ? i + half : 2 * i + 1;
                y[a] = x[a] * cs[i] - x[b] * sn[i];
                y[b] = x[b] * cs[i] + x[a] * sn[i];
            }
        }
    }
}

/* Returns 0, or a negative code: -1 shapes it does not take, -2 no scratch, -3 a slot outside
 * the request's blocks. */
int64_t ig_paged_decode(ig_paged_step *s) {
    const int64_t R = s->R, H = s->H, Hkv = s->Hkv, d = s->d, C = s->C, bs = s->bs, G = H / Hkv;
    if (d > PAGED_MAX_DIM || C > SCORE_MAX_CHANNELS || G * Hkv != H || bs < 1) return -1;
    const int nthreads = s->threads > 0 ? (int)s->threads : 1;
    float *qf = s->work, *qs = qf + R * H * d, *attn = qs + R * H * d, *kf = attn + R * H * d, *vf = kf + R * Hkv * d;
    float *kq = vf + R * Hkv * d, *oq = kq + R * H * C, *kb = oq + R * H * C, *ob = kb + R * H, *sr = ob + R * H;
    const int64_t io = fmt_size(s->io_format), st = fmt_size(s->store_format);
    const int64_t block_elems = Hkv * 2 * bs * d;
    /* the new tokens: widened (the queries scaled), into the tier and the page */
    for (int64_t r = 0; r < R; r++) {
        const int64_t row = s->rows[r], slot = s->slots[r], blk = slot / bs, off = slot % bs;
        if (s->lengths[r] / bs >= s->table_ld || blk < 0) return -3;
        widen_vec((const char *)s->q + row * s->q_row * io, s->io_format, H * d, qf + r * H * d);
        for (int64_t i = 0; i < H * d; i++) qs[r * H * d + i] = qf[r * H * d + i] * (float)s->scaling;
        for (int64_t h = 0; h < Hkv; h++) {
            float *kr = kf + (r * Hkv + h) * d, *vr = vf + (r * Hkv + h) * d;
            widen_vec((const char *)s->k + (row * s->k_row + h * d) * io, s->io_format, d, kr);
            widen_vec((const char *)s->v + (row * s->v_row + h * d) * io, s->io_format, d, vr);
            char *at = (char *)s->store + (blk * block_elems + h * 2 * bs * d + off * d) * st;
            if (s->write_kv) {
                narrow_vec(kr, d, at, s->store_format);
                narrow_vec(vr, d, at + bs * d * st, s->store_format);
            }
            if (s->page) { /* the partial key, quantized about the request's channel means and scales */
                float kp[SCORE_MAX_CHANNELS];
                int32_t code[SCORE_MAX_CHANNELS + 1];
                uint16_t scale;
                project(kr, s->proj + h * d * C, d, C, kp);
                const int64_t at = r * s->stats_stride + h * s->stats_head;
                ig_quantize_position(kp, s->mu + at, s->sigma + at, C, 7.0f, code, &scale);
                code[C] = 0;
                uint8_t *chunk = s->page + (blk * Hkv + h) * bs * s->page_row;
                for (int64_t j = 0; j < s->pairs; j++)
                    chunk[j * bs + off] = (uint8_t)((code[2 * j] + 8) | ((2 * j + 1 < C ? code[2 * j + 1] : 0) + 8) << 4);
                memcpy(chunk + s->pairs * bs + 2 * off, &scale, 2);
            }
        }
    }
    const ig_kv_rows kv = {s->store, (const char *)s->store + bs * d * st, s->tables, s->table_ld, 0, 2 * bs * d,
                           block_elems, d, bs, s->store_format};
    const int64_t *positions = NULL, *counts = NULL;
    if (s->page) {
        const ig_codes codes = {s->page, s->page + s->pairs * bs, s->tables, s->table_ld, 0, bs * s->page_row,
                                Hkv * bs * s->page_row, 0, bs * s->page_row, Hkv * bs * s->page_row, bs, bs, s->pairs};
        const int own = s->rule.correction > 0.0;
        const float *spec = s->spec;
        if (s->cos_sin) { /* the speculated queries come before their rotary embedding: apply it */
            rotate(s, sr);
            spec = sr;
        }
        partial_queries(s, spec, kq, kb); /* the speculated queries, then the own ones (the correction) */
        if (own) partial_queries(s, qf, oq, ob);
        const int64_t widest = ig_select_codes(&codes, R, Hkv, G, C, s->lengths, NULL, 0, kq, kb, own ? oq : NULL,
                                               own ? ob : NULL, &s->rule, s->positions, s->ldp, s->counts,
                                               s->extra, nthreads);
        if (widest < 0) return widest;
        int64_t attended = 0;
        for (int64_t i = 0; i < R * Hkv; i++) {
            s->counts[i] += s->extra[i];
            attended += s->counts[i];
        }
        s->attended = attended;
        positions = s->positions, counts = s->counts;
    }
    const int64_t rc = ig_attend_rows(&kv, R, Hkv, G, d, qs, positions, counts, s->ldp, s->lengths, kf, vf, attn,
                                      nthreads);
    if (rc == 0)
        for (int64_t r = 0; r < R; r++)
            narrow_vec(attn + r * H * d, H * d, (char *)s->out + s->rows[r] * s->out_row * io, s->io_format);
    return rc;
}
