/* One decode step of one pre-LN LLaMA-style layer for B rows (one token of each of B sequences, or B
 * consecutive tokens of one sequence), in place on x:
 *
 *   h = RMSNorm(x) * g_attn                                   (fp32 statistics)
 *   q | k | v = W_qkv h                                       (Hq*D | Hkv*D | Hkv*D rows)
 *   q, k = RoPE(q, k) at position p;  K[:, p] = k;  V[:, p] = v
 *   a_i = softmax(q_i K^T * scale) V   for each query head i  (its kv head i / (Hq / Hkv), keys 0..p)
 *   x = x + W_o a
 *   h = RMSNorm(x) * g_ffn
 *   x = x + W_2 (silu(W_1 h) * (W_3 h))                       (SwiGLU)
 *
 * Storage dtype T (kind: MH_F32, MH_BF16 or MH_F16 of native.h) is that of x, the weights and the cache;
 * arithmetic is fp32. In bf16 / fp16 every intermediate is rounded to T where torch's modules round
 * it (the norm's output before and after the gain, each projection, the rotated q and k, the attention
 * output, each residual sum, silu and the gated product), so the step follows the eager model of that
 * dtype up to the order of the sums. Matrices are row-major with contiguous rows (leading dimension =
 * columns); the cache of the layer is (B, Hkv, max_len, D) with the given head stride, position stride D
 * and batch stride Hkv head strides.
 *
 * This file: that layer for B rows (layer) and the entries of a whole step (mh_decode_batch,
 * mh_decode_layers); decode_team.c: a one-row step on one team of threads; decode_ops.h: the helpers
 * both share.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "decode_ops.h" /* the storage dtypes' helpers, RoPE, silu, project, cache_write */

/* the sum of the squares of x's d values of kind K: 16 running sums, then their tree */
static inline __attribute__((always_inline)) float sum_squares(const void *x, int64_t d, int K) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) {
        v16 v;
        for (int t = 0; t < 16; t++) v[t] = get(x, i + t, K);
        acc += v * v;
    }
    float ss = hsum16(acc);
    for (; i < d; i++) ss += get(x, i, K) * get(x, i, K);
    return ss;
}

/* out = RMSNorm(x) * g, as torch: fp32 F.rms_norm for fp32; for bf16 (x * rsqrt(mean(x^2) + eps)) rounded
 * to bf16, then times g rounded again */
void mh_rms_norm(const void *x, const void *g, void *out, int64_t d, float eps, int kind) {
    MH_BY_KIND(kind, {
        const float inv = 1.0f / sqrtf(sum_squares(x, d, K) / (float)d + eps);
        for (int64_t i = 0; i < d; i++) put(out, i, rnd(get(x, i, K) * inv, K) * get(g, i, K), K);
    });
}

/* the layer of the file's comment for B rows x (B, d): B sequences at position pos, each with its own
 * cache (batch stride: Hkv heads; the caches are contiguous (B, Hkv, max_len, D), their scales (B, Hkv,
 * max_len)), or (seq) B consecutive tokens of one sequence at positions pos .. pos + B - 1 in the cache of
 * batch 0, row b with rotary row b and attending to the positions up to its own; ckind: the cache's kind
 * (kind, or MH_I8 with scales ks, vs). Each row gets the bits a one-token step of it gives it. */
