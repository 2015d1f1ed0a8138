/* Products with weights in GGUF's own blocks (llama.cpp's Q4_0, Q4_1 and Q8_0, as a .gguf file holds
 * them), times activations rounded to int8 per block of 32 as the int8 path rounds them (gemv_q8.c).
 *
 * A row of cols weights (cols a multiple of 32) is cols / 32 blocks, back to back (ldw bytes a row):
 * - Q4_0 (type 2, 18 bytes): fp16 d, 16 bytes qs; value j = d * ((qs[j] & 15) - 8), value j + 16 =
 *   d * ((qs[j] >> 4) - 8), j < 16;
 * - Q4_1 (type 3, 20 bytes): fp16 d, fp16 m, 16 bytes qs; value j = d * (qs[j] & 15) + m, value j + 16 =
 *   d * (qs[j] >> 4) + m;
 * - Q8_0 (type 8, 34 bytes): fp16 d, 32 int8 q; value j = d * q[j].
 * The activation x (cols fp32) is rounded once per product (mh_quantize_q8: xs[b] = absmax / 127 per
 * block b, xq = round(x / xs[b])), and with q the block's integer weights (Q4_0: nibble - 8, Q4_1: the
 * nibble, Q8_0: q):
 *
 *   y[o] = sum_b  (d_b * xs[b]) * isum_b  [+ m_b * (xs[b] * sumx_b)  for Q4_1]  (+ bias[o])
 *   isum_b = sum_{i in b} q_i xq_i,  sumx_b = sum_{i in b} xq_i     (exact int32)
 *
 * In fp32: d_b * xs[b] and, for Q4_1, m_b * (xs[b] * sumx_b) rounded once each; the int32 partial sums of
 * a block's lanes converted exactly (|sum| < 2^24) and multiplied by the block's scale into independent
 * lane accumulators, summed at the end of the row (a tree of halves). The float64 reference of the same
 * blocks on the same rounded activations (multihead.native.gguf_blocks.reference_product) agrees to
 * about 1e-7 of the sum of the terms' magnitudes. A row's product is the same function of its blocks
 * and of the activation row however many rows a call has (mh_gemm_gguf's row n: the bits of its one-row
 * call).
 *
 * Dot products, chosen by the compiler's target (-march=native), as gemv_q8.c's:
 * - AVX512-VNNI: two blocks (64 columns) a VPDPBUSD: the nibbles are u8 already (0-15), the activation
 *   s8; the two blocks' low and high nibbles side by side ([A lo, B lo, A hi, B hi], 16 bytes each), x
 *   permuted once per product to match; Q4_0's - 8 as each lane's start (-8 * its four x, made once per
 *   product); Q8_0 as gemv_q8.c (w + 128 as u8, each lane starting at -128 * its four x);
 * - AVX2 (with AVX-VNNI's VPDPBUSD where present, else VPMADDUBSW + VPMADDWD) one block a 32-byte step;
 * - portable C elsewhere.
 *
 * This file: the products; gguf_dequant.c: a row back to fp32; gguf_blocks.h: what both read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "gguf_blocks.h" /* GG_Q4_0, GG_Q4_1, GG_Q8_0, gg_h2f, gg_u16 */
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__F16C__)
#define MH_GG_ISA 3 /* AVX512-VNNI */
#elif defined(__AVX2__) && defined(__AVXVNNI__) && defined(__F16C__) && defined(__FMA__)
#define MH_GG_ISA 2 /* AVX-VNNI */
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MH_GG_ISA 1 /* AVX2 */
#else
#define MH_GG_ISA 0 /* portable */
#endif

#define GG_TILE 64 /* mh_gemm_gguf: activation rows rounded and held at once */
#define GG_WROWS 16 /* weight rows a work item (kept in the caches while the tile's rows meet them) */

int mh_gguf_isa(void) { return MH_GG_ISA; }

/* bytes of one block of type, 0 for a type without a kernel */
int64_t mh_gguf_block_bytes(int type) {
    return type == GG_Q4_0 ? 18 : type == GG_Q4_1 ? 20 : type == GG_Q8_0 ? 34 : type == GG_Q4_K ? 144 : type == GG_Q6_K ? 210 : 0;
}

/* weights in one block of type: 32, 256 for the k-quants' super-blocks, 0 for a type without a kernel */
int64_t mh_gguf_block_weights(int type) {
    return mh_gguf_block_bytes(type) == 0 ? 0 : type == GG_Q4_K || type == GG_Q6_K ? 256 : 32;
}

