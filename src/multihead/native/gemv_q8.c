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
 * (two streams read side by side, each 64 bytes of x loaded once for both: closer to the rate of a plain
 * read of as many bytes than one row at a time).
 *
 * Layouts (q8_rows.c; the "blocked" argument): a row in column order, "blocked" (AVX512-VNNI builds only:
 * the blocks of every whole 512 columns interleaved four bytes at a time, so that lane l of each of the 8
 * vectors belongs to block l, VPDPBUSD keeps a block's whole sum in one int32 lane, and its scale is
 * applied once per 512 columns instead of once per 64: a faster read than column order), or "packed"
 * (blocked, groups of 32, each 512 columns followed by their 16 scales: one stream a row).
 *
 * Dot products, chosen by the compiler's target (-march=native):
 * - AVX512-VNNI (VPDPBUSD: u8 x s8 -> int32, 64 bytes at once): the weights offset to u8 (w + 128, one
 *   xor) times x as s8, each int32 lane starting at -128 * (its four x), made once per product for every
 *   row; the fp32 work of 16 blocks' scales done once per 512 columns (faster than moving x's sign onto
 *   the weights, which costs a VPSIGNB per 32 weights);
 * - AVX2 (with AVX-VNNI's VPDPBUSD where present, else VPMADDUBSW + VPMADDWD: |x| * |w| <= 127 * 127, so
 *   the int16 pair sums cannot saturate) on 32 bytes;
 * - portable C elsewhere (integer loops the compiler vectorizes).
 *
 * This file: the one-row products (mh_gemv_q8 and its _into and _team entries, rows paired with
 * AVX512-VNNI); gemm_q8.c: the multi-row product mh_gemm_q8; q8_kernels.h: the row kernels both share.
 */
#include <stdint.h>
#include <stdlib.h>

#include "native.h"
#include "q8_kernels.h" /* MH_Q8_ISA, the row kernels (and <immintrin.h>) */

int mh_q8_isa(void) { return MH_Q8_ISA; }

#define MH_Q8_STACK_BYTES 32768 /* mh_gemv_q8's scratch on the stack up to this many bytes */

#if MH_Q8_ISA == 3
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

/* whether this build reads the blocked layout (AVX512-VNNI) */
int mh_q8_blocked(void) { return MH_Q8_ISA == 3; }