static int layer(void *x, const void *g_attn, const void *g_ffn, weights *W, void *k_cache, void *v_cache,
                 float *ks, float *vs, int64_t k_head_stride, int64_t v_head_stride, int64_t s_head_stride,
                 int64_t pos, const float *cos, const float *sin, int interleaved, int64_t d, int64_t Hq,
                 int64_t Hkv, int64_t D, int64_t F, float eps, float scale, int kind, int ckind, int64_t B,
                 int seq) {
    const int64_t esz = kind == MH_F32 ? 4 : 2, cesz = ckind == MH_I8 ? 1 : esz;
    const int64_t G = Hq / Hkv, L = pos + (seq ? B : 1), nqkv = (Hq + 2 * Hkv) * D; /* L: the most keys a row reads */
    /* row b's cache (batch strides; one sequence: all rows in batch 0), position, and rotary row */
    const int64_t kb = seq ? 0 : Hkv * k_head_stride, vb = seq ? 0 : Hkv * v_head_stride, sb = seq ? 0 : Hkv * s_head_stride;
#define MH_POS(b) (seq ? pos + (b) : pos)
#define MH_ROT(t, b) ((t) + (seq ? (b) * (D / 2) : 0))
    /* activations of the B rows in the storage dtype (4-byte slots), then fp32 scratch, then the int8 input */
    const int64_t per_head = G * D * 2 + G * L; /* q, out, scores of one kv head's attention */
    const int64_t n_act = d + nqkv + Hq * D + 2 * F, n_f32 = B * Hkv * per_head + F;
    const int64_t widest = d > Hq * D ? (d > F ? d : F) : (Hq * D > F ? Hq * D : F);
    const int64_t nq = (widest + 63) & ~(int64_t)63;
    char *buf = malloc((size_t)(B * n_act * 4 + n_f32 * 4 + nq / MH_Q8_BLOCK * 4 + nq + 64 + MH_Q8_SCRATCH(nq)));
    if (!buf) return -1;
    char *h = buf, *qkv = h + B * d * 4, *att = qkv + B * nqkv * 4, *gate = att + B * Hq * D * 4;
    char *up = gate + B * F * 4;
    float *heads = (float *)(buf + B * n_act * 4), *act = heads + B * Hkv * per_head;
    W->xs = act + F;
    W->xq = (int8_t *)(W->xs + nq / MH_Q8_BLOCK);
    W->scratch = (void *)(((uintptr_t)(W->xq + nq) + 63) & ~(uintptr_t)63); /* MH_Q8_SCRATCH(nq) at 64 */
    int status = 0;
#define MH_ROW(p, b, n) ((char *)(p) + (b) * (n) * esz) /* row b of B rows of n values of the storage dtype */

    /* attention block */
    for (int64_t b = 0; b < B; b++) mh_rms_norm(MH_ROW(x, b, d), g_attn, MH_ROW(h, b, d), d, eps, kind);
    if ((status = project(W, P_QKV, h, qkv, nqkv, d, kind, 1, B)) != 0) goto out;
    for (int64_t b = 0; b < B; b++) {
        char *q = MH_ROW(qkv, b, nqkv), *k = q + Hq * D * esz, *v = k + Hkv * D * esz;
        const float *cb = MH_ROT(cos, b), *sn = MH_ROT(sin, b);
        for (int64_t i = 0; i < Hq; i++) rope(q + i * D * esz, D, cb, sn, interleaved, kind);
        for (int64_t j = 0; j < Hkv; j++) {
            rope(k + j * D * esz, D, cb, sn, interleaved, kind);
            const int64_t ks_at = b * sb + j * s_head_stride + MH_POS(b);
            cache_write((char *)k_cache + (b * kb + j * k_head_stride + MH_POS(b) * D) * cesz,
                        ks ? ks + ks_at : NULL, k + j * D * esz, D, kind, ckind);
            cache_write((char *)v_cache + (b * vb + j * v_head_stride + MH_POS(b) * D) * cesz,
                        vs ? vs + ks_at : NULL, v + j * D * esz, D, kind, ckind);
        }
    }
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (B * Hkv > 1 && B * G * L * D >= (1 << 15))
#endif
    for (int64_t bj = 0; bj < B * Hkv; bj++) { /* rows' kv heads in parallel, each with its own scratch; */
        /* a row of one sequence reads the keys up to its own position (the later rows' are written too) */
        const int64_t b = bj / Hkv, j = bj % Hkv;
        const char *q = MH_ROW(qkv, b, nqkv);
        char *a = MH_ROW(att, b, Hq * D);
        float *qf = heads + bj * per_head, *of = qf + G * D, *scores = of + G * D;
        MH_BY_KIND(kind, for (int64_t i = 0; i < G * D; i++) qf[i] = get(q, j * G * D + i, K));
        mh_attend(qf, (char *)k_cache + (b * kb + j * k_head_stride) * cesz,
               (char *)v_cache + (b * vb + j * v_head_stride) * cesz, ks ? ks + b * sb + j * s_head_stride : NULL,
               vs ? vs + b * sb + j * s_head_stride : NULL, MH_POS(b) + 1, D, G, scale, ckind, of, scores);
        MH_BY_KIND(kind, for (int64_t i = 0; i < G * D; i++) put(a, j * G * D + i, of[i], K));
    }
    if ((status = project(W, P_O, att, h, d, Hq * D, kind, 1, B)) != 0) goto out;
    MH_BY_KIND(kind, for (int64_t i = 0; i < B * d; i++) put(x, i, get(x, i, K) + get(h, i, K), K));

    /* feed-forward block */
    for (int64_t b = 0; b < B; b++) mh_rms_norm(MH_ROW(x, b, d), g_ffn, MH_ROW(h, b, d), d, eps, kind);
    if ((status = project(W, P_W1, h, gate, F, d, kind, 1, B)) != 0) goto out;
    if ((status = project(W, P_W3, h, up, F, d, kind, 0, B)) != 0) goto out; /* the same input: quantized once */
    for (int64_t b = 0; b < B; b++) {
        char *gb = MH_ROW(gate, b, F), *ub = MH_ROW(up, b, F);
        MH_BY_KIND(kind, for (int64_t i = 0; i < F; i++) act[i] = get(gb, i, K));
        silu(act, F);
        MH_BY_KIND(kind, for (int64_t i = 0; i < F; i++) put(gb, i, rnd(act[i], K) * get(ub, i, K), K));
    }
    if ((status = project(W, P_W2, gate, h, d, F, kind, 1, B)) != 0) goto out;
    MH_BY_KIND(kind, for (int64_t i = 0; i < B * d; i++) put(x, i, get(x, i, K) + get(h, i, K), K));
#undef MH_ROW
#undef MH_POS
#undef MH_ROT
out:
    free(buf);
    return status;
}

