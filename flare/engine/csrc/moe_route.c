/* The route of a mixture-of-experts layer in one call: each row's router logits and, from them,
 * its k experts and their weights, under the four kinds of flare/engine/layers/routing.py (whose
 * docstring states each kind's math; that module is the reference these routes are tested
 * against, and what runs where this library was not built).
 *
 * Why in C: a decode round's route is a dozen small torch operators per layer (the float64
 * product, softmax, top-k, sort, gather), and after a token's weights have streamed through the
 * caches each one runs cold, many times its warm cost (docs/benchmarks.md, "Mixture-of-experts
 * against llama.cpp"). Here it is one pass, and it runs inside the one-call decoder layer.
 *
 * Logits. logit[t, e] = sum_h x[t, h] w[e, h] (+ bias[e]) summed in float64 and rounded to float32
 * once, as routing.py's float64 product: a product of two float32 values is exact in float64, so
 * a fused multiply-add rounds as a multiply then an add does, and the sum runs in 16 lanes
 * (lane j takes h = j mod 16, in h order) added up in one fixed tree. The bits are therefore the
 * same at every level (AVX2 + FMA or the portable loop) and whichever rows share the call: a row's
 * route never depends on its batch-mates. Rows are taken 2 at a time only to share each router
 * row's load and widening (two widened rows stay in L1).
 *
 * Choice. The k experts are the k largest scores, ties to the lower expert index (torch.topk
 * leaves ties unspecified). Softmax is monotonic, so softmax kinds choose by the logits
 * themselves: the same experts as choosing by the float32 probabilities, but where two
 * different logits round to the same probability. Groups (softmax_group_max, sigmoid_group) are
 * kept the same way: the `topk_group` best group scores, ties to the lower group.
 *
 * Weights are computed in float64 and rounded once (routing.py rounds each torch step to
 * float32: the two differ by about an ulp), times `scaling` (routed_scaling_factor). A row's k
 * experts are returned in ascending order, the order the MoE layer sums them in.
 *
 * A shared expert's gate (Qwen2-MoE) is one more router row: its logit in the same lanes, rounded
 * once, and sigmoid(logit) in float64 rounded once, the factor on the shared expert's output.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

#define LANES 16
#define ROW_TILE 2

/* The fixed tree that adds a row's 16 lane sums. */
static double lane_total(const double *acc) {
    double quad[4];
    for (int j = 0; j < 4; j++) quad[j] = (acc[j] + acc[j + 8]) + (acc[j + 4] + acc[j + 12]);
    return (quad[0] + quad[2]) + (quad[1] + quad[3]);
}

/* The logit of lane sums acc [16] with the router's bias. */
static float logit_of(const MoERoute *m, const double *acc, int64_t e) {
    double logit = lane_total(acc);
    if (m->router_bias) logit += (double)m->router_bias[e];
    return (float)logit;
}

/* The portable loop: lane j of row r sums h = j mod 16 in h order. */
static void router_logits_portable(const MoERoute *m, const double *xd, int64_t rows, int64_t e0, int64_t e1, float *logits) {
    const int64_t H = m->hidden;
    for (int64_t e = e0; e < e1; e++) {
        const float *w = m->router + e * H;
        for (int64_t r = 0; r < rows; r++) {
            double acc[LANES] = {0};
            for (int64_t h = 0; h < H; h++) acc[h % LANES] += xd[r * H + h] * (double)w[h];
            logits[r * m->experts + e] = logit_of(m, acc, e);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* The same lanes, four to a ymm register: four independent chains of fused multiply-adds per
 * row (one decode row is not bound by their latency), each router row widened once for `rows`
 * (a constant where it is inlined, so the accumulators stay in registers). */
__attribute__((target("avx2,fma"), always_inline)) static inline void router_rows_avx2(const MoERoute *m, const double *xd,
                                                                                       const int rows, int64_t e0, int64_t e1,
                                                                                       float *logits) {
    const int64_t H = m->hidden, body = H - H % LANES;
    for (int64_t e = e0; e < e1; e++) {
        const float *w = m->router + e * H;
        __m256d acc[ROW_TILE][4];
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < 4; v++) acc[r][v] = _mm256_setzero_pd();
        for (int64_t h = 0; h < body; h += LANES) {
            __m256d wd[4];
            for (int v = 0; v < 4; v++) wd[v] = _mm256_cvtps_pd(_mm_loadu_ps(w + h + 4 * v));
            for (int r = 0; r < rows; r++)
                for (int v = 0; v < 4; v++) acc[r][v] = _mm256_fmadd_pd(_mm256_loadu_pd(xd + r * H + h + 4 * v), wd[v], acc[r][v]);
        }
        for (int r = 0; r < rows; r++) {
            double lanes[LANES];
            for (int v = 0; v < 4; v++) _mm256_storeu_pd(lanes + 4 * v, acc[r][v]);
            for (int64_t h = body; h < H; h++) lanes[h - body] += xd[r * H + h] * (double)w[h];
            logits[r * m->experts + e] = logit_of(m, lanes, e);
        }
    }
}

__attribute__((target("avx2,fma"))) static void router_logits_avx2(const MoERoute *m, const double *xd, int64_t rows, int64_t e0,
                                                                   int64_t e1, float *logits) {
    if (rows == 1)
        router_rows_avx2(m, xd, 1, e0, e1, logits);
    else
        router_rows_avx2(m, xd, ROW_TILE, e0, e1, logits);
}
#endif

/* logits[r, e] for rows (at most ROW_TILE) widened into xd [rows, hidden], experts [e0, e1). */
static void router_logits_tile(const MoERoute *m, int vector, const double *xd, int64_t rows, int64_t e0, int64_t e1,
                               float *logits) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (vector >= ISA_AVX2) {
        router_logits_avx2(m, xd, rows, e0, e1, logits);
        return;
    }
#endif
    (void)vector;
    router_logits_portable(m, xd, rows, e0, e1, logits);
}

/* Index of the largest v[i] with eligible[i] and not taken[i], ties to the lower index; NaN
 * counts as the lowest value, so a row of NaN still gets valid experts. */
static int64_t best_index(const float *v, int64_t n, const uint8_t *eligible, const uint8_t *taken) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++) {
        if (taken[i] || (eligible && !eligible[i])) continue;
        if (best < 0 || v[i] > v[best] || (isnan(v[best]) && !isnan(v[i]))) best = i;
    }
    return best;
}

