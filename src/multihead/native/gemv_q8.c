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
 * bandwidth: independent accumulators, the block scales applied to whole vectors of partial sums (no
 * horizontal sum per block), and with AVX512-VNNI two rows at a time, one from each half of the matrix
 * (two streams read side by side, each 64 bytes of x loaded once for both: on a Zen 5 core the model's
 * products read 1.10x the GB/s of one row at a time, 90% of a plain read of as many bytes against 82%).
 *
 * Layouts (q8_rows.c; the "blocked" argument): a row in column order, "blocked" (AVX512-VNNI builds only:
 * the blocks of every whole 512 columns interleaved four bytes at a time, so that lane l of each of the 8
 * vectors belongs to block l, VPDPBUSD keeps a block's whole sum in one int32 lane, and its scale is
 * applied once per 512 columns instead of once per 64; measured on a Zen 5 core: 1.05-1.2x the read rate
 * of column order on 1024-2816 wide rows, groups of 32), or "packed" (blocked, groups of 32, each 512
 * columns followed by their 16 scales: one stream a row; ~1% less time a token on that core).
 *
 * Dot products, chosen by the compiler's target (-march=native):
 * - AVX512-VNNI (VPDPBUSD: u8 x s8 -> int32, 64 bytes at once): the weights offset to u8 (w + 128, one
 *   xor) times x as s8, each int32 lane starting at -128 * (its four x), made once per product for every
 *   row; the fp32 work of 16 blocks' scales done once per 512 columns (measured on a Zen 5 core: 1.3x
 *   the rate of moving x's sign onto the weights, 10% more of the memory's read rate on large matrices);
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

#define MH_Q8_STACK_BYTES 32768 /* mh_gemv_q8's scratch on the stack up to this many bytes */
#define MH_Q8_TILE 64           /* mh_gemm_q8: activation rows rounded and held at once, */
#define MH_Q8_WBLOCK 64         /* met by this many weight rows at a time (kept in the caches), */
#define MH_Q8_XBLOCK 8          /* each against this many activation rows in a pass */

#if MH_Q8_ISA < 3
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

/* Two weight rows (r0, r1, their scales ws0, ws1) against one activation, each 64 bytes of x loaded once
 * for both; each row's sums in row_q8's order, so out[0], out[1] equal row_q8 of r0, r1 bit for bit.
 * The decode GEMV pairs rows from the two halves of a matrix: two streams read side by side, which a core
 * pulls from memory faster than one. Kept in registers and specialized by its callers (per_row, shift
 * constant): with the accumulators indexed at run time or the scale's branches in the loop, it spilled to
 * the stack and read slower than one row at a time. */
static inline __attribute__((always_inline)) void rows2_q8(const int8_t *r0, const int8_t *r1, const float *ws0,
                                                            const float *ws1, const int8_t *xq, const float *xs,
                                                            const __m512i *start, const __m512i *bstart,
                                                            int64_t cols, int64_t G, int shift, int per_row,
                                                            int packed, float *out) {
    const int64_t full = cols / 64, cs = packed ? MH_Q8_CHUNK_BYTES : 512; /* a chunk's bytes */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0; /* row 0's, row 1's: even, odd chunks */
    int64_t j = 0;
    for (; bstart && 8 * j + 8 <= full; j++) {
        const __m512 xsj = _mm512_loadu_ps(xs + 16 * j);
        const int8_t *xj = xq + 512 * j, *p0 = r0 + cs * j, *p1 = r1 + cs * j;
        __m512i s0 = bstart[j], s1 = _mm512_setzero_si512(), t0 = s0, t1 = s1;
#define MH_Q8_PSTEP(k, s, t)                                                                            \
    {                                                                                                   \
        const __m512i xv = _mm512_loadu_si512(xj + 64 * k);                                             \
        s = _mm512_dpbusd_epi32(s, _mm512_xor_si512(_mm512_loadu_si512(p0 + 64 * k), flip), xv);       \
        t = _mm512_dpbusd_epi32(t, _mm512_xor_si512(_mm512_loadu_si512(p1 + 64 * k), flip), xv);       \
    }
        MH_Q8_PSTEP(0, s0, t0) MH_Q8_PSTEP(1, s1, t1) MH_Q8_PSTEP(2, s0, t0) MH_Q8_PSTEP(3, s1, t1)
        MH_Q8_PSTEP(4, s0, t0) MH_Q8_PSTEP(5, s1, t1) MH_Q8_PSTEP(6, s0, t0) MH_Q8_PSTEP(7, s1, t1)
#undef MH_Q8_PSTEP
        const __m512 sc0 = packed    ? _mm512_mul_ps(xsj, _mm512_loadu_ps(p0 + 512))
                           : per_row ? xsj
                                     : _mm512_mul_ps(xsj, group_scales(ws0, j, G, shift, 0xFFFF));
        const __m512 sc1 = packed    ? _mm512_mul_ps(xsj, _mm512_loadu_ps(p1 + 512))
                           : per_row ? xsj
                                     : _mm512_mul_ps(xsj, group_scales(ws1, j, G, shift, 0xFFFF));
        const __m512 sum0 = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)); /* 16 blocks' exact sums */
        const __m512 sum1 = _mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1));
        if (j & 1) a1 = _mm512_fmadd_ps(sum0, sc0, a1), b1 = _mm512_fmadd_ps(sum1, sc1, b1);
        else a0 = _mm512_fmadd_ps(sum0, sc0, a0), b0 = _mm512_fmadd_ps(sum1, sc1, b0);
    }
    out[0] = reduce16(row_rest(r0, ws0, xq, xs, start, cols, G, shift, per_row, packed, j, a0, a1));
    out[1] = reduce16(row_rest(r1, ws1, xq, xs, start, cols, G, shift, per_row, packed, j, b0, b1));
}

