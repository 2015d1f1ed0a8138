/* The functions of the native library, shared by its C files, and its storage dtypes. */
#ifndef MH_NATIVE_H
#define MH_NATIVE_H
#include <stdint.h>

enum { MH_F32 = 0, MH_BF16 = 1, MH_F16 = 2, MH_I8 = 3 }; /* storage dtypes ("kind"); MH_I8: int8 K / V with scales */

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

/* Products split their rows across the OpenMP threads (torch's pool: torch.set_num_threads sets their
 * number) when the matrix has at least this many elements, enough to pay for waking them; one thread
 * without OpenMP. */
#define MH_PAR_MIN ((int64_t)1 << 18) /* elements */

/* A loop over n items split across the OpenMP threads and balanced as it runs. Each thread first takes
 * its own contiguous part from its front, MH_SPAN_CHUNK items at a time (one stream of reads, as a static
 * split), then the parts still left to the others from their backs: a thread the machine slows down (a
 * memory-bound product's two halves differ by ~8% from one call to the next on a 2-core virtual machine)
 * does not hold every other thread at the loop's end. A part is its front and back in one 64-bit word
 * (low and high 32 bits), taken by compare-and-swap; the items are independent. Without OpenMP, in order. */
#define MH_SPAN_CHUNK 16
#define MH_MAX_SPANS 64
#ifdef _OPENMP
#include <omp.h>
#include <stdatomic.h>
typedef struct {
    _Alignas(64) _Atomic uint64_t fb; /* front (low 32 bits), back (high 32) */
} mh_span;

/* up to chunk items of span s, from its back (steal) or front; their count (0: none left), the first at
 * *at */
static inline int64_t mh_span_take(mh_span *s, int back, int64_t *at, uint32_t chunk) {
    uint64_t v = atomic_load_explicit(&s->fb, memory_order_relaxed);
    for (;;) {
        const uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
        if (f >= b) return 0;
        const uint32_t k = b - f < chunk ? b - f : chunk;
        const uint64_t nv = back ? ((uint64_t)(b - k) << 32) | f : ((uint64_t)b << 32) | (f + k);
        if (atomic_compare_exchange_weak_explicit(&s->fb, &v, nv, memory_order_relaxed, memory_order_relaxed)) {
            *at = back ? b - k : f;
            return k;
        }
    }
}

/* A one-row decode step runs all its layers on one team (decode_team.c): each of its threads points
 * mh_team_spans at the team's shared spans and calls the GEMVs' _team entries, whose balanced loop
 * (MH_BALANCED_FOR with TEAM 1) takes this thread's share with no region of its own and no barrier at its
 * end (the step places one after each loop; with it, every span is empty when the next loop starts, so a
 * thread that finds another's span not yet set up for this loop finds nothing to take). NULL elsewhere. */
extern _Thread_local mh_span *mh_team_spans;

/* thread ME of a team of T taking every item left in SPANS (T of them), CHUNK at a time: its own span
 * from the front, then the others' from their backs, running the statement after I on each */
#define MH_TAKE_ALL(SPANS, T, ME, CHUNK, I, ...)                                                           \
    for (int v_ = 0; v_ < (T); v_++) {                                                                     \
        mh_span *s_ = &(SPANS)[((ME) + v_) % (T)];                                                         \
        int64_t at_, k_;                                                                                   \
        while ((k_ = mh_span_take(s_, v_ > 0, &at_, (CHUNK))) > 0)                                         \
            for (int64_t I = at_; I < at_ + k_; I++) __VA_ARGS__;                                          \
    }

/* for (I = 0; I < N; I++) the statement after I, on the team when PAR (N < 2^32; it may not leave the
 * loop). TEAM, a constant: 1 inside a step's team (mh_team_spans set: this thread's share of the team's
 * spans, no region of its own, no barrier), 0 elsewhere (its code then compiles as if the team's were not
 * there: a copy of the statement for the team in every kernel made the one-thread step 1-3% slower). */
