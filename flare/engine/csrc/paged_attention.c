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
 * Long rows are attended a range of keys at a time (ATTENTION_KEY_RANGE positions, cut at fixed
 * places; `paged_attention` below says why). A query whose keys reach over ranges s gets from each
 * the range's own maximum m_s, l_s = sum_k exp(s_ik - m_s) and the unnormalised
 * acc_s = sum_k exp(s_ik - m_s) v_k, and `merge` joins them as split attention does
 * (FlashDecoding; the online softmax of Milakov and Gimelshein):
 *
 *   M = max(z_h, max_s m_s),   out_i = sum_s exp(m_s - M) acc_s / (exp(z_h - M) + sum_s exp(m_s - M) l_s)
 *
 * (z_h the sink, -inf without). A query whose keys lie in one range is computed whole as above.
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
 * A float16 or bfloat16 pool is widened exactly to float32 as it is read, and the same float32
 * code runs on it, so it gives the bits its float32 widening would: the register tiles widen each
 * vector as they load it (vcvtph2ps, or a 16-bit shift for bfloat16), the portable loops a block
 * at a time into scratch. Reading half the bytes, a 16-bit pool's attention over a long context
 * takes about half the time of a float32 pool's, memory being what bounds it there.
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

/* Block `block` of one KV head's pool (n elements a block), as it is stored. */
static inline const void *block_at(const void *head, int dtype, int64_t block, int64_t n) {
    return (const char *)head + block * n * kv_element_size(dtype);
}

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

#define ATTENTION_TARGET __attribute__((target("avx2,fma,f16c")))

/* Eight elements of a pool block from element i as floats: loaded as they are (float32), or
 * widened in the register (float16 by vcvtph2ps, bfloat16 by a 16-bit shift): exact either way,
 * so a 16-bit pool gives the bits its float32 widening would. */
