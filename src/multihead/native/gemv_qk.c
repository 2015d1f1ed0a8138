/* Products with weights in llama.cpp's k-quant super-blocks (Q4_K, Q6_K: 256 weights each, as a .gguf
 * file holds them), times activations rounded to int8 per block of 32 as the other GGUF-block products
 * round them (gemv_q4.c prepares them: xq, xs, and sx[b] = xs[b] * sum of block b's xq).
 *
 * - Q4_K (type 12, 144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales sc_j and mins m_j
 *   (gg_scale_min), 128 bytes qs; sub-block j (32 weights, j < 8) holds the low (j even) or high (j odd)
 *   nibbles of qs[32 (j / 2) ..]: value i = (d sc_j) q_i - (dmin m_j);
 * - Q6_K (type 14, 210 bytes): 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d; half n (128 weights)
 *   holds sub-blocks s < 4 of 32: q_i = (ql[64 n + 32 (s & 1) + i] >> 4 (s >> 1) & 15) |
 *   ((qh[32 n + i] >> 2 s & 3) << 4), value i = (d sc_g) (q_i - 32), one scale g = 8 n + 2 s + (i >= 16)
 *   a group of 16.
 *
 * With b the activation block (32 columns) and isum an exact int32 sum over a sub-block (Q4_K) or a group
 * of 16 (Q6_K):
 *
 *   Q4_K:  y += ((d sc_j) xs[b]) isum_j - (dmin m_j) sx[b]
 *   Q6_K:  y += ((d sc_g) xs[b]) isum_g        (q_i - 32: a signed dot)
 *
 * in fp32, the int32 lane sums converted exactly and multiplied into independent lane accumulators.
 * Dot products by the compiler's target, 256 bits at a time: VPDPBUSD (AVX512-VNNI with AVX512-VL, or
 * AVX-VNNI), else VPMADDUBSW + VPMADDWD (AVX2; |products| stay far below int16's range), else portable C.
 * The float64 reference of the same blocks on the same rounded activations is
 * multihead.native.gguf_blocks.reference_product.
 */
#include <stdint.h>
#include <string.h>

#include "native.h"
#include "gguf_blocks.h" /* GG_Q4_K, GG_Q6_K, gg_h2f, gg_u16, gg_scale_min */
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__F16C__) && defined(__FMA__)
#define GK_ISA 3
#elif defined(__AVX2__) && defined(__AVXVNNI__) && defined(__F16C__) && defined(__FMA__)
#define GK_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GK_ISA 1
#else
#define GK_ISA 0
#endif

#if GK_ISA >= 1
static inline __m256i gk_dot(const __m256i u, const __m256i s, const __m256i acc) { /* u8 x s8, 4 a lane */
#if GK_ISA == 3
    return _mm256_dpbusd_epi32(acc, u, s);
#elif GK_ISA == 2
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline float gk_sum8(const __m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

static float gk_row_q4k(const uint8_t *r, int64_t cols, const int8_t *xq, const float *xs, const float *sx) {
    float am = 0.f;
#if GK_ISA >= 1
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#else
    float acc = 0.f;
#endif
    for (int64_t k = 0; k < cols / 256; k++) {
        const uint8_t *blk = r + 144 * k, *qs = blk + 16;
        const float d = gg_h2f(gg_u16(blk)), dmin = gg_h2f(gg_u16(blk + 2));
        uint8_t sc[8], mn[8];
        gg_scale_min(blk + 4, sc, mn);
        for (int p = 0; p < 4; p++) {
            const int64_t b = 8 * k + 2 * p; /* activation blocks b (low nibbles) and b + 1 (high) */
            const float s0 = (d * (float)sc[2 * p]) * xs[b], s1 = (d * (float)sc[2 * p + 1]) * xs[b + 1];
            am += (dmin * (float)mn[2 * p]) * sx[b] + (dmin * (float)mn[2 * p + 1]) * sx[b + 1];
#if GK_ISA >= 1
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            const __m256i i0 = gk_dot(lo, _mm256_loadu_si256((const __m256i *)(xq + 32 * b)), _mm256_setzero_si256());
            const __m256i i1 = gk_dot(hi, _mm256_loadu_si256((const __m256i *)(xq + 32 * b + 32)), _mm256_setzero_si256());
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_set1_ps(s0), a0);
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_set1_ps(s1), a1);
#else
            int32_t i0 = 0, i1 = 0;
            for (int i = 0; i < 32; i++)
                i0 += (qs[32 * p + i] & 15) * xq[32 * b + i], i1 += (qs[32 * p + i] >> 4) * xq[32 * b + 32 + i];
            acc += s0 * (float)i0 + s1 * (float)i1;
#endif
        }
    }
#if GK_ISA >= 1
    return gk_sum8(_mm256_add_ps(a0, a1)) - am;
#else
    return acc - am;
#endif
}

static float gk_row_q6k(const uint8_t *r, int64_t cols, const int8_t *xq, const float *xs) {
#if GK_ISA >= 1
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
#else
    float acc = 0.f;
#endif
    for (int64_t k = 0; k < cols / 256; k++) {
        const uint8_t *blk = r + 210 * k, *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = gg_h2f(gg_u16(blk + 208));
        for (int n = 0; n < 2; n++) {
#if GK_ISA >= 1
            const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * n));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * n + 32));
#endif
            for (int s = 0; s < 4; s++) {
                const int64_t b = 8 * k + 4 * n + s;
                const int g = 8 * n + 2 * s;
                const float sa = (d * (float)sc[g]) * xs[b], sb = (d * (float)sc[g + 1]) * xs[b];
#if GK_ISA >= 1
                const __m256i l = (s & 1) ? l1 : l0;
                const __m256i nib = _mm256_and_si256((s >> 1) ? _mm256_srli_epi16(l, 4) : l, m4);
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, 2 * s), m3);
                const __m256i w = _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_slli_epi16(hb, 4)), c32); /* -32..31 */
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
                const __m256i i = gk_dot(_mm256_abs_epi8(xv), _mm256_sign_epi8(w, xv), _mm256_setzero_si256());
                const __m256 scale = _mm256_set_m128(_mm_set1_ps(sb), _mm_set1_ps(sa)); /* lanes 0-3: group g */
                if (s & 1) a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), scale, a1);
                else a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), scale, a0);
#else
                int32_t i0 = 0, i1 = 0;
                for (int i = 0; i < 32; i++) {
                    const int lo = (ql[64 * n + 32 * (s & 1) + i] >> (4 * (s >> 1))) & 15;
                    const int q = (lo | (((qh[32 * n + i] >> (2 * s)) & 3) << 4)) - 32;
                    if (i < 16) i0 += q * xq[32 * b + i];
                    else i1 += q * xq[32 * b + i];
                }
                acc += sa * (float)i0 + sb * (float)i1;
#endif
            }
        }
    }
#if GK_ISA >= 1
    return gk_sum8(_mm256_add_ps(a0, a1));
#else
    return acc;
#endif
}

/* One row of cols weights (a multiple of 256) in super-blocks of type (Q4_K, Q6_K) times an activation
 * rounded per 32 (xq, xs, sx as gemv_q4.c prepares them); 0 for another type. */
float mh_gguf_row_k(const uint8_t *r, int64_t cols, int type, const int8_t *xq, const float *xs, const float *sx) {
    if (type == GG_Q4_K) return gk_row_q4k(r, cols, xq, xs, sx);
    if (type == GG_Q6_K) return gk_row_q6k(r, cols, xq, xs);
    return 0.f;
}
