/* Paged attention of short rows (decode and verify rows) on the CPU, reading keys and values
 * straight from the paged KV pool.
 *
 * The torch path (flare/engine/model.py) first gathers each row's blocks into a contiguous
 * buffer and then runs SDPA on it: every cached key and value is read, written and read again,
 * and for a handful of queries per row that copy costs as much as the attention itself. Here
 * each (row, KV head) pair is one task that walks its block table once:
 *
 *   s_ik = scale * q_i . k_k                       for every query i of the task and key k
 *   p_ik = exp(s_ik - m_i) / sum_k' exp(s_ik' - m_i),   m_i = max_k s_ik   (softmax, stabilised)
 *   out_i = sum_k p_ik v_k
 *
 * where query i sees keys 0 .. start + t_i (causal: t_i is its offset among the row's new
 * tokens). The `group` query heads that share a KV head are handled by the same task, so each
 * key and value is loaded once for all of them (grouped-query attention without repeating K/V).
 *
 * exp is evaluated by `exp_nonpositive` (every argument is s - max <= 0), a vectorisable
 * polynomial rather than libm's scalar expf, which alone would cost more than the whole kernel.
 * Sums are reassociated (`omp simd reduction`), so results agree with SDPA to float32 rounding,
 * not bit for bit. NaN in q, k or v propagates to the output, as it does through SDPA, so the
 * sampler still reports NONFINITE_LOGITS for the row.
 *
 * A float16 or bfloat16 pool is read a block at a time: the block's keys (or values) are widened
 * into float32 scratch once per task and the same float32 code runs on them; this costs little
 * beside the dot products and halves the bytes read from memory, which is what bounds attention
 * over long contexts.
 *
 * module.c checks every block id and position against the pool before the call.
 */
#include <float.h>
#include <stdlib.h>

#include "kernels.h"

/* Block `block` of one KV head's pool as floats: the pool itself when it is float32, else its
 * `n` elements widened into `scratch`. */
static inline const float *block_floats(const void *head, int dtype, int64_t block, int64_t n, float *scratch) {
    if (dtype == KV_FLOAT32) return (const float *)head + block * n;
    const uint16_t *src = (const uint16_t *)head + block * n;
    if (dtype == KV_FLOAT16) {
        for (int64_t i = 0; i < n; i++) scratch[i] = float_from_half(src[i]);
    } else {
        for (int64_t i = 0; i < n; i++) scratch[i] = float_from_bfloat16(src[i]);
    }
    return scratch;
}

/* One task: row `r`, KV head `g`. Scratch: `scores` holds group * query_len * keys floats,
 * `acc` group * query_len * head_dim, `queries` and `visible` group * query_len entries,
 * `widened` block_size * head_dim floats. */
