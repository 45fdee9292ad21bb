/* A round's mixture-of-experts MLP (flare/engine/layers/moe.py) in one call, its experts' weights
 * ggml blocks, the route given (moe_route.c's, or routing.py's without the kernels); decoder_layer.c
 * calls both for a layer of a round of short rows:
 *
 *   out[t] = sum over the row's k slots s, in slot order:  w[t, s] * down_e(act(gate_e(x_t)) * up_e(x_t)),
 *            e = experts[t, s]
 *
 * gpt-oss's experts add their biases (gate/up's output + b_gu[e], down's + b_d[e]) and take the
 * clamped SwiGLU for act(gate) * up (swiglu.c), as moe.py's `_expert` does.
 *
 * Rows are grouped by expert (a counting sort of the T k slots, stable: in row order within an
 * expert), so each active expert's gate/up and down run once on all the rows routed to it, through
 * `quantized_linear` (the dense layers' product, with its dispatch) and `gated_rows` (swiglu.c):
 * the very functions the torch path with kernels calls per expert, so each slot's output has that
 * path's bits. With 8-bit activations (`flare run --activations int8x2|int8`, a projection's
 * `halves`) the products are quantized.py's integer ones instead: each row of x is quantized once
 * (quantize_row_q8k_halves for the K types, quantize_row_q8 for the 32-value ones, row by row as
 * module.c's quantize_q8k_rows and quantize_q8 do, so the same blocks) and those blocks are read by
 * the gate/up of every expert the row is routed to; each expert's activation rows are quantized once
 * for its down; the products are integer_kquant_linear / integer_linear, the same bits at every
 * IDOT_* level and a row's own whatever rows share an expert.
 *
 * The weighted sum then reads each row's k outputs in its own slot order, each product rounded
 * before it is added (as torch's `slots * weights` then `+=` rounds it: this file is compiled
 * without contracting multiply-adds), so a row's result never depends on its batch-mates nor on
 * how the experts were scheduled.
 *
 * Threads: over the active experts, each expert's three steps on one thread (a decode row's 8
 * experts keep every core busy without a barrier between the steps), or over each product's output
 * rows, expert after expert, when there are fewer active experts than 2 per thread (a long prompt
 * whose rows crowd few experts). Either way every output is one thread's sum in the same order.
 */
#pragma GCC optimize("fp-contract=off")

#include <omp.h>
#include <stdlib.h>

#include "integer_dot.h"
#include "kernels.h"

static int k_type(int type) { return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K; }

/* The bytes of one row of `in` inputs as the 8-bit blocks a product of `type` with `halves` reads
 * (0 with halves 0: that product reads the float32 row). */
static int64_t blocks_row_bytes(int type, int halves, int64_t in) {
    if (!halves) return 0;
    return k_type(type) ? halves * (in / 256) * (int64_t)sizeof(Q8KBlock) : halves * (in / 32) * (int64_t)sizeof(Q8Block);
}

/* Row x [in] as those blocks, as quantized.py's quantize_activations writes them. */
static void quantize_input(int type, int halves, const float *x, int64_t in, uint8_t *out, int integer_isa) {
    if (k_type(type))
        quantize_row_q8k_halves(integer_isa, x, in, halves, (Q8KBlock *)out);
    else
        quantize_row_q8(integer_isa, x, in, halves, (Q8Block *)out);
}

/* y [n, out] = n rows times one expert's weight `blocks` [out, in] of `type`: float32 rows x through
 * quantized_linear (halves 0), or their blocks xq through the integer products, the one
 * quantized.py's quantized_linear picks for the weight. */
static int product(int type, int halves, const float *x, const uint8_t *xq, const uint8_t *blocks, float *y, int64_t n,
                   int64_t in, int64_t out, int threads, int isa, int integer_isa) {
    if (!halves) {
        const QuantizedLinear l = {
            .x = x, .x_stride = in, .blocks = blocks, .type = type, .y = y, .tokens = n, .in = in, .out = out, .y_stride = 0,
        };
        return quantized_linear(&l, threads, isa) ? -1 : 0;
    }
    if (k_type(type)) {
        integer_kquant_linear(type, halves, blocks, (const Q8KBlock *)xq, y, n, in, out, out, threads, integer_isa);
        return 0;
    }
    const IntegerLinear l = {
        .x = (const Q8Block *)xq, .halves = halves, .x_stride = halves * (in / 32), .blocks = blocks, .type = type,
        .y = y, .tokens = n, .in = in, .out = out, .y_stride = 0,
    };
    return integer_linear(&l, threads, integer_isa);
}

/* rows [n, width] += bias [width], each sum rounded once: moe.py's `+ bias` on the expert's output. */
static void add_rows(float *rows, const float *bias, int64_t n, int64_t width) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < width; c++) rows[r * width + c] += bias[c];
}

/* One expert's scratch, at its first grouped position: gathered inputs [n, hidden] (float32 or, with
 * gate/up halves, their blocks), gate/up rows [n, 2I], activations [n, I] (and their blocks for a
 * down with halves), down's outputs [n, hidden] (in the grouped buffer `y`, read by the sum). */
typedef struct {
    float *xg;
    uint8_t *xq;
    float *gu, *act;
    uint8_t *actq;
    float *y;
} ExpertScratch;

