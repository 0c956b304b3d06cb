/* The selection of a step's rows over 4-bit codes read where they lie (select.c). */
#ifndef INFINIGEN_SELECT_H
#define INFINIGEN_SELECT_H

#include <stdint.h>

typedef struct {
    const uint8_t *codes, *scales; /* request 0, KV head 0, block id 0 */
    const int32_t *tables;         /* [R][table_ld] block ids, or NULL (each row one block, at its request) */
    int64_t table_ld;
    int64_t code_request, code_head, code_block;    /* bytes */
    int64_t scale_request, scale_head, scale_block; /* bytes */
    int64_t block, ld, pairs;
} ig_codes;

typedef struct { /* every field 8 bytes (ctypes mirrors it) */
    int64_t mode, unit_rule;
    double alpha, budget;
    int64_t budget_tokens, min_tokens, unit;
    double correction; /* the top-up: this fraction of the context from the own query (0: none) */
} ig_rule;

/* Every (request, KV head) row's positions, in one call (see select.c). spec, own: [R][Hkv][G][C]
 * scaled partial queries with the channel scales folded in (own: NULL, or the layer's own query,
 * which tops the choice up by rule->correction of the context); *_bias: [R][Hkv][G] or NULL;
 * lengths: [R] positions per request; valid: [R * Hkv][ldv] bytes or NULL. out [R * Hkv][ldo]:
 * the chosen positions ascending (counts), then the top-up's (extra). Returns the widest row,
 * -1 for shapes it does not take, -2 when scratch cannot be allocated, -3 for ldo too small. */
int64_t ig_select_codes(const ig_codes *k, int64_t R, int64_t Hkv, int64_t G, int64_t C, const int64_t *lengths,
                        const uint8_t *valid, int64_t ldv, const float *spec, const float *spec_bias, const float *own,
                        const float *own_bias, const ig_rule *rule, int64_t *out, int64_t ldo, int64_t *counts,
                        int64_t *extra, int nthreads);

#endif
