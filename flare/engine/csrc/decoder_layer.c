/* One decoder layer of a round whose rows are all short enough for `paged_attention`, its linear
 * layers float16 (`float16_linear`) or ggml blocks (`quantized_linear`), or parts of each: the
 * kernels of the layer in one call.
 *
 *   x = rms_norm(h) * input_norm
 *   q, k, v = x W_qkv;  q, k = rope(q, k);  k, v -> the pool's slots
 *   h += attention(q) W_o
 *   x = rms_norm(h) * post_norm
 *   h += swiglu(x W_gate_up) W_down      (or a mixture-of-experts layer's route and experts of x,
 *                                         and its shared expert: gate_up and down, gated)
 *
 * with each family's features where the layer has them (kernels.h, DecoderLayerRound): the q/k/v
 * bias, q/k norms and partial rotary inside `rope_and_cache`, the layer's own RoPE tables, its
 * window, soft-cap, scale and sinks inside `paged_attention`, the o projection's bias (gpt-oss),
 * GELU-tanh for silu, and Gemma's sandwich norms: h += rms_norm(attention(q) W_o) *
 * attention_output_norm, and the same of the MLP's output with mlp_output_norm.
 *
 * These are the same kernels, in the same order and on the same inputs, that model.py calls one
 * by one, so the result is the same bits; what goes is the Python and tensor allocation between
 * them, which for one decode row of a small model costs as much as some of the products.
 */
#include <stdlib.h>

#include "integer_dot.h"
#include "kernels.h"

#pragma GCC optimize("fp-contract=off")

/* x [T, in] (rows `x_stride` apart) through a layer's linear layer into y [T, out], contiguous:
 * each part's outputs in its columns of y, as model.py concatenates them. Parts flagged
 * LINEAR_INTEGER_ACTIVATIONS multiply 8-bit activation blocks (integer_linear.c), quantized from
 * x once and shared by every such part (q, k and v; gate and up). 0, or -1 when a part's type is
 * unknown or scratch memory could not be allocated. */
static int layer_linear(const DecoderLayerRound *l, const LayerLinear *w, const float *x, int64_t x_stride, float *y,
                        int64_t in, int64_t out, int threads) {
    int64_t first = 0;
    Q8Block *xq = NULL;
    Q8KBlock *xk = NULL; /* x as Q8K rows, for the K parts: quantized once too */
    int quantized_halves = 0, k_halves = 0, status = 0;
    for (int p = 0; p < LAYER_LINEAR_PARTS && w->parts[p].out && !status; p++) {
        const LinearPart *part = &w->parts[p];
        const int type = (int)(part->type % LINEAR_INTEGER_ACTIVATIONS), halves = (int)(part->type / LINEAR_INTEGER_ACTIVATIONS);
        if (part->type == LINEAR_PACKED_FLOAT16) {
            const Float16Linear f = {.x = x, .x_stride = x_stride, .packed = part->data, .y = y + first, .tokens = l->tokens,
                                     .in = in, .out = part->out, .y_stride = out};
            float16_linear(&f, threads, l->isa);
        } else if ((halves == 1 || halves == 2) && integer_linear_type(type) && in % 32 == 0) {
            if (halves != quantized_halves) {
                free(xq);
                xq = malloc(sizeof(Q8Block) * (size_t)(l->tokens * halves * (in / 32)));
                if (!xq) return -1;
#pragma omp parallel for num_threads(l->tokens * in < 65536 ? 1 : threads)
                for (int64_t t = 0; t < l->tokens; t++) quantize_row_q8(l->integer_isa, x + t * x_stride, in, halves, xq + t * halves * (in / 32));
                quantized_halves = halves;
            }
            const IntegerLinear q = {.x = xq, .x_stride = halves * (in / 32), .halves = halves, .blocks = part->data, .type = type,
                                     .y = y + first, .tokens = l->tokens, .in = in, .out = part->out, .y_stride = out};
            status = integer_linear(&q, threads, l->integer_isa);
        } else if ((halves == 1 || halves == 2) && (type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K) && in % 256 == 0) {
            if (halves != k_halves) {
                free(xk);
                xk = malloc(sizeof(Q8KBlock) * (size_t)(l->tokens * halves * (in / 256)));
                if (!xk) {
                    free(xq);
                    return -1;
                }
#pragma omp parallel for num_threads(l->tokens * in < 65536 ? 1 : threads)
                for (int64_t t = 0; t < l->tokens; t++)
                    quantize_row_q8k_halves(l->integer_isa, x + t * x_stride, in, halves, xk + t * halves * (in / 256));
                k_halves = halves;
            }
            integer_kquant_linear(type, halves, part->data, xk, y + first, l->tokens, in, part->out, out, threads, l->integer_isa);
        } else {
            const QuantizedLinear q = {.x = x, .x_stride = x_stride, .blocks = part->data, .type = type, .y = y + first,
                                       .tokens = l->tokens, .in = in, .out = part->out, .y_stride = out};
            status = quantized_linear(&q, threads, l->quantized_isa);
        }
        first += part->out;
    }
    free(xq);
    free(xk);
    return status ? -1 : 0;
}