static inline __attribute__((always_inline)) ATTENTION_TARGET __m256 load8(const void *block, int64_t i, const int dtype) {
    if (dtype == KV_FLOAT32) return _mm256_loadu_ps((const float *)block + i);
    const __m128i halves = _mm_loadu_si128((const __m128i *)((const uint16_t *)block + i));
    if (dtype == KV_FLOAT16) return _mm256_cvtph_ps(halves);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

/* The four sums of a, b, c and d's lanes, in that order: the horizontal adds of four dot
 * products at once (a third of the instructions of four separate reductions). */
static inline __attribute__((always_inline)) ATTENTION_TARGET __m128 sums_of_four(__m256 a, __m256 b, __m256 c,
                                                                                  __m256 d) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

/* scale * q_i . k_p for MQ queries and the keys p .. p + 4 * KS of a block of `dtype` (KS groups
 * of four; keys past `n` repeat the last one and are not stored): MQ * 4 * KS independent chains
 * of multiply-adds, each key and query vector loaded once per tile. */
static inline __attribute__((always_inline)) ATTENTION_TARGET void score_tile(const float *const *q, const void *block,
                                                                              const int dtype, int64_t p, int64_t n,
                                                                              int64_t D, float scale, float *out,
                                                                              int64_t stride, const int MQ, const int KS) {
    int64_t k[8];
    for (int j = 0; j < 4 * KS; j++) k[j] = (p + j < n ? p + j : n - 1) * D;
    __m256 acc[3][8];
#pragma GCC unroll 8
    for (int i = 0; i < MQ; i++)
#pragma GCC unroll 8
        for (int j = 0; j < 4 * KS; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 kv[8];
#pragma GCC unroll 8
        for (int j = 0; j < 4 * KS; j++) kv[j] = load8(block, k[j] + d, dtype);
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
static inline __attribute__((always_inline)) ATTENTION_TARGET void block_scores_of(const float *const *queries, int64_t nq,
                                                                                   const void *block, const int dtype,
                                                                                   int64_t n, int64_t D, float scale,
                                                                                   float *scores, int64_t stride) {
    for (int64_t i = 0; i < nq; i += 3) {
        const int64_t mq = nq - i < 3 ? nq - i : 3;
        for (int64_t p = 0; p < n; p += mq == 1 ? 8 : 4) {
            if (mq == 3)
                score_tile(queries + i, block, dtype, p, n, D, scale, scores + i * stride, stride, 3, 1);
            else if (mq == 2)
                score_tile(queries + i, block, dtype, p, n, D, scale, scores + i * stride, stride, 2, 1);
            else
                score_tile(queries + i, block, dtype, p, n, D, scale, scores + i * stride, stride, 1, 2);
        }
    }
}

static ATTENTION_TARGET void block_scores_avx2(const float *const *queries, int64_t nq, const void *block, int dtype,
                                               int64_t n, int64_t D, float scale, float *scores, int64_t stride) {
    if (dtype == KV_FLOAT32) block_scores_of(queries, nq, block, KV_FLOAT32, n, D, scale, scores, stride);
    else if (dtype == KV_FLOAT16) block_scores_of(queries, nq, block, KV_FLOAT16, n, D, scale, scores, stride);
    else block_scores_of(queries, nq, block, KV_BFLOAT16, n, D, scale, scores, stride);
}

/* acc_i += sum_p w_i[p] v_p for MQ queries over one block's n values of `dtype` (rows D elements
 * apart, the accumulators Dv), 32 dimensions (four vectors) at a time: each value vector is
 * loaded once for the MQ queries. */
static inline __attribute__((always_inline)) ATTENTION_TARGET void value_tile(const float *w, int64_t stride,
                                                                              const void *block, const int dtype,
                                                                              int64_t n, int64_t D, int64_t Dv,
                                                                              int64_t dim, float *acc, const int MQ) {
    __m256 o[3][4];
#pragma GCC unroll 4
    for (int i = 0; i < MQ; i++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) o[i][j] = _mm256_loadu_ps(acc + i * Dv + dim + 8 * j);
    for (int64_t p = 0; p < n; p++) {
        __m256 v[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) v[j] = load8(block, p * D + dim + 8 * j, dtype);
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
static inline __attribute__((always_inline)) ATTENTION_TARGET void block_values_of(const float *weights, int64_t stride,
                                                                                   int64_t nq, const void *block,
                                                                                   const int dtype, int64_t n, int64_t D,
                                                                                   int64_t Dv, float *acc) {
    for (int64_t i = 0; i < nq; i += 3) {
        const int64_t mq = nq - i < 3 ? nq - i : 3;
        for (int64_t dim = 0; dim < Dv; dim += 32) {
            if (mq == 3)
                value_tile(weights + i * stride, stride, block, dtype, n, D, Dv, dim, acc + i * Dv, 3);
            else if (mq == 2)
                value_tile(weights + i * stride, stride, block, dtype, n, D, Dv, dim, acc + i * Dv, 2);
            else
                value_tile(weights + i * stride, stride, block, dtype, n, D, Dv, dim, acc + i * Dv, 1);
        }
    }
}

static ATTENTION_TARGET void block_values_avx2(const float *weights, int64_t stride, int64_t nq, const void *block,
                                               int dtype, int64_t n, int64_t D, int64_t Dv, float *acc) {
    if (dtype == KV_FLOAT32) block_values_of(weights, stride, nq, block, KV_FLOAT32, n, D, Dv, acc);
    else if (dtype == KV_FLOAT16) block_values_of(weights, stride, nq, block, KV_FLOAT16, n, D, Dv, acc);
    else block_values_of(weights, stride, nq, block, KV_BFLOAT16, n, D, Dv, acc);
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

/* The first key the query at `position` sees: 0, or the first of its sliding window. */
static inline int64_t first_visible_key(int64_t position, int64_t window) {
    return window && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* Where query i of row r and KV head g leaves its partial softmax over key range `range`: m, l,
 * then the Dv unnormalised weighted sums. */
static inline float *partial_slot(const Attention *a, float *partial, int64_t r, int64_t g, int64_t range,
                                  int64_t ranges, int64_t i) {
    const int64_t Dv = a->value_dim ? a->value_dim : a->head_dim, nq = a->heads / a->kv_heads * a->query_len;
    return partial + (((r * a->kv_heads + g) * ranges + range) * nq + i) * (Dv + 2);
}

/* One task: row `r`, KV head `g`, its queries i0 .. i1 (of the group * query_len that share the KV
 * head; each query's result is its own whatever others share the task), over the keys of
 * range `range` (positions range * span_keys .. + span_keys). A query whose keys all lie in the
 * range gets its output here; one whose keys reach past it leaves its partial at `partial_slot`
 * for `merge`. Scratch: `scores` holds group * query_len * (the range's keys) floats, `acc`
 * group * query_len * value_dim,
 * `queries` group * query_len entries and `visible` twice that (each query's end of keys, then
 * its first key), `widened` block_size * head_dim floats. */
FLARE_TARGET_CLONES
static void attend(const Attention *a, int64_t r, int64_t g, int64_t i0, int64_t i1, int64_t range, int64_t span_keys,
                   int64_t ranges, float *partial, float *scores, float *acc, const float **queries, int64_t *visible,
                   float *widened, int vector) {
    const int64_t D = a->head_dim, Dv = a->value_dim ? a->value_dim : D, Q = a->query_len, B = a->block_size;
    const int64_t group = a->heads / a->kv_heads, nq = group * Q;
    const int64_t start = a->start_positions[r], keys = start + Q;
    const int64_t *table = a->block_table + r * a->max_blocks;
    const int64_t head_bytes = a->num_blocks * B * D * kv_element_size(a->kv_dtype);
    const void *key_head = (const char *)a->keys + g * head_bytes;
    const void *value_head = (const char *)a->values + g * head_bytes;
    const int64_t lo = range * span_keys, hi = lo + span_keys;

    /* Query i is head g * group + j of token t (i = j * Q + t); it sees keys seen_from[i] ..
     * start + t. Scores are kept from key `base` on (the first key of the first block any of
     * the task's queries sees): query i's score of key k at scores[i * span + k - base]. */
    int64_t *seen_from = visible + nq;
    const int64_t W = a->window, window_base = W && start - W + 1 > 0 ? (start - W + 1) / B * B : 0;
    /* The task's keys: those of its range that any of the row's queries sees (lo is a whole
     * number of blocks, as the window's first block is). */
    const int64_t base = window_base > lo ? window_base : lo, end = keys < hi ? keys : hi, span = end - base;
    if (span <= 0) return;
    for (int64_t j = 0; j < group; j++) {
        for (int64_t t = 0; t < Q; t++) {
            queries[j * Q + t] = a->q + (r * Q + t) * a->q_token_stride + (g * group + j) * D;
            visible[j * Q + t] = start + t + 1;
            seen_from[j * Q + t] = first_visible_key(start + t, W);
        }
    }
    /* Scores of every query against every key of the row, a block at a time (the causally
     * hidden ones too: they are only the last Q - 1, and the softmax skips them). Four keys
     * at a time: one dot product is a chain of dependent multiply-adds, four are independent
     * chains the CPU overlaps. */
    for (int64_t first = base; first < end; first += B) {
        if (first + B < end) prefetch_block(key_head, a->kv_dtype, table[first / B + 1], B * D);
        else prefetch_block(value_head, a->kv_dtype, table[base / B], B * D);
        const int64_t in_block = end - first < B ? end - first : B;
#if defined(__x86_64__) && defined(__GNUC__)
        if (vector) { /* the tiles widen a 16-bit block as they load it */
            block_scores_avx2(queries + i0, i1 - i0, block_at(key_head, a->kv_dtype, table[first / B], B * D), a->kv_dtype,
                              in_block, D, a->scale, scores + i0 * span + first - base, span);
            continue;
        }
#endif
        const float *block = block_floats(key_head, a->kv_dtype, table[first / B], B * D, widened);
        /* Four keys a pass, keys past the block's last standing in for it (their scores not
         * stored): every key's dot product takes the same loop, in the same place of its pass,
         * however many keys the block has, so a query's scores do not depend on how many tokens
         * its row verifies. */
        for (int64_t i = i0; i < i1; i++) {
            const float *q = queries[i];
            float *out = scores + i * span + first - base;
            for (int64_t p = 0; p < in_block; p += 4) {
                const int64_t last = in_block - 1;
                const float *k0 = block + p * D, *k1 = block + (p + 1 < last ? p + 1 : last) * D;
                const float *k2 = block + (p + 2 < last ? p + 2 : last) * D, *k3 = block + (p + 3 < last ? p + 3 : last) * D;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t d = 0; d < D; d++) {
                    s0 += q[d] * k0[d];
                    s1 += q[d] * k1[d];
                    s2 += q[d] * k2[d];
                    s3 += q[d] * k3[d];
                }
                const float sums[4] = {s0, s1, s2, s3};
                for (int64_t j = 0; j < 4 && p + j < in_block; j++) out[p + j] = sums[j] * a->scale;
            }
        }
    }
    /* Softmax of each query over the keys it sees (soft-capped first where the layer caps): whole
     * where they all lie in the range; where they reach past it, only this range's maximum m and
     * sum of exp(s - m), the weights left unnormalised for the merge. */
    for (int64_t i = i0; i < i1; i++) {
        float *s = scores + i * span;
        const int64_t from = (seen_from[i] > base ? seen_from[i] : base) - base, n = (visible[i] < end ? visible[i] : end) - base;
        if (from >= n) continue; /* none of its keys is in the range */
        const int whole = seen_from[i] >= lo && visible[i] <= hi;
        if (a->softcap > 0.0f) {
            const float cap = a->softcap, inverse_cap = 1.0f / a->softcap;
#pragma omp simd
            for (int64_t p = from; p < n; p++) s[p] = cap * tanh_float(s[p] * inverse_cap);
        }
        /* Query i is of head g * group + i / Q (its sink's, which the merge adds for the split). */
        const float sink = a->sinks && whole ? a->sinks[g * group + i / Q] : -FLT_MAX;
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
        if (!whole) {
            float *slot = partial_slot(a, partial, r, g, range, ranges, i);
            slot[0] = m, slot[1] = total;
            continue;
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
    for (int64_t first = base; first < end; first += B) {
        if (first + B < end) prefetch_block(value_head, a->kv_dtype, table[first / B + 1], B * D);
        const int64_t in_block = end - first < B ? end - first : B;
        for (int64_t i = i0; i < i1; i++) {
            float *w = scores + i * span + first - base;
            for (int64_t p = visible[i] > first ? visible[i] - first : 0; p < in_block; p++) w[p] = 0.0f;
            for (int64_t p = 0; p < seen_from[i] - first && p < in_block; p++) w[p] = 0.0f;
        }
#if defined(__x86_64__) && defined(__GNUC__)
        if (vector) {
            block_values_avx2(scores + i0 * span + first - base, span, i1 - i0,
                              block_at(value_head, a->kv_dtype, table[first / B], B * D), a->kv_dtype, in_block, D, Dv,
                              acc + i0 * Dv);
            continue;
        }
#endif
        const float *block = block_floats(value_head, a->kv_dtype, table[first / B], B * D, widened);
        /* Four values a pass, as the scores: keys past the block's last weigh 0 (times the last
         * value, which is finite), so each query sums the same terms in the same order whatever
         * the block's length. */
        for (int64_t i = i0; i < i1; i++) {
            const float *w = scores + i * span + first - base;
            float *o = acc + i * Dv;
            for (int64_t p = 0; p < in_block; p += 4) {
                const int64_t last = in_block - 1;
                const float *v0 = block + p * D, *v1 = block + (p + 1 < last ? p + 1 : last) * D;
                const float *v2 = block + (p + 2 < last ? p + 2 : last) * D, *v3 = block + (p + 3 < last ? p + 3 : last) * D;
                const float w0 = w[p], w1 = p + 1 < in_block ? w[p + 1] : 0.0f;
                const float w2 = p + 2 < in_block ? w[p + 2] : 0.0f, w3 = p + 3 < in_block ? w[p + 3] : 0.0f;
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) o[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d];
            }
        }
    }
    for (int64_t i = i0; i < i1; i++) { /* query i is head j = i / Q of the group at token t = i % Q */
        if (seen_from[i] >= end || visible[i] <= base) continue; /* none of its keys is in the range */
        float *o = seen_from[i] >= lo && visible[i] <= hi
                       ? a->out + ((r * Q + i % Q) * a->heads + g * group + i / Q) * Dv
                       : partial_slot(a, partial, r, g, range, ranges, i) + 2;
        memcpy(o, acc + i * Dv, (size_t)Dv * sizeof(float));
    }
}

/* The output of query i of row r and KV head g whose keys reach over several ranges: the ranges'
 * partial softmaxes joined (the log-sum-exp merge of split attention, as FlashDecoding's):
 *
 *   M = max(z, m_s),  L = exp(z - M) + sum_s exp(m_s - M) l_s,  out = sum_s exp(m_s - M) acc_s / L
 *
 * over its ranges s in order, z the head's sink (none: -inf). */
static void merge(const Attention *a, int64_t r, int64_t g, int64_t i, int64_t span_keys, int64_t ranges,
                  float *partial) {
    const int64_t Dv = a->value_dim ? a->value_dim : a->head_dim, Q = a->query_len;
    const int64_t group = a->heads / a->kv_heads, nq = group * Q, t = i % Q;
    const int64_t start = a->start_positions[r], W = a->window;
    const int64_t first = first_visible_key(start + t, W) / span_keys, last = (start + t) / span_keys;
    if (first == last) return; /* whole in one range: written by its task */
    const float *slots = partial_slot(a, partial, r, g, 0, ranges, i);
    const int64_t stride = nq * (Dv + 2); /* from one range's slot to the next's */
    const float sink = a->sinks ? a->sinks[g * group + i / Q] : -FLT_MAX;
    float m = sink;
    for (int64_t s = first; s <= last; s++) m = slots[s * stride] > m ? slots[s * stride] : m;
    float total = a->sinks ? exp_nonpositive(sink - m) : 0.0f;
    float *o = a->out + ((r * Q + t) * a->heads + g * group + i / Q) * Dv;
    memset(o, 0, (size_t)Dv * sizeof(float));
    for (int64_t s = first; s <= last; s++) {
        const float *slot = slots + s * stride, factor = exp_nonpositive(slot[0] - m);
        total += factor * slot[1];
#pragma omp simd
        for (int64_t d = 0; d < Dv; d++) o[d] += factor * slot[2 + d];
    }
    const float inverse = 1.0f / total;
#pragma omp simd
    for (int64_t d = 0; d < Dv; d++) o[d] *= inverse;
}

/* Keys are cut into ranges of ATTENTION_KEY_RANGE positions (rounded up to whole blocks) at fixed
 * places: 0 .. 1024, 1024 .. 2048, and so on. A query whose keys lie in one range is computed
 * whole by one task; one whose keys reach over several, range by range by as many tasks, then
 * merged (`merge`). Where the cuts fall depends on the query's own positions alone, never on the
 * row's other queries or the round's other rows, so each query's result stays its own (a verify
 * row's query and the decode row at its position agree to the bit). Over a long context this
 * spreads a row's few (row, KV head) pairs over every thread, where one thread took two pairs
 * and the other one, and a verify row's query chunks each read a range again (from cache), not
 * the whole context from memory. Ranges of 256 positions made 32 rows of 2,000 - 4,000 keys about
 * 5% slower (more tasks, more merging); of 1,024 they run level, and one row as fast. */
int paged_attention(const Attention *a, int64_t longest_row, int threads) {
    const int64_t nq = a->heads / a->kv_heads * a->query_len, pairs = a->rows * a->kv_heads;
    const int64_t Dv = a->value_dim ? a->value_dim : a->head_dim, B = a->block_size;
    const int64_t span_keys = (ATTENTION_KEY_RANGE + B - 1) / B * B, ranges = (longest_row + span_keys - 1) / span_keys;
    /* Few (row, KV head, key range) units, as in one verify row over a short context (3 pairs of
     * 15 queries on 2 threads), left a thread idle for a whole unit's time, long enough to fall
     * asleep, and the region after it then paid a wake-up (flare/engine/openmp.py). Such units
     * split their queries into chunks (whole 3-query score tiles) so that there are about 4 tasks
     * a thread; each chunk reads the unit's keys and values again, from cache. */
    const int64_t units = pairs * ranges;
    int64_t size = nq;
    if (units < 4 * threads) {
        const int64_t wanted = (4 * threads + units - 1) / units;
        size = (nq + wanted - 1) / wanted;
        size = (size + 2) / 3 * 3;
    }
    const int64_t chunks = (nq + size - 1) / size;
    /* Each unit's partial softmax of every query that reaches past its range: max, sum, and the
     * unnormalised weighted sum of the values. */
    float *partial = ranges > 1 ? malloc((size_t)(units * nq * (Dv + 2)) * sizeof(float)) : NULL;
    if (ranges > 1 && !partial) return -1;
    int failed = 0, vector = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    vector = !a->portable && a->head_dim % 32 == 0 && a->value_dim % 32 == 0 && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
#pragma omp parallel num_threads(threads)
    {
        const int64_t longest_span = longest_row < span_keys ? longest_row : span_keys;
        float *scores = malloc((size_t)(nq * longest_span) * sizeof(float));
        float *acc = malloc((size_t)(nq * Dv) * sizeof(float));
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
        for (int64_t task = 0; task < units * chunks; task++) {
            const int64_t unit = task / chunks, pair = unit / ranges, range = unit % ranges;
            const int64_t i0 = task % chunks * size, i1 = i0 + size < nq ? i0 + size : nq;
            if (ready)
                attend(a, pair / a->kv_heads, pair % a->kv_heads, i0, i1, range, span_keys, ranges, partial, scores,
                       acc, queries, visible, widened, vector);
        }
        if (partial) {
#pragma omp for schedule(static)
            for (int64_t query = 0; query < pairs * nq; query++) {
                const int64_t pair = query / nq;
                if (ready) merge(a, pair / a->kv_heads, pair % a->kv_heads, query % nq, span_keys, ranges, partial);
            }
        }
        free(scores);
        free(acc);
        free(queries);
        free(visible);
        free(widened);
    }
    free(partial);
    return failed ? -1 : 0;
}
