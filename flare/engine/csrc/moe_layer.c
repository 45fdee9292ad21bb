/* A round's mixture-of-experts MLP (flare/engine/layers/moe.py) in one call, its experts' weights
 * ggml blocks, the route given (routing.py computes it in Python, float64-exact):
 *
 *   out[t] = sum over the row's k slots s, in slot order:  w[t, s] * down_e(act(gate_e(x_t)) * up_e(x_t)),
 *            e = experts[t, s]
 *
 * Rows are grouped by expert (a counting sort of the T k slots, stable: in row order within an
 * expert), so each active expert's gate/up and down run once on all the rows routed to it, through
 * `quantized_linear` (the dense layers' product, with its dispatch) and `gated_rows` (swiglu.c):
 * the very functions the torch path with kernels calls per expert, so each slot's output has that
 * path's bits. The weighted sum then reads each row's k outputs in its own slot order, each
 * product rounded before it is added (as torch's `slots * weights` then `+=` rounds it: this file
 * is compiled without contracting multiply-adds), so a row's result never depends on its
 * batch-mates nor on how the experts were scheduled.
 *
 * Threads: over the active experts, each expert's three steps on one thread (a decode row's 8
 * experts keep every core busy without a barrier between the steps), or over each product's output
 * rows, expert after expert, when there are fewer active experts than 2 per thread (a long prompt
 * whose rows crowd few experts). Either way every output is one thread's sum in the same order.
 */
#pragma GCC optimize("fp-contract=off")

#include <omp.h>
#include <stdlib.h>

#include "kernels.h"

/* Scratch of one expert's rows: gathered inputs [n, hidden], gate/up rows [n, 2I], activations
 * [n, I], down's outputs [n, hidden] (the last in the grouped buffer `y`, read by the sum). */
static int run_expert(const MoELayer *m, int64_t e, const int64_t *slots, int64_t n, float *xg, float *gu, float *act,
                      float *y, int threads, int isa) {
    const int64_t H = m->hidden, I = m->intermediate;
    for (int64_t r = 0; r < n; r++) memcpy(xg + r * H, m->x + slots[r] / m->k * H, sizeof(float) * (size_t)H);
    const QuantizedLinear up = {
        .x = xg, .x_stride = H, .blocks = m->gate_up + e * m->gate_up_expert_bytes, .type = m->gate_up_type,
        .y = gu, .tokens = n, .in = H, .out = 2 * I, .y_stride = 0,
    };
    if (quantized_linear(&up, threads, isa)) return -1;
    /* gu holds rows [n, 2I]: channel c of row t at c + 2I t, as gated_rows reads a packed format's rows. */
    if (gated_rows(gu, 1, 2 * I, act, I, n, m->activation, threads)) return -1;
    const QuantizedLinear down = {
        .x = act, .x_stride = I, .blocks = m->down + e * m->down_expert_bytes, .type = m->down_type,
        .y = y, .tokens = n, .in = I, .out = H, .y_stride = 0,
    };
    return quantized_linear(&down, threads, isa) ? -1 : 0;
}

int moe_layer(const MoELayer *m, int threads, int isa) {
    const int64_t T = m->tokens, K = m->k, E = m->experts, H = m->hidden, I = m->intermediate, S = T * K;
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * (size_t)S);
    int64_t *position = malloc(sizeof(int64_t) * (size_t)S), *active = malloc(sizeof(int64_t) * (size_t)E);
    float *xg = malloc(sizeof(float) * (size_t)(S * H)), *gu = malloc(sizeof(float) * (size_t)(S * 2 * I));
    float *act = malloc(sizeof(float) * (size_t)(S * I)), *y = malloc(sizeof(float) * (size_t)(S * H));
    int failed = !start || !order || !position || !active || !xg || !gu || !act || !y;
    if (!failed) {
        /* The counting sort: start[e] is expert e's first grouped position, order[p] the slot at p,
         * position[slot] its grouped position. */
        for (int64_t s = 0; s < S; s++) start[m->expert_ids[s] + 1]++;
        for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
        int64_t count = 0;
        for (int64_t e = 0; e < E; e++)
            if (start[e + 1] > start[e]) active[count++] = e;
        int64_t *fill = malloc(sizeof(int64_t) * (size_t)E);
        failed = !fill;
        if (fill) {
            memcpy(fill, start, sizeof(int64_t) * (size_t)E);
            for (int64_t s = 0; s < S; s++) {
                const int64_t p = fill[m->expert_ids[s]]++;
                order[p] = s;
                position[s] = p;
            }
            free(fill);
        }
        if (!failed && count >= 2 * (int64_t)threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : failed)
            for (int64_t a = 0; a < count; a++) {
                const int64_t e = active[a], p = start[e], n = start[e + 1] - p;
                failed |= run_expert(m, e, order + p, n, xg + p * H, gu + p * 2 * I, act + p * I, y + p * H, 1, isa);
            }
        } else if (!failed) {
            for (int64_t a = 0; a < count && !failed; a++) {
                const int64_t e = active[a], p = start[e], n = start[e + 1] - p;
                failed |= run_expert(m, e, order + p, n, xg + p * H, gu + p * 2 * I, act + p * I, y + p * H, threads, isa);
            }
        }
        if (!failed) {
            /* Each row's k outputs in its slot order: the first as it is, then + w y slot by slot. */
#pragma omp parallel for num_threads(threads) schedule(static) if (T * K * H >= 65536)
            for (int64_t t = 0; t < T; t++) {
                float *o = m->out + t * H;
                const float *first = y + position[t * K] * H;
                const float w0 = m->expert_weights[t * K];
                for (int64_t h = 0; h < H; h++) o[h] = first[h] * w0;
                for (int64_t s = 1; s < K; s++) {
                    const float *ys = y + position[t * K + s] * H;
                    const float w = m->expert_weights[t * K + s];
                    for (int64_t h = 0; h < H; h++) o[h] = o[h] + ys[h] * w;
                }
            }
        }
    }
    free(start);
    free(order);
    free(position);
    free(active);
    free(xg);
    free(gu);
    free(act);
    free(y);
    return failed ? -1 : 0;
}
