/* A row of weights in GGUF's blocks back to fp32 (mh_dequantize_row_gguf; the layouts: gemv_q4.c's
 * comment). */
#include <stdint.h>

#include "native.h"
#include "gguf_blocks.h" /* GG_Q4_0, GG_Q4_1, GG_Q8_0, gg_h2f, gg_u16 */

/* One row of cols weights in GGUF's blocks of type back to fp32, as gguf.quants.dequantize makes them:
 * d * q (Q4_0: q = nibble - 8; Q8_0), d * q + m (Q4_1: a product, then a sum, each rounded to fp32).
 * Returns 0, -2 as mh_gemm_gguf. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off"))) /* d * q + m in two roundings, as numpy's */
#endif
int mh_dequantize_row_gguf(int type, const uint8_t *row, int64_t cols, float *out) {
    const int64_t bb = mh_gguf_block_bytes(type);
    if (bb == 0 || cols % 32 != 0) return -2;
    for (int64_t k = 0; k < cols / 32; k++) {
        const uint8_t *a = row + k * bb;
        const float d = gg_h2f(gg_u16(a));
        float *o = out + 32 * k;
        if (type == GG_Q8_0) {
            for (int i = 0; i < 32; i++) o[i] = d * (float)(int8_t)a[2 + i];
        } else if (type == GG_Q4_0) {
            for (int i = 0; i < 16; i++) o[i] = d * (float)((a[2 + i] & 15) - 8), o[i + 16] = d * (float)((a[2 + i] >> 4) - 8);
        } else {
            const float mn = gg_h2f(gg_u16(a + 2));
            for (int i = 0; i < 16; i++) {
                volatile float lo = d * (float)(a[4 + i] & 15), hi = d * (float)(a[4 + i] >> 4);
                o[i] = lo + mn, o[i + 16] = hi + mn;
            }
        }
    }
    return 0;
}
