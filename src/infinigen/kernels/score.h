/* Partial scores of 4-bit partial-key codes against 8-bit queries, in integers (score.c). */
#ifndef INFINIGEN_SCORE_H
#define INFINIGEN_SCORE_H

#include <stdint.h>

/* Where one (request, KV head) row's codes lie: block by block (vLLM's pages through its block
 * table, or one contiguous buffer read as a single block). Within a block, `pairs` rows of `ld`
 * bytes, one per pair of channels (channel 2j in the low nibble, 2j + 1 in the high one, each
 * stored as code + 8), a position per byte; its float16 scales contiguous, one per position. */
typedef struct {
    const uint8_t *codes;  /* block id 0's first channel-pair row */
    const uint8_t *scales; /* block id 0's first scale (bytes) */
    const int32_t *table;  /* block ids of the row's positions, block after block; NULL: block j is id j */
    int64_t code_block;    /* bytes from block id b's codes to b + 1's */
    int64_t scale_block;   /* bytes from block id b's scales to b + 1's */
    int64_t block;         /* positions per block */
    int64_t ld;            /* bytes from one channel-pair row to the next */
    int64_t pairs;         /* channel-pair rows */
} ig_code_row;

/* Query heads quantized for the codes (`ig_quantize_query`): head q's channels as int8, four to an
 * int32 word (the channels of two channel-pair rows), its sum, its scale and its bias. */
typedef struct {
    int64_t heads;
    int64_t quads;        /* int32 words per head: ceil(pairs / 2) */
    const int32_t *q4;    /* [heads][quads] */
    const int32_t *qsum;  /* [heads] sum of the head's int8 channels */
    const float *qscale;  /* [heads] */
    const float *bias;    /* [heads] added to every score, or NULL */
} ig_int_query;

enum { SCORE_MAX_CHANNELS = 1024 };

/* q [heads][C] float -> the int8 query (q4 [heads][quads], zero past C), its sums and scales:
 * per head, scale = max|q| / 127 and code = rint(q / scale) (all zero for a zero head). */
void ig_quantize_query(const float *q, int64_t heads, int64_t C, int64_t quads, int32_t *q4, int32_t *qsum,
                       float *qscale);

/* out[h * ldo + t] for t in [start, stop): s[t] * qscale[h] times the integer dot product of the
 * head's int8 channels with the codes (centered: code - 8), plus bias[h]:
 * (float)(dot - 8 * qsum[h]) * (s[t] * qscale[h]) + bias[h], in that order, on every path. */
void ig_score_row(const ig_code_row *k, int64_t start, int64_t stop, const ig_int_query *q, float *out, int64_t ldo,
                  int isa);

#endif
