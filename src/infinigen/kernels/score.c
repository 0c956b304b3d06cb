/* Partial scores of 4-bit codes against 8-bit queries, with integer dot products (see score.h).
 *
 * A score is read for every cached position at every decode step: this pass sets how fast the
 * selection runs, and it should run at the memory's speed. The codes are widened to bytes in
 * registers, four channels of a position to a 32-bit lane (two channel-pair rows interleaved),
 * and multiplied by the query's four int8 channels of those rows with one instruction where the
 * CPU has it (vpdpbusd: AVX-512 VNNI, AVX-VNNI), else with vpmaddubsw + vpmaddwd (AVX2, AVX-512
 * BW). Every product and sum is an exact integer (|sum| <= 15 * 127 * channels), so every path
 * gives the same scores bit for bit: the portable C below is the reference the others are held
 * to, and the float finish is the same sequence of IEEE operations on each.
 */
#include "score.h"

#include <math.h>
#include <string.h>

#include "isa.h"
#include "numeric.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define IG_X86 1
#endif

enum { HEAD_GROUP = 8 }; /* query heads scored per pass over a block's codes */

void ig_quantize_query(const float *q, int64_t heads, int64_t C, int64_t quads, int32_t *q4, int32_t *qsum,
                       float *qscale) {
    for (int64_t h = 0; h < heads; h++) {
        const float *qh = q + h * C;
        float top = 0.0f;
        for (int64_t c = 0; c < C; c++) top = fabsf(qh[c]) > top ? fabsf(qh[c]) : top;
        const float scale = top / 127.0f;
        int8_t *out = (int8_t *)(q4 + h * quads);
        int32_t sum = 0;
        for (int64_t c = 0; c < 4 * quads; c++) {
            float v = c < C && scale > 0.0f ? rintf(qh[c] / scale) : 0.0f;
            v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
            out[c] = (int8_t)v;
            sum += (int32_t)v;
        }
        qsum[h] = sum;
        qscale[h] = scale;
    }
}

/* The float finish of one score (the order every path keeps). */
static inline float finish(int32_t dot, int32_t qsum, float s, float qscale, const float *bias, int64_t h) {
    const float x = (float)(dot - 8 * qsum) * (s * qscale);
    return bias ? x + bias[h] : x;
}

/* Positions [0, n) of one block piece: cp its codes (row j at cp + j * ld), sp its scales. */
static void piece_portable(const uint8_t *cp, int64_t ld, int64_t pairs, const uint16_t *sp, int64_t n,
                           const ig_int_query *q, float *out, int64_t ldo) {
    enum { TILE = 64 };
    for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t m = n - i0 < TILE ? n - i0 : TILE;
        for (int64_t h = 0; h < q->heads; h++) {
            const int8_t *qb = (const int8_t *)(q->q4 + h * q->quads);
            int32_t acc[TILE];
            for (int64_t i = 0; i < TILE; i++) acc[i] = 0;
            for (int64_t j = 0; j < pairs; j++) {
                const uint8_t *row = cp + j * ld + i0;
                const int32_t a = qb[2 * j], b = qb[2 * j + 1];
                for (int64_t i = 0; i < m; i++) acc[i] += a * (int32_t)(row[i] & 15) + b * (int32_t)(row[i] >> 4);
            }
            float *o = out + h * ldo + i0;
            for (int64_t i = 0; i < m; i++) o[i] = finish(acc[i], q->qsum[h], widen_f16(sp[i0 + i]), q->qscale[h], q->bias, h);
        }
    }
}

#ifdef IG_X86
/* Four channels of 16 (8) positions to a 32-bit lane each: rows j (bytes x) and j + 1 (bytes y)
 * give w = x | y << 16, then (w | w << 4) & 0x0f0f0f0f = (x & 15, x >> 4, y & 15, y >> 4). */
#define T512 "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma"
#define T512V T512 ",avx512vnni"
#define T256 "avx2,fma,f16c"
#define T256V T256 ",avxvnni"

#define LANES512(x, y) ({                                                                             \
        const __m512i w_ = _mm512_or_si512((x), _mm512_slli_epi32((y), 16));                         \
        _mm512_and_si512(_mm512_or_si512(w_, _mm512_slli_epi32(w_, 4)), _mm512_set1_epi32(0x0f0f0f0f)); })
