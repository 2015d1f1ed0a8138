/* Batch-1 matrix-vector products for decoding: y = W x, W (rows, cols) row-major with row stride ldw.
 *
 * A decode step multiplies every weight matrix by one vector, so it is a single pass over the weights
 * and its speed is the memory's read bandwidth. The loops below keep it there: independent accumulators
 * (a single one would wait on the latency of each fused multiply-add instead of on memory), fp32
 * accumulation, and for the widening kernels (fp32, fp16, bf16 without AVX512-BF16) two rows at a time,
 * one from each half of the matrix: two sequential streams, which one core pulls from memory faster than
 * one. The AVX512-BF16 kernel reads one row at a time: paired, it read slower.
 * Every kernel loads 256 bits at a time (8 fp32 lanes, or 16 bf16 values to VDPBF16PS): a stream of
 * 256-bit loads came from memory faster than one of 512-bit loads on the CPUs we measured, and 512-bit
 * VDPBF16PS read slower when x and the rows are both 32-byte aligned (torch's tensors are) than when x
 * is not; the 256-bit loop reads the same either way. The measurements behind these choices are
 * reproduced by benchmarks/native_gemv.py (docs/cpu-decode.md explains the bandwidth bound).
 *
 * mh_gemv_f32:  fp32 W, fp32 x, fp32 bias b (or NULL), fp32 y = W x + b.
 * mh_gemv_bf16: the same in bf16 (accumulated in fp32 with the bias, rounded to nearest even once).
 * mh_gemv_f16:  the same in fp16 (widened to fp32 by the x86 conversion instructions, or the compiler's
 *     _Float16 elsewhere).
 *     With AVX512-BF16 the products are VDPBF16PS (pairs of bf16 products summed into fp32 lanes);
 *     elsewhere W and x are widened to fp32 first. Both are exact products with fp32 sums.
 *
 * Compiled at first use by multihead.native with the system C compiler for the machine it runs on
 * (-O3 -march=native, -fopenmp where the compiler has it); GCC / Clang vector extensions keep the
 * generic code portable.
 *
 * This file: the one-row kernels and their _team entries; gemv_rows.c: several activation rows at once
 * (mh_gemv_rows); gemv_kernels.h: the loads, conversions and AVX512-BF16 row sums both share.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#include "gemv_kernels.h" /* load_f32, load_bf16, load_f16, the bf16 conversions, MH_DPBF16, dpbf16_sums */

/* The row loop the widening kernels share: rows o and o + part side by side, part = ceil(rows / 2) (two
 * streams read at once, each 8 values of x widened once for both: a core pulls two streams from memory
 * faster than one; an odd row count's middle row is its own partner, summed twice and stored once), each
 * with eight independent accumulators of 8 lanes (64 values of a row a pass), then the 8-value and
 * single-value tails. LOAD_W(p) / LOAD_X(p) widen 8 values at p to fp32 lanes, ONE_W(v) / ONE_X(v) one value;
 * STORE(o, s) writes output o from the row's fp32 sum s. Reads rows, cols, ldw of the enclosing kernel. A
 * row's sums do not depend on its partner. */
#define MH_STREAM_ROWS(W, X, LOAD_W, LOAD_X, ONE_W, ONE_X, STORE, TEAM)                                      \
    do {                                                                                                     \
        const int64_t c64_ = cols & ~(int64_t)63, c8_ = cols & ~(int64_t)7, part_ = (rows + 1) / 2;         \
        MH_BALANCED_FOR(part_, rows * cols >= MH_PAR_MIN, TEAM, o, {                                       \
            const int64_t u = o + part_ < rows ? o + part_ : o;                                              \
            const __typeof__(&(W)[0]) r = (W) + o * ldw, q = (W) + u * ldw;                                  \
            mh_v8 a[8] = {{0}}, c[8] = {{0}};                                                                \
            int64_t i = 0;                                                                                   \
            for (; i < c64_; i += 64)                                                                        \
                for (int k = 0; k < 8; k++) {                                                                \
                    const mh_v8 xv = LOAD_X((X) + i + 8 * k);                                                \
                    a[k] += LOAD_W(r + i + 8 * k) * xv;                                                      \
                    c[k] += LOAD_W(q + i + 8 * k) * xv;                                                      \
                }                                                                                            \
            for (; i < c8_; i += 8) {                                                                        \
                const mh_v8 xv = LOAD_X((X) + i);                                                            \
                a[0] += LOAD_W(r + i) * xv;                                                                  \
                c[0] += LOAD_W(q + i) * xv;                                                                  \
            }                                                                                                \
            float s = hsum8(((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])));              \
            float t = hsum8(((c[0] + c[4]) + (c[1] + c[5])) + ((c[2] + c[6]) + (c[3] + c[7])));              \
            for (int64_t j = i; j < cols; j++) s += ONE_W(r[j]) * ONE_X((X)[j]);                             \
            for (int64_t j = i; j < cols; j++) t += ONE_W(q[j]) * ONE_X((X)[j]);                             \
            STORE(o, s);                                                                                     \
            STORE(u, t);                                                                                     \
        });                                                                                                  \
    } while (0)