/* bytes of a row of cols weights of type (cols a multiple of its block) */
int64_t mh_gguf_row_bytes(int type, int64_t cols) {
    const int64_t n = mh_gguf_block_weights(type);
    return n ? cols / n * mh_gguf_block_bytes(type) : 0;
}

/* whether rows of cols weights of type have a kernel */
static int gg_fits(int type, int64_t cols) {
    const int64_t n = mh_gguf_block_weights(type);
    return n > 0 && cols > 0 && cols % n == 0;
}

/* What every row's product with one activation row needs, made once (gg_prepare) in its scratch. */
typedef struct {
    int8_t *xq;   /* (P,) the rounded activation, zeros past cols (P = cols rounded up to 128) */
    float *xs;    /* (P / 32,) its block scales, zeros past the last block */
    float *sx;    /* (P / 32,) xs[b] * sumx_b (Q4_1's m term) */
    int8_t *xv;   /* (P,) AVX-512 Q4: x in the nibbles' order, each 128 columns [lo 0-3, hi 0-3] (below) */
    void *start;  /* each lane's starting sum (Q4_0: -8 * its x; Q8_0 on AVX-512: -128 * its x) */
    float *xsv;   /* AVX-512: 8 floats a quad of blocks: [xs, sx] of each of its four blocks */
} gg_x;

/* scratch bytes of one activation row of cols (each part at 64) */
static int64_t gg_scratch_bytes(int64_t cols) {
    const int64_t P = (cols + 127) & ~(int64_t)127, sbytes = (P / 8 + 63) & ~(int64_t)63;
    return 3 * P + 2 * sbytes + ((P / 4 + 63) & ~(int64_t)63);
}

static void gg_prepare(const float *x, int64_t cols, int type, char *scratch, gg_x *p) {
    const int64_t P = (cols + 127) & ~(int64_t)127, P64 = (cols + 63) & ~(int64_t)63, nbp = P / 32;
    const int64_t sbytes = (P / 8 + 63) & ~(int64_t)63;
    p->xq = (int8_t *)scratch;
    p->xs = (float *)(scratch + P);
    p->sx = (float *)(scratch + P + sbytes);
    p->xv = (int8_t *)(scratch + P + 2 * sbytes);
    p->start = scratch + 2 * P + 2 * sbytes;
    p->xsv = (float *)(scratch + 3 * P + 2 * sbytes);
    mh_quantize_q8(x, MH_F32, cols, p->xq, p->xs); /* P64 values, P64 / 32 scales */
    memset(p->xq + P64, 0, (size_t)(P - P64)), memset(p->xs + P64 / 32, 0, (size_t)(P - P64) / 8);
    for (int64_t b = 0; b < nbp; b++) {
        int32_t s = 0;
        for (int i = 0; i < 32; i++) s += p->xq[32 * b + i];
        p->sx[b] = p->xs[b] * (float)s;
    }
#if MH_GG_ISA == 3
    __m512i *start = p->start; /* two a quad */
    for (int64_t k = 0; k < P / 128; k++) {
        const int8_t *src = p->xq + 128 * k;
        int8_t *dst = p->xv + 128 * k;
        if (type == GG_Q4_K || type == GG_Q6_K) continue; /* gemv_qk.c reads xq, xs and sx alone */
        if (type == GG_Q8_0) { /* the blocks in order: lanes 0-7 block 0 (1 in the second vector), 8-15 block 1 (3) */
            for (int h = 0; h < 2; h++)
                start[2 * k + h] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80),
                                                                        _mm512_loadu_si512(src + 64 * h)));
        } else { /* [A lo, B lo, C lo, D lo] then [A hi, ...]: block j's columns 0-15, then 16-31 */
            for (int j = 0; j < 4; j++) memcpy(dst + 16 * j, src + 32 * j, 16), memcpy(dst + 64 + 16 * j, src + 32 * j + 16, 16);
            const __m512i e = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(8), _mm512_loadu_si512(dst)),
                                                  _mm512_set1_epi8(8), _mm512_loadu_si512(dst + 64));
            start[2 * k] = _mm512_sub_epi32(_mm512_setzero_si512(), e); /* -8 * the lane's eight x */
        }
        for (int j = 0; j < 4; j++) p->xsv[8 * k + 2 * j] = p->xs[4 * k + j], p->xsv[8 * k + 2 * j + 1] = p->sx[4 * k + j];
    }