#define MH_BALANCED_FOR(N, PAR, TEAM, I, ...)                                                             \
    do {                                                                                                   \
        const int64_t n_ = (N);                                                                            \
        const int par_ = (PAR);                                                                            \
        if (TEAM) {                                                                                        \
            const int tn_ = omp_get_num_threads(), tme_ = omp_get_thread_num();                            \
            atomic_store_explicit(&mh_team_spans[tme_].fb,                                                 \
                                  (uint64_t)(n_ * tme_ / tn_) | ((uint64_t)(n_ * (tme_ + 1) / tn_) << 32),  \
                                  memory_order_relaxed);                                                   \
            MH_TAKE_ALL(mh_team_spans, tn_, tme_, MH_SPAN_CHUNK, I, __VA_ARGS__);                          \
            break;                                                                                         \
        }                                                                                                  \
        int T_ = omp_get_max_threads();                                                                    \
        T_ = T_ > MH_MAX_SPANS ? MH_MAX_SPANS : (T_ < 1 ? 1 : T_);                                         \
        if (!par_ || T_ == 1 || omp_in_parallel()) { /* one thread: no team (entering one costs ~1 us) */  \
            for (int64_t I = 0; I < n_; I++) __VA_ARGS__;                                                  \
            break;                                                                                         \
        }                                                                                                  \
        mh_span spans_[MH_MAX_SPANS];                                                                      \
        for (int t_ = 0; t_ < T_; t_++)                                                                    \
            atomic_init(&spans_[t_].fb, (uint64_t)(n_ * t_ / T_) | ((uint64_t)(n_ * (t_ + 1) / T_) << 32)); \
        _Pragma("omp parallel") {                                                                          \
            const int me_ = omp_get_thread_num();                                                          \
            MH_TAKE_ALL(spans_, T_, me_, MH_SPAN_CHUNK, I, __VA_ARGS__);                                   \
        }                                                                                                  \
    } while (0)
#else
#define MH_BALANCED_FOR(N, PAR, TEAM, I, ...)                                                              \
    do {                                                                                                   \
        (void)(TEAM);                                                                                      \
        for (int64_t I = 0; I < (N); I++) __VA_ARGS__;                                                     \
    } while (0)
#endif

/* 16 and 8 fp32 lanes (GCC / Clang vector extensions) and their sums as trees of halves: a few vector adds
 * instead of 15 or 7 dependent scalar ones, which a row of a few KiB would otherwise wait on */
typedef float v16 __attribute__((vector_size(64)));
typedef float mh_v8 __attribute__((vector_size(32)));
typedef float mh_v4 __attribute__((vector_size(16)));
#if defined(__clang__) || __GNUC__ >= 12 /* halves by shuffles: v stays in registers */
#define MH_LO8(v) __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
#define MH_HI8(v) __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
#define MH_LO4(v) __builtin_shufflevector(v, v, 0, 1, 2, 3)
#define MH_HI4(v) __builtin_shufflevector(v, v, 4, 5, 6, 7)
#else /* halves through memory: older compilers keep v on the stack */
#define MH_HALF(T, v, at) __extension__({ T h_; __builtin_memcpy(&h_, (const char *)&(v) + (at), sizeof h_); h_; })
#define MH_LO8(v) MH_HALF(mh_v8, v, 0)
#define MH_HI8(v) MH_HALF(mh_v8, v, 32)
#define MH_LO4(v) MH_HALF(mh_v4, v, 0)
#define MH_HI4(v) MH_HALF(mh_v4, v, 16)
#endif
static inline float hsum8(mh_v8 v) {
    const mh_v4 c = MH_LO4(v) + MH_HI4(v);
    return (c[0] + c[2]) + (c[1] + c[3]);
}
static inline float hsum16(v16 v) { return hsum8(MH_LO8(v) + MH_HI8(v)); }

typedef int32_t mh_i32x16 __attribute__((vector_size(64)));

/* e^x for 16 lanes: x = n ln2 + f ln2 with n = round(x / ln2), |f| <= 1/2, 2^f by its Taylor series to
 * degree 6 (relative error about 1.2e-7, one fp32 ulp), 2^n by the exponent field; x clamped to
 * [-87, 88], where e^x is a normal float (e^-87 ~ 1.6e-38 stands in for anything smaller) */
static inline v16 mh_vselect(mh_i32x16 mask, v16 a, v16 b) { /* a where mask, else b */
    mh_i32x16 ai, bi;
    __builtin_memcpy(&ai, &a, sizeof ai);
    __builtin_memcpy(&bi, &b, sizeof bi);
    const mh_i32x16 r = (ai & mask) | (bi & ~mask);
    v16 out;
    __builtin_memcpy(&out, &r, sizeof out);
    return out;
}

