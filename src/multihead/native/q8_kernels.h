/* The int8 row kernels that gemv_q8.c (the one-row product) and gemm_q8.c (the multi-row product) share:
 * the dot products of one row chosen by the compiler's target (MH_Q8_ISA), the activation's preparation
 * for them, and each output's last rounding, so that both give a row the same bits. The math and the
 * layouts: gemv_q8.c's comment. Private to those two files (their static inline functions). */
#ifndef MH_Q8_KERNELS_H
#define MH_Q8_KERNELS_H
#include <math.h>
#include <stdint.h>
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

#if MH_Q8_ISA < 3
/* blocks b0..nb-1 of one row in plain C: the tails of the vector loops and the portable kernel */
static inline float row_blocks(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs, int64_t b0,
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
#endif

#if MH_Q8_ISA == 3
/* lanes 0-7: block 2k of a 16-block scale vector, lanes 8-15: block 2k + 1 */
static inline __m512i pair_index(int k) {
    const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_add_epi32(half, _mm512_set1_epi32(2 * k));
}

/* the weight scales of blocks 16 j .. 16 j + 15 of one row (bm: the blocks that exist); G = 32 << shift
 * (shift 0-4), else (shift -1) any multiple of 64: gathered */
static inline __m512 group_scales(const float *wsr, int64_t j, int64_t G, int shift, __mmask16 bm) {
    if (shift == 0) return _mm512_maskz_loadu_ps(bm, wsr + 16 * j);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    if (shift > 0) { /* each scale serves 1 << shift blocks */
        const int nb = __builtin_popcount(bm);
        const __mmask16 m = (__mmask16)((1u << (((nb - 1) >> shift) + 1)) - 1); /* none past the row's */
        const __m512 v = _mm512_maskz_loadu_ps(m, wsr + ((16 * j) >> shift));
        return _mm512_permutexvar_ps(_mm512_srli_epi32(lane, (unsigned)shift), v);
    }
    int32_t ix[16]; /* block 16 j + l's scale: 32 (16 j + l) / G */
    for (int l = 0; l < 16; l++) ix[l] = (int32_t)(((16 * j + l) * 32) / G);
    const __m512i idx = _mm512_loadu_si512(ix);
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), bm, idx, wsr, 4);
}

/* the start of each lane's int32 sum over the 64 columns at x: -128 * (its four x) */
static inline __m512i offset_start(const int8_t *x) {
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), _mm512_loadu_si512(x));
    return _mm512_sub_epi32(_mm512_setzero_si512(), sum);
}

/* The sums of 16 lanes of four vectors in one tree of halves (the 256-bit halves added, then the 128-bit
 * halves, then lanes 0 + 2 and 1 + 3, then those two): out[t] the sum of v[t]. Every row's sum is made by
 * this tree (reduce16 for one row), so a row's product has the same bits whichever way it was made. */
static inline void reduce4(__m512 a, __m512 b, __m512 c, __m512 d, float *out) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E)); /* each 128 bits: lanes 0 + 2, 1 + 3 */
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1)); /* and those two */
    _Alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}

static inline float reduce16(__m512 v) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); /* AVX512F */
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_permute_ps(q, 0x4E));
    q = _mm_add_ps(q, _mm_permute_ps(q, 0xB1));
    return _mm_cvtss_f32(q);
}

/* The rest of one row after its first j whole 512-column chunks (their sums in a0, a1): whole 64-column
 * steps in column order, then the last 1-8 steps, the last one maybe partial (a masked load: nothing past
 * the row is touched); returns the row's 16 lane sums (reduce16 gives the row's sum). */