int mh_gemv_has_dpbf16(void) { return MH_DPBF16; }

int mh_native_threads(void) { /* threads a large product uses now */
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* the kernels below as one body each with team (MH_BALANCED_FOR's TEAM) a constant: mh_gemv_X (0) and
 * mh_gemv_X_team (1, on a step's team) */
#define MH_TWO_ENTRIES(NAME, T, XT)                                                                        \
    void NAME(const T *w, const XT *x, const XT *b, XT *y, int64_t rows, int64_t cols, int64_t ldw) {      \
        NAME##_body(w, x, b, y, rows, cols, ldw, 0);                                                       \
    }                                                                                                      \
    void NAME##_team(const T *w, const XT *x, const XT *b, XT *y, int64_t rows, int64_t cols, int64_t ldw) { \
        NAME##_body(w, x, b, y, rows, cols, ldw, 1);                                                       \
    }

static inline __attribute__((always_inline)) void mh_gemv_f32_body(const float *w, const float *x, const float *b,
                                                                   float *y, int64_t rows, int64_t cols,
                                                                   int64_t ldw, const int team) {
#define MH_STORE_F32(o, s) (y[o] = b ? (s) + b[o] : (s))
    MH_STREAM_ROWS(w, x, load_f32, load_f32, MH_SAME, MH_SAME, MH_STORE_F32, team);
}
MH_TWO_ENTRIES(mh_gemv_f32, float, float)

int mh_gemv_has_f16(void) { return MH_HAS_F16; }

static inline __attribute__((always_inline)) void mh_gemv_f16_body(const uint16_t *w, const uint16_t *x,
                                                                   const uint16_t *b, uint16_t *y, int64_t rows,
                                                                   int64_t cols, int64_t ldw, const int team) {
#define MH_STORE_F16(o, s) (y[o] = mh_f2h(b ? (s) + mh_h2f(b[o]) : (s)))
#if MH_HAS_F16 && defined(__AVX512F__)
    /* x read as fp16 and widened with each row's values (one VCVTPH2PS more per 8 weights): half the
     * cache traffic of a widened fp32 copy of x, and no slower to read than that copy
     * (benchmarks/native_gemv.py; established when the kernels loaded 512 bits at a time, so kept to
     * AVX-512 builds) */
    MH_STREAM_ROWS(w, x, load_f16, load_f16, mh_h2f, mh_h2f, MH_STORE_F16, team);
#elif MH_HAS_F16
    float stack[4096], *xf = cols <= 4096 ? stack : malloc((size_t)cols * sizeof(float));
    if (!xf) { /* no memory for the widened x: widen it again for every row */
        for (int64_t o = 0; o < rows; o++) {
            float s = 0.f;
            for (int64_t i = 0; i < cols; i++) s += mh_h2f(w[o * ldw + i]) * mh_h2f(x[i]);
            y[o] = mh_f2h(b ? s + mh_h2f(b[o]) : s);
        }
        return;
    }
    for (int64_t i = 0; i < cols; i++) xf[i] = mh_h2f(x[i]); /* x widened once, not once per row */
    MH_STREAM_ROWS(w, xf, load_f16, load_f32, mh_h2f, MH_SAME, MH_STORE_F16, team);
    if (xf != stack) free(xf);
#else
    (void)w, (void)x, (void)b, (void)y, (void)rows, (void)cols, (void)ldw, (void)team;
#endif
}
MH_TWO_ENTRIES(mh_gemv_f16, uint16_t, uint16_t)

static inline __attribute__((always_inline)) void mh_gemv_bf16_body(const uint16_t *w, const uint16_t *x,
                                                                    const uint16_t *b, uint16_t *y, int64_t rows,
                                                                    int64_t cols, int64_t ldw, const int team) {
#if MH_DPBF16
    MH_BALANCED_FOR(rows, rows * cols >= MH_PAR_MIN, team, o, {
        float sum[2];
        dpbf16_sums(w + o * ldw, x, NULL, 0, cols, sum);
        y[o] = f32_to_bf16(b ? sum[0] + bf16_to_f32(b[o]) : sum[0]);
    });
#else
#define MH_STORE_BF16(o, s) (y[o] = f32_to_bf16(b ? (s) + bf16_to_f32(b[o]) : (s)))
    MH_STREAM_ROWS(w, x, load_bf16, load_bf16, bf16_to_f32, bf16_to_f32, MH_STORE_BF16, team);
#endif
}
MH_TWO_ENTRIES(mh_gemv_bf16, uint16_t, uint16_t)