#elif MH_GG_ISA >= 1
    __m256i *start = p->start; /* Q4_0: -8 * its four x, a block a vector */
    for (int64_t b = 0; b < nbp; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(p->xq + 32 * b));
        const __m256i e = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), xv), _mm256_set1_epi16(1));
        start[b] = _mm256_sub_epi32(_mm256_setzero_si256(), e);
    }
    (void)type;
#else
    (void)type;
#endif
}

#if MH_GG_ISA == 3
static inline float gg_reduce16(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_permute_ps(q, 0x4E));
    q = _mm_add_ps(q, _mm_permute_ps(q, 0xB1));
    return _mm_cvtss_f32(q);
}

/* Four blocks at q (bb bytes apart) against the prepared quad k: the fp32 lane sums added to acc, and
 * (Q4_1) the m terms to am (lanes 1, 3, 5, 7). Q4: one 512-bit vector of the four blocks' low nibbles and
 * one of their high, both dotted into the same lanes (4 a block); Q8_0: blocks 0-1 and 2-3 a vector
 * each (8 lanes a block). The scales' d (and m): four 32-bit words. */
static inline __attribute__((always_inline)) void gg_quad(const uint8_t *q, int64_t bb, int type, const gg_x *p,
                                                          int64_t k, __m512 *acc, __m256 *am, int nblk) {
    uint32_t u[4] = {0, 0, 0, 0}; /* nblk < 4 (a row's last blocks): the missing ones' d = 0, weights 0 */
    for (int j = 0; j < nblk; j++) memcpy(&u[j], q + j * bb, 4);
    __m128i h = _mm_set_epi32((int)u[3], (int)u[2], (int)u[1], (int)u[0]);
    if (type != GG_Q4_1) h = _mm_and_si128(h, _mm_set1_epi32(0xFFFF)); /* d alone */
    const __m256 t = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(p->xsv + 8 * k)); /* [d xs, m sx] x4 */
    const __m512 t5 = _mm512_castps256_ps512(t);
    const __m512i *start = p->start;
    if (type == GG_Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        const __m256i z = _mm256_set1_epi8((char)0x80); /* a missing block: 0 once flipped */
#define GG_Q8_AT(j) (j < nblk ? _mm256_loadu_si256((const __m256i *)(q + (j) * bb + 2)) : z)
        const __m512i w0 = _mm512_inserti64x4(_mm512_castsi256_si512(GG_Q8_AT(0)), GG_Q8_AT(1), 1);
        const __m512i w1 = _mm512_inserti64x4(_mm512_castsi256_si512(GG_Q8_AT(2)), GG_Q8_AT(3), 1);
#undef GG_Q8_AT
        const __m512i s0 = _mm512_dpbusd_epi32(start[2 * k], _mm512_xor_si512(w0, flip), _mm512_loadu_si512(p->xq + 128 * k));
        const __m512i s1 = _mm512_dpbusd_epi32(start[2 * k + 1], _mm512_xor_si512(w1, flip), _mm512_loadu_si512(p->xq + 128 * k + 64));
        const __m512i i0 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i i1 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
        acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_permutexvar_ps(i0, t5), acc[0]);
        acc[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_permutexvar_ps(i1, t5), acc[1]);
        return;
    }
    const int off = type == GG_Q4_0 ? 2 : 4;
    __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)(q + off)));
    if (nblk > 1) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + bb + off)), 1);
    if (nblk > 2) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + 2 * bb + off)), 2);
    if (nblk > 3) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q + 3 * bb + off)), 3);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    const __m512i s0 = type == GG_Q4_0 ? start[2 * k] : _mm512_setzero_si512();
    const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s0, lo, _mm512_loadu_si512(p->xv + 128 * k)), hi,
                                          _mm512_loadu_si512(p->xv + 128 * k + 64));
    const __m512i si = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
    acc[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(si, t5), acc[0]);
    if (type == GG_Q4_1) *am = _mm256_mask_add_ps(*am, 0xAA, *am, t);
}

