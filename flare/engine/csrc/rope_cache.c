/* RoPE on a layer's queries and keys, and the write of its keys and values into the KV pool,
 * in one pass over the q/k/v linear layer's output.
 *
 * The linear layer returns columns, qkv[c, t] for channel c of token t (model.py,
 * `linear_columns`, MKL's float32 product), or rows, qkv[t, c] (fbgemm's and oneDNN's packed
 * products): the kernel reads either through two strides. The torch path transposes them into
 * rows (a copy), rotates q and k (five elementwise passes and a concatenation) and copies k and
 * v into the pool (two index_copy_). Here each channel pair is read once and written once to
 * where it belongs:
 *
 *   q_out[t, h, d]         = x1 cos(p_t w_d) - x2 sin(p_t w_d)     x1 = x[h D + d], x2 = x[h D + d + D/2]
 *   q_out[t, h, d + D/2]   = x2 cos(p_t w_d) + x1 sin(p_t w_d)     (rotate-half, Hugging Face layout)
 *
 * for d < D/2, and the same rotation of the key heads written to keys[g, slot_t, :], values
 * copied to values[g, slot_t, :], both rounded to the pool's dtype (kernels.h, `kv_store`). cos and sin come from the model's tables (`rope_tables`), so
 * the angles are the torch path's bit for bit; the products may be fused into one rounding.
 *
 * Other families add steps before the rotation, all per (token, head), in Hugging Face's order:
 * the q/k/v bias (Qwen2), then RMSNorm of each q and k head over its head_dim (Qwen3, Gemma 3:
 * x * w / sqrt(mean(x^2) + eps)), then RoPE of the leading `rotary_dims` dims only (Phi-4-mini:
 * rotate-half within them, D/2 above replaced by R/2), the rest copied. A layer with any of them
 * takes `rotate_features`, one token's head at a time through a buffer of head_dim floats; a
 * Llama layer keeps the loops above.
 */
#include <math.h>

#include "kernels.h"

/* Rotate the channel pairs of the head whose channels start at qkv row `first` into
 * base[row_t * stride + ...] (elements of `dtype`), where row_t is slots[t], or t when `slots`
 * is NULL. Always inlined where `dtype` is a constant, so the stores do not test it. */
static inline __attribute__((always_inline)) void rotate_head(const RopeCache *r, int64_t first, void *base, int dtype,
                                                             const int64_t *slots, int64_t stride) {
    const int64_t T = r->tokens, half = r->head_dim / 2, cs = r->channel_stride, ts = r->token_stride;
    if (cs == 1) {
        /* Rows: a token's channels, its cos and sin and its destination are contiguous, so the
         * loop over channels vectorises (with channels outer it does not). */
        for (int64_t t = 0; t < T; t++) {
            const float *x1 = r->qkv + t * ts + first, *x2 = x1 + half;
            const float *c = r->cos + r->positions[t] * half, *s = r->sin + r->positions[t] * half;
            const int64_t o = (slots ? slots[t] : t) * stride;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                kv_store(base, o + d, x1[d] * c[d] - x2[d] * s[d], dtype);
                kv_store(base, o + d + half, x2[d] * c[d] + x1[d] * s[d], dtype);
            }
        }
        return;
    }
    for (int64_t d = 0; d < half; d++) {
        const float *x1 = r->qkv + (first + d) * cs, *x2 = r->qkv + (first + d + half) * cs;
        for (int64_t t = 0; t < T; t++) {
            const float c = r->cos[r->positions[t] * half + d], s = r->sin[r->positions[t] * half + d];
            const int64_t o = (slots ? slots[t] : t) * stride;
            kv_store(base, o + d, x1[t * ts] * c - x2[t * ts] * s, dtype);
            kv_store(base, o + d + half, x2[t * ts] * c + x1[t * ts] * s, dtype);
        }
    }
}

/* Copy the value head whose channels start at qkv row `first` into its pool rows. */
static inline __attribute__((always_inline)) void copy_head(const RopeCache *r, int64_t first, void *pool, int dtype) {
    const int64_t D = r->head_dim, T = r->tokens, cs = r->channel_stride, ts = r->token_stride;
    if (cs == 1) {
        for (int64_t t = 0; t < T; t++) {
            const float *x = r->qkv + t * ts + first;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) kv_store(pool, r->slots[t] * D + d, x[d], dtype);
        }
        return;
    }
    for (int64_t d = 0; d < D; d++) {
        const float *x = r->qkv + (first + d) * cs;
        for (int64_t t = 0; t < T; t++) kv_store(pool, r->slots[t] * D + d, x[t * ts], dtype);
    }
}