/* chosen[0 .. k): the k best of v [n] among the eligible (all where NULL), best first; where
 * fewer than k are eligible the rest come from the ineligible, best first. `taken` [n] scratch. */
static void top_k(const float *v, int64_t n, int64_t k, const uint8_t *eligible, uint8_t *taken, int64_t *chosen) {
    memset(taken, 0, (size_t)n);
    for (int64_t s = 0; s < k; s++) {
        int64_t i = best_index(v, n, eligible, taken);
        if (i < 0) i = best_index(v, n, NULL, taken);
        taken[i] = 1;
        chosen[s] = i;
    }
}

/* eligible[e] = 1 for the experts of the `topk_group` best groups by group_scores [n_group]. */
static void keep_groups(const MoERoute *m, const float *group_scores, uint8_t *taken, int64_t *groups, uint8_t *eligible) {
    const int64_t size = m->experts / m->n_group;
    top_k(group_scores, m->n_group, m->topk_group, NULL, taken, groups);
    memset(eligible, 0, (size_t)m->experts);
    for (int64_t g = 0; g < m->topk_group; g++) memset(eligible + groups[g] * size, 1, (size_t)size);
}

typedef struct {
    float *scores, *group_scores;
    uint8_t *taken, *eligible;
    int64_t *groups;
} RouteScratch;

/* Row t's experts and weights from its logits [experts]. */
static void route_row(const MoERoute *m, int64_t t, const float *logits, RouteScratch s) {
    const int64_t E = m->experts, K = m->k, size = E / m->n_group;
    int64_t *experts = m->expert_ids + t * K;
    double w[K];
    if (m->kind == ROUTING_SOFTMAX || m->kind == ROUTING_SOFTMAX_GROUP_MAX) {
        const uint8_t *eligible = NULL;
        if (m->kind == ROUTING_SOFTMAX_GROUP_MAX) { /* a group scores by its largest probability */
            for (int64_t g = 0; g < m->n_group; g++) {
                float best = logits[g * size];
                for (int64_t i = 1; i < size; i++) best = logits[g * size + i] > best ? logits[g * size + i] : best;
                s.group_scores[g] = best;
            }
            keep_groups(m, s.group_scores, s.taken, s.groups, s.eligible);
            eligible = s.eligible;
        }
        top_k(logits, E, K, eligible, s.taken, experts);
        /* p_e = exp(l_e - max) / sum over all experts; normalized, over the k chosen. */
        float top = logits[0];
        for (int64_t e = 1; e < E; e++) top = logits[e] > top ? logits[e] : top;
        double z = 0.0;
        for (int64_t e = 0; e < E; e++) z += exp((double)logits[e] - (double)top);
        double chosen = 0.0;
        for (int64_t i = 0; i < K; i++) chosen += w[i] = exp((double)logits[experts[i]] - (double)top);
        const double denominator = m->kind == ROUTING_SOFTMAX && m->normalize ? chosen : z;
        for (int64_t i = 0; i < K; i++) w[i] /= denominator;
    } else if (m->kind == ROUTING_SIGMOID_GROUP) {
        /* s_e = sigmoid(l_e) in float32, as torch.sigmoid; the choice reads s_e + bias_e. */
        for (int64_t e = 0; e < E; e++) {
            const float sigmoid = (float)(1.0 / (1.0 + exp(-(double)logits[e])));
            s.scores[e] = sigmoid + (m->correction_bias ? m->correction_bias[e] : 0.0f);
        }
        for (int64_t g = 0; g < m->n_group; g++) { /* a group scores by the sum of its two best */
            const float *v = s.scores + g * size;
            float first = v[0], second = -INFINITY;
            for (int64_t i = 1; i < size; i++) {
                if (v[i] > first) {
                    second = first;
                    first = v[i];
                } else if (v[i] > second) {
                    second = v[i];
                }
            }
            s.group_scores[g] = size > 1 ? first + second : first;
        }
        keep_groups(m, s.group_scores, s.taken, s.groups, s.eligible);
        top_k(s.scores, E, K, s.eligible, s.taken, experts);
        double total = 0.0;
        for (int64_t i = 0; i < K; i++) total += w[i] = (double)(float)(1.0 / (1.0 + exp(-(double)logits[experts[i]])));
        if (m->normalize)
            for (int64_t i = 0; i < K; i++) w[i] /= total + 1e-20;
    } else { /* ROUTING_TOPK_SOFTMAX: softmax over the k largest logits */
        top_k(logits, E, K, NULL, s.taken, experts);
        double z = 0.0;
        const double top = (double)logits[experts[0]];
        for (int64_t i = 0; i < K; i++) z += w[i] = exp((double)logits[experts[i]] - top);
        for (int64_t i = 0; i < K; i++) w[i] /= z;
    }
    /* Ascending expert order (insertion sort of k), the weights alongside. */
    for (int64_t i = 1; i < K; i++) {
        const int64_t e = experts[i];
        const double v = w[i];
        int64_t j = i - 1;
        for (; j >= 0 && experts[j] > e; j--) {
            experts[j + 1] = experts[j];
            w[j + 1] = w[j];
        }
        experts[j + 1] = e;
        w[j + 1] = v;
    }
    for (int64_t i = 0; i < K; i++) m->expert_weights[t * K + i] = (float)(w[i] * m->scaling);
}

