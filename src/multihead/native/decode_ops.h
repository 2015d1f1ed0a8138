/* The per-value helpers and the steps of a layer that decode_layer.c (the loop over B rows) and
 * decode_team.c (one row on one team of threads) share, as static inline functions, so that both run the
 * same code on a row: the storage dtypes' rounding, loads and stores, RoPE, silu, the products (project)
 * and the cache writes. Private to those two files; the math: decode_layer.c's comment. */
#ifndef MH_DECODE_OPS_H
#define MH_DECODE_OPS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

static inline float bf_to_f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f_to_bf(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* the storage dtypes: MH_F32, MH_BF16, MH_F16 (native.h; fp16 where MH_HAS_F16) */
static inline float rnd(float f, int kind) {
    if (kind == MH_BF16) return bf_to_f(f_to_bf(f));
#if MH_HAS_F16
    if (kind == MH_F16) return mh_h2f(mh_f2h(f));
#endif
    return f;
}

static inline float get(const void *p, int64_t i, int kind) {
    if (kind == MH_BF16) return bf_to_f(((const uint16_t *)p)[i]);
#if MH_HAS_F16
    if (kind == MH_F16) return mh_h2f(((const uint16_t *)p)[i]);
#endif
    return ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float f, int kind) {
    if (kind == MH_BF16)
        ((uint16_t *)p)[i] = f_to_bf(f);
#if MH_HAS_F16
    else if (kind == MH_F16)
        ((uint16_t *)p)[i] = mh_f2h(f);
#endif
    else
        ((float *)p)[i] = f;
}

/* y = W x of kind; team: on a step's team (the kernels' _team entries) */
static inline void gemv(const void *w, const void *x, void *y, int64_t rows, int64_t cols, int kind, int team) {
    if (kind == MH_BF16)
        (team ? mh_gemv_bf16_team : mh_gemv_bf16)((const uint16_t *)w, (const uint16_t *)x, NULL, (uint16_t *)y,
                                                  rows, cols, cols);
    else if (kind == MH_F16)
        (team ? mh_gemv_f16_team : mh_gemv_f16)((const uint16_t *)w, (const uint16_t *)x, NULL, (uint16_t *)y, rows,
                                                cols, cols);
    else
        (team ? mh_gemv_f32_team : mh_gemv_f32)((const float *)w, (const float *)x, NULL, (float *)y, rows, cols, cols);
}

/* STMT with the storage dtype kind a constant K (MH_F32, MH_BF16 or MH_F16), so that its loops over get /
 * put vectorize instead of testing the kind at every value */
#define MH_BY_KIND(kind, ...)                                                                              \
    do {                                                                                                   \
        if ((kind) == MH_F32) {                                                                            \
            enum { K = MH_F32 };                                                                           \
            __VA_ARGS__;                                                                                   \
        } else if ((kind) == MH_BF16) {                                                                    \
            enum { K = MH_BF16 };                                                                          \
            __VA_ARGS__;                                                                                   \
        } else {                                                                                           \
            enum { K = MH_F16 };                                                                           \
            __VA_ARGS__;                                                                                   \
        }                                                                                                  \
    } while (0)

/* rotate one head of D values in place at the angles of cos / sin (D/2 each): pairs (i, i + D/2), or
 * (2i, 2i + 1) when interleaved; the result is rounded to the storage dtype */
static inline void rope(void *t, int64_t D, const float *cos, const float *sin, int interleaved, int kind) {
    const int64_t half = D / 2;
    MH_BY_KIND(kind, for (int64_t i = 0; i < half; i++) {
        const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        const float x1 = get(t, a, K), x2 = get(t, b, K);
        put(t, a, x1 * cos[i] - x2 * sin[i], K);
        put(t, b, x2 * cos[i] + x1 * sin[i], K);
    });
}

/* silu(a) = a / (1 + e^-a) over n floats in place */
static inline void silu(float *a, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 v;
        memcpy(&v, a + i, sizeof v);
        v = v / (1.0f + mh_vexp(-v));
        memcpy(a + i, &v, sizeof v);
    }
    for (; i < n; i++) a[i] = a[i] / (1.0f + expf(-a[i]));
}

