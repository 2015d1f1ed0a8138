/* The functions of the native library, shared by its C files, and its storage dtypes. */
#ifndef MH_NATIVE_H
#define MH_NATIVE_H
#include <stdint.h>

enum { MH_F32 = 0, MH_BF16 = 1, MH_F16 = 2 }; /* the "kind" argument of the decode layer */

/* fp16 <-> fp32 of one value, fp16 held as its 16 bits: the x86 conversion instructions (F16C) where the
 * CPU has them, else the compiler's _Float16; no fp16 kernels without either */
#if defined(__F16C__)
#include <immintrin.h>
#define MH_HAS_F16 1
static inline float mh_h2f(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t mh_f2h(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
#elif defined(__FLT16_MAX__)
#include <string.h>
#define MH_HAS_F16 1
static inline float mh_h2f(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
}
static inline uint16_t mh_f2h(float f) {
    const _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, sizeof h);
    return h;
}
#else
#define MH_HAS_F16 0
#endif

void mh_gemv_f32(const float *w, const float *x, const float *b, float *y, int64_t rows, int64_t cols,
                 int64_t ldw);
void mh_gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *b, uint16_t *y, int64_t rows,
                  int64_t cols, int64_t ldw);
/* fp16 W, x, bias, y as their 16-bit patterns; a no-op without MH_HAS_F16 */
void mh_gemv_f16(const uint16_t *w, const uint16_t *x, const uint16_t *b, uint16_t *y, int64_t rows,
                 int64_t cols, int64_t ldw);
void mh_rms_norm(const void *x, const void *g, void *out, int64_t d, float eps, int kind);
#endif
