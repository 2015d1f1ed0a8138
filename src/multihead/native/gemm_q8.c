/* The multi-row int8 product mh_gemm_q8: Y = X W8^T + b for n activation rows, the weights read once for
 * many rows, each row's outputs with the bits of its one-row product (gemv_q8.c: the math, the layouts
 * and the ISAs; q8_kernels.h: the row kernels both share). */
#include <stdint.h>
#include <stdlib.h>

#include "native.h"
#include "q8_kernels.h" /* MH_Q8_ISA, the row kernels (and <immintrin.h>) */

#define MH_Q8_TILE 64           /* mh_gemm_q8: activation rows rounded and held at once, */
#define MH_Q8_WBLOCK 64         /* met by this many weight rows at a time (kept in the caches), */
#define MH_Q8_XBLOCK 8          /* each against this many activation rows in a pass */

#if MH_Q8_ISA == 3
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
#endif

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