/* sigmoid(shared_gate . x_t): the portable lanes (the same bits as every level's) of one row. */
static float shared_scale_of(const MoERoute *m, int64_t t) {
    const int64_t H = m->hidden;
    double acc[LANES] = {0};
    for (int64_t h = 0; h < H; h++) acc[h % LANES] += (double)m->x[t * H + h] * (double)m->shared_gate[h];
    const float logit = (float)lane_total(acc);
    return (float)(1.0 / (1.0 + exp(-(double)logit)));
}

int moe_route(const MoERoute *m, int threads) {
    const int64_t T = m->tokens, E = m->experts, H = m->hidden, tiles = (T + ROW_TILE - 1) / ROW_TILE;
    float *logits = malloc(sizeof(float) * (size_t)(T * E));
    if (!logits) return -1;
    int failed = 0;
    /* One decode row's logits are split over the experts (each thread streams its part of the
     * router); a prompt's over its row tiles. Either way each logit is one thread's sum. */
    const int split_experts = tiles < threads, vector = quantized_vector_isa(m->isa);
    const int64_t parts = split_experts ? threads : tiles;
#pragma omp parallel num_threads(threads) if (T * E * H >= 131072) reduction(| : failed)
    {
        double *xd = malloc(sizeof(double) * (size_t)(ROW_TILE * H));
        failed |= !xd;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < parts; p++) {
            if (!xd) continue;
            /* Part p: a share of the experts for every row tile, or every expert for row tile p. */
            const int64_t e0 = split_experts ? E * p / parts : 0, e1 = split_experts ? E * (p + 1) / parts : E;
            const int64_t first_tile = split_experts ? 0 : p, last_tile = split_experts ? tiles : p + 1;
            for (int64_t tile = first_tile; tile < last_tile; tile++) {
                const int64_t t0 = tile * ROW_TILE, rows = T - t0 < ROW_TILE ? T - t0 : ROW_TILE;
                for (int64_t i = 0; i < rows * H; i++) xd[i] = (double)m->x[t0 * H + i];
                router_logits_tile(m, vector, xd, rows, e0, e1, logits + t0 * E);
            }
        }
        free(xd);
    }
    if (!failed) {
#pragma omp parallel num_threads(threads) if (T >= 64) reduction(| : failed)
        {
            RouteScratch s = {
                .scores = malloc(sizeof(float) * (size_t)E), .group_scores = malloc(sizeof(float) * (size_t)m->n_group),
                .taken = malloc((size_t)E), .eligible = malloc((size_t)E), .groups = malloc(sizeof(int64_t) * (size_t)m->n_group),
            };
            const int ok = s.scores && s.group_scores && s.taken && s.eligible && s.groups;
            failed |= !ok;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                if (ok) route_row(m, t, logits + t * E, s);
                if (m->shared_gate) m->shared_scale[t] = shared_scale_of(m, t);
            }
            free(s.scores);
            free(s.group_scores);
            free(s.taken);
            free(s.eligible);
            free(s.groups);
        }
    }
    free(logits);
    return failed ? -1 : 0;
}