/* sizeof(mh_layer_args): what the ctypes mirror must match (checked as the library loads) */
int64_t mh_layer_args_bytes(void) { return (int64_t)sizeof(mh_layer_args); }

/* Every layer of one decode step of B rows in one call, in order, in place on x (B, d): layer i with the
 * fixed arguments a[i] (native.h's mh_layer_args) and its rotary rows cos[i], sin[i]; then out (B, d) = the
 * final RMSNorm of x with gain g_final. The rows are either B sequences at one position pos (seq == 0: a
 * batch without padding; one rotary row, each row's own cache) or B consecutive tokens of one sequence at
 * positions pos .. pos + B - 1 (seq != 0: a prompt's chunk; B rotary rows, the cache of batch 0, each
 * row attending to the positions up to its own).
 * - weights: of the storage dtype kind (a[i].s all NULL), or int8 (a[i].s[p] the fp32 scales of weight p
 *   per group of a[i].group inputs, as mh_gemv_q8, in layout a[i].blocked: packed rows hold their
 *   scales, and a[i].s[p] is then any non-NULL pointer), which need
 *   fp32 activations (kind MH_F32);
 * - cache: of the storage dtype (k_scale, v_scale NULL), or int8 with an fp32 scale per position
 *   (k_scale, v_scale (B, Hkv, max_len) at head stride s_head_stride); the caches (B, Hkv, max_len, D),
 *   contiguous, row b's at b * Hkv head strides.
 * Row b of the result has the bits a step of row b alone gives it: one row runs the one-row GEMVs, several
 * the multi-row products (the weights read once for all the rows), which give each row those bits.
 * One call a step instead of one per layer of 25 arguments, and the final norm in it: on the 8-layer
 * llama-155m shape (int8, one thread) the step's time outside the native code went from 0.36-0.45 ms to
 * 0.20-0.27 ms (with the int8 embedding row dequantized natively too), the interpreter being slow once the
 * weights streaming through the caches have evicted its working set.
 * *done receives the layers that ran (each wrote its cache at pos). Returns 0,
 * or the failing layer's -1 (no scratch memory) or -2 (int8 weights with another kind, blocked or packed
 * ones in a build that does not read them, packed ones not in groups of 32 or 32 columns wide or less, or
 * several fp16 rows without fp16 kernels; checked for every layer before any runs). */
