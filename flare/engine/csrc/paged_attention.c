/* Paged attention of short rows (decode and verify rows) on the CPU, reading keys and values
 * straight from the paged KV pool.
 *
 * The torch path (flare/engine/layers/attention.py) first gathers each row's blocks into a contiguous
 * buffer and then runs SDPA on it: every cached key and value is read, written and read again,
 * and for a handful of queries per row that copy costs as much as the attention itself. Here
 * each (row, KV head) pair is one task that walks its block table once:
 *
 *   s_ik = scale * q_i . k_k                       for every query i of the task and key k
 *   p_ik = exp(s_ik - m_i) / sum_k' exp(s_ik' - m_i),   m_i = max_k s_ik   (softmax, stabilised)
 *   out_i = sum_k p_ik v_k
 *
 * where query i sees keys 0 .. start + t_i (causal: t_i is its offset among the row's new
 * tokens). A sliding-window layer's query sees only the last `window` of them, keys k with
 * start + t_i - window < k <= start + t_i (Mistral, Gemma's local layers): the task reads the
 * blocks from the one holding its first query's first key, and each query's softmax and
 * weighted sum run over its own keys. A soft-capped layer's scores (Gemma 2) become
 * softcap * tanh(s / softcap) after the scale and before the softmax (`tanh_float`). A layer with
 * attention sinks (gpt-oss) has one learned logit z_h per query head that joins the softmax's
 * denominator and carries no value:
 *
 *   m_i = max(z_h, max_k s_ik),   p_ik = exp(s_ik - m_i) / (exp(z_h - m_i) + sum_k' exp(s_ik' - m_i))
 *
 * so a head can put weight on "nothing" and its output shrinks towards zero.
 *
 * Values may be narrower than the keys (`value_dim`): each value is then the first value_dim
 * numbers of its pool row, which is how latent attention's absorbed form reads its one pool
 * (flare/engine/layers/latent_attention.py: keys [latent | rope key], values the latent).
 *
 * The `group` query heads that share a KV head are handled by the same task, so each key and
 * value is loaded once for all of them (grouped-query attention without repeating K/V).
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
 * On x86 CPUs with AVX2 and FMA (and a head_dim that is a multiple of 32) both products run in
 * register tiles: scores for three queries by four keys with one horizontal reduction per four
 * dot products, the weighted sum for three queries by 32 dimensions with each value vector
 * loaded once for the three. The portable loops run elsewhere, and when asked (`portable`, for
 * the tests).
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

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define ATTENTION_TARGET __attribute__((target("avx2,fma")))

/* The four sums of a, b, c and d's lanes, in that order: the horizontal adds of four dot
 * products at once (a third of the instructions of four separate reductions). */
static inline __attribute__((always_inline)) ATTENTION_TARGET __m128 sums_of_four(__m256 a, __m256 b, __m256 c,
                                                                                  __m256 d) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

/* scale * q_i . k_p for MQ queries and the keys p .. p + 4 * KS of a block (KS groups of four;
 * keys past `n` repeat the last one and are not stored): MQ * 4 * KS independent chains of
 * multiply-adds, each key and query vector loaded once per tile. */
static inline __attribute__((always_inline)) ATTENTION_TARGET void score_tile(const float *const *q, const float *block,
                                                                              int64_t p, int64_t n, int64_t D,
                                                                              float scale, float *out, int64_t stride,
                                                                              const int MQ, const int KS) {
    const float *k[8];
    for (int j = 0; j < 4 * KS; j++) k[j] = block + (p + j < n ? p + j : n - 1) * D;
    __m256 acc[3][8];
#pragma GCC unroll 8
    for (int i = 0; i < MQ; i++)
#pragma GCC unroll 8
        for (int j = 0; j < 4 * KS; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 kv[8];
#pragma GCC unroll 8
        for (int j = 0; j < 4 * KS; j++) kv[j] = _mm256_loadu_ps(k[j] + d);
#pragma GCC unroll 8
        for (int i = 0; i < MQ; i++) {
            const __m256 qv = _mm256_loadu_ps(q[i] + d);
#pragma GCC unroll 8
            for (int j = 0; j < 4 * KS; j++) acc[i][j] = _mm256_fmadd_ps(qv, kv[j], acc[i][j]);
        }
    }
    const __m128 factor = _mm_set1_ps(scale);
    float sums[3][8];
#pragma GCC unroll 8
    for (int i = 0; i < MQ; i++)
#pragma GCC unroll 8
        for (int j = 0; j < KS; j++)
            _mm_storeu_ps(sums[i] + 4 * j, _mm_mul_ps(factor, sums_of_four(acc[i][4 * j], acc[i][4 * j + 1],
                                                                            acc[i][4 * j + 2], acc[i][4 * j + 3])));
    const int64_t valid = n - p < 4 * KS ? n - p : 4 * KS;
    for (int i = 0; i < MQ; i++)
        for (int64_t j = 0; j < valid; j++) out[i * stride + p + j] = sums[i][j];
}