/* the five matrices of a layer: of the storage dtype, or int8 with fp32 scales per group of G inputs */
enum { P_QKV, P_O, P_W1, P_W3, P_W2 };
typedef struct {
    const void *w[5]; /* qkv, o, w1, w3, w2 */
    const float *s[5]; /* int8 weights: their group scales; NULL for weights of the storage dtype */
    int64_t group;
    int blocked; /* int8 weights' layout (native.h's MH_Q8_*: in column order, blocked, packed with scales) */
    int8_t *xq; /* int8 weights: the quantized input of the last product (mh_quantize_q8) */
    float *xs;
    void *scratch; /* int8 weights: mh_gemv_q8_into's, 64-aligned */
    int team; /* the products run on a step's team (mh_team_step) */
    int gg_types; /* GGUF weights: weight p's ggml type in bits 4p .. 4p + 3, 0: blocked's for all */
} weights;

/* Y = X W_p^T for B rows of X (B, cols) into Y (B, rows), each row as the one-row product gives it. One
 * row: the one-row GEMV (int8 weights quantize x first, unless fresh == 0: x was the last product's input
 * too); several: the multi-row products, which read the weights once for all of them and give each row
 * the bits of its one-row product. Returns 0, or -1 when the int8 product's scratch cannot be allocated. */
static inline int project(const weights *W, int p, const void *x, void *y, int64_t rows, int64_t cols, int kind, int fresh,
                          int64_t B) {
    if (W->blocked >= MH_GG_LAYOUT) { /* GGUF's blocks: one product for one row or several (fp32 x) */
        const int type = W->gg_types ? (W->gg_types >> (4 * p)) & 15 : W->blocked - MH_GG_LAYOUT;
        const int64_t ldw = mh_gguf_row_bytes(type, cols);
        const float *xf = (const float *)x;
        const int s = W->team ? mh_gemv_gguf_team(type, W->w[p], ldw, xf, (float *)y, rows, cols)
                              : mh_gemm_gguf(type, W->w[p], ldw, xf, NULL, (float *)y, B, rows, cols);
        return s == 0 ? 0 : -1;
    }
    if (B > 1 && W->s[p] == NULL)
        return mh_gemv_rows(kind, W->w[p], x, NULL, y, B, rows, cols, cols) == 0 ? 0 : -1; /* kind: checked */
    const int64_t ldw = mh_q8_row_bytes(cols, W->blocked); /* int8 rows: packed ones hold their scales */
    if (B > 1)
        return mh_gemm_q8((const int8_t *)W->w[p], W->s[p], (const float *)x, NULL, (float *)y, B, rows, cols, ldw,
                          W->group, W->blocked);
    if (W->s[p] == NULL) {
        gemv(W->w[p], x, y, rows, cols, kind, W->team);
        return 0;
    }
    if (fresh) mh_quantize_q8(x, kind, cols, W->xq, W->xs);
    (W->team ? mh_gemv_q8_team : mh_gemv_q8_into)((const int8_t *)W->w[p], W->s[p], W->xq, W->xs, NULL, (float *)y,
                                                  rows, cols, ldw, W->group, W->blocked,
                                                  W->scratch); /* cannot fail: the layout was checked on entry */
    return 0;
}

/* write the rotated key or the value of one kv head (D values of kind) at cache row dst: a copy, or for
 * an int8 cache (ckind MH_I8) its per-token int8 rounding as torch's: scale = absmax / 127 into *scale,
 * q = round(x / scale) half to even (an all-zero row: scale 0, q 0) */
static inline void cache_write(void *dst, float *scale, const void *src, int64_t D, int kind, int ckind) {
    if (ckind != MH_I8) {
        memcpy(dst, src, (size_t)(D * (kind == MH_F32 ? 4 : 2)));
        return;
    }
    float amax = 0.f;
    for (int64_t i = 0; i < D; i++) { /* a NaN passed over */
        const float a = fabsf(get(src, i, kind));
        amax = a > amax ? a : amax;
    }
    const float s = amax / 127.0f, div = s > 0.f ? s : 1.f;
    *scale = s;
    for (int64_t i = 0; i < D; i++) {
        const float q = nearbyintf(get(src, i, kind) / div);
        ((int8_t *)dst)[i] = (int8_t)(q > 127.f ? 127.f : (q < -127.f ? -127.f : q));
    }
}

#ifdef _OPENMP
/* mh_decode_batch of one row (checked by the caller) on one team of up to MH_MAX_SPANS threads
 * (decode_team.c); 0, or -1 when its memory cannot be allocated (nothing run). Hidden: not one of the
 * library's entries */
__attribute__((visibility("hidden"))) int mh_team_step(void *x, const mh_layer_args *a, int64_t n, int64_t pos,
                                                       const float *const *cos, const float *const *sin,
                                                       const void *g_final, float eps_final, void *out,
                                                       int64_t *done);
#endif
#endif
