/* The int8 rows' layouts, and the rounding of activations to int8 (gemv_q8.c's products read both).
 *
 * A row of W8 (cols int8 weights, one fp32 scale per group of G) is kept in one of three layouts:
 * - MH_Q8_COLUMNS (0): the weights in column order, the scales apart (ws, rows x ceil(cols / G));
 * - MH_Q8_BLOCKED (1): every whole 512 columns of the row (16 blocks of 32) with their blocks interleaved
 *   four bytes at a time, byte 64 v + 4 l + t holding column 32 l + 4 v + t (v 0-7, l 0-15, t 0-3), the
 *   columns past the last whole 512 as they are; the scales apart;
 * - MH_Q8_PACKED (2, groups of 32 only): the blocked row with its scales inside it: each whole 512
 *   columns (512 bytes, blocked) followed by their 16 scales (64 bytes: a chunk of MH_Q8_CHUNK_BYTES),
 *   then the tail (the columns past the last whole 512, in order, padded to 64 bytes) followed by its
 *   ceil(tail / 32) scales (padded to 64 bytes); mh_q8_row_bytes(cols, MH_Q8_PACKED) bytes a row. A
 *   product then reads one stream a row instead of a stream of weights and one of scales.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* Where the blocked layout stores column c of a row whose first `full` columns (its whole 512s) are
 * blocked: column 32 l + 4 v + t of a chunk at 64 v + 4 l + t; the columns past them where they are. */
static inline int64_t blocked_at(int64_t c, int64_t full) {
    if (c >= full) return c;
    const int64_t r = c % 512;
    return c - r + 64 * ((r % 32) / 4) + 4 * (r / 32) + r % 4;
}

/* bytes from the start of a packed tail (cols_tail columns past the last whole 512) to its scales */
static inline int64_t packed_tail_scales(int64_t cols_tail) { return (cols_tail + 63) & ~(int64_t)63; }

/* bytes of one row of cols weights in layout (the row stride a product reads it at, packed rows padded) */
int64_t mh_q8_row_bytes(int64_t cols, int layout) {
    if (layout != MH_Q8_PACKED) return cols;
    const int64_t tail = cols % 512, tail_scales = 4 * ((tail + 31) / 32);
    return cols / 512 * MH_Q8_CHUNK_BYTES + (tail ? packed_tail_scales(tail) + ((tail_scales + 63) & ~(int64_t)63) : 0);
}

/* x (n values of the storage dtype kind) -> xq (ceil64(n) int8, zeros past n) and xs (ceil64(n) / 32
 * fp32 block scales, zeros past the last block). */
void mh_quantize_q8(const void *x, int kind, int64_t n, int8_t *xq, float *xs) {
    const int64_t padded = (n + 63) & ~(int64_t)63;
    int64_t b = 0;
#if defined(__AVX512F__)
    /* whole fp32 blocks 16 lanes at a time, the same operations as the loop below: the largest |x| (a NaN
     * is passed over, as there: MAXPS returns its second operand when one is NaN), a true division, the
     * rounding half to even, the clamp, and the truncation to int8 of what cvttss2si gives */
    const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    for (; kind == MH_F32 && (b + 1) * MH_Q8_BLOCK <= n; b++) {
        const float *p = (const float *)x + b * MH_Q8_BLOCK;
        const __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
        const __m512 a = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps()));
        const float amax = _mm512_reduce_max_ps(a); /* no NaN left in a */
        const float s = amax / 127.0f, div = s > 0.f ? s : 1.0f;
        xs[b] = s;
        const __m512 d = _mm512_set1_ps(div);
#define MH_HALF_EVEN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
        const __m512 r0 = _mm512_roundscale_ps(_mm512_div_ps(v0, d), MH_HALF_EVEN);
        const __m512 r1 = _mm512_roundscale_ps(_mm512_div_ps(v1, d), MH_HALF_EVEN);
#undef MH_HALF_EVEN
        const __m512 h0 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r0, lim, _CMP_GT_OQ), r0, lim); /* NaN stays */
        const __m512 h1 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(r1, lim, _CMP_GT_OQ), r1, lim);
        const __m512 c0 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(h0, nlim, _CMP_LT_OQ), h0, nlim);
        const __m512 c1 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(h1, nlim, _CMP_LT_OQ), h1, nlim);
        int8_t *q = xq + b * MH_Q8_BLOCK;
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(c0)));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(c1)));
    }
#endif
    for (; b * MH_Q8_BLOCK < padded; b++) {
        const int64_t lo = b * MH_Q8_BLOCK, hi = lo + MH_Q8_BLOCK < n ? lo + MH_Q8_BLOCK : n;
        float amax = 0.f;
        for (int64_t i = lo; i < hi; i++) {
            const float a = fabsf(mh_get(x, i, kind));
            amax = a > amax ? a : amax;
        }
        const float s = amax / 127.0f, div = s > 0.f ? s : 1.0f; /* all zeros: scale 0, values 0 */
        xs[b] = s;
        for (int64_t i = lo; i < lo + MH_Q8_BLOCK; i++) {
            float q = i < hi ? nearbyintf(mh_get(x, i, kind) / div) : 0.f; /* half to even, as torch */
            q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
            xq[i] = (int8_t)q;
        }
    }
}

/* One row of an int8 table back to fp32 (an int8 embedding's lookup, a packed row read back): out[c] = the
 * weight of column c times the scale of its group (s: the row's ceil(d / G) scales; G >= d: one), in fp32
 * as torch's q.float() * scale; a row in the blocked layout (layout MH_Q8_BLOCKED) or packed with its
 * scales (MH_Q8_PACKED: s unused, the scales read from the row) read back in column order. */
void mh_dequantize_row_q8(const int8_t *q, const float *s, int64_t d, int64_t G, int layout, float *out) {
    const int64_t full = layout ? d / 512 * 512 : 0, g = G < d ? G : d; /* columns in the blocked order */
    for (int64_t c0 = 0; c0 < d; c0 += g) { /* a group at a time: one scale, no division per value */
        const int8_t *base = q; /* the weights of c0's chunk (packed) or of the row */
        int64_t first = 0;      /* the row's column at base */
        float sc;
        if (layout == MH_Q8_PACKED) { /* groups of 32: chunk j's 16 scales after its 512 weights */
            const int64_t j = c0 / 512, at = j < d / 512 ? 512 : packed_tail_scales(d - 512 * j);
            base = q + MH_Q8_CHUNK_BYTES * j, first = 512 * j;
            memcpy(&sc, base + at + 4 * ((c0 - first) / 32), sizeof sc);
        } else {
            sc = s[c0 / g];
        }
        for (int64_t c = c0; c < c0 + g && c < d; c++) out[c] = (float)base[blocked_at(c, full) - first] * sc;
    }
}
