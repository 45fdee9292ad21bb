/* One decoder layer of a round whose linear layers are float16 (`float16_linear`) and whose
 * rows are all short enough for `paged_attention`: the kernels of the layer in one call.
 *
 *   x = rms_norm(h) * input_norm
 *   q, k, v = x W_qkv;  q, k = rope(q, k);  k, v -> the pool's slots
 *   h += attention(q) W_o
 *   x = rms_norm(h) * post_norm
 *   h += swiglu(x W_gate_up) W_down
 *
 * These are the same kernels, in the same order and on the same inputs, that model.py calls one
 * by one, so the result is the same bits; what goes is the Python between them. Each of a
 * layer's nine steps cost 3-4 us of Python and tensor allocation around a product that, for
 * one decode row of the default model, takes 10 to 90 us: one decode row's round took 8.3 ms
 * step by step and 6.3 in one call a layer (AVX2 dispatch on a Zen 4 EPYC, 2 threads).
 */
#include "kernels.h"

int decoder_layer(const DecoderLayerRound *l, int threads) {
    const int64_t T = l->tokens, hidden = l->hidden, C = (l->heads + 2 * l->kv_heads) * l->head_dim;
    const int64_t A = l->heads * l->head_dim, I = l->intermediate;
    float *x = l->scratch, *qkv = x + T * hidden, *q = qkv + T * C, *attended = q + T * A, *delta = attended + T * A;
    float *gate_up = delta + T * hidden, *gated = gate_up + T * 2 * I;

    const AddRmsNorm input_norm = {.h = l->h, .weight = l->input_norm, .out = x, .tokens = T, .hidden = hidden, .eps = l->eps};
    add_rms_norm(&input_norm, threads);

    const Float16Linear qkv_layer = {.x = x, .x_stride = hidden, .packed = l->qkv, .y = qkv, .tokens = T, .in = hidden, .out = C};
    float16_linear(&qkv_layer, threads, l->isa);

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
        };
        if (paged_attention(&a, plan->longest, threads)) return -1;
    }

    const Float16Linear o_layer = {.x = attended, .x_stride = A, .packed = l->o, .y = delta, .tokens = T, .in = A, .out = hidden};
    float16_linear(&o_layer, threads, l->isa);

    const AddRmsNorm post_norm = {.h = l->h, .delta = delta, .delta_token_stride = hidden, .delta_channel_stride = 1,
                                  .weight = l->post_norm, .out = x, .tokens = T, .hidden = hidden, .eps = l->eps};
    add_rms_norm(&post_norm, threads);

    const Float16Linear gate_up_layer = {.x = x, .x_stride = hidden, .packed = l->gate_up, .y = gate_up, .tokens = T, .in = hidden,
                                         .out = 2 * I};
    float16_linear(&gate_up_layer, threads, l->isa);
    if (swiglu_rows(gate_up, 1, 2 * I, gated, I, T, threads)) return -1;

    const Float16Linear down_layer = {.x = gated, .x_stride = I, .packed = l->down, .y = delta, .tokens = T, .in = I, .out = hidden};
    float16_linear(&down_layer, threads, l->isa);
    /* The residual add the next layer's norm would make (model.py hands it the delta instead). */
    for (int64_t i = 0; i < T * hidden; i++) l->h[i] += delta[i];
    return 0;
}