int mh_decode_batch(void *x, const mh_layer_args *a, int64_t n, int64_t pos, const float *const *cos,
                    const float *const *sin, const void *g_final, float eps_final, void *out, int64_t *done,
                    int64_t B, int32_t seq) {
    *done = 0;
    for (int64_t i = 0; i < n; i++) {
        if (B > 1 && a[i].kind == MH_F16 && !MH_HAS_F16) return -2;
        const int packed = a[i].blocked == MH_Q8_PACKED, narrow = a[i].d <= 32 || a[i].Hq * a[i].D <= 32 || a[i].F <= 32;
        const int gg = a[i].blocked >= MH_GG_LAYOUT, q8 = a[i].blocked > 0 && !gg; /* GGUF: rows of 32s */
        for (int p = 0; gg && p < 5; p++) { /* each weight's type: a kernel, and its input width whole blocks */
            const int t = a[i].gg_types ? (a[i].gg_types >> (4 * p)) & 15 : a[i].blocked - MH_GG_LAYOUT;
            const int64_t nw = mh_gguf_block_weights(t), width = p == 1 ? a[i].Hq * a[i].D : p == 4 ? a[i].F : a[i].d;
            if (nw == 0 || width % nw) return -2;
        }
        for (int p = 0; p < 5; p++)
            if (a[i].s[p] && (a[i].kind != MH_F32 || (q8 && !mh_q8_blocked()) ||
                              (packed && (a[i].group != 32 || narrow))))
                return -2;
    }
#ifdef _OPENMP /* one row whose products are large enough to split: one team for the whole step */
    if (B == 1 && !seq && n > 0 && omp_get_max_threads() > 1 && !omp_in_parallel() &&
        (a[0].Hq + 2 * a[0].Hkv) * a[0].D * a[0].d >= MH_PAR_MIN)
        return mh_team_step(x, a, n, pos, cos, sin, g_final, eps_final, out, done);
#endif
    for (int64_t i = 0; i < n; i++) {
        const mh_layer_args *l = &a[i];
        weights W = {{l->w[0], l->w[1], l->w[2], l->w[3], l->w[4]}, {l->s[0], l->s[1], l->s[2], l->s[3], l->s[4]},
                     l->group, l->blocked, NULL, NULL, NULL, 0, l->gg_types};
        const int ckind = l->k_scale && l->v_scale ? MH_I8 : l->kind;
        const int status = layer(x, l->g_attn, l->g_ffn, &W, l->k_cache, l->v_cache, l->k_scale, l->v_scale,
                                 l->k_head_stride, l->v_head_stride, l->s_head_stride, pos, cos[i], sin[i],
                                 l->interleaved, l->d, l->Hq, l->Hkv, l->D, l->F, l->eps, l->scale, l->kind, ckind,
                                 B, seq);
        if (status != 0) return status;
        *done = i + 1;
    }
    const int64_t d = n > 0 ? a[0].d : 0, esz = n > 0 && a[0].kind == MH_F32 ? 4 : 2;
    for (int64_t b = 0; n > 0 && b < B; b++) /* the model's final norm, row by row */
        mh_rms_norm((char *)x + b * d * esz, g_final, (char *)out + b * d * esz, d, eps_final, a[0].kind);
    return 0;
}

/* mh_decode_batch of one row */
int mh_decode_layers(void *x, const mh_layer_args *a, int64_t n, int64_t pos, const float *const *cos,
                     const float *const *sin, const void *g_final, float eps_final, void *out, int64_t *done) {
    return mh_decode_batch(x, a, n, pos, cos, sin, g_final, eps_final, out, done, 1, 0);
}
