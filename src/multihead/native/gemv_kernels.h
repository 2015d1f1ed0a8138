/* The pieces of the fp32 / bf16 / fp16 GEMVs that gemv.c (one activation row) and gemv_rows.c (several)
 * share, so that both give a row the same bits: 8-lane loads widening each storage dtype to fp32, the
 * bf16 conversions, and the AVX512-BF16 row sums (MH_DPBF16). Private to those two files; the loops and
 * why they are shaped so: gemv.c's comment. */
#ifndef MH_GEMV_KERNELS_H
#define MH_GEMV_KERNELS_H
#include <stdint.h>
#include <string.h>

#include "native.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define MH_DPBF16 1
#else
#define MH_DPBF16 0
#endif

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline mh_v8 load_f32(const float *p) {
    mh_v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline mh_v8 load_bf16(const uint16_t *p) { /* 8 bf16 -> 8 fp32: the bf16 bits are the high half */
    u16x8 h;
    memcpy(&h, p, sizeof h);
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    mh_v8 v;
    memcpy(&v, &w, sizeof v);
    return v;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN (as torch) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define MH_SAME(v) (v)

#if MH_HAS_F16
static inline mh_v8 load_f16(const uint16_t *p) { /* 8 fp16 -> 8 fp32 */
    mh_v8 v;
#if defined(__F16C__)
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &f, sizeof v);
#else
    for (int k = 0; k < 8; k++) v[k] = mh_h2f(p[k]);
#endif
    return v;
}
#endif

#if MH_DPBF16
/* a row's sum from its four accumulators v and the values i .. cols - 1 past the vector loops */
static inline __attribute__((always_inline)) float dpbf16_total(__m256 v[4], const uint16_t *r, const uint16_t *x,
                                                                int64_t i, int64_t cols) {
    mh_v8 t;
    const __m256 u = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
    memcpy(&t, &u, sizeof t);
    float s = hsum8(t);
    for (; i < cols; i++) s += bf16_to_f32(r[i]) * bf16_to_f32(x[i]);
    return s;
}

/* The AVX512-BF16 sums of one bf16 row r with x0 into sum[0], and with x1 into sum[1] when both (a
 * constant at each call; each 16 weights loaded once for both): four accumulators of 256-bit VDPBF16PS
 * over 64 values (128 bytes of the row a pass), the 16-value and single-value tails; sum[0] has the same
 * bits either way. */
static inline __attribute__((always_inline)) void dpbf16_sums(const uint16_t *r, const uint16_t *x0,
                                                               const uint16_t *x1, int both, int64_t cols,
                                                               float *sum) {
    const int64_t c64 = cols & ~(int64_t)63, c16 = cols & ~(int64_t)15;
    __m256 a[4], c[4];
    for (int k = 0; k < 4; k++) a[k] = c[k] = _mm256_setzero_ps();
    int64_t i = 0;
#define MH_BF(p) ((__m256bh)_mm256_loadu_si256((const __m256i *)(p)))
    for (; i < c64; i += 64)
        for (int k = 0; k < 4; k++) {
            const __m256bh wv = MH_BF(r + i + 16 * k);
            a[k] = _mm256_dpbf16_ps(a[k], wv, MH_BF(x0 + i + 16 * k));
            if (both) c[k] = _mm256_dpbf16_ps(c[k], wv, MH_BF(x1 + i + 16 * k));
        }
    for (; i < c16; i += 16) {
        const __m256bh wv = MH_BF(r + i);
        a[0] = _mm256_dpbf16_ps(a[0], wv, MH_BF(x0 + i));
        if (both) c[0] = _mm256_dpbf16_ps(c[0], wv, MH_BF(x1 + i));
    }
#undef MH_BF
    sum[0] = dpbf16_total(a, r, x0, i, cols);
    if (both) sum[1] = dpbf16_total(c, r, x1, i, cols);
}
#endif

#endif