FLARE_TARGET_CLONES
static void attend(const Attention *a, int64_t r, int64_t g, float *scores, float *acc, const float **queries,
                   int64_t *visible, float *widened) {
    const int64_t D = a->head_dim, Q = a->query_len, B = a->block_size;
    const int64_t group = a->heads / a->kv_heads, nq = group * Q;
    const int64_t start = a->start_positions[r], keys = start + Q;
    const int64_t *table = a->block_table + r * a->max_blocks;
    const int64_t head_bytes = a->num_blocks * B * D * kv_element_size(a->kv_dtype);
    const void *key_head = (const char *)a->keys + g * head_bytes;
    const void *value_head = (const char *)a->values + g * head_bytes;

    /* Query i is head g * group + j of token t (i = j * Q + t); it sees keys 0 .. start + t. */
    for (int64_t j = 0; j < group; j++) {
        for (int64_t t = 0; t < Q; t++) {
            queries[j * Q + t] = a->q + (r * Q + t) * a->q_token_stride + (g * group + j) * D;
            visible[j * Q + t] = start + t + 1;
        }
    }
    /* Scores of every query against every key of the row, a block at a time (the causally
     * hidden ones too: they are only the last Q - 1, and the softmax skips them). Four keys
     * at a time: one dot product is a chain of dependent multiply-adds, four are independent
     * chains the CPU overlaps (30 layers of 32 rows with the pool in cache: 12.4 -> 9.7 ms). */
    for (int64_t first = 0; first < keys; first += B) {
        const float *block = block_floats(key_head, a->kv_dtype, table[first / B], B * D, widened);
        const int64_t in_block = keys - first < B ? keys - first : B;
        for (int64_t i = 0; i < nq; i++) {
            const float *q = queries[i];
            float *out = scores + i * keys + first;
            int64_t p = 0;
            for (; p + 4 <= in_block; p += 4) {
                const float *k0 = block + p * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t d = 0; d < D; d++) {
                    s0 += q[d] * k0[d];
                    s1 += q[d] * k1[d];
                    s2 += q[d] * k2[d];
                    s3 += q[d] * k3[d];
                }
                out[p] = s0 * a->scale;
                out[p + 1] = s1 * a->scale;
                out[p + 2] = s2 * a->scale;
                out[p + 3] = s3 * a->scale;
            }
            for (; p < in_block; p++) {
                const float *k = block + p * D;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += q[d] * k[d];
                out[p] = s * a->scale;
            }
        }
    }
    /* Softmax of each query over the keys it sees. */
    for (int64_t i = 0; i < nq; i++) {
        float *s = scores + i * keys;
        const int64_t n = visible[i];
        float m = -FLT_MAX;
        for (int64_t p = 0; p < n; p++) m = s[p] > m ? s[p] : m;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t p = 0; p < n; p++) {
            s[p] = exp_nonpositive(s[p] - m);
            total += s[p];
        }
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t p = 0; p < n; p++) s[p] *= inverse;
    }
    /* Weighted sum of the values, a block at a time, four values per pass over a query's
     * accumulator (a quarter of its loads and stores). Weights past a query's last visible
     * key are zeroed, so every key of the block can be summed. */
    memset(acc, 0, (size_t)(nq * D) * sizeof(float));
    for (int64_t first = 0; first < keys; first += B) {
        const float *block = block_floats(value_head, a->kv_dtype, table[first / B], B * D, widened);
        const int64_t in_block = keys - first < B ? keys - first : B;
        for (int64_t i = 0; i < nq; i++) {
            float *w = scores + i * keys + first;
            for (int64_t p = visible[i] > first ? visible[i] - first : 0; p < in_block; p++) w[p] = 0.0f;
            float *o = acc + i * D;
            int64_t p = 0;
            for (; p + 4 <= in_block; p += 4) {
                const float *v0 = block + p * D, *v1 = v0 + D, *v2 = v1 + D, *v3 = v2 + D;
                const float w0 = w[p], w1 = w[p + 1], w2 = w[p + 2], w3 = w[p + 3];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
            }
            for (; p < in_block; p++) {
                const float *v = block + p * D;
                const float wp = w[p];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) o[d] += wp * v[d];
            }
        }
    }
    for (int64_t j = 0; j < group; j++) {
        for (int64_t t = 0; t < Q; t++) {
            float *o = a->out + ((r * Q + t) * a->heads + g * group + j) * D;
            memcpy(o, acc + (j * Q + t) * D, (size_t)D * sizeof(float));
        }
    }
}

int paged_attention(const Attention *a, int64_t longest_row, int threads) {
    const int64_t nq = a->heads / a->kv_heads * a->query_len;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc((size_t)(nq * longest_row) * sizeof(float));
        float *acc = malloc((size_t)(nq * a->head_dim) * sizeof(float));
        const float **queries = malloc((size_t)nq * sizeof(float *));
        int64_t *visible = malloc((size_t)nq * sizeof(int64_t));
        float *widened = malloc((size_t)(a->block_size * a->head_dim) * sizeof(float));
        const int ready = scores && acc && queries && visible && widened;
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
        /* Rows differ in length, so tasks are handed out as threads come free. */
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < a->rows * a->kv_heads; task++) {
            if (ready) attend(a, task / a->kv_heads, task % a->kv_heads, scores, acc, queries, visible, widened);
        }
        free(scores);
        free(acc);
        free(queries);
        free(visible);
        free(widened);
    }
    return failed ? -1 : 0;
}