static inline v16 mh_vexp(v16 x) {
    const v16 zero = {0}, lo = zero - 87.0f, hi = zero + 88.0f;
    x = mh_vselect(x < lo, lo, x);
    x = mh_vselect(x > hi, hi, x);
    const v16 t = x * 1.44269504088896341f + 0.5f; /* x / ln2, shifted so that floor rounds */
    mh_i32x16 n = __builtin_convertvector(t, mh_i32x16);  /* truncates toward zero */
    v16 nf = __builtin_convertvector(n, v16);
    const mh_i32x16 down = nf > t;                       /* -1 where truncation went up (t < 0) */
    n += down;
    nf = __builtin_convertvector(n, v16);
    const v16 f = (t - 0.5f - nf) * 0.69314718055994531f; /* f ln2, in [-ln2 / 2, ln2 / 2] */
    v16 p = f * (1.0f / 720) + 1.0f / 120;
    p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const mh_i32x16 e = (n + 127) << 23;
    v16 scale;
    __builtin_memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* one value of storage dtype kind at p[i], as fp32 */
static inline float mh_get(const void *p, int64_t i, int kind) {
    if (kind == MH_BF16) {
        const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        __builtin_memcpy(&f, &u, sizeof f);
        return f;
    }
#if MH_HAS_F16
    if (kind == MH_F16) return mh_h2f(((const uint16_t *)p)[i]);
#endif
    return ((const float *)p)[i];
}

/* the attention of the G query heads q (G, D) fp32 sharing one kv head over its cached keys and values
 * 0..L-1 (K, V (L, D) of cache kind ckind; per-position scales ks, vs for MH_I8, else NULL) into out (G, D)
 * fp32; scratch scores (G, L) (attend.c) */
void mh_attend(const float *q, const void *K, const void *V, const float *ks, const float *vs, int64_t L,
               int64_t D, int64_t G, float scale, int ckind, float *out, float *scores);

/* int8 products (gemv_q8.c, gemm_q8.c): activations quantized in blocks of MH_Q8_BLOCK values
 * (q8_rows.c); weight rows in one of three layouts (q8_rows.c: in column order, blocked, packed with their
 * scales), each function's "blocked" argument the layout */
#define MH_Q8_BLOCK 32
enum { MH_Q8_COLUMNS = 0, MH_Q8_BLOCKED = 1, MH_Q8_PACKED = 2 };
#define MH_Q8_CHUNK_BYTES 576 /* a packed row's 512 weights and their 16 scales */
void mh_quantize_q8(const void *x, int kind, int64_t n, int8_t *xq, float *xs);
int64_t mh_q8_row_bytes(int64_t cols, int layout);
/* 0, -1 without scratch memory, -2: the blocked or packed layout in a build without AVX512-VNNI, or packed
 * rows whose groups are not 32 wide or that are 32 columns or fewer */
int mh_gemv_q8(const int8_t *w, const float *ws, const int8_t *xq, const float *xs, const float *b, float *y,
               int64_t rows, int64_t cols, int64_t ldw, int64_t G, int blocked);
int mh_q8_blocked(void); /* whether this build reads the blocked layout */
/* Y (n, rows) = X W8^T + b for n fp32 rows X (n, cols); 0, -1 without scratch memory, -2 as mh_gemv_q8 */
int mh_gemm_q8(const int8_t *w, const float *ws, const float *x, const float *b, float *y, int64_t n, int64_t rows,
               int64_t cols, int64_t ldw, int64_t G, int blocked);
void mh_dequantize_row_q8(const int8_t *q, const float *s, int64_t d, int64_t G, int layout, float *out);
/* GGUF's blocks (gemv_q4.c, gemv_qk.c, gguf_dequant.c): a layer's weights in ggml block type T (2 Q4_0,
 * 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K) have layout MH_GG_LAYOUT + T (mh_layer_args.blocked; their s[p] any non-NULL pointer), fp32
 * activations */
#define MH_GG_LAYOUT 16
int64_t mh_gguf_block_bytes(int type); /* 0: a type without a kernel */
int64_t mh_gguf_block_weights(int type); /* 32, 256 (Q4_K, Q6_K), 0: a type without a kernel */
int64_t mh_gguf_row_bytes(int type, int64_t cols);
int mh_gemm_gguf(int type, const uint8_t *w, int64_t ldw, const float *x, const float *b, float *y, int64_t n,
                 int64_t rows, int64_t cols);
int mh_gemv_gguf_team(int type, const uint8_t *w, int64_t ldw, const float *x, float *y, int64_t rows, int64_t cols);
int mh_dequantize_row_gguf(int type, const uint8_t *row, int64_t cols, float *out);
/* mh_gemv_q8's scratch: each lane's start, x in the blocked order, the blocks' starts */
#define MH_Q8_SCRATCH(cols) (3 * (((cols) + 63) & ~(int64_t)63) + 64)
/* the same with the caller's scratch: MH_Q8_SCRATCH(cols) bytes aligned to 64; fails only as -2 above */
int mh_gemv_q8_into(const int8_t *w, const float *ws, const int8_t *xq, const float *xs, const float *b,
                    float *y, int64_t rows, int64_t cols, int64_t ldw, int64_t G, int blocked, void *scratch);

void mh_gemv_f32(const float *w, const float *x, const float *b, float *y, int64_t rows, int64_t cols,
                 int64_t ldw);
void mh_gemv_bf16(const uint16_t *w, const uint16_t *x, const uint16_t *b, uint16_t *y, int64_t rows,
                  int64_t cols, int64_t ldw);
/* fp16 W, x, bias, y as their 16-bit patterns; a no-op without MH_HAS_F16 */
void mh_gemv_f16(const uint16_t *w, const uint16_t *x, const uint16_t *b, uint16_t *y, int64_t rows,
                 int64_t cols, int64_t ldw);
/* the GEMVs (mh_gemv_f32, _bf16, _f16, mh_gemv_q8_into) on a step's team: called by every thread of it
 * (mh_team_spans set), each taking its share of the rows; no barrier at the end (decode_team.c) */
void mh_gemv_f32_team(const float *w, const float *x, const float *b, float *y, int64_t rows, int64_t cols,
                      int64_t ldw);
void mh_gemv_bf16_team(const uint16_t *w, const uint16_t *x, const uint16_t *b, uint16_t *y, int64_t rows,
                       int64_t cols, int64_t ldw);
void mh_gemv_f16_team(const uint16_t *w, const uint16_t *x, const uint16_t *b, uint16_t *y, int64_t rows,
                      int64_t cols, int64_t ldw);
int mh_gemv_q8_team(const int8_t *w, const float *ws, const int8_t *xq, const float *xs, const float *b,
                    float *y, int64_t rows, int64_t cols, int64_t ldw, int64_t G, int blocked, void *scratch);
/* Y (n, rows) = X W^T + b for n rows X (n, cols) of kind, each row as its one-row kernel gives it; 0 or -2
 * (gemv_rows.c) */
int mh_gemv_rows(int kind, const void *w, const void *x, const void *b, void *y, int64_t n, int64_t rows,
                 int64_t cols, int64_t ldw);
void mh_rms_norm(const void *x, const void *g, void *out, int64_t d, float eps, int kind);

/* The fixed arguments of one layer of a decode step (decode_layer.c, mh_decode_layers): the norms' gains,
 * the five weights (qkv, o, w1, w3, w2) and, for int8 ones, their group scales (NULL: a weight of the
 * storage dtype), the layer's cache (k_scale, v_scale NULL: a cache of the storage dtype) and its shape.
 * ctypes mirrors this layout (multihead.native.LayerArgs). */
typedef struct {
    const void *g_attn, *g_ffn;
    const void *w[5];
    const float *s[5];
    void *k_cache, *v_cache;
    float *k_scale, *v_scale;
    int64_t group, k_head_stride, v_head_stride, s_head_stride;
    int64_t d, Hq, Hkv, D, F;
    float eps, scale;
    int32_t blocked, interleaved, kind;
    int32_t gg_types; /* blocked >= MH_GG_LAYOUT: 4 bits p the ggml type of weight p (qkv, o, w1, w3, w2); 0: all of blocked's */
} mh_layer_args;

/* every layer of one decode step and the final norm (decode_layer.c): of B rows, of one */
int mh_decode_batch(void *x, const mh_layer_args *a, int64_t n, int64_t pos, const float *const *cos,
                    const float *const *sin, const void *g_final, float eps_final, void *out, int64_t *done,
                    int64_t B, int32_t seq);
int mh_decode_layers(void *x, const mh_layer_args *a, int64_t n, int64_t pos, const float *const *cos,
                     const float *const *sin, const void *g_final, float eps_final, void *out, int64_t *done);

#endif