/* A sandwich norm: delta [T, hidden] RMS-normalized in place with `weight`, where the layer has one. */
static void output_norm(const DecoderLayerRound *l, const float *weight, float *delta, int threads) {
    if (!weight) return;
    const AddRmsNorm n = {.h = delta, .weight = weight, .out = delta, .tokens = l->tokens, .hidden = l->hidden, .eps = l->eps};
    add_rms_norm(&n, threads);
}

/* The gated MLP of x [T, hidden] through linear layers gate_up [2 width, hidden] and down
 * [hidden, width] into y [T, hidden], its scratch gate_up [T, 2 width] and gated [T, width]. */
static int gated_mlp(const DecoderLayerRound *l, const LayerLinear *gate_up, const LayerLinear *down, int64_t width, const float *x,
                     float *gate_up_rows, float *gated, float *y, int threads) {
    if (layer_linear(l, gate_up, x, l->hidden, gate_up_rows, l->hidden, 2 * width, threads)) return -1;
    if (gated_rows(gate_up_rows, 1, 2 * width, gated, width, l->tokens, l->activation, threads)) return -1;
    return layer_linear(l, down, gated, width, y, width, l->hidden, threads);
}

/* The mixture-of-experts MLP of x [T, hidden] into delta: its route (moe_route.c), then its
 * experts (moe_layer.c), at the levels moe.py's steps call them at (native.ATEN_ISA is the
 * quantized products' level), so the same bits; then a shared expert where the layer has one (its
 * gate_up and down): delta + scale * shared, the product rounded before the sum as moe.py's
 * torch steps round it (this file does not contract multiply-adds), without a gate delta + shared. */
static int moe_mlp(const DecoderLayerRound *l, const float *x, float *delta, int threads) {
    const int64_t T = l->tokens, K = l->moe->route.k, H = l->hidden;
    int64_t width = 0;
    for (int p = 0; p < LAYER_LINEAR_PARTS; p++) width += l->gate_up.parts[p].out;
    width /= 2;
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(T * K));
    float *weights = malloc(sizeof(float) * (size_t)(T * K)), *scale = malloc(sizeof(float) * (size_t)T);
    float *shared = width ? malloc(sizeof(float) * (size_t)(T * (3 * width + H))) : NULL;
    int status = !ids || !weights || !scale || (width && !shared);
    if (!status) {
        MoERoute route = l->moe->route;
        route.x = x, route.tokens = T, route.expert_ids = ids, route.expert_weights = weights, route.isa = l->quantized_isa;
        route.shared_scale = scale;
        MoELayer layer = l->moe->layer;
        layer.x = x, layer.tokens = T, layer.expert_ids = ids, layer.expert_weights = weights, layer.out = delta;
        status = moe_route(&route, threads) || moe_layer(&layer, threads, l->quantized_isa, l->integer_isa);
        if (!status && width) {
            float *y = shared + T * 3 * width;
            status = gated_mlp(l, &l->gate_up, &l->down, width, x, shared, shared + T * 2 * width, y, threads);
            for (int64_t t = 0; t < T && !status; t++)
                for (int64_t i = 0; i < H; i++) delta[t * H + i] += route.shared_gate ? scale[t] * y[t * H + i] : y[t * H + i];
        }
    }
    free(ids);
    free(weights);
    free(scale);
    free(shared);
    return status ? -1 : 0;
}