static inline __attribute__((always_inline)) float gg_row(const uint8_t *r, int64_t cols, int type, const gg_x *p) {
    const int64_t bb = mh_gguf_block_bytes(type), nb = cols / 32, quads = nb / 4;
    __m512 a[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
    __m256 am = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 2 <= quads; k += 2) { /* two quads a step, each its own accumulators */
        gg_quad(r + 4 * k * bb, bb, type, p, k, a[0], &am, 4);
        gg_quad(r + 4 * (k + 1) * bb, bb, type, p, k + 1, a[1], &am, 4);
    }
    if (k < quads) gg_quad(r + 4 * k * bb, bb, type, p, k, a[0], &am, 4), k++;
    const int left = (int)(nb - 4 * k); /* the last 1-3 blocks (x is 0 past the row) */
    if (left == 1) gg_quad(r + 4 * k * bb, bb, type, p, k, a[1], &am, 1);
    else if (left == 2) gg_quad(r + 4 * k * bb, bb, type, p, k, a[1], &am, 2);
    else if (left == 3) gg_quad(r + 4 * k * bb, bb, type, p, k, a[1], &am, 3);
    const __m128 m2 = _mm_add_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[0][0], a[0][1]), _mm512_add_ps(a[1][0], a[1][1]));
    return gg_reduce16(sum) + (_mm_cvtss_f32(_mm_movehdup_ps(m2)) + _mm_cvtss_f32(_mm_movehl_ps(_mm_movehdup_ps(m2), _mm_movehdup_ps(m2))));
}
#elif MH_GG_ISA >= 1
static inline __m256i gg_dot(const __m256i u, const __m256i s, __m256i acc) { /* u8 x s8, 4 a lane */
#if MH_GG_ISA == 2
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) float gg_row(const uint8_t *r, int64_t cols, int type, const gg_x *p) {
    const int64_t bb = mh_gguf_block_bytes(type), nb = cols / 32;
    const __m256i *start = p->start, m4 = _mm256_set1_epi8(0x0F);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    float am = 0.f;
    for (int64_t k = 0; k < nb; k++) {
        const uint8_t *a = r + k * bb;
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(p->xq + 32 * k));
        __m256i s;
        if (type == GG_Q8_0) { /* |x| (u8) times w * sign(x) */
            const __m256i w = _mm256_loadu_si256((const __m256i *)(a + 2));
            s = gg_dot(_mm256_abs_epi8(xv), _mm256_sign_epi8(w, xv), _mm256_setzero_si256());
        } else {
            const __m128i v = _mm_loadu_si128((const __m128i *)(a + (type == GG_Q4_0 ? 2 : 4)));
            const __m256i vv = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
            s = gg_dot(_mm256_and_si256(vv, m4), xv, type == GG_Q4_0 ? start[k] : _mm256_setzero_si256());
        }
        const float sc = _cvtsh_ss(gg_u16(a)) * p->xs[k];
        if (k & 1) a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(sc), a1);
        else a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(sc), a0);
        if (type == GG_Q4_1) am += _cvtsh_ss(gg_u16(a + 2)) * p->sx[k];
    }
    const __m256 v = _mm256_add_ps(a0, a1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h) + am;
}
#else
static float gg_row(const uint8_t *r, int64_t cols, int type, const gg_x *p) {
    const int64_t bb = mh_gguf_block_bytes(type), nb = cols / 32;
    float acc = 0.f;
    for (int64_t k = 0; k < nb; k++) {
        const uint8_t *a = r + k * bb;
        const int8_t *x = p->xq + 32 * k;
        int32_t s = 0;
        if (type == GG_Q8_0) {
            for (int i = 0; i < 32; i++) s += (int32_t)(int8_t)a[2 + i] * x[i];
        } else {
            const uint8_t *q = a + (type == GG_Q4_0 ? 2 : 4);
            const int off = type == GG_Q4_0 ? 8 : 0;
            for (int i = 0; i < 16; i++) s += ((q[i] & 15) - off) * x[i] + ((q[i] >> 4) - off) * x[i + 16];
        }
        acc += (gg_h2f(gg_u16(a)) * p->xs[k]) * (float)s;
        if (type == GG_Q4_1) acc += gg_h2f(gg_u16(a + 2)) * p->sx[k];
    }
    return acc;
}
#endif