/* Scores of `nq` queries against the n keys of one block into scores[i * stride + 0 .. n): tiles of three
 * queries by four keys (a lone query takes eight keys, or its four chains would wait on the
 * multiply-add latency). D must be a multiple of 8. */
static ATTENTION_TARGET void block_scores_avx2(const float *const *queries, int64_t nq, const float *block, int64_t n,
                                               int64_t D, float scale, float *scores, int64_t stride) {
    for (int64_t i = 0; i < nq; i += 3) {
        const int64_t mq = nq - i < 3 ? nq - i : 3;
        for (int64_t p = 0; p < n; p += mq == 1 ? 8 : 4) {
            if (mq == 3)
                score_tile(queries + i, block, p, n, D, scale, scores + i * stride, stride, 3, 1);
            else if (mq == 2)
                score_tile(queries + i, block, p, n, D, scale, scores + i * stride, stride, 2, 1);
            else
                score_tile(queries + i, block, p, n, D, scale, scores + i * stride, stride, 1, 2);
        }
    }
}

/* acc_i += sum_p w_i[p] v_p for MQ queries over one block's n values (rows D floats apart, the
 * accumulators Dv), 32 dimensions (four vectors) at a time: each value vector is loaded once for
 * the MQ queries. */
static inline __attribute__((always_inline)) ATTENTION_TARGET void value_tile(const float *w, int64_t stride,
                                                                              const float *block, int64_t n, int64_t D,
                                                                              int64_t Dv, int64_t dim, float *acc, const int MQ) {
    __m256 o[3][4];
#pragma GCC unroll 4
    for (int i = 0; i < MQ; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) o[i][j] = _mm256_loadu_ps(acc + i * Dv + dim + 8 * j);
    for (int64_t p = 0; p < n; p++) {
        __m256 v[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(block + p * D + dim + 8 * j);
#pragma GCC unroll 4
        for (int i = 0; i < MQ; i++) {
            const __m256 weight = _mm256_broadcast_ss(w + i * stride + p);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) o[i][j] = _mm256_fmadd_ps(weight, v[j], o[i][j]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < MQ; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + i * Dv + dim + 8 * j, o[i][j]);
}

/* The weighted sum of one block's values, weights[i * stride + 0 .. n), into the accumulators
 * acc[i * Dv ..] of `nq` queries: each value the first Dv of its row of D. Dv must be a multiple
 * of 32. */
static ATTENTION_TARGET void block_values_avx2(const float *weights, int64_t stride, int64_t nq, const float *block,
                                               int64_t n, int64_t D, int64_t Dv, float *acc) {
    for (int64_t i = 0; i < nq; i += 3) {
        const int64_t mq = nq - i < 3 ? nq - i : 3;
        for (int64_t dim = 0; dim < Dv; dim += 32) {
            if (mq == 3)
                value_tile(weights + i * stride, stride, block, n, D, Dv, dim, acc + i * Dv, 3);
            else if (mq == 2)
                value_tile(weights + i * stride, stride, block, n, D, Dv, dim, acc + i * Dv, 2);
            else
                value_tile(weights + i * stride, stride, block, n, D, Dv, dim, acc + i * Dv, 1);
        }
    }
}
#endif

/* Ask for block `block` of a head's pool (n elements) to be brought into cache. A task walks
 * blocks scattered over the pool, each a few kilobytes the hardware prefetcher only picks up
 * after a miss or two, and a round streams the weights through the cache between layers, so the
 * next block is fetched while this one is computed. */
static inline void prefetch_block(const void *head, int dtype, int64_t block, int64_t n) {
    const char *start = (const char *)head + block * n * kv_element_size(dtype);
    for (int64_t byte = 0; byte < n * kv_element_size(dtype); byte += 64) __builtin_prefetch(start + byte);
}

/* One task: row `r`, KV head `g`, its queries i0 .. i1 (of the group * query_len that share the KV
 * head; each query's result is its own whatever others share the task). Scratch: `scores` holds
 * group * query_len * keys floats, `acc` group * query_len * head_dim, `queries` group *
 * query_len entries and `visible` twice that (each query's end of keys, then its first key),
 * `widened` block_size * head_dim floats. */
FLARE_TARGET_CLONES
static void attend(const Attention *a, int64_t r, int64_t g, int64_t i0, int64_t i1, float *scores, float *acc,
                   const float **queries, int64_t *visible, float *widened, int vector) {
    const int64_t D = a->head_dim, Dv = a->value_dim ? a->value_dim : D, Q = a->query_len, B = a->block_size;
    const int64_t group = a->heads / a->kv_heads, nq = group * Q;
    const int64_t start = a->start_positions[r], keys = start + Q;
    const int64_t *table = a->block_table + r * a->max_blocks;
    const int64_t head_bytes = a->num_blocks * B * D * kv_element_size(a->kv_dtype);
    const void *key_head = (const char *)a->keys + g * head_bytes;
    const void *value_head = (const char *)a->values + g * head_bytes;

    /* Query i is head g * group + j of token t (i = j * Q + t); it sees keys seen_from[i] ..
     * start + t. Scores are kept from key `base` on (the first key of the first block any of
     * the task's queries sees): query i's score of key k at scores[i * span + k - base]. */
    int64_t *seen_from = visible + nq;
    const int64_t W = a->window, base = W && start - W + 1 > 0 ? (start - W + 1) / B * B : 0, span = keys - base;
    for (int64_t j = 0; j < group; j++) {
        for (int64_t t = 0; t < Q; t++) {
            queries[j * Q + t] = a->q + (r * Q + t) * a->q_token_stride + (g * group + j) * D;
            visible[j * Q + t] = start + t + 1;
            seen_from[j * Q + t] = W && start + t - W + 1 > 0 ? start + t - W + 1 : 0;
        }
    }
    /* Scores of every query against every key of the row, a block at a time (the causally
     * hidden ones too: they are only the last Q - 1, and the softmax skips them). Four keys
     * at a time: one dot product is a chain of dependent multiply-adds, four are independent
     * chains the CPU overlaps. */
    for (int64_t first = base; first < keys; first += B) {
        if (first + B < keys) prefetch_block(key_head, a->kv_dtype, table[first / B + 1], B * D);
        else prefetch_block(value_head, a->kv_dtype, table[base / B], B * D);
        const float *block = block_floats(key_head, a->kv_dtype, table[first / B], B * D, widened);
        const int64_t in_block = keys - first < B ? keys - first : B;
#if defined(__x86_64__) && defined(__GNUC__)
        if (vector) {
            block_scores_avx2(queries + i0, i1 - i0, block, in_block, D, a->scale, scores + i0 * span + first - base, span);
            continue;
        }
#endif
        for (int64_t i = i0; i < i1; i++) {
            const float *q = queries[i];
            float *out = scores + i * span + first - base;
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
    /* Softmax of each query over the keys it sees (soft-capped first where the layer caps). */
    for (int64_t i = i0; i < i1; i++) {
        float *s = scores + i * span;
        const int64_t from = seen_from[i] - base, n = visible[i] - base;
        if (a->softcap > 0.0f) {
            const float cap = a->softcap, inverse_cap = 1.0f / a->softcap;
#pragma omp simd
            for (int64_t p = from; p < n; p++) s[p] = cap * tanh_float(s[p] * inverse_cap);
        }
        /* Query i is of head g * group + i / Q (its sink's). */
        const float sink = a->sinks ? a->sinks[g * group + i / Q] : -FLT_MAX;
        float m = sink;
        /* Vectorised: as a scalar loop each step waited on the last (vmaxss's latency), which cost
         * a verify row's attention more than its dot products. The maximum is the same whatever
         * the order (a NaN score is never taken, as vmaxps's operand order keeps it). */
#pragma omp simd reduction(max : m)
        for (int64_t p = from; p < n; p++) m = s[p] > m ? s[p] : m;
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t p = from; p < n; p++) {
            s[p] = exp_nonpositive(s[p] - m);
            total += s[p];
        }
        if (a->sinks) total += exp_nonpositive(sink - m);
        const float inverse = 1.0f / total;
#pragma omp simd
        for (int64_t p = from; p < n; p++) s[p] *= inverse;
    }
    /* Weighted sum of the values, a block at a time, four values per pass over a query's
     * accumulator (a quarter of its loads and stores). Weights outside a query's visible
     * keys (past its last, or before its window) are zeroed, so every key of the block can be
     * summed. */
    memset(acc + i0 * Dv, 0, (size_t)((i1 - i0) * Dv) * sizeof(float));
    for (int64_t first = base; first < keys; first += B) {
        if (first + B < keys) prefetch_block(value_head, a->kv_dtype, table[first / B + 1], B * D);
        const float *block = block_floats(value_head, a->kv_dtype, table[first / B], B * D, widened);
        const int64_t in_block = keys - first < B ? keys - first : B;
        for (int64_t i = i0; i < i1; i++) {
            float *w = scores + i * span + first - base;
            for (int64_t p = visible[i] > first ? visible[i] - first : 0; p < in_block; p++) w[p] = 0.0f;
            for (int64_t p = 0; p < seen_from[i] - first && p < in_block; p++) w[p] = 0.0f;
        }
#if defined(__x86_64__) && defined(__GNUC__)
        if (vector) {
            block_values_avx2(scores + i0 * span + first - base, span, i1 - i0, block, in_block, D, Dv, acc + i0 * Dv);
            continue;
        }
#endif
        for (int64_t i = i0; i < i1; i++) {
            const float *w = scores + i * span + first - base;
            float *o = acc + i * Dv;
            int64_t p = 0;
            for (; p + 4 <= in_block; p += 4) {
                const float *v0 = block + p * D, *v1 = v0 + D, *v2 = v1 + D, *v3 = v2 + D;
                const float w0 = w[p], w1 = w[p + 1], w2 = w[p + 2], w3 = w[p + 3];
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) o[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
            }
            for (; p < in_block; p++) {
                const float *v = block + p * D;
                const float wp = w[p];
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) o[d] += wp * v[d];
            }
        }
    }
    for (int64_t i = i0; i < i1; i++) { /* query i is head j = i / Q of the group at token t = i % Q */
        float *o = a->out + ((r * Q + i % Q) * a->heads + g * group + i / Q) * Dv;
        memcpy(o, acc + i * Dv, (size_t)Dv * sizeof(float));
    }
}

int paged_attention(const Attention *a, int64_t longest_row, int threads) {
    const int64_t nq = a->heads / a->kv_heads * a->query_len, pairs = a->rows * a->kv_heads;
    /* Few (row, KV head) pairs, as in one verify row (3 pairs of 15 queries on 2 threads), left a
     * thread idle for a whole pair's time, long enough to fall asleep, and the region after it
     * then paid a wake-up (flare/engine/openmp.py). Such pairs split their queries into chunks
     * (whole 3-query score tiles) so that there are about 4 tasks a thread; each chunk reads the
     * pair's keys and values again, from cache. */
    int64_t size = nq;
    if (pairs < 4 * threads) {
        const int64_t wanted = (4 * threads + pairs - 1) / pairs;
        size = (nq + wanted - 1) / wanted;
        size = (size + 2) / 3 * 3;
    }
    const int64_t chunks = (nq + size - 1) / size;
    int failed = 0, vector = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    vector = !a->portable && a->head_dim % 32 == 0 && a->value_dim % 32 == 0 && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma");
#endif
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc((size_t)(nq * longest_row) * sizeof(float));
        float *acc = malloc((size_t)(nq * a->head_dim) * sizeof(float));
        const float **queries = malloc((size_t)nq * sizeof(float *));
        int64_t *visible = malloc((size_t)(2 * nq) * sizeof(int64_t));
        float *widened = malloc((size_t)(a->block_size * a->head_dim) * sizeof(float));
        const int ready = scores && acc && queries && visible && widened;
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
        /* Rows differ in length, so tasks are handed out as threads come free. */
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < pairs * chunks; task++) {
            const int64_t pair = task / chunks, i0 = task % chunks * size, i1 = i0 + size < nq ? i0 + size : nq;
            if (ready) attend(a, pair / a->kv_heads, pair % a->kv_heads, i0, i1, scores, acc, queries, visible, widened, vector);
        }
        free(scores);
        free(acc);
        free(queries);
        free(visible);
        free(widened);
    }
    return failed ? -1 : 0;
}
