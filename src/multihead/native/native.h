/* The functions of the native library, shared by its C files. */
#ifndef MH_NATIVE_H
#define MH_NATIVE_H
#include <stdint.h>

void mh_gemv_f32(const float *w, const float *x, const float *b, float *y, int64_t rows, int64_t cols,
                 int64_t ldw);
void mh_gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *b, uint16_t *y, int64_t rows,
                  int64_t cols, int64_t ldw);
void mh_rms_norm(const void *x, const void *g, void *out, int64_t d, float eps, int bits);
#endif
