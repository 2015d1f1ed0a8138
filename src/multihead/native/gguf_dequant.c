/* A row of weights in GGUF's blocks back to fp32 (mh_dequantize_row_gguf; the layouts: gemv_q4.c's
 * comment). */
#include <stdint.h>

#include "native.h"
#include "gguf_blocks.h" /* GG_Q4_0, GG_Q4_1, GG_Q8_0, gg_h2f, gg_u16 */

/* A row of Q4_K / Q6_K super-blocks back to fp32, as gguf.quants.dequantize makes them: Q4_K
 * (d sc_j) q - (dmin m_j), a product then a difference, each rounded to fp32; Q6_K (d sc_g) (q - 32). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void gg_dequantize_k(int type, const uint8_t *row, int64_t cols, float *out) {
    for (int64_t k = 0; k < cols / 256; k++, out += 256) {
        if (type == GG_Q4_K) {
            const uint8_t *blk = row + 144 * k, *qs = blk + 16;
            const float d = gg_h2f(gg_u16(blk)), dmin = gg_h2f(gg_u16(blk + 2));
            uint8_t sc[8], mn[8];
            gg_scale_min(blk + 4, sc, mn);
            for (int j = 0; j < 8; j++) {
                const float dj = d * (float)sc[j], mj = dmin * (float)mn[j];
                for (int i = 0; i < 32; i++) {
                    volatile float v = dj * (float)((qs[32 * (j / 2) + i] >> (4 * (j & 1))) & 15);
                    out[32 * j + i] = v - mj;
                }
            }
        } else {
            const uint8_t *blk = row + 210 * k, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = gg_h2f(gg_u16(blk + 208));
            for (int n = 0; n < 2; n++)
                for (int s = 0; s < 4; s++)
                    for (int i = 0; i < 32; i++) {
                        const int lo = (ql[64 * n + 32 * (s & 1) + i] >> (4 * (s >> 1))) & 15;
                        const int q = (lo | (((qh[32 * n + i] >> (2 * s)) & 3) << 4)) - 32;
                        out[128 * n + 32 * s + i] = (d * (float)sc[8 * n + 2 * s + (i >= 16)]) * (float)q;
                    }
        }
    }
}

/* One row of cols weights in GGUF's blocks of type back to fp32, as gguf.quants.dequantize makes them:
 * d * q (Q4_0: q = nibble - 8; Q8_0), d * q + m (Q4_1: a product, then a sum, each rounded to fp32).
 * Returns 0, -2 as mh_gemm_gguf. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off"))) /* d * q + m in two roundings, as numpy's */
#endif
int mh_dequantize_row_gguf(int type, const uint8_t *row, int64_t cols, float *out) {
    const int64_t bb = mh_gguf_block_bytes(type), nw = mh_gguf_block_weights(type);
    if (bb == 0 || cols % nw != 0) return -2;
    if (type == GG_Q4_K || type == GG_Q6_K) return gg_dequantize_k(type, row, cols, out), 0;
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
