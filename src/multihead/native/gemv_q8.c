/* Batch-1 int8 matrix-vector products for decoding: y = W x with int8 weights and int8 activations.
 *
 * Weights: W8 (rows, cols) int8 row-major (row stride ldw), one fp32 scale per group of G consecutive
 * weights of a row (ws, rows x ceil(cols / G), G a multiple of 32), or per row (G >= cols: one group).
 * Activations: x quantized once per product by mh_quantize_q8 in blocks of 32 (symmetric, scale =
 * absmax / 127, the rounding of torch.round(x / scale)), zero-padded to a multiple of 64 values.
 *
 *   y[o] = sum over blocks b of  ws[o, 32 b / G] * xs[b] * (sum over i in block b of W8[o, i] xq[i])
 *
 * The inner sums are exact int32; each block's sum is scaled and added in fp32. The weights are one byte
 * each, so a decode step reads a quarter of the fp32 bytes and its speed is still the memory's read
 * bandwidth: one row at a time, independent accumulators, the block scales applied to whole vectors of
 * partial sums (no horizontal sum per block).
 *
 * Dot products, chosen by the compiler's target (-march=native):
 * - AVX512-VNNI (VPDPBUSD: u8 x s8 -> int32, 64 bytes at once): the activations' sign moves onto the
 *   weights (|x| as u8, w negated where x < 0; |w| <= 127 so the negation cannot overflow);
 * - AVX2 (with AVX-VNNI's VPDPBUSD where present, else VPMADDUBSW + VPMADDWD: |x| * |w| <= 127 * 127, so
 *   the int16 pair sums cannot saturate) on 32 bytes;
 * - portable C elsewhere (integer loops the compiler vectorizes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define MH_Q8_ISA 3 /* AVX512-VNNI */
#elif defined(__AVX2__) && defined(__AVXVNNI__)
#define MH_Q8_ISA 2 /* AVX-VNNI */
#elif defined(__AVX2__) && defined(__FMA__)
#define MH_Q8_ISA 1 /* AVX2 */
#else
#define MH_Q8_ISA 0 /* portable */
#endif

int mh_q8_isa(void) { return MH_Q8_ISA; }

/* x (n values of the storage dtype kind) -> xq (ceil64(n) int8, zeros past n) and xs (ceil64(n) / 32
 * fp32 block scales, zeros past the last block). */
void mh_quantize_q8(const void *x, int kind, int64_t n, int8_t *xq, float *xs) {
    const int64_t padded = (n + 63) & ~(int64_t)63;
    for (int64_t b = 0; b * MH_Q8_BLOCK < padded; b++) {
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

/* blocks b0..nb-1 of one row in plain C: the tails of the vector loops and the portable kernel */
static float row_blocks(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs, int64_t b0,
                        int64_t nb, int64_t cols, int64_t G, int per_row) {
    float acc = 0.f;
    for (int64_t b = b0; b < nb; b++) {
        const int64_t lo = b * MH_Q8_BLOCK, hi = lo + MH_Q8_BLOCK < cols ? lo + MH_Q8_BLOCK : cols;
        int32_t s = 0;
        for (int64_t i = lo; i < hi; i++) s += (int32_t)r[i] * (int32_t)xq[i];
        acc += (float)s * (per_row ? xs[b] : xs[b] * wsr[lo / G]);
    }
    return acc;
}

#if MH_Q8_ISA == 3
/* the two 32-blocks of 64 bytes at block b: lanes 0-7 scaled by s[b], lanes 8-15 by s[b + 1] */
static inline __m512 pair_scales(const float *s) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)s))));
}

static inline __m512i dot64(const int8_t *r, const int8_t *x) { /* 16 int32 sums of 4 products each */
    const __m512i xv = _mm512_loadu_si512(x), wv = _mm512_loadu_si512(r);
    const __m512i w = _mm512_mask_sub_epi8(wv, _mm512_movepi8_mask(xv), _mm512_setzero_si512(), wv);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(xv), w);
}

