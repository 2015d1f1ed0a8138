/* Greedy decoding of several tokens in one native call: for each step s of a batch-1 generation
 *
 *   logits = W_head h + b                   (h: the final-normed hidden state of the last position)
 *   id     = argmax(logits)                 (the first maximum; a NaN counts as the maximum, as torch's)
 *   x      = embedding row id               (a copy, or an int8 row dequantized)
 *   h      = every layer at position pos + s, then the final norm   (mh_decode_layers)
 *
 * the same kernels in the same order as the step-by-step path (the head's GEMV of its kind, the int8
 * activations' rounding of mh_quantize_q8, the layers of decode_layer.c), so the tokens and the caches
 * are the same; only the interpreter between the steps is gone. A model of a few hundred MB streams its
 * weights through the caches at every step and evicts the interpreter's working set, so each step's
 * ~20 Python calls cost several percent of a step that could be spent reading weights.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* The head and the embedding of a greedy run (ctypes mirrors it: multihead.native.GreedyArgs). */
typedef struct {
    const void *table; /* the input embedding (V, d): rows of the storage dtype, or int8 rows */
    const float *table_scale; /* int8 rows: their scales (V, ceil(d / table_group)); NULL: a float table */
    const void *head; /* the output head (V, d): of the storage dtype, or int8 */
    const float *head_scale; /* int8 head: its scales per group of head_group inputs; NULL: a float head */
    const void *head_bias; /* (V,) of the head's output dtype (fp32 for an int8 head), or NULL */
    const float *const *cos, *const *sin; /* per layer: the rotary rows of this call's first position */
    int64_t table_row, table_scale_row; /* the table's and its scales' row strides, in elements */
    int64_t table_group, head_group, vocab, rot_stride; /* rot_stride: floats from one position's row to the next */
    int32_t table_blocked, head_blocked;
} mh_greedy_args;

int64_t mh_greedy_args_bytes(void) { return (int64_t)sizeof(mh_greedy_args); }

#if defined(__AVX512F__)
/* values i .. i + 15 of kind as fp32 lanes */
static inline __m512 load_ps(const void *v, int64_t i, int kind) {
    if (kind == MH_F32) return _mm512_loadu_ps((const float *)v + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)v + i));
    if (kind == MH_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16: the high half */
}
#endif

/* the index of the largest of n values of kind (fp32 for an int8 head): the first maximum, a NaN first */
static int64_t argmax(const void *v, int64_t n, int kind) {
    int64_t best = 0, i = 1;
    float top = mh_get(v, 0, kind);
    if (isnan(top)) return 0;
#if defined(__AVX512F__) /* the largest value 16 lanes at a time, then where it is first */
    __m512 m = _mm512_set1_ps(top);
    __mmask16 nan = 0;
    for (i = 0; i + 16 <= n && !nan; i += 16) {
        const __m512 x = load_ps(v, i, kind);
        nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, x);
    }
    if (nan) {
        i = 1; /* value by value from the start (the loop below) */
    } else { /* the values past the whole blocks: the loop below */
        const float mx = _mm512_reduce_max_ps(m);
        if (mx > top) { /* its first place, 16 values at a time (it lies in the whole blocks) */
            const __m512 want = _mm512_set1_ps(mx);
            for (int64_t j = 0;; j += 16) {
                const __mmask16 eq = _mm512_cmp_ps_mask(load_ps(v, j, kind), want, _CMP_EQ_OQ);
                if (eq) {
                    best = j + __builtin_ctz(eq);
                    break;
                }
            }
        }
        top = mh_get(v, best, kind);
        i = i > 1 ? i : 1;
    }
#endif
    for (; i < n; i++) {
        const float f = mh_get(v, i, kind);
        if (isnan(f)) return i;
        if (f > top) top = f, best = i;
    }
    return best;
}

/* Up to `steps` greedy tokens after the state h (d values of the storage dtype, overwritten): ids[s]
 * the token picked at step s; after each pick the layers run on it at position pos + s (writing every
 * layer's cache there), unless it is eos (>= 0) or the run's last pick and `last` is set (the caller
 * needs no state after it). *picked: tokens written to ids; *stepped: whole steps the layers ran (the
 * caches to advance); *done: the layers of a failed step that wrote their caches. Returns 0, -1 (no
 * memory) or mh_decode_layers' error. */
