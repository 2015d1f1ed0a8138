/* A list of batch-1 matrix-vector products run back to back in one call: the floor of a native decode
 * step (its products with nothing between them, called from C as the step calls them), which a loop of
 * calls from Python overstates by its interpreter time (a few microseconds a call, more once the weights
 * streaming through the caches have evicted the interpreter's working set).
 *
 * Each product is y = W x (+ b) of one kind: W of the storage dtype kind (MH_F32, MH_BF16, MH_F16) with
 * x, y and b of that kind, or W int8 (kind MH_I8) with fp32 scales per group of `group` inputs, x fp32
 * rounded to int8 per block of 32 first (mh_quantize_q8), y and b fp32: the kernels of gemv.c and
 * gemv_q8.c, as a decode step and Int8GemvLinear run them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "native.h"

/* One product (ctypes mirrors it: multihead.native.Product). */
typedef struct {
    const void *w; /* (rows, cols), rows contiguous at stride ldw */
    const float *s; /* int8: the group scales (rows, ceil(cols / group)) or one a row; else NULL */
    const void *b; /* (rows,) or NULL */
    const void *x; /* (cols,) */
    void *y; /* (rows,) */
    int64_t rows, cols, ldw, group;
    int32_t kind, blocked; /* blocked: int8 rows in the blocked layout (gemv_q8.c) */
} mh_product;

int64_t mh_product_bytes(void) { return (int64_t)sizeof(mh_product); }

/* Every product of p[0..n-1] in order. Returns 0, -1 (no memory for the int8 input), or the first failing
 * int8 product's -2 (blocked rows in a build that reads them in order; the rest not run). */
int mh_products(const mh_product *p, int64_t n) {
    int64_t widest = 64;
    for (int64_t i = 0; i < n; i++) widest = p[i].cols > widest ? p[i].cols : widest;
    const int64_t nq = (widest + 63) & ~(int64_t)63;
    char *buf = malloc((size_t)(nq + nq / MH_Q8_BLOCK * 4));
    if (!buf) return -1;
    int8_t *xq = (int8_t *)buf;
    float *xs = (float *)(buf + nq);
    int status = 0;
    for (int64_t i = 0; i < n && status == 0; i++) {
        const mh_product *q = &p[i];
        if (q->kind == MH_I8) {
            mh_quantize_q8(q->x, MH_F32, q->cols, xq, xs);
            status = mh_gemv_q8(q->w, q->s, xq, xs, q->b, q->y, q->rows, q->cols, q->ldw, q->group, q->blocked);
        } else if (q->kind == MH_F32) {
            mh_gemv_f32(q->w, q->x, q->b, q->y, q->rows, q->cols, q->ldw);
        } else if (q->kind == MH_BF16) {
            mh_gemv_bf16(q->w, q->x, q->b, q->y, q->rows, q->cols, q->ldw);
        } else {
            mh_gemv_f16(q->w, q->x, q->b, q->y, q->rows, q->cols, q->ldw);
        }
    }
    free(buf);
    return status;
}

/* Nanoseconds of one round trip between OpenMP threads 0 and 1 (the median of 7 batches of n, n >= 1): a
 * cache line written by one and read by the other, and back, the least each meeting of the threads of a
 * product costs. On a virtual machine it moves with where the host places the two virtual CPUs (~50 ns on
 * one core complex, several hundred across two). -1 when the team has fewer than two threads (or without
 * OpenMP). */
double mh_thread_round_trip(int64_t n) {
#ifdef _OPENMP
    enum { BATCHES = 7 };
    if (omp_get_max_threads() < 2) return -1.0; /* torch.set_num_threads(1): one thread, nobody to meet */
    double ns[BATCHES];
    int team = 0;
    _Alignas(64) _Atomic int64_t flag = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        team = omp_get_num_threads(); /* a barrier after it: both threads know the team's size */
        const int me = omp_get_thread_num();
        if (team == 2)
            for (int b = 0; b < BATCHES; b++) {
                const int64_t base = 2 * n * b;
#pragma omp barrier
                struct timespec t0, t1;
                if (me == 0) clock_gettime(CLOCK_MONOTONIC, &t0);
                for (int64_t i = 0; i < n; i++) {
                    const int64_t ping = base + 2 * i + 1, pong = ping + 1;
                    if (me == 0) {
                        atomic_store_explicit(&flag, ping, memory_order_release);
                        while (atomic_load_explicit(&flag, memory_order_acquire) != pong) {
                        }
                    } else {
                        while (atomic_load_explicit(&flag, memory_order_acquire) != ping) {
                        }
                        atomic_store_explicit(&flag, pong, memory_order_release);
                    }
                }
                if (me == 0) {
                    clock_gettime(CLOCK_MONOTONIC, &t1);
                    ns[b] = ((double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec)) / (double)n;
                }
            }
    }
    if (team != 2) return -1.0;
    for (int i = 1; i < BATCHES; i++) /* sort the 7, take the middle one */
        for (int j = i; j > 0 && ns[j - 1] > ns[j]; j--) {
            const double t = ns[j];
            ns[j] = ns[j - 1], ns[j - 1] = t;
        }
    return ns[BATCHES / 2];
#else
    (void)n;
    return -1.0;
#endif
}
