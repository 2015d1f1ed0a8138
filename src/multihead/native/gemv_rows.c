/* Several activation rows times one weight matrix in fp32 / bf16 / fp16 (mh_gemv_rows: a batch's decode
 * step), the weights read once for all the rows and each row given the bits of its one-row kernel
 * (gemv.c; gemv_kernels.h: the loads and row sums both use). */
#include <stdint.h>
#include <stdlib.h>

#include "native.h"
#include "gemv_kernels.h" /* load_f32, load_bf16, load_f16, the bf16 conversions, MH_DPBF16, dpbf16_sums */

/* The same sums for two activation rows X0, X1 at once, one weight row at a time: each 8 weights loaded
 * once for both, each row's sums in the one-row loop's order (eight accumulators over 64 values, then
 * the 8-value and single-value tails), so STORE0(o, s) / STORE1(o, t) write the bits the one-row kernels
 * give. Serial (the caller splits the rows); reads rows, cols, ldw of the enclosing function. */
#define MH_TWO_X(W, X0, X1, LOAD_W, LOAD_X, ONE_W, ONE_X, STORE0, STORE1)                                    \
    do {                                                                                                     \
        const int64_t c64_ = cols & ~(int64_t)63, c8_ = cols & ~(int64_t)7;                                  \
        for (int64_t o = 0; o < rows; o++) {                                                                 \
            const __typeof__(&(W)[0]) r = (W) + o * ldw;                                                     \
            mh_v8 a[8] = {{0}}, c[8] = {{0}};                                                                \
            int64_t i = 0;                                                                                   \
            for (; i < c64_; i += 64)                                                                        \
                for (int k = 0; k < 8; k++) {                                                                \
                    const mh_v8 wv = LOAD_W(r + i + 8 * k);                                                  \
                    a[k] += wv * LOAD_X((X0) + i + 8 * k);                                                   \
                    c[k] += wv * LOAD_X((X1) + i + 8 * k);                                                   \
                }                                                                                            \
            for (; i < c8_; i += 8) {                                                                        \
                const mh_v8 wv = LOAD_W(r + i);                                                              \
                a[0] += wv * LOAD_X((X0) + i);                                                               \
                c[0] += wv * LOAD_X((X1) + i);                                                               \
            }                                                                                                \
            float s = hsum8(((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])));              \
            float t = hsum8(((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7])));              \
            for (int64_t j = i; j < cols; j++) s += ONE_W(r[j]) * ONE_X((X0)[j]);                            \
            for (int64_t j = i; j < cols; j++) t += ONE_W(r[j]) * ONE_X((X1)[j]);                            \
            STORE0(o, s);                                                                                    \
            STORE1(o, t);                                                                                    \
        }                                                                                                    \
    } while (0)

/* y0 = W x0 + b and y1 = W x1 + b of kind (x1, y1 the rows after x0, y0: strides cols and ystride), the
 * weights read once for both, each with the bits of its one-row product; 0, or -1 where the one-row
 * kernel of kind has no two-row twin here (fp16 without AVX-512: the caller runs the rows one by one) */