/* rows o0 .. o1 - 1 against the m prepared activation rows: y[t * rows + o] */
static inline __attribute__((always_inline)) void gg_rows(const uint8_t *w, int64_t ldw, const gg_x *xs, int64_t m,
                                                          const float *b, float *y, int64_t rows, int64_t cols,
                                                          int type, int64_t o0, int64_t o1) {
    for (int64_t t = 0; t < m; t++)
        for (int64_t o = o0; o < o1; o++) {
            const float s = type == GG_Q4_K || type == GG_Q6_K
                                ? mh_gguf_row_k(w + o * ldw, cols, type, xs[t].xq, xs[t].xs, xs[t].sx)
                                : gg_row(w + o * ldw, cols, type, xs + t);
            y[t * rows + o] = b ? s + b[o] : s;
        }
}

/* work item k: weight rows GG_WROWS k .. against the m rows, the type a constant in each copy */
static void gg_item(int type, const uint8_t *w, int64_t ldw, const gg_x *xs, int64_t m, const float *b, float *y,
                    int64_t rows, int64_t cols, int64_t k) {
    const int64_t o0 = k * GG_WROWS, o1 = o0 + GG_WROWS < rows ? o0 + GG_WROWS : rows;
    if (type == GG_Q4_0) gg_rows(w, ldw, xs, m, b, y, rows, cols, GG_Q4_0, o0, o1);
    else if (type == GG_Q4_1) gg_rows(w, ldw, xs, m, b, y, rows, cols, GG_Q4_1, o0, o1);
    else if (type == GG_Q8_0) gg_rows(w, ldw, xs, m, b, y, rows, cols, GG_Q8_0, o0, o1);
    else gg_rows(w, ldw, xs, m, b, y, rows, cols, type, o0, o1); /* the k-quants: a call a row */
}

/* Y (n, rows) fp32 = X W^T + b for n activation rows X (n, cols) fp32 (row stride cols), W (rows, ldw bytes)
 * in GGUF's blocks of type (2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K: gemv_qk.c), b (rows) fp32 or NULL. Each row of X is rounded to int8
 * per block of 32 (mh_quantize_q8), then every output made by the same row function, whatever n: row i
 * of Y has the bits of the call with X's row i alone. Up to GG_TILE rows of X are rounded and held at once
 * while each GG_WROWS weight rows meet them. Returns 0, -1 when the scratch cannot be allocated, -2 for a
 * type without a kernel or cols not a multiple of its block (Y then unwritten). */
int mh_gemm_gguf(int type, const uint8_t *w, int64_t ldw, const float *x, const float *b, float *y, int64_t n,
                 int64_t rows, int64_t cols) {
    if (!gg_fits(type, cols)) return -2;
    if (n <= 0 || rows <= 0) return 0;
    const int64_t tile = n < GG_TILE ? n : GG_TILE, per = gg_scratch_bytes(cols);
    char *buf = aligned_alloc(64, (size_t)(tile * per));
    if (!buf) return -1;
    gg_x xs[GG_TILE];
    for (int64_t i0 = 0; i0 < n; i0 += tile) {
        const int64_t m = n - i0 < tile ? n - i0 : tile;
        for (int64_t t = 0; t < m; t++) gg_prepare(x + (i0 + t) * cols, cols, type, buf + t * per, &xs[t]);
        float *yt = y + i0 * rows;
        const int64_t items = (rows + GG_WROWS - 1) / GG_WROWS;
        MH_BALANCED_FOR(items, rows * cols * m >= MH_PAR_MIN, 0, k, gg_item(type, w, ldw, xs, m, b, yt, rows, cols, k));
    }
    free(buf);
    return 0;
}

/* mh_gemm_gguf of one row on a decode step's team (native.h's MH_BALANCED_FOR with TEAM 1): called by
 * every thread of it, each rounding x in its own scratch and taking its share of the rows; no barrier at
 * the end. Returns 0, -1 without scratch memory, -2 as mh_gemm_gguf. */
int mh_gemv_gguf_team(int type, const uint8_t *w, int64_t ldw, const float *x, float *y, int64_t rows, int64_t cols) {
    if (!gg_fits(type, cols)) return -2;
    const int64_t per = gg_scratch_bytes(cols);
    _Alignas(64) char local[32768];
    char *buf = per <= (int64_t)sizeof local ? local : aligned_alloc(64, (size_t)per);
    if (!buf) return -1;
    gg_x xs;
    gg_prepare(x, cols, type, buf, &xs);
    MH_BALANCED_FOR((rows + GG_WROWS - 1) / GG_WROWS, 1, 1, k, gg_item(type, w, ldw, &xs, 1, NULL, y, rows, cols, k));
    if (buf != local) free(buf);
    return 0;
}
