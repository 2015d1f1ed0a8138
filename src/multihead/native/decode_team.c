/* A one-row decode step on one team of threads (mh_team_step, run by mh_decode_batch of decode_layer.c
 * where OpenMP is there): every layer in one parallel region, the products split across the team, the
 * kv heads across its threads, with the helpers of decode_ops.h. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "decode_ops.h" /* the storage dtypes' helpers, RoPE, silu, project, cache_write */

#ifdef _OPENMP
_Thread_local mh_span *mh_team_spans;

/* A one-row step on one team. Splitting each product across the threads with a region of its own costs,
 * per product, the region's start (the other thread woken, ~0.5 us) and end, and in between the calling
 * thread does the serial work alone (norms, the int8 input, residuals, the gate) while the others wait,
 * then they read what it wrote: ~0.3 ms of a 3.6 ms llama-155m int8 step with two threads, more when the
 * host places the two virtual CPUs of a virtual machine on two core complexes (each meeting then costs
 * several hundred ns). Here one region runs every layer: each thread keeps its own copy of x and does the
 * serial work itself (the same bits on every thread), the products split their rows across the team
 * into shared outputs with a barrier after each, and the kv heads split across the threads, each rotating,
 * caching and attending its own. The same kernels in the same order: the bits of layer() for one row. */

/* the products' shared outputs (4-byte slots of the storage dtype) */
typedef struct {
    char *qkv, *att, *o, *gate, *up, *w2;
} team_out;

/* one layer on the calling thread of the team: x, h (its copy of the row and the products' input), heads
 * (one kv head's attention scratch), act (F fp32) its own; W its own int8 input and scratch */
static void team_layer(const mh_layer_args *l, weights *W, void *x, char *h, float *heads, float *act,
                       const team_out *o, int64_t pos, const float *cos, const float *sin) {
    const int kind = l->kind, ckind = l->k_scale && l->v_scale ? MH_I8 : kind;
    const int64_t d = l->d, Hq = l->Hq, Hkv = l->Hkv, D = l->D, F = l->F, G = Hq / Hkv;
    const int64_t esz = kind == MH_F32 ? 4 : 2, cesz = ckind == MH_I8 ? 1 : esz;
    const int T = omp_get_num_threads(), me = omp_get_thread_num();
    mh_rms_norm(x, l->g_attn, h, d, l->eps, kind);
    project(W, P_QKV, h, o->qkv, (Hq + 2 * Hkv) * D, d, kind, 1, 1);
#pragma omp barrier
    for (int64_t j = Hkv * me / T; j < Hkv * (me + 1) / T; j++) { /* this thread's kv heads */
        char *q = o->qkv + j * G * D * esz, *k = o->qkv + (Hq + j) * D * esz, *v = k + Hkv * D * esz;
        for (int64_t i = 0; i < G; i++) rope(q + i * D * esz, D, cos, sin, l->interleaved, kind);
        rope(k, D, cos, sin, l->interleaved, kind);
        char *kc = (char *)l->k_cache + j * l->k_head_stride * cesz, *vc = (char *)l->v_cache + j * l->v_head_stride * cesz;
        float *ks = l->k_scale ? l->k_scale + j * l->s_head_stride : NULL;
        float *vs = l->v_scale ? l->v_scale + j * l->s_head_stride : NULL;
        cache_write(kc + pos * D * cesz, ks ? ks + pos : NULL, k, D, kind, ckind);
        cache_write(vc + pos * D * cesz, vs ? vs + pos : NULL, v, D, kind, ckind);
        float *qf = heads, *of = qf + G * D, *scores = of + G * D;
        MH_BY_KIND(kind, for (int64_t i = 0; i < G * D; i++) qf[i] = get(q, i, K));
        mh_attend(qf, kc, vc, ks, vs, pos + 1, D, G, l->scale, ckind, of, scores);
        MH_BY_KIND(kind, for (int64_t i = 0; i < G * D; i++) put(o->att, j * G * D + i, of[i], K));
    }
#pragma omp barrier
    project(W, P_O, o->att, o->o, d, Hq * D, kind, 1, 1);
#pragma omp barrier
    MH_BY_KIND(kind, for (int64_t i = 0; i < d; i++) put(x, i, get(x, i, K) + get(o->o, i, K), K));
    mh_rms_norm(x, l->g_ffn, h, d, l->eps, kind);
    project(W, P_W1, h, o->gate, F, d, kind, 1, 1);
#pragma omp barrier
    project(W, P_W3, h, o->up, F, d, kind, 0, 1); /* the same input: quantized once */
#pragma omp barrier
    MH_BY_KIND(kind, for (int64_t i = 0; i < F; i++) act[i] = get(o->gate, i, K));
    silu(act, F);
    MH_BY_KIND(kind, for (int64_t i = 0; i < F; i++) put(h, i, rnd(act[i], K) * get(o->up, i, K), K));
    project(W, P_W2, h, o->w2, d, F, kind, 1, 1);
#pragma omp barrier
    MH_BY_KIND(kind, for (int64_t i = 0; i < d; i++) put(x, i, get(x, i, K) + get(o->w2, i, K), K));
}