static int two_rows(int kind, const void *w, const void *x, const void *b, void *y, int64_t rows, int64_t cols,
                    int64_t ldw, int64_t ystride) {
    if (kind == MH_F32) {
        const float *x0 = x, *x1 = x0 + cols, *bf = b;
        float *y0 = y, *y1 = y0 + ystride;
#define MH_Y0(o, s) (y0[o] = bf ? (s) + bf[o] : (s))
#define MH_Y1(o, s) (y1[o] = bf ? (s) + bf[o] : (s))
        MH_TWO_X((const float *)w, x0, x1, load_f32, load_f32, MH_SAME, MH_SAME, MH_Y0, MH_Y1);
#undef MH_Y0
#undef MH_Y1
        return 0;
    }
    const uint16_t *x0 = x, *x1 = x0 + cols, *bh = b, *wh = w;
    uint16_t *y0 = y, *y1 = y0 + ystride;
    if (kind == MH_BF16) {
#if MH_DPBF16 /* the one-row kernel's loop with both rows */
        for (int64_t o = 0; o < rows; o++) {
            float sum[2] = {0.f, 0.f};
            dpbf16_sums(wh + o * ldw, x0, x1, 1, cols, sum);
            y0[o] = f32_to_bf16(bh ? sum[0] + bf16_to_f32(bh[o]) : sum[0]);
            y1[o] = f32_to_bf16(bh ? sum[1] + bf16_to_f32(bh[o]) : sum[1]);
        }
#else
#define MH_Y0(o, s) (y0[o] = f32_to_bf16(bh ? (s) + bf16_to_f32(bh[o]) : (s)))
#define MH_Y1(o, s) (y1[o] = f32_to_bf16(bh ? (s) + bf16_to_f32(bh[o]) : (s)))
        MH_TWO_X(wh, x0, x1, load_bf16, load_bf16, bf16_to_f32, bf16_to_f32, MH_Y0, MH_Y1);
#undef MH_Y0
#undef MH_Y1
#endif
        return 0;
    }
#if MH_HAS_F16 && defined(__AVX512F__) /* fp16: x widened with the weights, as the one-row kernel here */
#define MH_Y0(o, s) (y0[o] = mh_f2h(bh ? (s) + mh_h2f(bh[o]) : (s)))
#define MH_Y1(o, s) (y1[o] = mh_f2h(bh ? (s) + mh_h2f(bh[o]) : (s)))
    MH_TWO_X(wh, x0, x1, load_f16, load_f16, mh_h2f, mh_h2f, MH_Y0, MH_Y1);
#undef MH_Y0
#undef MH_Y1
    return 0;
#else
    (void)wh, (void)x0, (void)x1, (void)bh, (void)y0, (void)y1;
    return -1;
#endif
}

/* Y (n, rows) = X W^T + b for n activation rows X (n, cols) of the storage dtype kind (MH_F32, MH_BF16,
 * MH_F16; row stride cols), W and b as the one-row kernels take them: a batch's decode step. The weights
 * are read from memory once: each block of rows (about MH_ROWS_BLOCK_BYTES of them, kept in the caches)
 * is multiplied by the rows of X two at a time (two_rows: each weight loaded once for both; an odd
 * count's last row by the one-row kernel), so row t of Y has the bits the one-row kernel of kind gives
 * row t of X alone. Blocks are split across the threads (each block's products then run on its thread).
 * Returns 0, or -2 for a kind the build has no kernel for (fp16 without MH_HAS_F16). */
#define MH_ROWS_BLOCK_BYTES ((int64_t)128 << 10)
int mh_gemv_rows(int kind, const void *w, const void *x, const void *b, void *y, int64_t n, int64_t rows,
                 int64_t cols, int64_t ldw) {
    if (kind == MH_F16 && !MH_HAS_F16) return -2;
    if (kind != MH_F32 && kind != MH_BF16 && kind != MH_F16) return -2;
    const int64_t esz = kind == MH_F32 ? 4 : 2, row_bytes = (cols > 0 ? cols : 1) * esz;
    const int64_t block = MH_ROWS_BLOCK_BYTES / row_bytes > 0 ? MH_ROWS_BLOCK_BYTES / row_bytes : 1;
    const int64_t blocks = (rows + block - 1) / block;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (blocks > 1 && n * rows * cols >= MH_PAR_MIN)
#endif
    for (int64_t k = 0; k < blocks; k++) {
        const int64_t o0 = k * block, m = rows - o0 < block ? rows - o0 : block;
        const char *wk = (const char *)w + o0 * ldw * esz, *bk = b ? (const char *)b + o0 * esz : NULL;
        int64_t t = 0;
        for (; t + 1 < n; t += 2) /* two rows at once where the kind has the kernel */
            if (two_rows(kind, wk, (const char *)x + t * cols * esz, bk, (char *)y + (t * rows + o0) * esz, m, cols,
                         ldw, rows) != 0)
                break;
        for (; t < n; t++) {
            const void *xt = (const char *)x + t * cols * esz;
            void *yt = (char *)y + (t * rows + o0) * esz;
            if (kind == MH_F32)
                mh_gemv_f32((const float *)wk, xt, (const float *)bk, yt, m, cols, ldw);
            else if (kind == MH_BF16)
                mh_gemv_bf16((const uint16_t *)wk, xt, (const uint16_t *)bk, yt, m, cols, ldw);
            else
                mh_gemv_f16((const uint16_t *)wk, xt, (const uint16_t *)bk, yt, m, cols, ldw);
        }
    }
    return 0;
}