static inline __m512 row_rest(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs,
                             const __m512i *start, int64_t cols, int64_t G, int shift, int per_row, int packed,
                             int64_t j, __m512 a0, __m512 a1) {
    const int64_t nc = (cols + 63) / 64, full = cols / 64, nblocks = (cols + 31) / 32;
    const __mmask64 tail = cols % 64 ? (((__mmask64)1 << (cols % 64)) - 1) : ~(__mmask64)0;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 a2 = _mm512_setzero_ps(), a3 = a2;
    for (; 8 * j + 8 <= full; j++) { /* 8 whole steps: 512 columns, 16 blocks */
        __m512 sc = _mm512_loadu_ps(xs + 16 * j);
        if (!per_row) sc = _mm512_mul_ps(sc, group_scales(wsr, j, G, shift, 0xFFFF));
        const int8_t *rj = r + 512 * j, *xj = xq + 512 * j;
#define MH_Q8_STEP(k, acc)                                                                                \
    {                                                                                                     \
        const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(rj + 64 * k), flip);                      \
        const __m512i d = _mm512_dpbusd_epi32(start[8 * j + k], wu, _mm512_loadu_si512(xj + 64 * k));    \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(pair_index(k), sc), acc);      \
    }
        MH_Q8_STEP(0, a0) MH_Q8_STEP(1, a1) MH_Q8_STEP(2, a2) MH_Q8_STEP(3, a3)
        MH_Q8_STEP(4, a0) MH_Q8_STEP(5, a1) MH_Q8_STEP(6, a2) MH_Q8_STEP(7, a3)
#undef MH_Q8_STEP
    }
    if (8 * j < nc) { /* the last 1-8 steps, the last one maybe partial */
        const int64_t left = nblocks - 16 * j;
        const __mmask16 bm = (__mmask16)(left >= 16 ? 0xFFFF : (1u << left) - 1);
        const int8_t *rt = r + (packed ? MH_Q8_CHUNK_BYTES : 512) * j; /* column 512 j on */
        __m512 sc = _mm512_maskz_loadu_ps(bm, xs + 16 * j);
        if (packed) /* the tail's scales after its columns, padded to 64 bytes */
            sc = _mm512_mul_ps(sc, _mm512_maskz_loadu_ps(bm, rt + ((cols - 512 * j + 63) & ~(int64_t)63)));
        else if (!per_row)
            sc = _mm512_mul_ps(sc, group_scales(wsr, j, G, shift, bm));
        for (int64_t c = 8 * j; c < nc; c++) {
            const __mmask64 lm = c < full ? ~(__mmask64)0 : tail;
            const __m512i wu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(lm, rt + 64 * (c - 8 * j)), flip);
            const __m512i d = _mm512_dpbusd_epi32(start[c], wu, _mm512_loadu_si512(xq + 64 * c)); /* x 0-padded */
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(pair_index((int)(c - 8 * j)), sc), a0);
        }
    }
    return _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
}

/* One row, 64 columns a step: the weights offset to u8 (w + 128: the sign bit flipped) dotted with x as
 * s8 by VPDPBUSD, each lane starting at -128 * (its four x) (start[c], made once for every row), so
 * the int32 lane sums are exactly w . x. Blocked rows (bstart: each whole 512 columns' lane starts): 16
 * blocks' sums a chunk, scaled by one vector (xs[b] * ws[o, b]). Rows in column order: the scales of 16
 * blocks multiplied once and each step permuting its two blocks' scales out of them; four accumulators. */
static inline float row_q8(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs,
                           const __m512i *start, const __m512i *bstart, int64_t cols, int64_t G, int shift,
                           int per_row, int packed) {
    const int64_t full = cols / 64, cs = packed ? MH_Q8_CHUNK_BYTES : 512; /* a chunk's bytes */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    int64_t j = 0;
    if (bstart) /* blocked: lane l of the 8 vectors of 512 columns holds block 16 j + l */
        for (; 8 * j + 8 <= full; j++) {
            const int8_t *rj = r + cs * j, *xj = xq + 512 * j;
            __m512 sc = _mm512_loadu_ps(xs + 16 * j);
            if (packed) sc = _mm512_mul_ps(sc, _mm512_loadu_ps(rj + 512));
            else if (!per_row) sc = _mm512_mul_ps(sc, group_scales(wsr, j, G, shift, 0xFFFF));
            __m512i s0 = bstart[j], s1 = _mm512_setzero_si512(); /* two chains of VPDPBUSD */
#define MH_Q8_BSTEP(k, acc) \
    acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(_mm512_loadu_si512(rj + 64 * k), flip), _mm512_loadu_si512(xj + 64 * k));
            MH_Q8_BSTEP(0, s0) MH_Q8_BSTEP(1, s1) MH_Q8_BSTEP(2, s0) MH_Q8_BSTEP(3, s1)
            MH_Q8_BSTEP(4, s0) MH_Q8_BSTEP(5, s1) MH_Q8_BSTEP(6, s0) MH_Q8_BSTEP(7, s1)
#undef MH_Q8_BSTEP
            const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)); /* 16 blocks' exact sums */
            if (j & 1) a1 = _mm512_fmadd_ps(sums, sc, a1);
            else a0 = _mm512_fmadd_ps(sums, sc, a0);
        }
    return reduce16(row_rest(r, wsr, xq, xs, start, cols, G, shift, per_row, packed, j, a0, a1));
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

