/* Attention of one decode step over the cache (mh_attend): the query heads that share one kv head, their
 * scores against every cached key, the softmax, and the weighted sum of the cached values; the keys and
 * values read straight from a cache of fp32, bf16, fp16 or int8 (a scale per position) and widened in
 * registers. Called by the decode layers (decode_layer.c) for each kv head of each row.
 *
 * Per cached position and kv head the work is the query heads' FMAs over D lanes (32 FMAs of 16 lanes
 * for four query heads and D = 64), the widening of its key and value and the sums of the scores: the
 * FMAs are about half of it, so the widening is what a faster cache layout would save.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* e^x over n floats in place; returns their sum */
static float exp_sum(float *x, int64_t n) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 v;
        memcpy(&v, x + i, sizeof v);
        v = mh_vexp(v);
        memcpy(x + i, &v, sizeof v);
        acc += v;
    }
    float s = hsum16(acc);
    for (; i < n; i++) s += (x[i] = expf(x[i]));
    return s;
}

typedef int8_t mh_i8x16 __attribute__((vector_size(16)));
typedef uint16_t mh_u16x16 __attribute__((vector_size(32)));
typedef uint32_t mh_u32x16 __attribute__((vector_size(64)));

/* 16 cached values p[i .. i + 15] of kind (int8 unscaled) as fp32 lanes, straight from the cache */
static inline v16 load16(const void *p, int64_t i, int kind) {
    v16 r;
    if (kind == MH_F32) {
        memcpy(&r, (const float *)p + i, sizeof r);
        return r;
    }
#if defined(__AVX512F__) /* one widening instruction and one conversion (compilers scalarise the generic) */
    if (kind == MH_I8) {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)p + i));
        return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (kind == MH_F16) return (v16)_mm512_cvtph_ps(h);
    return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16: the high half */
#elif defined(__AVX2__) /* two halves of 8 */
    __m256 lo, hi;
    if (kind == MH_I8) {
        const int8_t *b = (const int8_t *)p + i;
        lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)b)));
        hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8))));
    } else {
        const __m128i h0 = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        const __m128i h1 = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i + 8));
        if (kind == MH_BF16) {
            lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h0), 16));
            hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h1), 16));
        } else {
#if defined(__F16C__)
            lo = _mm256_cvtph_ps(h0), hi = _mm256_cvtph_ps(h1);
#else
            for (int t = 0; t < 16; t++) r[t] = mh_get(p, i + t, MH_F16);
            return r;
#endif
        }
    }
    memcpy(&r, &lo, sizeof lo);
    memcpy((char *)&r + sizeof lo, &hi, sizeof hi);
    return r;
#else
    if (kind == MH_I8) {
        mh_i8x16 b;
        memcpy(&b, (const int8_t *)p + i, sizeof b);
        return __builtin_convertvector(__builtin_convertvector(b, mh_i32x16), v16);
    }
    if (kind == MH_BF16) { /* the bits move to the high half */
        mh_u16x16 h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const mh_u32x16 u = __builtin_convertvector(h, mh_u32x16) << 16;
        memcpy(&r, &u, sizeof r);
        return r;
    }
    for (int t = 0; t < 16; t++) r[t] = mh_get(p, i + t, MH_F16);
    return r;
#endif
}

/* one cached value p[i] of kind (int8 unscaled) as fp32 */
static inline float cached(const void *p, int64_t i, int kind) {
    return kind == MH_I8 ? (float)((const int8_t *)p)[i] : mh_get(p, i, kind);
}

/* the four sums of a, b, c, d into s[0..3] */
static inline void hsum4(v16 a, v16 b, v16 c, v16 d, float *s) {
#if defined(__clang__) || __GNUC__ >= 12 /* a tree of shuffles: 13 vector operations for 4 sums */
    const mh_v8 a8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    const mh_v8 b8 = __builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15);
    const mh_v8 c8 = __builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15);
    const mh_v8 d8 = __builtin_shufflevector(d, d, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(d, d, 8, 9, 10, 11, 12, 13, 14, 15);
    const mh_v8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                     __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15); /* a: 0-3, b: 4-7 */
    const mh_v8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                     __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
    const mh_v8 z = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                    __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15); /* a, a, b, b, c, c, d, d */
    const mh_v4 r = __builtin_shufflevector(z, z, 0, 2, 4, 6) + __builtin_shufflevector(z, z, 1, 3, 5, 7);
    memcpy(s, &r, sizeof r);
#else
    s[0] = hsum16(a), s[1] = hsum16(b), s[2] = hsum16(c), s[3] = hsum16(d);
#endif
}

/* the rows of heads g0 .. g0 + 3 of a (G, stride) array into r[0..3]; past the last head (G - g0 < 4)
 * the last head's row again, so four-wide loops need no tail (their extra sums are dropped) */
static inline void four_rows(const float *base, int64_t g0, int64_t G, int64_t stride, const float *r[4]) {
    for (int t = 0; t < 4; t++) r[t] = base + (g0 + t < G ? g0 + t : G - 1) * stride;
}

