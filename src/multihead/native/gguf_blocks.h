/* What gemv_q4.c and gemv_qk.c (the products) and gguf_dequant.c (a row back to fp32) share about GGUF's blocks:
 * ggml's type numbers and the reading of a block's fp16 fields. The layouts: gemv_q4.c's comment. */
#ifndef MH_GGUF_BLOCKS_H
#define MH_GGUF_BLOCKS_H
#include <stdint.h>
#include <string.h>

enum { GG_Q4_0 = 2, GG_Q4_1 = 3, GG_Q8_0 = 8, GG_Q4_K = 12, GG_Q6_K = 14 }; /* ggml's type numbers */

/* Q4_K's 12 bytes of scales: eight 6-bit scales sc and mins m (llama.cpp's get_scale_min_k4): j < 4 in
 * the low 6 bits of bytes j and j + 4, j >= 4 in the nibbles of byte j + 4 with the top 2 bits of bytes
 * j - 4 (scale) and j (min) */
static inline void gg_scale_min(const uint8_t *q, uint8_t *sc, uint8_t *m) {
    for (int j = 0; j < 4; j++) sc[j] = q[j] & 63, m[j] = q[j + 4] & 63;
    for (int j = 4; j < 8; j++)
        sc[j] = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), m[j] = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
}

/* gemv_qk.c: one row of k-quant super-blocks times a rounded activation (gemv_q4.c's xq, xs, sx) */
float mh_gguf_row_k(const uint8_t *r, int64_t cols, int type, const int8_t *xq, const float *xs, const float *sx);

/* fp16 (its 16 bits) -> fp32, exactly, in plain C */
static inline float gg_h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t u;
    if (e == 0) { /* zero or subnormal: man * 2^-24 is exact in fp32 */
        const float f = (float)man * 0x1p-24f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7F800000u | (man << 13);
    } else {
        u = sign | ((e + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t gg_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
#endif
