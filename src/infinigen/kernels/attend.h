/* Attention over rows read where they lie (attend.c). */
#ifndef INFINIGEN_ATTEND_H
#define INFINIGEN_ATTEND_H

#include <stdint.h>

typedef struct {
    const void *k, *v;      /* request 0, KV head 0, block id 0, position 0 */
    const int32_t *tables;  /* [R][table_ld] block ids, or NULL (a request's positions in one block) */
    int64_t table_ld;
    int64_t request, head, block_stride, row; /* element strides */
    int64_t block;          /* positions per block */
    int64_t format;         /* KEYS_F32, KEYS_F16 or KEYS_BF16 */
} ig_kv_rows;

/* q: [R][Hkv][G][d] scaled queries; positions: [R * Hkv][ldp] with counts [R * Hkv], or NULL for
 * positions 0 .. lengths[r]; knew, vnew: [R][Hkv][d] the new position, or NULL; out: [R][Hkv][G][d].
 * Returns 0, -1 for a head dim it does not read, -2 when scratch cannot be allocated. */
int64_t ig_attend_rows(const ig_kv_rows *kv, int64_t R, int64_t Hkv, int64_t G, int64_t d, const float *q,
                       const int64_t *positions, const int64_t *counts, int64_t ldp, const int64_t *lengths,
                       const float *knew, const float *vnew, float *out, int nthreads);

#endif
