/* The engine's CPU kernels: fused steps of one layer that torch's CPU operators run as several
 * passes over memory. Each is the counterpart of a torch expression in flare/engine/model.py,
 * which runs where this library was not built; tests/engine/test_native.py holds them equal.
 *
 * The kernels trust their arguments: flare/engine/native.py checks the tensors behind every
 * pointer (device, dtype, shape, strides) and module.c checks every index into the KV pool. */
#ifndef FLARE_KERNELS_H
#define FLARE_KERNELS_H

#include <stdint.h>
#include <string.h>

/* Compile the hot loops for AVX2 + FMA where the CPU has them and generic x86-64 elsewhere: the
 * loader picks the clone at run time, so one build runs on any x86-64 machine. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLARE_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FLARE_TARGET_CLONES
#endif

/* exp(x) for x <= 0, to about 2 ulp, in a form compilers vectorise (libm's expf is a scalar
 * call, slower than everything else these kernels do). Cody-Waite range reduction
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the polynomial of Cephes' expf (S. L. Moshier),
 * 2^n by writing the float's exponent bits. Below -87.3 the result would be denormal; it is
 * clamped there (e^-87.3 ~ 1e-38). NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    /* n = x / ln2 rounded to the nearest integer by adding and subtracting 1.5 * 2^23 (exact for
     * |x / ln2| < 2^22): plain adds, where floorf needs SSE4.1 and is a libm call per element in
     * code compiled for baseline x86-64, as OpenMP's outlined loop bodies are. */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* Paged attention of short rows: see paged_attention.c. */
typedef struct {
    const float *q;            /* [tokens, heads, head_dim]; tokens `q_token_stride` floats apart */
    int64_t q_token_stride;
    const float *keys;         /* [kv_heads, num_blocks * block_size, head_dim] */
    const float *values;
    float *out;                /* [tokens, heads, head_dim], contiguous */
    const int64_t *block_table;     /* [rows, max_blocks] */
    const int64_t *start_positions; /* [rows]: position of each row's first new token */
    int64_t rows, query_len, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks;
    float scale;
} Attention;

/* Returns 0, or -1 when scratch memory could not be allocated (nothing was written then). */
int paged_attention(const Attention *a, int64_t longest_row, int threads);

/* RoPE on q and k and the write of k and v into the KV pool: see rope_cache.c. */
typedef struct {
    /* A linear layer's output, channel c of token t at qkv[c * channel_stride + t * token_stride]:
     * columns (channel_stride = tokens, token_stride = 1) or rows (1, channels). */
    const float *qkv;
    int64_t channel_stride, token_stride;
    const int64_t *positions;  /* [tokens] */
    const int64_t *slots;      /* [tokens]: pool slot (block * block_size + offset) of each token */
    const float *cos, *sin;    /* [max_positions, head_dim / 2] */
    int64_t max_positions;
    float *q_out;              /* [tokens, heads, head_dim] */
    float *keys, *values;      /* [kv_heads, pool_slots, head_dim] */
    int64_t tokens, heads, kv_heads, head_dim, pool_slots;
} RopeCache;

void rope_and_cache(const RopeCache *r, int threads);

/* SwiGLU from a gate/up linear layer's output (channel c of token t at
 * gate_up[c * channel_stride + t * token_stride]) to the rows the down projection reads: see
 * swiglu.c. Returns 0, or -1 when scratch memory could not be allocated. */
int swiglu_rows(const float *gate_up, int64_t channel_stride, int64_t token_stride, float *out, int64_t intermediate,
                int64_t tokens, int threads);

/* The residual add and the RMSNorm after it: see rms_norm.c. */
typedef struct {
    float *h;                  /* [tokens, hidden], contiguous: the residual stream, updated in place */
    const float *delta;        /* NULL, or delta[t * delta_token_stride + i * delta_channel_stride] */
    int64_t delta_token_stride, delta_channel_stride;
    const float *weight;       /* [hidden] */
    float *out;                /* [tokens, hidden], contiguous */
    int64_t tokens, hidden;
    float eps;
} AddRmsNorm;

void add_rms_norm(const AddRmsNorm *n, int threads);

#endif