static float row_q8(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs, int64_t cols,
                    int64_t G, int per_row) {
    const int64_t c128 = cols & ~(int64_t)127, c64 = cols & ~(int64_t)63;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    int64_t i = 0;
    if (per_row) { /* one weight scale: applied once, at the end */
        for (; i < c128; i += 128) {
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64(r + i, xq + i)), pair_scales(xs + i / 32), a0);
            a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64(r + i + 64, xq + i + 64)), pair_scales(xs + i / 32 + 2),
                                 a1);
        }
        for (; i < c64; i += 64)
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64(r + i, xq + i)), pair_scales(xs + i / 32), a0);
    } else if (G == 32) { /* a weight scale per block */
        for (; i < c64; i += 64) {
            const __m512 s = _mm512_mul_ps(pair_scales(xs + i / 32), pair_scales(wsr + i / 32));
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64(r + i, xq + i)), s, a0);
        }
    } else { /* G a multiple of 64: one weight scale per 64 bytes */
        for (; i < c64; i += 64) {
            const __m512 s = _mm512_mul_ps(pair_scales(xs + i / 32), _mm512_set1_ps(wsr[i / G]));
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot64(r + i, xq + i)), s, a0);
        }
    }
    const float head = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    const int64_t nb = (cols + MH_Q8_BLOCK - 1) / MH_Q8_BLOCK;
    return head + row_blocks(r, wsr, xq, xs, i / MH_Q8_BLOCK, nb, cols, G, per_row);
}
#elif MH_Q8_ISA >= 1
static inline __m256i dot32(const int8_t *r, const int8_t *x) { /* 8 int32 sums of 4 products each */
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    const __m256i w = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)r), xv); /* w * sign(x) */
    const __m256i ax = _mm256_abs_epi8(xv);
#if MH_Q8_ISA == 2
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ax, w);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, w), _mm256_set1_epi16(1));
#endif
}

static float row_q8(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs, int64_t cols,
                    int64_t G, int per_row) {
    const int64_t c64 = cols & ~(int64_t)63, c32 = cols & ~(int64_t)31;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t i = 0;
    for (; i < c64; i += 64) {
        const float s0 = per_row ? xs[i / 32] : xs[i / 32] * wsr[i / G];
        const float s1 = per_row ? xs[i / 32 + 1] : xs[i / 32 + 1] * wsr[(i + 32) / G];
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(r + i, xq + i)), _mm256_set1_ps(s0), a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(r + i + 32, xq + i + 32)), _mm256_set1_ps(s1), a1);
    }
    for (; i < c32; i += 32) {
        const float s0 = per_row ? xs[i / 32] : xs[i / 32] * wsr[i / G];
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(r + i, xq + i)), _mm256_set1_ps(s0), a0);
    }
    const __m256 a = _mm256_add_ps(a0, a1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    const int64_t nb = (cols + MH_Q8_BLOCK - 1) / MH_Q8_BLOCK;
    return _mm_cvtss_f32(h) + row_blocks(r, wsr, xq, xs, i / MH_Q8_BLOCK, nb, cols, G, per_row);
}
#else
static float row_q8(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs, int64_t cols,
                    int64_t G, int per_row) {
    return row_blocks(r, wsr, xq, xs, 0, (cols + MH_Q8_BLOCK - 1) / MH_Q8_BLOCK, cols, G, per_row);
}
#endif

/* y (rows fp32) = W8 x + b: ws (rows, ldws) fp32 group scales (ldws = ceil(cols / G), 1 per row when
 * G >= cols), xq / xs from mh_quantize_q8 of x, b (rows fp32) or NULL. G: a multiple of 32, or >= cols. */
void mh_gemv_q8(const int8_t *w, const float *ws, const int8_t *xq, const float *xs, const float *b, float *y,
                int64_t rows, int64_t cols, int64_t ldw, int64_t G) {
    const int per_row = G >= cols;
    const int64_t ldws = per_row ? 1 : (cols + G - 1) / G;
    MH_PARALLEL_ROWS
    for (int64_t o = 0; o < rows; o++) {
        const float *wsr = ws + o * ldws;
        float s = row_q8(w + o * ldw, wsr, xq, xs, cols, G, per_row);
        if (per_row) s *= wsr[0];
        y[o] = b ? s + b[o] : s;
    }
}