/* `xq_rows`: each row of x quantized once for gate/up (NULL without gate/up halves). */
static int run_expert(const MoELayer *m, int64_t e, const int64_t *slots, int64_t n, const uint8_t *xq_rows, ExpertScratch s,
                      int threads, int isa, int integer_isa) {
    const int64_t H = m->hidden, I = m->intermediate;
    const int64_t gb = blocks_row_bytes(m->gate_up_type, m->gate_up_halves, H), db = blocks_row_bytes(m->down_type, m->down_halves, I);
    for (int64_t r = 0; r < n; r++) {
        const int64_t t = slots[r] / m->k;
        if (m->gate_up_halves)
            memcpy(s.xq + r * gb, xq_rows + t * gb, (size_t)gb);
        else
            memcpy(s.xg + r * H, m->x + t * H, sizeof(float) * (size_t)H);
    }
    if (product(m->gate_up_type, m->gate_up_halves, s.xg, s.xq, m->gate_up + e * m->gate_up_expert_bytes, s.gu, n, H, 2 * I,
                threads, isa, integer_isa))
        return -1;
    if (m->gate_up_bias) add_rows(s.gu, m->gate_up_bias + e * 2 * I, n, 2 * I);
    /* gu holds rows [n, 2I]: channel c of row t at c + 2I t, as gated_rows reads a packed format's rows. */
    if (m->activation == ACTIVATION_CLAMPED_SWIGLU)
        clamped_swiglu_rows(s.gu, 1, 2 * I, s.act, I, n, m->swiglu_alpha, m->swiglu_limit, threads);
    else if (gated_rows(s.gu, 1, 2 * I, s.act, I, n, m->activation, threads))
        return -1;
    if (m->down_halves)
        for (int64_t r = 0; r < n; r++) quantize_input(m->down_type, m->down_halves, s.act + r * I, I, s.actq + r * db, integer_isa);
    if (product(m->down_type, m->down_halves, s.act, s.actq, m->down + e * m->down_expert_bytes, s.y, n, I, H, threads, isa,
                integer_isa))
        return -1;
    if (m->down_bias) add_rows(s.y, m->down_bias + e * H, n, H);
    return 0;
}

/* The scratch of the expert whose rows start at grouped position p. */
static ExpertScratch scratch_at(const ExpertScratch *base, int64_t p, int64_t H, int64_t I, int64_t gb, int64_t db) {
    return (ExpertScratch){
        .xg = base->xg ? base->xg + p * H : NULL, .xq = base->xq ? base->xq + p * gb : NULL, .gu = base->gu + p * 2 * I,
        .act = base->act + p * I, .actq = base->actq ? base->actq + p * db : NULL, .y = base->y + p * H,
    };
}

int moe_layer(const MoELayer *m, int threads, int isa, int integer_isa) {
    const int64_t T = m->tokens, K = m->k, E = m->experts, H = m->hidden, I = m->intermediate, S = T * K;
    const int64_t gb = blocks_row_bytes(m->gate_up_type, m->gate_up_halves, H), db = blocks_row_bytes(m->down_type, m->down_halves, I);
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)), *order = malloc(sizeof(int64_t) * (size_t)S);
    int64_t *position = malloc(sizeof(int64_t) * (size_t)S), *active = malloc(sizeof(int64_t) * (size_t)E);
    uint8_t *xq_rows = gb ? malloc((size_t)(T * gb)) : NULL;
    ExpertScratch base = {
        .xg = gb ? NULL : malloc(sizeof(float) * (size_t)(S * H)), .xq = gb ? malloc((size_t)(S * gb)) : NULL,
        .gu = malloc(sizeof(float) * (size_t)(S * 2 * I)), .act = malloc(sizeof(float) * (size_t)(S * I)),
        .actq = db ? malloc((size_t)(S * db)) : NULL, .y = malloc(sizeof(float) * (size_t)(S * H)),
    };
    int failed = !start || !order || !position || !active || (gb && (!xq_rows || !base.xq)) || (!gb && !base.xg) || !base.gu ||
                 !base.act || (db && !base.actq) || !base.y;
    if (!failed && gb) {
        /* Each row quantized once, whichever experts read it (module.c's quantize_q8k_rows / quantize_q8). */
#pragma omp parallel for num_threads(threads) schedule(static) if (T * H >= 65536)
        for (int64_t t = 0; t < T; t++) quantize_input(m->gate_up_type, m->gate_up_halves, m->x + t * H, H, xq_rows + t * gb, integer_isa);
    }
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
                failed |= run_expert(m, e, order + p, n, xq_rows, scratch_at(&base, p, H, I, gb, db), 1, isa, integer_isa);
            }
        } else if (!failed) {
            for (int64_t a = 0; a < count && !failed; a++) {
                const int64_t e = active[a], p = start[e], n = start[e + 1] - p;
                failed |= run_expert(m, e, order + p, n, xq_rows, scratch_at(&base, p, H, I, gb, db), threads, isa, integer_isa);
            }
        }
        if (!failed) {
            const float *y = base.y;
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
    free(xq_rows);
    free(base.xg);
    free(base.xq);
    free(base.gu);
    free(base.act);
    free(base.actq);
    free(base.y);
    return failed ? -1 : 0;
}