static inline float row_q8(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs, int64_t cols,
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
static inline float row_q8(const int8_t *r, const float *wsr, const int8_t *xq, const float *xs, int64_t cols,
                           int64_t G, int per_row) {
    return row_blocks(r, wsr, xq, xs, 0, (cols + MH_Q8_BLOCK - 1) / MH_Q8_BLOCK, cols, G, per_row);
}
#endif

#if MH_Q8_ISA == 3
/* What every row's product with one activation x needs, made once in scratch (MH_Q8_SCRATCH(cols) bytes at
 * 64): x in the weights' order (*xv: the blocked order when blocked, else xq itself), each 64 columns'
 * lane starts (*start), and for blocked rows each whole 512 columns' (*bstart, else NULL). */
static inline void prepare_x(const int8_t *xq, int64_t cols, int blocked, void *scratch, const int8_t **xv,
                             const __m512i **start_out, const __m512i **bstart_out) {
    const int64_t nc = (cols + 63) / 64, chunks = cols / 512;
    __m512i *start = scratch, *bstart = NULL;
    *xv = xq;
    if (blocked) { /* x in the weights' order (the columns past the whole 512 as they are) */
        int8_t *xb = (int8_t *)(start + nc);
        memcpy(xb + 512 * chunks, xq + 512 * chunks, (size_t)(64 * nc - 512 * chunks));
        for (int64_t j = 0; j < chunks; j++) /* four bytes 32 l + 4 v of the chunk to 64 v + 4 l (blocked_at) */
            for (int v = 0; v < 8; v++)
                for (int l = 0; l < 16; l++) memcpy(xb + 512 * j + 64 * v + 4 * l, xq + 512 * j + 32 * l + 4 * v, 4);
        *xv = xb;
        bstart = (__m512i *)(xb + 64 * nc);
    }
    for (int64_t c = 0; c < nc; c++) start[c] = offset_start(*xv + 64 * c);
    for (int64_t j = 0; blocked && j < chunks; j++) { /* lane l: -128 * (block 16 j + l's 32 x) */
        __m512i acc = start[8 * j];
        for (int k = 1; k < 8; k++) acc = _mm512_add_epi32(acc, start[8 * j + k]);
        bstart[j] = acc;
    }
    *start_out = start, *bstart_out = bstart;
}

static inline int scale_shift(int64_t G) { /* G = 32 << shift up to 512; -1: scales gathered */
    for (int e = 0; e <= 4; e++)
        if (G == ((int64_t)32 << e)) return e;
    return -1;
}
#endif

/* output o from its row's sum s: times the row's scale (per_row), plus its bias; one rounding for both
 * (an explicit fused multiply-add), so that every product that calls it gives the same bits */
static inline float q8_out(float s, const float *wsr, const float *b, int64_t o, int per_row) {
    if (per_row) return b ? fmaf(s, wsr[0], b[o]) : s * wsr[0];
    return b ? s + b[o] : s;
}

#if MH_Q8_ISA == 3
/* CALL(shift, per_row, packed) with the common cases' constants, so that the compiler specializes the
 * inlined kernel and its loop carries no branch (reads shift, per_row and packed of the caller) */
#define MH_Q8_SPECIALIZED(CALL)                                                                           \
    (packed ? CALL(0, 0, 1) : per_row ? CALL(0, 1, 0) : shift == 0 ? CALL(0, 0, 0) : CALL(shift, 0, 0))
#endif
#endif