/* One blocked weight row against four activation rows t (xq[t], xs[t], their starts start[t], bstart[t]):
 * each 64 weight bytes loaded once for the four; each row's sums in row_q8's order, so out[t] equals
 * row_q8 of row t bit for bit. Its accumulators are named registers (indexed at run time they went to the
 * stack) and its callers pass per_row and shift as constants where they can (no branch in the loop). */
static inline __attribute__((always_inline)) void rows4_q8(const int8_t *r, const float *wsr,
                                                           const int8_t *const *xq, const float *const *xs,
                                                           const __m512i *const *start,
                                                           const __m512i *const *bstart, int64_t cols, int64_t G,
                                                           int shift, int per_row, int packed, float *out) {
    const int64_t full = cols / 64, cs = packed ? MH_Q8_CHUNK_BYTES : 512; /* a chunk's bytes */
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t *x0 = xq[0], *x1 = xq[1], *x2 = xq[2], *x3 = xq[3];
    __m512 a0 = _mm512_setzero_ps(), b0 = a0, c0 = a0, d0 = a0; /* rows 0-3: even chunks */
    __m512 a1 = a0, b1 = a0, c1 = a0, d1 = a0;                   /* odd chunks */
    int64_t j = 0;
    for (; 8 * j + 8 <= full; j++) {
        const int8_t *rj = r + cs * j;
        const __m512 gs = packed    ? _mm512_loadu_ps(rj + 512)
                          : per_row ? _mm512_setzero_ps()
                                    : group_scales(wsr, j, G, shift, 0xFFFF);
        const int64_t o = 512 * j;
        __m512i sa0 = bstart[0][j], sb0 = bstart[1][j], sc0 = bstart[2][j], sd0 = bstart[3][j];
        __m512i sa1 = _mm512_setzero_si512(), sb1 = sa1, sc1 = sa1, sd1 = sa1;
#define MH_Q8_R4STEP(k, sa, sb, sc, sd)                                                                 \
    {                                                                                                   \
        const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(rj + 64 * k), flip);                    \
        sa = _mm512_dpbusd_epi32(sa, wu, _mm512_loadu_si512(x0 + o + 64 * k));                          \
        sb = _mm512_dpbusd_epi32(sb, wu, _mm512_loadu_si512(x1 + o + 64 * k));                          \
        sc = _mm512_dpbusd_epi32(sc, wu, _mm512_loadu_si512(x2 + o + 64 * k));                          \
        sd = _mm512_dpbusd_epi32(sd, wu, _mm512_loadu_si512(x3 + o + 64 * k));                          \
    }
        MH_Q8_R4STEP(0, sa0, sb0, sc0, sd0) MH_Q8_R4STEP(1, sa1, sb1, sc1, sd1)
        MH_Q8_R4STEP(2, sa0, sb0, sc0, sd0) MH_Q8_R4STEP(3, sa1, sb1, sc1, sd1)
        MH_Q8_R4STEP(4, sa0, sb0, sc0, sd0) MH_Q8_R4STEP(5, sa1, sb1, sc1, sd1)
        MH_Q8_R4STEP(6, sa0, sb0, sc0, sd0) MH_Q8_R4STEP(7, sa1, sb1, sc1, sd1)
#undef MH_Q8_R4STEP
#define MH_Q8_R4SCALE(t, s0, s1, e, od)                                                                  \
    {                                                                                                   \
        __m512 sc = _mm512_loadu_ps(xs[t] + 16 * j);                                                    \
        if (!per_row) sc = _mm512_mul_ps(sc, gs);                                                       \
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));                               \
        if (j & 1) od = _mm512_fmadd_ps(sums, sc, od);                                                  \
        else e = _mm512_fmadd_ps(sums, sc, e);                                                          \
    }
        MH_Q8_R4SCALE(0, sa0, sa1, a0, a1) MH_Q8_R4SCALE(1, sb0, sb1, b0, b1)
        MH_Q8_R4SCALE(2, sc0, sc1, c0, c1) MH_Q8_R4SCALE(3, sd0, sd1, d0, d1)