/* A key or value head into a pool of `dtype`, with the dtype a constant in each branch. */
static void cache_head(const RopeCache *r, int64_t first, void *pool, int rotate) {
    switch (r->kv_dtype) {
    case KV_FLOAT16:
        if (rotate) rotate_head(r, first, pool, KV_FLOAT16, r->slots, r->head_dim);
        else copy_head(r, first, pool, KV_FLOAT16);
        break;
    case KV_BFLOAT16:
        if (rotate) rotate_head(r, first, pool, KV_BFLOAT16, r->slots, r->head_dim);
        else copy_head(r, first, pool, KV_BFLOAT16);
        break;
    default:
        if (rotate) rotate_head(r, first, pool, KV_FLOAT32, r->slots, r->head_dim);
        else copy_head(r, first, pool, KV_FLOAT32);
        break;
    }
}

/* n floats into a pool of `dtype` from element `offset` on, the dtype a constant in each loop. */
static inline void store_row(void *pool, int64_t offset, const float *y, int64_t n, int dtype) {
    switch (dtype) {
    case KV_FLOAT16:
#pragma omp simd
        for (int64_t d = 0; d < n; d++) kv_store(pool, offset + d, y[d], KV_FLOAT16);
        break;
    case KV_BFLOAT16:
#pragma omp simd
        for (int64_t d = 0; d < n; d++) kv_store(pool, offset + d, y[d], KV_BFLOAT16);
        break;
    default:
        memcpy((float *)pool + offset, y, (size_t)n * sizeof(float));
        break;
    }
}

/* Head `head` (q heads, then k, then v) of every token with the family features: bias, q/k
 * norm and partial rotary, into q_out or the pools. */
static void rotate_features(const RopeCache *r, int64_t head) {
    const int64_t D = r->head_dim, H = r->heads, G = r->kv_heads, half = r->rotary_dims / 2, first = head * D;
    const int64_t cs = r->channel_stride, ts = r->token_stride;
    const int is_q = head < H, is_v = head >= H + G;
    const float *norm = is_q ? r->q_norm : (is_v ? NULL : r->k_norm);
    const int64_t head_bytes = r->pool_slots * D * kv_element_size(r->kv_dtype);
    void *pool = is_q ? NULL : (char *)(is_v ? r->values : r->keys) + (head - H - (is_v ? G : 0)) * head_bytes;
    float x[D], y[D];
    for (int64_t t = 0; t < r->tokens; t++) {
        const float *src = r->qkv + first * cs + t * ts;
        if (cs == 1) { /* rows (decoder_layer's, the packed formats'): a contiguous copy */
            memcpy(x, src, (size_t)D * sizeof(float));
        } else {
            for (int64_t d = 0; d < D; d++) x[d] = src[d * cs];
        }
        if (r->bias) {
            const float *b = r->bias + first;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) x[d] += b[d];
        }
        if (norm) {
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < D; d++) sum += x[d] * x[d];
            const float scale = 1.0f / sqrtf(sum / (float)D + r->norm_eps);
#pragma omp simd
            for (int64_t d = 0; d < D; d++) x[d] = x[d] * scale * norm[d];
        }
        if (is_v) {
            memcpy(y, x, (size_t)D * sizeof(float));
        } else {
            const float *c = r->cos + r->positions[t] * half, *s = r->sin + r->positions[t] * half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                y[d] = x[d] * c[d] - x[d + half] * s[d];
                y[d + half] = x[d + half] * c[d] + x[d] * s[d];
            }
            memcpy(y + 2 * half, x + 2 * half, (size_t)(D - 2 * half) * sizeof(float));
        }
        if (is_q) {
            memcpy(r->q_out + (t * H + head) * D, y, (size_t)D * sizeof(float));
        } else {
            store_row(pool, r->slots[t] * D, y, D, r->kv_dtype);
        }
    }
}

FLARE_TARGET_CLONES
void rope_and_cache(const RopeCache *r, int threads) {
    const int64_t D = r->head_dim, T = r->tokens, H = r->heads, G = r->kv_heads;
    if (r->bias || r->q_norm || r->k_norm || r->rotary_dims != D) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= 64)
        for (int64_t head = 0; head < H + 2 * G; head++) rotate_features(r, head);
        return;
    }
    /* One task per head (query, key and value heads): a round of a few tokens is too small to
     * be worth waking a second thread for, a long prompt chunk has work for every thread. */
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= 64)
    for (int64_t head = 0; head < H + 2 * G; head++) {
        const int64_t head_bytes = r->pool_slots * D * kv_element_size(r->kv_dtype);
        if (head < H)
            rotate_head(r, head * D, r->q_out + head * D, KV_FLOAT32, NULL, H * D);
        else if (head < H + G)
            cache_head(r, head * D, (char *)r->keys + (head - H) * head_bytes, 1);
        else
            cache_head(r, head * D, (char *)r->values + (head - H - G) * head_bytes, 0);
    }
}