#define LANES256(x, y) ({                                                                             \
        const __m256i w_ = _mm256_or_si256((x), _mm256_slli_epi32((y), 16));                         \
        _mm256_and_si256(_mm256_or_si256(w_, _mm256_slli_epi32(w_, 4)), _mm256_set1_epi32(0x0f0f0f0f)); })

#define DOT512_VNNI(acc, t, qw) _mm512_dpbusd_epi32((acc), (t), _mm512_set1_epi32(qw))
#define DOT512_BW(acc, t, qw) \
    _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((t), _mm512_set1_epi32(qw)), _mm512_set1_epi16(1)))
#define DOT256_VNNI(acc, t, qw) _mm256_dpbusd_avx_epi32((acc), (t), _mm256_set1_epi32(qw))
#define DOT256_AVX2(acc, t, qw) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((t), _mm256_set1_epi32(qw)), _mm256_set1_epi16(1)))

/* One pass of NQ heads (h0 ..) over positions [0, n - n % W) of a piece, W = 16 (512) or 8 (256). */
#define PASS(NAME, TARGET, VEC, W, ZERO, LOADX, LANES, DOT, FINISH)                                          \
    static inline __attribute__((always_inline, target(TARGET))) int64_t NAME(                               \
        const uint8_t *cp, int64_t ld, int64_t pairs, const uint16_t *sp, int64_t n, const ig_int_query *q,   \
        int64_t h0, const int NQ, float *out, int64_t ldo) {                                                \
        const int32_t *q4 = q->q4 + h0 * q->quads;                                                          \
        int64_t i = 0;                                                                                       \
        for (; i + W <= n; i += W) {                                                                         \
            VEC acc[HEAD_GROUP];                                                                             \
            for (int k = 0; k < NQ; k++) acc[k] = ZERO;                                                      \
            int64_t j = 0;                                                                                   \
            for (; j + 2 <= pairs; j += 2) {                                                                 \
                const VEC t = LANES(LOADX(cp + j * ld + i), LOADX(cp + (j + 1) * ld + i));                    \
                for (int k = 0; k < NQ; k++) acc[k] = DOT(acc[k], t, q4[k * q->quads + j / 2]);               \
            }                                                                                                \
            if (j < pairs) {                                                                                 \
                const VEC t = LANES(LOADX(cp + j * ld + i), ZERO);                                           \
                for (int k = 0; k < NQ; k++) acc[k] = DOT(acc[k], t, q4[k * q->quads + j / 2]);               \
            }                                                                                                \
            FINISH;                                                                                          \
        }                                                                                                    \
        return i;                                                                                            \
    }

#define FINISH512                                                                                            \
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + i)));                         \
    for (int k = 0; k < NQ; k++) {                                                                           \
        const int64_t h = h0 + k;                                                                            \
        const __m512i c = _mm512_sub_epi32(acc[k], _mm512_set1_epi32(8 * q->qsum[h]));                       \
        __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_mul_ps(s, _mm512_set1_ps(q->qscale[h])));     \
        if (q->bias) x = _mm512_add_ps(x, _mm512_set1_ps(q->bias[h]));                                       \
        _mm512_storeu_ps(out + h * ldo + i, x);                                                              \
    }
#define FINISH256                                                                                            \
    const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + i)));                            \
    for (int k = 0; k < NQ; k++) {                                                                           \
        const int64_t h = h0 + k;                                                                            \
        const __m256i c = _mm256_sub_epi32(acc[k], _mm256_set1_epi32(8 * q->qsum[h]));                       \
        __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_mul_ps(s, _mm256_set1_ps(q->qscale[h])));     \
        if (q->bias) x = _mm256_add_ps(x, _mm256_set1_ps(q->bias[h]));                                       \
        _mm256_storeu_ps(out + h * ldo + i, x);                                                              \
    }

#define LOAD16(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))

PASS(pass_512v, T512V, __m512i, 16, _mm512_setzero_si512(), LOAD16, LANES512, DOT512_VNNI, FINISH512)
PASS(pass_512, T512, __m512i, 16, _mm512_setzero_si512(), LOAD16, LANES512, DOT512_BW, FINISH512)
PASS(pass_256, T256, __m256i, 8, _mm256_setzero_si256(), LOAD8, LANES256, DOT256_AVX2, FINISH256)
#if !defined(__clang__) && __GNUC__ >= 11
PASS(pass_256v, T256V, __m256i, 8, _mm256_setzero_si256(), LOAD8, LANES256, DOT256_VNNI, FINISH256)
#endif

