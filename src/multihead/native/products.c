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