#undef MH_Q8_R4SCALE
    }
    __m512 v[4];
    v[0] = row_rest(r, wsr, x0, xs[0], start[0], cols, G, shift, per_row, packed, j, a0, a1);
    v[1] = row_rest(r, wsr, x1, xs[1], start[1], cols, G, shift, per_row, packed, j, b0, b1);
    v[2] = row_rest(r, wsr, x2, xs[2], start[2], cols, G, shift, per_row, packed, j, c0, c1);
    v[3] = row_rest(r, wsr, x3, xs[3], start[3], cols, G, shift, per_row, packed, j, d0, d1);
    reduce4(v[0], v[1], v[2], v[3], out);
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

#if MH_Q8_ISA == 3
/* What every row's product with one activation x needs, made once in scratch (MH_Q8_SCRATCH(cols) bytes at
 * 64): x in the weights' order (*xv: the blocked order when blocked, else xq itself), each 64 columns'
 * lane starts (*start), and for blocked rows each whole 512 columns' (*bstart, else NULL). */
static void prepare_x(const int8_t *xq, int64_t cols, int blocked, void *scratch, const int8_t **xv,
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

static int scale_shift(int64_t G) { /* G = 32 << shift up to 512; -1: scales gathered */
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

/* row o and its partner o + part of W8 side by side into y; the partner past the last row (an odd row
 * count's middle row) is o itself, summed twice and stored once */
static inline __attribute__((always_inline)) void pair_q8(int64_t o, int64_t part, int64_t rows, const int8_t *w,
                                                          const float *ws, const int8_t *xv, const float *xs,
                                                          const __m512i *start, const __m512i *bstart,
                                                          const float *b, float *y, int64_t cols, int64_t ldw,
                                                          int64_t ldws, int64_t G, int shift, int per_row,
                                                          int packed) {
    const int64_t u = o + part < rows ? o + part : o;
    const int8_t *r0 = w + o * ldw, *r1 = w + u * ldw;
    const float *ws0 = ws + o * ldws, *ws1 = ws + u * ldws;
    float s[2];
#define MH_Q8_PAIR(sh, pr, pk) rows2_q8(r0, r1, ws0, ws1, xv, xs, start, bstart, cols, G, sh, pr, pk, s)
    MH_Q8_SPECIALIZED(MH_Q8_PAIR);
#undef MH_Q8_PAIR
    y[o] = q8_out(s[0], ws0, b, o, per_row);
    y[u] = q8_out(s[1], ws1, b, u, per_row);
}
#endif

/* y (rows fp32) = W8 x + b: W8's rows at stride ldw, ws (rows, ldws) fp32 group scales (ldws = ceil(cols /
 * G), 1 per row when G >= cols), xq / xs from mh_quantize_q8 of x, b (rows fp32) or NULL. G: a multiple of
 * 32, or >= cols. blocked: the rows' layout (native.h's MH_Q8_*; q8_rows.c): in column order, blocked
 * (AVX512-VNNI builds; elsewhere -2) or packed with their scales (also G == 32 and cols > 32, else -2; ws
 * unused, ldw at least mh_q8_row_bytes). scratch: MH_Q8_SCRATCH(cols) bytes aligned to 64 (each lane's
 * start, x in the blocked order; unused without AVX-512). Returns 0 or -2. */
static inline __attribute__((always_inline)) int q8_into(const int8_t *w, const float *ws, const int8_t *xq,
                                                        const float *xs, const float *b, float *y, int64_t rows,
                                                        int64_t cols, int64_t ldw, int64_t G, int blocked,
                                                        void *scratch, const int team) {
    const int per_row = G >= cols, packed = blocked == MH_Q8_PACKED;
    const int64_t ldws = per_row ? 1 : (cols + G - 1) / G;
    if (packed && (G != 32 || cols <= 32)) return -2;
#if MH_Q8_ISA == 3
    const int shift = scale_shift(G);
    const int8_t *xv;
    const __m512i *start, *bstart;
    prepare_x(xq, cols, blocked, scratch, &xv, &start, &bstart);
    const int64_t part = (rows + 1) / 2; /* rows o and o + part side by side */
    MH_BALANCED_FOR(part, rows * cols >= MH_PAR_MIN, team, o, /* the work test: rows * cols, all of them */
                    pair_q8(o, part, rows, w, ws, xv, xs, start, bstart, b, y, cols, ldw, ldws, G, shift, per_row,
                            packed));
#else
    (void)scratch;
    if (blocked) return -2; /* the blocked layout is AVX512-VNNI's */
    MH_BALANCED_FOR(rows, rows * cols >= MH_PAR_MIN, team, o, {
        const float *wsr = ws + o * ldws;
        y[o] = q8_out(row_q8(w + o * ldw, wsr, xq, xs, cols, G, per_row), wsr, b, o, per_row);
    });
#endif
    return 0;
}
int mh_gemv_q8_into(const int8_t *w, const float *ws, const int8_t *xq, const float *xs, const float *b, float *y,
                    int64_t rows, int64_t cols, int64_t ldw, int64_t G, int blocked, void *scratch) {
    return q8_into(w, ws, xq, xs, b, y, rows, cols, ldw, G, blocked, scratch, 0);
}

int mh_gemv_q8_team(const int8_t *w, const float *ws, const int8_t *xq, const float *xs, const float *b, float *y,
                    int64_t rows, int64_t cols, int64_t ldw, int64_t G, int blocked, void *scratch) {
    return q8_into(w, ws, xq, xs, b, y, rows, cols, ldw, G, blocked, scratch, 1);
}

/* mh_gemv_q8_into with its scratch (MH_Q8_SCRATCH(cols) bytes) on the stack up to 32768 bytes, else
 * allocated. Returns 0, -1 when that allocation fails, -2 for the blocked layout in a build that is not
 * AVX512-VNNI's (y then unwritten). */
int mh_gemv_q8(const int8_t *w, const float *ws, const int8_t *xq, const float *xs, const float *b, float *y,
               int64_t rows, int64_t cols, int64_t ldw, int64_t G, int blocked) {
    const int64_t bytes = MH_Q8_SCRATCH(cols);
    _Alignas(64) int8_t local[MH_Q8_STACK_BYTES];
    void *scratch = bytes <= MH_Q8_STACK_BYTES ? local : aligned_alloc(64, (size_t)bytes);
    if (!scratch) return -1;
    const int status = mh_gemv_q8_into(w, ws, xq, xs, b, y, rows, cols, ldw, G, blocked, scratch);
    if (scratch != (void *)local) free(scratch);
    return status;
}

/* bytes of a rounded row's block scales (pad values), rounded up to 64 */
static int64_t xs_bytes_of(int64_t pad) { return (pad / MH_Q8_BLOCK * 4 + 63) & ~(int64_t)63; }

/* bytes of one activation row's part of mh_gemm_q8's scratch: xq, xs, the GEMV's scratch, each at 64 */
static int64_t gemm_row_bytes(int64_t cols) {
    const int64_t pad = (cols + 63) & ~(int64_t)63;
    return pad + xs_bytes_of(pad) + ((MH_Q8_SCRATCH(cols) + 63) & ~(int64_t)63);
}

/* Y (n, rows) fp32 = X W8^T + b for n activation rows X (n, cols) fp32 (row stride cols): each row of X
 * rounded to int8 as mh_quantize_q8, then every output as mh_gemv_q8 makes it (the same sums in the same
 * order: Y[i] equals mh_gemv_q8 of row i bit for bit). W8, ws, b, G, blocked as mh_gemv_q8_into.
 *
 * The weights are read once for up to MH_Q8_TILE rows of X (rounded and held in scratch): each block of
 * MH_Q8_WBLOCK weight rows, kept in the caches, meets the tile's rows MH_Q8_XBLOCK at a time (those in
 * the nearest cache); with AVX512-VNNI and blocked rows four activation rows share each 64-byte weight
 * load (rows4_q8). Returns 0, -1 when the scratch cannot be allocated,
 * -2 for the blocked layout in a build that is not AVX512-VNNI's (Y then unwritten). */
int mh_gemm_q8(const int8_t *w, const float *ws, const float *x, const float *b, float *y, int64_t n, int64_t rows,
               int64_t cols, int64_t ldw, int64_t G, int blocked) {
#if MH_Q8_ISA != 3
    if (blocked) return -2;
#endif
    const int per_row = G >= cols, packed = blocked == MH_Q8_PACKED;
    if (packed && (G != 32 || cols <= 32)) return -2;
    if (n <= 0) return 0;
    const int64_t ldws = per_row ? 1 : (cols + G - 1) / G, pad = (cols + 63) & ~(int64_t)63;
    const int64_t tile = n < MH_Q8_TILE ? n : MH_Q8_TILE, per = gemm_row_bytes(cols);
    char *buf = aligned_alloc(64, (size_t)(tile * per));
    if (!buf) return -1;
    const int8_t *xq[MH_Q8_TILE];
    const float *xs[MH_Q8_TILE];
#if MH_Q8_ISA == 3
    const int shift = scale_shift(G);
    const int8_t *xv[MH_Q8_TILE];
    const __m512i *start[MH_Q8_TILE], *bstart[MH_Q8_TILE];
#endif
    for (int64_t i0 = 0; i0 < n; i0 += tile) {
        const int64_t m = n - i0 < tile ? n - i0 : tile;
        for (int64_t t = 0; t < m; t++) { /* row i0 + t of X, rounded, and what its products need */
            char *row = buf + t * per;
            mh_quantize_q8(x + (i0 + t) * cols, MH_F32, cols, (int8_t *)row, (float *)(row + pad));
            xq[t] = (const int8_t *)row, xs[t] = (const float *)(row + pad);
#if MH_Q8_ISA == 3
            prepare_x(xq[t], cols, blocked, row + pad + xs_bytes_of(pad), &xv[t], &start[t], &bstart[t]);
#endif
        }
        float *yt = y + i0 * rows;
        const int64_t blocks = (rows + MH_Q8_WBLOCK - 1) / MH_Q8_WBLOCK;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (rows * cols >= MH_PAR_MIN)
#endif
        for (int64_t k = 0; k < blocks; k++) { /* weight rows o0 .. o1 - 1, kept in the caches */
            const int64_t o0 = k * MH_Q8_WBLOCK, o1 = o0 + MH_Q8_WBLOCK < rows ? o0 + MH_Q8_WBLOCK : rows;
            for (int64_t t0 = 0; t0 < m; t0 += MH_Q8_XBLOCK) { /* against a few activation rows at a time */
                const int64_t t1 = t0 + MH_Q8_XBLOCK < m ? t0 + MH_Q8_XBLOCK : m;
                for (int64_t o = o0; o < o1; o++) {
                    const int8_t *r = w + o * ldw;
                    const float *wsr = ws + o * ldws;
                    float s[MH_Q8_XBLOCK];
                    int64_t t = t0;
#if MH_Q8_ISA == 3
#define MH_Q8_QUAD(sh, pr, pk) rows4_q8(r, wsr, xv + t, xs + t, start + t, bstart + t, cols, G, sh, pr, pk, s + t - t0)
                    for (; blocked && t + 4 <= t1; t += 4) MH_Q8_SPECIALIZED(MH_Q8_QUAD);
#undef MH_Q8_QUAD
                    for (; t < t1; t++)
                        s[t - t0] = row_q8(r, wsr, xv[t], xs[t], start[t], bstart[t], cols, G, shift, per_row, packed);
#else
                    for (; t < t1; t++) s[t - t0] = row_q8(r, wsr, xq[t], xs[t], cols, G, per_row);
#endif
                    for (t = t0; t < t1; t++) yt[t * rows + o] = q8_out(s[t - t0], wsr, b, o, per_row);
                }
            }
        }
    }
    free(buf);
    return 0;
}

/* whether this build reads the blocked layout (AVX512-VNNI) */
int mh_q8_blocked(void) { return MH_Q8_ISA == 3; }