int mh_decode_greedy(const mh_layer_args *a, int64_t n, int64_t pos, const mh_greedy_args *g, const void *g_final,
                     float eps_final, void *h, int64_t steps, int32_t last, int64_t eos, int64_t *ids,
                     int64_t *picked, int64_t *stepped, int64_t *done) {
    *picked = *stepped = *done = 0;
    if (n < 1 || steps < 1) return 0;
    const int kind = a[0].kind, int8_head = g->head_scale != NULL;
    const int64_t d = a[0].d, V = g->vocab, esz = kind == MH_F32 ? 4 : 2;
    const int64_t nq = (d + 63) & ~(int64_t)63;
    /* x (d), logits (V, 4-byte slots), the head's int8 input, cos / sin pointers per layer */
    char *buf = malloc((size_t)(d * 4 + V * 4 + nq + nq / MH_Q8_BLOCK * 4 + 2 * n * sizeof(float *)));
    if (!buf) return -1;
    char *x = buf, *logits = x + d * 4;
    int8_t *xq = (int8_t *)(logits + V * 4);
    float *xs = (float *)(xq + nq);
    const float **cos = (const float **)(xs + nq / MH_Q8_BLOCK), **sin = cos + n;
    int status = 0;
    for (int64_t s = 0; s < steps; s++) {
        if (g->head_blocked >= MH_GG_LAYOUT) { /* GGUF's blocks (head_scale: any non-NULL), as GGUFLinear */
            const int t = g->head_blocked - MH_GG_LAYOUT;
            status = mh_gemm_gguf(t, g->head, mh_gguf_row_bytes(t, d), h, g->head_bias, (float *)logits, 1, V, d);
            if (status != 0) break;
        } else if (int8_head) { /* fp32 activations, as Int8GemvLinear */
            mh_quantize_q8(h, MH_F32, d, xq, xs);
            status = mh_gemv_q8(g->head, g->head_scale, xq, xs, g->head_bias, (float *)logits, V, d,
                                mh_q8_row_bytes(d, g->head_blocked), g->head_group, g->head_blocked);
            if (status != 0) break;
        } else if (kind == MH_F32) {
            mh_gemv_f32(g->head, h, g->head_bias, (float *)logits, V, d, d);
        } else if (kind == MH_BF16) {
            mh_gemv_bf16(g->head, h, g->head_bias, (uint16_t *)logits, V, d, d);
        } else {
            mh_gemv_f16(g->head, h, g->head_bias, (uint16_t *)logits, V, d, d);
        }
        const int64_t id = argmax(logits, V, int8_head ? MH_F32 : kind);
        ids[s] = id;
        *picked = s + 1;
        if (id == eos || (last && s == steps - 1)) break;
        if (g->table_blocked >= MH_GG_LAYOUT) { /* a row of GGUF's blocks (table_row in bytes), as GGUFEmbedding */
            mh_dequantize_row_gguf(g->table_blocked - MH_GG_LAYOUT, (const uint8_t *)g->table + id * g->table_row, d,
                                   (float *)x);
        } else if (g->table_scale) { /* an int8 row, dequantized as the embedding's own lookup */
            mh_dequantize_row_q8((const int8_t *)g->table + id * g->table_row, g->table_scale + id * g->table_scale_row, d,
                                 g->table_group, g->table_blocked, (float *)x);
        } else {
            memcpy(x, (const char *)g->table + id * g->table_row * esz, (size_t)(d * esz));
        }
        for (int64_t i = 0; i < n; i++) cos[i] = g->cos[i] + s * g->rot_stride, sin[i] = g->sin[i] + s * g->rot_stride;
        status = mh_decode_layers(x, a, n, pos + s, cos, sin, g_final, eps_final, h, done);
        if (status != 0) break;
        *stepped = s + 1, *done = 0;
    }
    free(buf);
    return status;
}