/* mh_decode_batch of one row (checked by the caller) on one team of up to MH_MAX_SPANS threads; 0, or -1
 * when its memory cannot be allocated (nothing run) */
int mh_team_step(void *x, const mh_layer_args *a, int64_t n, int64_t pos, const float *const *cos,
                 const float *const *sin, const void *g_final, float eps_final, void *out, int64_t *done) {
    int64_t wide = 0, shared = 0, per_head = 0; /* the widest vector, the shared outputs, a head's scratch */
    for (int64_t i = 0; i < n; i++) {
        const mh_layer_args *l = &a[i];
        const int64_t dF = l->d > l->F ? l->d : l->F, w = dF > l->Hq * l->D ? dF : l->Hq * l->D, G = l->Hq / l->Hkv;
        const int64_t sh = (l->Hq + 2 * l->Hkv) * l->D + l->Hq * l->D + 2 * l->d + 2 * l->F, ph = G * (2 * l->D + pos + 1);
        wide = w > wide ? w : wide, shared = sh > shared ? sh : shared, per_head = ph > per_head ? ph : per_head;
    }
    const int T = omp_get_max_threads() > MH_MAX_SPANS ? MH_MAX_SPANS : omp_get_max_threads();
    const int64_t nq = (wide + 63) & ~(int64_t)63, spans = MH_MAX_SPANS * (int64_t)sizeof(mh_span);
    const int64_t sh_bytes = (shared * 4 + 63) & ~(int64_t)63; /* then each thread's: x, h, heads, act, xs, xq, scratch */
    const int64_t own = (3 * wide * 4 + per_head * 4 + nq / MH_Q8_BLOCK * 4 + nq + MH_Q8_SCRATCH(nq) + 127) & ~(int64_t)63;
    char *buf = aligned_alloc(64, (size_t)(spans + sh_bytes + T * own));
    if (!buf) return -1;
    mh_span *span = (mh_span *)buf;
    for (int t = 0; t < MH_MAX_SPANS; t++) atomic_init(&span[t].fb, 0); /* empty */
    char *sh = buf + spans;
    const int64_t d = a[0].d, esz = a[0].kind == MH_F32 ? 4 : 2;
#pragma omp parallel num_threads(T)
    {
        mh_team_spans = span;
        const int me = omp_get_thread_num();
        char *xt = sh + sh_bytes + me * own, *h = xt + wide * 4;
        float *heads = (float *)(h + wide * 4), *act = heads + per_head;
        memcpy(xt, x, (size_t)(d * esz));
        for (int64_t i = 0; i < n; i++) {
            const mh_layer_args *l = &a[i];
            team_out o = {sh, NULL, NULL, NULL, NULL, NULL};
            o.att = o.qkv + (l->Hq + 2 * l->Hkv) * l->D * 4, o.o = o.att + l->Hq * l->D * 4;
            o.gate = o.o + l->d * 4, o.up = o.gate + l->F * 4, o.w2 = o.up + l->F * 4;
            weights W = {{l->w[0], l->w[1], l->w[2], l->w[3], l->w[4]}, {l->s[0], l->s[1], l->s[2], l->s[3], l->s[4]},
                         l->group, l->blocked, NULL, act + wide, NULL, 1, l->gg_types};
            W.xq = (int8_t *)(W.xs + nq / MH_Q8_BLOCK);
            W.scratch = (void *)(((uintptr_t)(W.xq + nq) + 63) & ~(uintptr_t)63); /* MH_Q8_SCRATCH(nq) at 64 */
            team_layer(l, &W, xt, h, heads, act, &o, pos, cos[i], sin[i]);
        }
        if (me == 0) {
            memcpy(x, xt, (size_t)(d * esz));
            mh_rms_norm(xt, g_final, out, d, eps_final, a[0].kind);
        }
        mh_team_spans = NULL;
    }
    free(buf);
    *done = n;
    return 0;
}
#endif
