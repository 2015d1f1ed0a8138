/* Batch-1 matrix-vector products for decoding: y = W x, W (rows, cols) row-major with row stride ldw.
 *
 * A decode step multiplies every weight matrix by one vector, so it is a single pass over the weights
 * and its speed is the memory's read bandwidth. The loops below keep it there: independent accumulators
 * (a single one would wait on the latency of each fused multiply-add instead of on memory), fp32
 * accumulation, and for the widening kernels (fp32, fp16, bf16 without AVX512-BF16) two rows at a time,
 * one from each half of the matrix: two sequential streams, which one core pulls from memory faster than
 * one (measured on a Zen 5 core, the 41 products of a 155M LLaMA-shaped model, one thread: fp16
 * 1.03-1.05x the GB/s of one row at a time, fp32 1.01-1.07x). The AVX512-BF16 kernel reads one row at
 * a time: paired, it read 0.90-0.95x as fast there.
 * Every kernel loads 256 bits at a time (8 fp32 lanes, or 16 bf16 values to VDPBF16PS): on that Zen 5
 * core a stream of 256-bit loads comes from memory faster than one of 512-bit loads (llama-155m's decode
 * steps, one thread: fp32 0.89-0.94x the time a token with 256-bit loads, bf16 0.90-0.91x, fp16 the
 * same), and 512-bit VDPBF16PS read 0.86-0.91x as fast when x and the rows are both 32-byte aligned
 * (torch's tensors are) as when x is not; the 256-bit loop reads the same either way.
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
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#ifdef _OPENMP
#include <omp.h>
#endif
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

#define MH_SAME(v) (v)

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

static inline __attribute__((always_inline)) void mh_gemv_f16_body(const uint16_t *w, const uint16_t *x,
                                                                   const uint16_t *b, uint16_t *y, int64_t rows,
                                                                   int64_t cols, int64_t ldw, const int team) {
#define MH_STORE_F16(o, s) (y[o] = mh_f2h(b ? (s) + mh_h2f(b[o]) : (s)))
#if MH_HAS_F16 && defined(__AVX512F__)
    /* x read as fp16 and widened with each row's values (one VCVTPH2PS more per 8 weights): half the
     * cache traffic of a widened fp32 copy of x, and 1.0-1.2x the GB/s of reading that copy on a Zen 5
     * (benchmarks/native_gemv.py, 1024-32000 rows of 1024-2816 fp16 weights, one thread; measured when
     * the kernels loaded 512 bits at a time, so kept to AVX-512 builds) */
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