/* Attention of the G query heads sharing one kv head over keys 0..L-1: q (G, D) fp32, out (G, D) fp32;
 * K, V (L, D) of cache kind ckind, with per-position scales ks, vs (L,) for MH_I8 (else NULL); scratch
 * scores (G, L). Each cached row is read and widened once for four query heads, straight from the cache
 * into registers; an int8 row's scale multiplies its score (keys) or its weights (values), not its D
 * values. */
void mh_attend(const float *q, const void *K, const void *V, const float *ks, const float *vs, int64_t L,
               int64_t D, int64_t G, float scale, int ckind, float *out, float *scores) {
    const int64_t esz = ckind == MH_F32 ? 4 : ckind == MH_I8 ? 1 : 2;
    float peak[G]; /* each head's largest score */
    for (int64_t g0 = 0; g0 < G; g0 += 4) { /* scores, four query heads at a time */
        const int n = G - g0 < 4 ? (int)(G - g0) : 4;
        const float *qr[4];
        four_rows(q, g0, G, D, qr);
        const float *q0 = qr[0], *q1 = qr[1], *q2 = qr[2], *q3 = qr[3];
        float top[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        for (int64_t l = 0; l < L; l++) {
            const char *k = (const char *)K + l * D * esz;
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            int64_t i = 0;
            for (; i + 16 <= D; i += 16) {
                const v16 kv = load16(k, i, ckind);
                v16 x0, x1, x2, x3;
                memcpy(&x0, q0 + i, sizeof x0);
                memcpy(&x1, q1 + i, sizeof x1);
                memcpy(&x2, q2 + i, sizeof x2);
                memcpy(&x3, q3 + i, sizeof x3);
                a0 += x0 * kv, a1 += x1 * kv, a2 += x2 * kv, a3 += x3 * kv;
            }
            float s4[4];
            hsum4(a0, a1, a2, a3, s4);
            for (; i < D; i++) {
                const float kv = cached(k, i, ckind);
                s4[0] += q0[i] * kv, s4[1] += q1[i] * kv, s4[2] += q2[i] * kv, s4[3] += q3[i] * kv;
            }
            const float f = ks ? scale * ks[l] : scale;
            for (int t = 0; t < n; t++) {
                const float v = s4[t] * f;
                scores[(g0 + t) * L + l] = v;
                top[t] = v > top[t] ? v : top[t]; /* the running max of each head (NaN: left to exp) */
            }
        }
        for (int t = 0; t < n; t++) peak[g0 + t] = top[t];
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * L, m = peak[g];
        for (int64_t l = 0; l < L; l++) s[l] -= m;
        const float inv = 1.0f / exp_sum(s, L);
        for (int64_t l = 0; l < L; l++) s[l] *= vs ? inv * vs[l] : inv; /* an int8 row's scale joins its weight */
    }
    for (int64_t g0 = 0; g0 < G; g0 += 4) { /* outputs, four query heads at a time, 64 lanes each */
        const int n = G - g0 < 4 ? (int)(G - g0) : 4;
        const float *pr[4];
        four_rows(scores, g0, G, L, pr);
        const float *p0 = pr[0], *p1 = pr[1], *p2 = pr[2], *p3 = pr[3];
        int64_t i = 0;
        for (; i + 64 <= D; i += 64) {
            v16 a[4][4] = {{{0}}};
            for (int64_t l = 0; l < L; l++) {
                const char *v = (const char *)V + l * D * esz;
                const v16 v0 = load16(v, i, ckind), v1 = load16(v, i + 16, ckind);
                const v16 v2 = load16(v, i + 32, ckind), v3 = load16(v, i + 48, ckind);
                const float w[4] = {p0[l], p1[l], p2[l], p3[l]};
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) a[t][0] += w[t] * v0, a[t][1] += w[t] * v1, a[t][2] += w[t] * v2, a[t][3] += w[t] * v3;
            }
            for (int t = 0; t < n; t++) memcpy(out + (g0 + t) * D + i, a[t], sizeof a[t]);
        }
        for (; i + 16 <= D; i += 16) {
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t l = 0; l < L; l++) {
                const v16 v0 = load16((const char *)V + l * D * esz, i, ckind);
                a0 += p0[l] * v0, a1 += p1[l] * v0, a2 += p2[l] * v0, a3 += p3[l] * v0;
            }
            const v16 *a4[4] = {&a0, &a1, &a2, &a3};
            for (int t = 0; t < n; t++) memcpy(out + (g0 + t) * D + i, a4[t], sizeof a0);
        }
        for (; i < D; i++) {
            float a4[4] = {0.f, 0.f, 0.f, 0.f};
            for (int64_t l = 0; l < L; l++) {
                const float v0 = cached((const char *)V + l * D * esz, i, ckind);
                a4[0] += p0[l] * v0, a4[1] += p1[l] * v0, a4[2] += p2[l] * v0, a4[3] += p3[l] * v0;
            }
            for (int t = 0; t < n; t++) out[(g0 + t) * D + i] = a4[t];
        }
    }
}