int decoder_layer(const DecoderLayerRound *l, int threads) {
    const int64_t T = l->tokens, hidden = l->hidden, C = (l->heads + 2 * l->kv_heads) * l->head_dim;
    const int64_t A = l->heads * l->head_dim, I = l->intermediate;
    float *x = l->scratch, *qkv = x + T * hidden, *q = qkv + T * C, *attended = q + T * A, *delta = attended + T * A;
    float *gate_up = delta + T * hidden, *gated = gate_up + T * 2 * I;

    const AddRmsNorm input_norm = {.h = l->h, .weight = l->input_norm, .out = x, .tokens = T, .hidden = hidden, .eps = l->eps};
    add_rms_norm(&input_norm, threads);

    if (layer_linear(l, &l->qkv, x, hidden, qkv, hidden, C, threads)) return -1;

    const RopeCache rope = {
        .qkv = qkv,
        .channel_stride = 1,
        .token_stride = C,
        .positions = l->positions,
        .slots = l->slots,
        .cos = l->cos,
        .sin = l->sin,
        .max_positions = l->max_positions,
        .q_out = q,
        .keys = l->keys,
        .values = l->values,
        .kv_dtype = l->kv_dtype,
        .tokens = T,
        .heads = l->heads,
        .kv_heads = l->kv_heads,
        .head_dim = l->head_dim,
        .pool_slots = l->num_blocks * l->block_size,
        .bias = l->qkv_bias,
        .q_norm = l->q_norm,
        .k_norm = l->k_norm,
        .norm_eps = l->eps,
        .rotary_dims = l->rotary_dims,
    };
    rope_and_cache(&rope, threads);

    for (int64_t g = 0; g < l->groups; g++) {
        const AttentionGroupPlan *plan = &l->group_plans[g];
        const Attention a = {
            .q = q + plan->start * A,
            .q_token_stride = A,
            .keys = l->keys,
            .values = l->values,
            .kv_dtype = l->kv_dtype,
            .out = attended + plan->start * A,
            .block_table = plan->block_table,
            .start_positions = plan->start_positions,
            .rows = plan->rows,
            .query_len = plan->query_len,
            .heads = l->heads,
            .kv_heads = l->kv_heads,
            .head_dim = l->head_dim,
            .block_size = l->block_size,
            .num_blocks = l->num_blocks,
            .max_blocks = plan->max_blocks,
            .scale = l->scale,
            .window = l->window,
            .softcap = l->softcap,
            .sinks = l->sinks,
        };
        if (paged_attention(&a, plan->longest, threads)) return -1;
    }

    if (layer_linear(l, &l->o, attended, A, delta, A, hidden, threads)) return -1;
    if (l->o_bias)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < hidden; i++) delta[t * hidden + i] += l->o_bias[i];
    output_norm(l, l->attention_output_norm, delta, threads);

    const AddRmsNorm post_norm = {.h = l->h, .delta = delta, .delta_token_stride = hidden, .delta_channel_stride = 1,
                                  .weight = l->post_norm, .out = x, .tokens = T, .hidden = hidden, .eps = l->eps};
    add_rms_norm(&post_norm, threads);

    if (l->moe ? moe_mlp(l, x, delta, threads) : gated_mlp(l, &l->gate_up, &l->down, I, x, gate_up, gated, delta, threads))
        return -1;
    output_norm(l, l->mlp_output_norm, delta, threads);
    /* The residual add the next layer's norm would make (model.py hands it the delta instead). */
    for (int64_t i = 0; i < T * hidden; i++) l->h[i] += delta[i];
    return 0;
}