/* The piece on a wide path: head groups of up to HEAD_GROUP with the count a constant (so that
 * the accumulators stay in registers), then the positions past the last full vector in C. */
#define PIECE(NAME, TARGET, PASSFN)                                                                          \
    static __attribute__((target(TARGET))) void NAME(const uint8_t *cp, int64_t ld, int64_t pairs,           \
                                                     const uint16_t *sp, int64_t n, const ig_int_query *q,    \
                                                     float *out, int64_t ldo) {                              \
        int64_t done = 0;                                                                                    \
        for (int64_t h0 = 0; h0 < q->heads; h0 += HEAD_GROUP) {                                              \
            const int64_t nq = q->heads - h0 < HEAD_GROUP ? q->heads - h0 : HEAD_GROUP;                      \
            switch (nq) {                                                                                    \
            case 1: done = PASSFN(cp, ld, pairs, sp, n, q, h0, 1, out, ldo); break;                           \
            case 2: done = PASSFN(cp, ld, pairs, sp, n, q, h0, 2, out, ldo); break;                           \
            case 3: done = PASSFN(cp, ld, pairs, sp, n, q, h0, 3, out, ldo); break;                           \
            case 4: done = PASSFN(cp, ld, pairs, sp, n, q, h0, 4, out, ldo); break;                           \
            case 5: done = PASSFN(cp, ld, pairs, sp, n, q, h0, 5, out, ldo); break;                           \
            case 6: done = PASSFN(cp, ld, pairs, sp, n, q, h0, 6, out, ldo); break;                           \
            case 7: done = PASSFN(cp, ld, pairs, sp, n, q, h0, 7, out, ldo); break;                           \
            default: done = PASSFN(cp, ld, pairs, sp, n, q, h0, 8, out, ldo); break;                          \
            }                                                                                                \
        }                                                                                                    \
        if (done < n) piece_portable(cp + done, ld, pairs, sp + done, n - done, q, out + done, ldo);          \
    }

PIECE(piece_512v, T512V, pass_512v)
PIECE(piece_512, T512, pass_512)
PIECE(piece_256, T256, pass_256)
#if !defined(__clang__) && __GNUC__ >= 11
PIECE(piece_256v, T256V, pass_256v)
#endif
#endif /* IG_X86 */

static void piece(const uint8_t *cp, int64_t ld, int64_t pairs, const uint16_t *sp, int64_t n, const ig_int_query *q,
                  float *out, int64_t ldo, int isa) {
#ifdef IG_X86
    switch (isa) {
    case ISA_AVX512_VNNI: piece_512v(cp, ld, pairs, sp, n, q, out, ldo); return;
    case ISA_AVX512: piece_512(cp, ld, pairs, sp, n, q, out, ldo); return;
#if !defined(__clang__) && __GNUC__ >= 11
    case ISA_AVX_VNNI: piece_256v(cp, ld, pairs, sp, n, q, out, ldo); return;
#endif
    case ISA_AVX2: piece_256(cp, ld, pairs, sp, n, q, out, ldo); return;
    default: break;
    }
#else
    (void)isa;
#endif
    piece_portable(cp, ld, pairs, sp, n, q, out, ldo);
}

void ig_score_row(const ig_code_row *k, int64_t start, int64_t stop, const ig_int_query *q, float *out, int64_t ldo,
                  int isa) {
    for (int64_t b = start / k->block; b * k->block < stop; b++) {
        const int64_t id = k->table ? k->table[b] : b;
        const int64_t first = b * k->block;
        const int64_t p0 = start > first ? start : first;
        const int64_t p1 = stop < first + k->block ? stop : first + k->block;
        const uint8_t *cp = k->codes + id * k->code_block + (p0 - first);
        const uint16_t *sp = (const uint16_t *)(k->scales + id * k->scale_block) + (p0 - first);
        piece(cp, k->ld, k->pairs, sp, p1 - p0, q, out + p0, ldo, isa);
    }
}
