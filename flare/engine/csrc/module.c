/* The Python module `flare.engine._native`: one function per kernel of kernels.h.
 *
 * Arguments are data addresses and sizes, which flare/engine/native.py takes from tensors it
 * has checked. What only the data can tell (a block id, a slot or a position outside its
 * table) is checked here, before a kernel reads or writes anything. Every kernel runs with the
 * GIL released, so the daemon's event loop goes on while a round computes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "integer_dot.h"
#include "kernels.h"
#include <math.h>
#include <stdlib.h>

static PyObject *invalid(const char *function, const char *problem) {
    PyErr_Format(PyExc_ValueError, "%s: %s", function, problem);
    return NULL;
}

/* NULL when every block id and position of the rows lies inside the pool, else the problem. */
static const char *check_rows(const Attention *a, int64_t *longest) {
    *longest = 0;
    for (int64_t r = 0; r < a->rows; r++) {
        const int64_t start = a->start_positions[r], keys = start + a->query_len;
        if (start < 0) return "a row starts at a negative position";
        if (keys > a->max_blocks * a->block_size) return "a row reaches past its block table";
        for (int64_t b = 0; b < (keys + a->block_size - 1) / a->block_size; b++) {
            const int64_t block = a->block_table[r * a->max_blocks + b];
            if (block < 0 || block >= a->num_blocks) return "a block id lies outside the KV pool";
        }
        if (keys > *longest) *longest = keys;
    }
    return NULL;
}

/* The most head_dim the family features' path takes (it keeps a head on the stack; Gemma's 256). */
enum { FEATURES_MAX_HEAD_DIM = 1024 };

/* NULL when rotary_dims and the norms' eps fit a head of head_dim, else the problem. */
static const char *check_features(int64_t head_dim, int64_t rotary_dims, float norm_eps, int featured) {
    if (rotary_dims < 2 || rotary_dims % 2 || rotary_dims > head_dim) return "rotary_dims must be even, from 2 to head_dim";
    if (featured && head_dim > FEATURES_MAX_HEAD_DIM) return "head_dim is over 1024 for a bias, q/k norms or partial rotary";
    if (!(norm_eps > 0.0f)) return "the norms' eps must be positive";
    return NULL;
}

static PyObject *py_paged_attention(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t q, q_token_stride, keys, values, out, block_table, start_positions;
    Py_ssize_t rows, query_len, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks, window, threads, sinks, value_dim;
    float scale, softcap;
    int kv_dtype, portable;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnnnnfnfnipnn", &q, &q_token_stride, &keys, &values, &out, &block_table,
                          &start_positions, &rows, &query_len, &heads, &kv_heads, &head_dim, &block_size,
                          &num_blocks, &max_blocks, &scale, &window, &softcap, &threads, &kv_dtype, &portable, &sinks,
                          &value_dim))
        return NULL;
    if (value_dim < 0 || value_dim > head_dim) return invalid("paged_attention", "value_dim must lie in 0 .. head_dim");
    if (kv_dtype < KV_FLOAT32 || kv_dtype > KV_BFLOAT16) return invalid("paged_attention", "unknown KV dtype code");
    if (rows < 1 || query_len < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || head_dim < 1 ||
        block_size < 1 || num_blocks < 1 || max_blocks < 1 || threads < 1)
        return invalid("paged_attention", "sizes must be positive and heads a multiple of kv_heads");
    if (window < 0 || !(softcap >= 0.0f) || !(scale > 0.0f))
        return invalid("paged_attention", "window and softcap must not be negative, scale must be positive");
    const Attention a = {
        .q = (const float *)q,
        .q_token_stride = q_token_stride,
        .keys = (const void *)keys,
        .values = (const void *)values,
        .kv_dtype = kv_dtype,
        .out = (float *)out,
        .block_table = (const int64_t *)block_table,
        .start_positions = (const int64_t *)start_positions,
        .rows = rows,
        .query_len = query_len,
        .heads = heads,
        .kv_heads = kv_heads,
        .head_dim = head_dim,
        .block_size = block_size,
        .num_blocks = num_blocks,
        .max_blocks = max_blocks,
        .scale = scale,
        .window = window,
        .softcap = softcap,
        .portable = portable,
        .sinks = (const float *)sinks,
        .value_dim = value_dim,
    };
    int64_t longest;
    const char *problem = check_rows(&a, &longest);
    if (problem) return invalid("paged_attention", problem);
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = paged_attention(&a, longest, (int)threads);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_rope_and_cache(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t qkv, channel_stride, token_stride, positions, slots, cos, sin, max_positions, q_out, keys, values;
    Py_ssize_t tokens, heads, kv_heads, head_dim, pool_slots, threads, bias, q_norm, k_norm, rotary_dims;
    float norm_eps;
    int kv_dtype;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnnnnnninnnfn", &qkv, &channel_stride, &token_stride, &positions, &slots, &cos,
                          &sin, &max_positions, &q_out, &keys, &values, &tokens, &heads, &kv_heads, &head_dim,
                          &pool_slots, &threads, &kv_dtype, &bias, &q_norm, &k_norm, &norm_eps, &rotary_dims))
        return NULL;
    if (kv_dtype < KV_FLOAT32 || kv_dtype > KV_BFLOAT16) return invalid("rope_and_cache", "unknown KV dtype code");
    if (tokens < 1 || heads < 1 || kv_heads < 1 || head_dim < 2 || head_dim % 2 || pool_slots < 1 ||
        max_positions < 1 || threads < 1 || channel_stride < 0 || token_stride < 0)
        return invalid("rope_and_cache", "sizes must be positive, strides non-negative and head_dim even");
    const char *problem = check_features(head_dim, rotary_dims, norm_eps, bias || q_norm || k_norm || rotary_dims != head_dim);
    if (problem) return invalid("rope_and_cache", problem);
    const RopeCache r = {
        .qkv = (const float *)qkv,
        .channel_stride = channel_stride,
        .token_stride = token_stride,
        .positions = (const int64_t *)positions,
        .slots = (const int64_t *)slots,
        .cos = (const float *)cos,
        .sin = (const float *)sin,
        .max_positions = max_positions,
        .q_out = (float *)q_out,
        .keys = (void *)keys,
        .values = (void *)values,
        .kv_dtype = kv_dtype,
        .tokens = tokens,
        .heads = heads,
        .kv_heads = kv_heads,
        .head_dim = head_dim,
        .pool_slots = pool_slots,
        .bias = (const float *)bias,
        .q_norm = (const float *)q_norm,
        .k_norm = (const float *)k_norm,
        .norm_eps = norm_eps,
        .rotary_dims = rotary_dims,
    };
    for (int64_t t = 0; t < tokens; t++) {
        if (r.positions[t] < 0 || r.positions[t] >= max_positions)
            return invalid("rope_and_cache", "a position lies outside the RoPE tables");
        if (r.slots[t] < 0 || r.slots[t] >= pool_slots) return invalid("rope_and_cache", "a slot lies outside the KV pool");
    }
    Py_BEGIN_ALLOW_THREADS
    rope_and_cache(&r, (int)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gated_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t gate_up, channel_stride, token_stride, out, intermediate, tokens, threads;
    int activation;
    if (!PyArg_ParseTuple(args, "nnnnnnin", &gate_up, &channel_stride, &token_stride, &out, &intermediate, &tokens,
                          &activation, &threads))
        return NULL;
    if (intermediate < 1 || tokens < 1 || threads < 1 || channel_stride < 0 || token_stride < 0)
        return invalid("gated_rows", "sizes must be positive and strides non-negative");
    if (activation != ACTIVATION_SILU && activation != ACTIVATION_GELU_TANH) return invalid("gated_rows", "unknown activation code");
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = gated_rows((const float *)gate_up, channel_stride, token_stride, (float *)out, intermediate, tokens,
                        activation, (int)threads);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_clamped_swiglu_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t gate_up, channel_stride, token_stride, out, intermediate, tokens, threads;
    float alpha, limit;
    if (!PyArg_ParseTuple(args, "nnnnnnffn", &gate_up, &channel_stride, &token_stride, &out, &intermediate, &tokens, &alpha,
                          &limit, &threads))
        return NULL;
    if (intermediate < 1 || tokens < 1 || threads < 1 || channel_stride < 0 || token_stride < 0)
        return invalid("clamped_swiglu_rows", "sizes must be positive and strides non-negative");
    if (!(alpha > 0.0f) || !(limit > 0.0f)) return invalid("clamped_swiglu_rows", "alpha and limit must be positive");
    Py_BEGIN_ALLOW_THREADS
    clamped_swiglu_rows((const float *)gate_up, channel_stride, token_stride, (float *)out, intermediate, tokens, alpha, limit,
                        (int)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_add_rms_norm(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t h, delta, delta_token_stride, delta_channel_stride, weight, out, tokens, hidden, threads;
    float eps;
    if (!PyArg_ParseTuple(args, "nnnnnnnnfn", &h, &delta, &delta_token_stride, &delta_channel_stride, &weight, &out,
                          &tokens, &hidden, &eps, &threads))
        return NULL;
    if (tokens < 1 || hidden < 1 || threads < 1 || delta_token_stride < 0 || delta_channel_stride < 0)
        return invalid("add_rms_norm", "sizes must be positive and strides non-negative");
    const AddRmsNorm n = {
        .h = (float *)h,
        .delta = (const float *)delta,
        .delta_token_stride = delta_token_stride,
        .delta_channel_stride = delta_channel_stride,
        .weight = (const float *)weight,
        .out = (float *)out,
        .tokens = tokens,
        .hidden = hidden,
        .eps = eps,
    };
    Py_BEGIN_ALLOW_THREADS
    add_rms_norm(&n, (int)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_float16_linear(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, x_stride, packed, y, tokens, in, out, threads;
    int isa;
    if (!PyArg_ParseTuple(args, "nnnnnnnni", &x, &x_stride, &packed, &y, &tokens, &in, &out, &threads, &isa))
        return NULL;
    if (tokens < 1 || in < 1 || out < 1 || threads < 1 || x_stride < in)
        return invalid("float16_linear", "sizes must be positive and rows at least `in` apart");
    const Float16Linear l = {
        .x = (const float *)x,
        .x_stride = x_stride,
        .packed = (const uint16_t *)packed,
        .y = (float *)y,
        .tokens = tokens,
        .in = in,
        .out = out,
    };
    Py_BEGIN_ALLOW_THREADS
    float16_linear(&l, (int)threads, isa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_quantized_linear(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, x_stride, blocks, y, tokens, in, out, threads;
    int type, isa;
    if (!PyArg_ParseTuple(args, "nnninnnnni", &x, &x_stride, &blocks, &type, &y, &tokens, &in, &out, &threads, &isa))
        return NULL;
    int64_t block_size, type_size;
    if (quantized_block_shape(type, &block_size, &type_size)) return invalid("quantized_linear", "unknown ggml type id");
    if (tokens < 1 || in < 1 || out < 1 || threads < 1 || x_stride < in || in % block_size)
        return invalid("quantized_linear", "sizes must be positive, rows at least `in` apart and `in` whole blocks");
    const QuantizedLinear l = {
        .x = (const float *)x,
        .x_stride = x_stride,
        .blocks = (const uint8_t *)blocks,
        .type = type,
        .y = (float *)y,
        .tokens = tokens,
        .in = in,
        .out = out,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = quantized_linear(&l, (int)threads, isa);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int is_k_type(int type) { return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K; }

/* NULL when a MoE layer's experts fit moe_layer.c (known types, whole blocks of hidden and
 * intermediate inputs, halves 0-2 and only on types with integer kernels, a known activation with
 * its parameters; the expert biases, where given, are [experts, 2 intermediate] and [experts, hidden]),
 * else the problem; each expert's gate_up and down bytes into the last two. The one check of
 * `moe_layer` and of a decoder layer's MoE table. */
static const char *moe_experts_problem(int gate_up_type, int down_type, int gate_up_halves, int down_halves, int activation,
                                       float swiglu_alpha, float swiglu_limit, int64_t hidden, int64_t intermediate,
                                       int64_t *gate_up_expert_bytes, int64_t *down_expert_bytes) {
    int64_t block_size, type_size, down_block_size, down_type_size;
    if (quantized_block_shape(gate_up_type, &block_size, &type_size)) return "gate_up: unknown ggml type id";
    if (quantized_block_shape(down_type, &down_block_size, &down_type_size)) return "down: unknown ggml type id";
    if (hidden < 1 || intermediate < 1) return "sizes must be positive";
    if (hidden % block_size) return "gate_up: each expert must be [2 intermediate, hidden] of whole blocks";
    if (intermediate % down_block_size) return "down: each expert must be [hidden, intermediate] of whole blocks";
    if (activation != ACTIVATION_SILU && activation != ACTIVATION_GELU_TANH && activation != ACTIVATION_CLAMPED_SWIGLU)
        return "unknown activation code";
    if (activation == ACTIVATION_CLAMPED_SWIGLU && !(swiglu_alpha > 0.0f && swiglu_alpha < INFINITY && swiglu_limit > 0.0f &&
                                                     swiglu_limit < INFINITY))
        return "the clamped SwiGLU's alpha and limit must be positive and finite";
    if (gate_up_halves < 0 || gate_up_halves > 2 || down_halves < 0 || down_halves > 2)
        return "halves must be 0 (float32 activations), 1 or 2";
    if ((gate_up_halves && !is_k_type(gate_up_type) && !integer_linear_type(gate_up_type)) ||
        (down_halves && !is_k_type(down_type) && !integer_linear_type(down_type)))
        return "8-bit activations need a type with integer kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)";
    *gate_up_expert_bytes = 2 * intermediate * (hidden / block_size) * type_size;
    *down_expert_bytes = hidden * (intermediate / down_block_size) * down_type_size;
    return NULL;
}

/* NULL when a route's options fit moe_route.c (a known kind, k of the experts, groups that split
 * them evenly), else the problem: the one check of `moe_route` and of a decoder layer's MoE table. */
static const char *moe_route_problem(int64_t kind, int64_t experts, int64_t k, int64_t n_group, int64_t topk_group, double scaling) {
    if (experts < 1 || k < 1 || k > experts) return "k must lie in 1 .. experts";
    if (kind < ROUTING_SOFTMAX || kind > ROUTING_TOPK_SOFTMAX) return "unknown routing kind";
    if (n_group < 1 || experts % n_group || topk_group < 1 || topk_group > n_group)
        return "the groups must split the experts evenly and topk_group lie in 1 .. n_group";
    if (!isfinite(scaling)) return "the scaling factor must be finite";
    return NULL;
}

/* Checks every expert id against the experts before anything is read. */
static PyObject *py_moe_layer(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, expert_ids, expert_weights, gate_up, gate_up_expert_bytes, down, down_expert_bytes, out;
    Py_ssize_t tokens, k, experts, hidden, intermediate, threads, gate_up_bias, down_bias;
    int gate_up_type, down_type, activation, gate_up_halves, down_halves, isa, integer_isa;
    float swiglu_alpha, swiglu_limit;
    if (!PyArg_ParseTuple(args, "nnnninnininnnnnnniiiiffnn", &x, &expert_ids, &expert_weights, &gate_up, &gate_up_type,
                          &gate_up_expert_bytes, &down, &down_type, &down_expert_bytes, &activation, &out, &tokens, &k,
                          &experts, &hidden, &intermediate, &threads, &gate_up_halves, &down_halves, &isa, &integer_isa,
                          &swiglu_alpha, &swiglu_limit, &gate_up_bias, &down_bias))
        return NULL;
    if (tokens < 1 || k < 1 || experts < 1 || threads < 1) return invalid("moe_layer", "sizes must be positive");
    int64_t gate_up_bytes, down_bytes;
    const char *problem = moe_experts_problem(gate_up_type, down_type, gate_up_halves, down_halves, activation, swiglu_alpha,
                                              swiglu_limit, hidden, intermediate, &gate_up_bytes, &down_bytes);
    if (problem) return invalid("moe_layer", problem);
    if (gate_up_expert_bytes != gate_up_bytes) return invalid("moe_layer", "gate_up: each expert must be [2 intermediate, hidden] of whole blocks");
    if (down_expert_bytes != down_bytes) return invalid("moe_layer", "down: each expert must be [hidden, intermediate] of whole blocks");
    for (int64_t s = 0; s < tokens * k; s++) {
        const int64_t e = ((const int64_t *)expert_ids)[s];
        if (e < 0 || e >= experts) return invalid("moe_layer", "expert_ids: an expert id lies outside the experts");
    }
    const MoELayer m = {
        .x = (const float *)x,
        .expert_ids = (const int64_t *)expert_ids,
        .expert_weights = (const float *)expert_weights,
        .gate_up = (const uint8_t *)gate_up,
        .down = (const uint8_t *)down,
        .gate_up_type = gate_up_type,
        .down_type = down_type,
        .gate_up_expert_bytes = gate_up_expert_bytes,
        .down_expert_bytes = down_expert_bytes,
        .activation = activation,
        .swiglu_alpha = swiglu_alpha,
        .swiglu_limit = swiglu_limit,
        .gate_up_bias = (const float *)gate_up_bias,
        .down_bias = (const float *)down_bias,
        .gate_up_halves = gate_up_halves,
        .down_halves = down_halves,
        .out = (float *)out,
        .tokens = tokens,
        .k = k,
        .experts = experts,
        .hidden = hidden,
        .intermediate = intermediate,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = moe_layer(&m, (int)threads, isa, integer_isa);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* The route of a mixture-of-experts layer (moe_route.c); checks the kind and the group sizes. */
static PyObject *py_moe_route(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, router, router_bias, correction_bias, expert_ids, expert_weights, tokens, hidden, experts, k, n_group,
        topk_group, threads, shared_gate, shared_scale;
    int kind, normalize, isa;
    double scaling;
    if (!PyArg_ParseTuple(args, "nnnnidinnnnnnnnninn", &x, &router, &router_bias, &correction_bias, &kind, &scaling, &normalize,
                          &tokens, &hidden, &experts, &k, &n_group, &topk_group, &expert_ids, &expert_weights, &threads, &isa,
                          &shared_gate, &shared_scale))
        return NULL;
    if (tokens && shared_gate && !shared_scale) return invalid("moe_route", "a shared gate needs its scales' output");
    if (tokens < 0 || hidden < 1 || threads < 1) return invalid("moe_route", "sizes must be positive");
    const char *problem = moe_route_problem(kind, experts, k, n_group, topk_group, scaling);
    if (problem) return invalid("moe_route", problem);
    const MoERoute m = {
        .x = (const float *)x,
        .router = (const float *)router,
        .router_bias = (const float *)router_bias,
        .correction_bias = (const float *)correction_bias,
        .kind = kind,
        .normalize = normalize,
        .scaling = scaling,
        .isa = isa,
        .tokens = tokens,
        .hidden = hidden,
        .experts = experts,
        .k = k,
        .n_group = n_group,
        .topk_group = topk_group,
        .expert_ids = (int64_t *)expert_ids,
        .expert_weights = (float *)expert_weights,
        .shared_gate = (const float *)shared_gate,
        .shared_scale = (float *)shared_scale,
    };
    int status = 0;
    if (tokens) {
        Py_BEGIN_ALLOW_THREADS
        status = moe_route(&m, (int)threads);
        Py_END_ALLOW_THREADS
    }
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* Rows of x [tokens, in] (rows `x_stride` floats apart) as 8-bit activation blocks into out
 * [tokens, in / 32] Q8Blocks (integer_linear.c). */
static PyObject *py_quantize_q8(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, x_stride, tokens, in, out, threads;
    int halves, isa;
    if (!PyArg_ParseTuple(args, "nnnnnini", &x, &x_stride, &tokens, &in, &out, &halves, &threads, &isa)) return NULL;
    if (tokens < 0 || in < 32 || in % 32 || x_stride < in || threads < 1 || halves < 1 || halves > 2)
        return invalid("quantize_q8", "in must be whole blocks of 32, rows at least `in` apart, halves 1 or 2");
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(tokens * in < 65536 ? 1 : (int)threads)
    for (Py_ssize_t t = 0; t < tokens; t++)
        quantize_row_q8(isa, (const float *)x + t * x_stride, in, halves, (Q8Block *)out + t * halves * (in / 32));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Rows of x [rows, width] float32 (contiguous) as Q4_K or Q6_K blocks into out (kquant_quantizers.c). */
static PyObject *py_quantize_kquant_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, rows, width, out, threads;
    int type;
    if (!PyArg_ParseTuple(args, "innnnn", &type, &x, &rows, &width, &out, &threads)) return NULL;
    if ((type != GGML_Q4_K && type != GGML_Q6_K) || rows < 0 || width < 256 || width % 256 || threads < 1)
        return invalid("quantize_kquant_rows", "type Q4_K or Q6_K, width whole 256-value super-blocks");
    Py_BEGIN_ALLOW_THREADS
    quantize_kquant_rows(type, (const float *)x, rows, width, (uint8_t *)out, (int)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_integer_linear(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, x_stride, blocks, y, tokens, in, out, threads;
    int halves, type, isa;
    if (!PyArg_ParseTuple(args, "nnininnnnni", &x, &x_stride, &halves, &blocks, &type, &y, &tokens, &in, &out, &threads, &isa))
        return NULL;
    if (!integer_linear_type(type)) return invalid("integer_linear", "not a 32-value block type");
    if (halves < 1 || halves > 2) return invalid("integer_linear", "halves must be 1 or 2");
    if (tokens < 1 || in < 32 || out < 1 || threads < 1 || in % 32 || x_stride < halves * (in / 32))
        return invalid("integer_linear", "sizes must be positive, `in` whole blocks and rows at least in / 32 blocks apart");
    const IntegerLinear l = {
        .x = (const Q8Block *)x,
        .x_stride = x_stride,
        .halves = halves,
        .blocks = (const uint8_t *)blocks,
        .type = type,
        .y = (float *)y,
        .tokens = tokens,
        .in = in,
        .out = out,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = integer_linear(&l, (int)threads, isa);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* integer_dot_level(isa, granted), `granted` -1 for what this CPU and its OS grant. */
static PyObject *py_integer_dot_isa(PyObject *self, PyObject *args) {
    (void)self;
    int isa, granted;
    if (!PyArg_ParseTuple(args, "ii", &isa, &granted)) return NULL;
    return PyLong_FromLong(integer_dot_level(isa, granted < 0 ? integer_dot_grants() : granted));
}

/* integer_dot_amx_trial(fault): AMX's trial child alone, `fault` 1 making it die of SIGILL. */
static PyObject *py_integer_dot_amx_trial(PyObject *self, PyObject *args) {
    (void)self;
    int fault;
    if (!PyArg_ParseTuple(args, "p", &fault)) return NULL;
    int passed;
    Py_BEGIN_ALLOW_THREADS
    passed = integer_dot_amx_trial(fault);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(passed);
}

static PyObject *py_quantized_first_nonfinite_scale(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t data, blocks;
    int type;
    if (!PyArg_ParseTuple(args, "inn", &type, &data, &blocks)) return NULL;
    if (blocks < 0) return invalid("quantized_first_nonfinite_scale", "blocks must not be negative");
    int64_t found;
    Py_BEGIN_ALLOW_THREADS
    found = quantized_first_nonfinite_scale(type, (const uint8_t *)data, blocks);
    Py_END_ALLOW_THREADS
    if (found == -2) return invalid("quantized_first_nonfinite_scale", "unknown ggml type id");
    return PyLong_FromLongLong(found);
}

/* Checks every row id against the weight's rows before anything is read. */
static PyObject *py_quantized_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t data, weight_rows, in, rows, count, out, threads;
    int type, isa;
    if (!PyArg_ParseTuple(args, "innnnnnni", &type, &data, &weight_rows, &in, &rows, &count, &out, &threads, &isa))
        return NULL;
    int64_t block_size, type_size;
    if (quantized_block_shape(type, &block_size, &type_size)) return invalid("dequantize_rows", "unknown ggml type id");
    if (in < 1 || count < 0 || threads < 1 || in % block_size) return invalid("dequantize_rows", "`in` must be whole blocks");
    for (int64_t r = 0; r < count; r++) {
        const int64_t row = ((const int64_t *)rows)[r];
        if (row < 0 || row >= weight_rows) return invalid("dequantize_rows", "a row id lies outside the weight");
    }
    Py_BEGIN_ALLOW_THREADS
    quantized_rows(type, (const uint8_t *)data, in, (const int64_t *)rows, count, (float *)out, (int)threads, isa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Checks a round's tokens and attention groups once for every layer of `decoder_layer`: each
 * position inside the RoPE tables, each slot inside the pool, each group's block ids inside the
 * pool and its rows inside their tables and inside the round's tokens. Fills each plan's
 * `longest` (the most keys a row of the group attends to); returns the furthest position (a
 * layer's own RoPE tables are checked against it). */
static PyObject *py_check_decoder_round(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t positions, slots, tokens, max_positions, pool_slots, plans, groups, num_blocks, block_size, heads, kv_heads;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnn", &positions, &slots, &tokens, &max_positions, &pool_slots, &plans, &groups,
                          &num_blocks, &block_size, &heads, &kv_heads))
        return NULL;
    if (tokens < 1 || groups < 1 || num_blocks < 1 || block_size < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads)
        return invalid("decoder_layer", "sizes must be positive and heads a multiple of kv_heads");
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t position = ((const int64_t *)positions)[t], slot = ((const int64_t *)slots)[t];
        if (position < 0 || position >= max_positions) return invalid("decoder_layer", "a position lies outside the RoPE tables");
        if (slot < 0 || slot >= pool_slots) return invalid("decoder_layer", "a slot lies outside the KV pool");
    }
    int64_t covered = 0;
    for (int64_t g = 0; g < groups; g++) {
        AttentionGroupPlan *plan = (AttentionGroupPlan *)plans + g;
        if (plan->start != covered || plan->rows < 1 || plan->query_len < 1 || plan->max_blocks < 1)
            return invalid("decoder_layer", "the groups must cover the round's tokens in order");
        covered += plan->rows * plan->query_len;
        const Attention a = {.block_table = plan->block_table, .start_positions = plan->start_positions,
                             .rows = plan->rows, .query_len = plan->query_len, .block_size = block_size,
                             .num_blocks = num_blocks, .max_blocks = plan->max_blocks};
        const char *problem = check_rows(&a, &plan->longest);
        if (problem) return invalid("decoder_layer", problem);
    }
    if (covered != tokens) return invalid("decoder_layer", "the groups must cover the round's tokens in order");
    int64_t furthest = 0;
    for (int64_t t = 0; t < tokens; t++) furthest = ((const int64_t *)positions)[t] > furthest ? ((const int64_t *)positions)[t] : furthest;
    return PyLong_FromLongLong(furthest);
}

/* A layer's linear layer from its row of native.py's part table: (type, address, out) per part. */
static LayerLinear layer_linear_from(const int64_t *row) {
    LayerLinear w;
    for (int p = 0; p < LAYER_LINEAR_PARTS; p++)
        w.parts[p] = (LinearPart){.type = row[3 * p], .data = (const void *)(intptr_t)row[3 * p + 1], .out = row[3 * p + 2]};
    return w;
}

/* A layer's row of native.py's LayerStack table (int64): its norms, part table ([4 linear layers:
 * qkv, o, gate_up, down][LAYER_LINEAR_PARTS][3]), pools, own RoPE tables (0: the round's), the
 * family features; and of its float32 row: scale, softcap. */
enum {
    LAYER_INPUT_NORM, LAYER_POST_NORM, LAYER_PARTS, LAYER_KEYS, LAYER_VALUES, LAYER_COS, LAYER_SIN, LAYER_COS_ROWS,
    LAYER_ROTARY_DIMS, LAYER_QKV_BIAS, LAYER_Q_NORM, LAYER_K_NORM, LAYER_ATTENTION_OUTPUT_NORM, LAYER_MLP_OUTPUT_NORM,
    LAYER_WINDOW, LAYER_ACTIVATION, LAYER_MOE, LAYER_SINKS, LAYER_O_BIAS, LAYER_FIELDS
};
enum { LAYER_SCALE, LAYER_SOFTCAP, LAYER_SCALARS };

/* A mixture-of-experts layer's table (native_layers.py's KernelMoE.table, int64; LAYER_MOE holds
 * its address, 0 for a gated MLP): its router, the route's options (the scaling factor's float64
 * bits), and its stacked experts' blocks. */
enum {
    MOE_ROUTER, MOE_ROUTER_BIAS, MOE_CORRECTION_BIAS, MOE_KIND, MOE_NORMALIZE, MOE_SCALING_BITS, MOE_EXPERTS, MOE_K,
    MOE_N_GROUP, MOE_TOPK_GROUP, MOE_INTERMEDIATE, MOE_GATE_UP, MOE_GATE_UP_TYPE, MOE_GATE_UP_HALVES, MOE_DOWN,
    MOE_DOWN_TYPE, MOE_DOWN_HALVES, MOE_ACTIVATION, MOE_SWIGLU_ALPHA_BITS, MOE_SWIGLU_LIMIT_BITS, MOE_GATE_UP_BIAS,
    MOE_DOWN_BIAS, MOE_SHARED_GATE, MOE_FIELDS
};

/* The LayerMoE of a table for layers of `hidden` into *moe: NULL, or what does not fit. */
static const char *layer_moe_from(const int64_t *t, int64_t hidden, LayerMoE *moe) {
    double scaling, alpha, limit;
    memcpy(&scaling, &t[MOE_SCALING_BITS], sizeof scaling);
    memcpy(&alpha, &t[MOE_SWIGLU_ALPHA_BITS], sizeof alpha);
    memcpy(&limit, &t[MOE_SWIGLU_LIMIT_BITS], sizeof limit);
    const char *problem = moe_route_problem(t[MOE_KIND], t[MOE_EXPERTS], t[MOE_K], t[MOE_N_GROUP], t[MOE_TOPK_GROUP], scaling);
    int64_t gate_up_bytes, down_bytes;
    if (!problem)
        problem = moe_experts_problem((int)t[MOE_GATE_UP_TYPE], (int)t[MOE_DOWN_TYPE], (int)t[MOE_GATE_UP_HALVES],
                                      (int)t[MOE_DOWN_HALVES], (int)t[MOE_ACTIVATION], (float)alpha, (float)limit, hidden,
                                      t[MOE_INTERMEDIATE], &gate_up_bytes, &down_bytes);
    if (problem) return problem;
    *moe = (LayerMoE){
        .route = {
            .router = (const float *)(intptr_t)t[MOE_ROUTER],
            .router_bias = (const float *)(intptr_t)t[MOE_ROUTER_BIAS],
            .correction_bias = (const float *)(intptr_t)t[MOE_CORRECTION_BIAS],
            .kind = (int)t[MOE_KIND],
            .normalize = (int)t[MOE_NORMALIZE],
            .scaling = scaling,
            .hidden = hidden,
            .experts = t[MOE_EXPERTS],
            .k = t[MOE_K],
            .n_group = t[MOE_N_GROUP],
            .topk_group = t[MOE_TOPK_GROUP],
            .shared_gate = (const float *)(intptr_t)t[MOE_SHARED_GATE],
        },
        .layer = {
            .gate_up = (const uint8_t *)(intptr_t)t[MOE_GATE_UP],
            .down = (const uint8_t *)(intptr_t)t[MOE_DOWN],
            .gate_up_type = (int)t[MOE_GATE_UP_TYPE],
            .down_type = (int)t[MOE_DOWN_TYPE],
            .gate_up_expert_bytes = gate_up_bytes,
            .down_expert_bytes = down_bytes,
            .activation = (int)t[MOE_ACTIVATION],
            .swiglu_alpha = (float)alpha,
            .swiglu_limit = (float)limit,
            .gate_up_bias = (const float *)(intptr_t)t[MOE_GATE_UP_BIAS],
            .down_bias = (const float *)(intptr_t)t[MOE_DOWN_BIAS],
            .gate_up_halves = (int)t[MOE_GATE_UP_HALVES],
            .down_halves = (int)t[MOE_DOWN_HALVES],
            .k = t[MOE_K],
            .experts = t[MOE_EXPERTS],
            .hidden = hidden,
            .intermediate = t[MOE_INTERMEDIATE],
        },
    };
    return NULL;
}

/* The decoder layers of a LayerStack (decoder_layer.c), one after another, over a round
 * `py_check_decoder_round` has checked: every layer's options are checked before any runs. */
static PyObject *py_decoder_layers(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t h, tokens, hidden, heads, kv_heads, head_dim, intermediate, positions, slots, cos, sin, max_positions;
    Py_ssize_t rotary_dims, num_blocks, block_size, plans, groups, scratch, threads, layers, scalars, count;
    float eps;
    int kv_dtype, isa, quantized_isa, integer_isa;
    if (!PyArg_ParseTuple(args, "nnnnnnnfnnnnnninnnnnniiinnn", &h, &tokens, &hidden, &heads, &kv_heads, &head_dim,
                          &intermediate, &eps, &positions, &slots, &cos, &sin, &max_positions, &rotary_dims, &kv_dtype,
                          &num_blocks, &block_size, &plans, &groups, &scratch, &threads, &isa, &quantized_isa, &integer_isa, &layers,
                          &scalars, &count))
        return NULL;
    if (kv_dtype < KV_FLOAT32 || kv_dtype > KV_BFLOAT16) return invalid("decoder_layer", "unknown KV dtype code");
    if (threads < 1) return invalid("decoder_layer", "threads must be positive");
    const int64_t *table = (const int64_t *)layers;
    const float *values = (const float *)scalars;
    for (Py_ssize_t i = 0; i < count; i++) {
        const int64_t *row = table + i * LAYER_FIELDS;
        const float scale = values[i * LAYER_SCALARS + LAYER_SCALE], softcap = values[i * LAYER_SCALARS + LAYER_SOFTCAP];
        const int64_t dims = row[LAYER_COS] ? row[LAYER_ROTARY_DIMS] : rotary_dims;
        const int featured = row[LAYER_QKV_BIAS] || row[LAYER_Q_NORM] || row[LAYER_K_NORM] || dims != head_dim;
        const char *problem = check_features(head_dim, dims, eps, featured);
        if (problem) return invalid("decoder_layer", problem);
        if (row[LAYER_WINDOW] < 0 || !(softcap >= 0.0f) || !(scale > 0.0f))
            return invalid("decoder_layer", "window and softcap must not be negative, scale must be positive");
        /* The clamped SwiGLU takes parameters only a MoE table carries: a gated MLP's (a shared
         * expert's too) is silu or gelu_tanh. */
        const int64_t *parts = (const int64_t *)(intptr_t)row[LAYER_PARTS];
        const int gated = !row[LAYER_MOE] || layer_linear_from(parts + 2 * 3 * LAYER_LINEAR_PARTS).parts[0].out != 0;
        if (row[LAYER_ACTIVATION] != ACTIVATION_SILU && row[LAYER_ACTIVATION] != ACTIVATION_GELU_TANH &&
            (gated || row[LAYER_ACTIVATION] != ACTIVATION_CLAMPED_SWIGLU))
            return invalid("decoder_layer", "unknown activation code");
    }
    /* Each MoE layer's route and experts' calls, checked and built once for the round. */
    LayerMoE *moes = PyMem_Calloc(count > 0 ? (size_t)count : 1, sizeof *moes);
    if (!moes) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        const int64_t *row = table + i * LAYER_FIELDS;
        const char *problem = row[LAYER_MOE] ? layer_moe_from((const int64_t *)(intptr_t)row[LAYER_MOE], hidden, &moes[i]) : NULL;
        if (problem) {
            PyMem_Free(moes);
            return invalid("decoder_layer", problem);
        }
    }
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count && !status; i++) {
        const int64_t *row = table + i * LAYER_FIELDS, *parts = (const int64_t *)(intptr_t)row[LAYER_PARTS];
        const int64_t linear = 3 * LAYER_LINEAR_PARTS;
        const int own = row[LAYER_COS] != 0;
        const DecoderLayerRound l = {
            .h = (float *)h,
            .input_norm = (const float *)(intptr_t)row[LAYER_INPUT_NORM],
            .post_norm = (const float *)(intptr_t)row[LAYER_POST_NORM],
            .qkv = layer_linear_from(parts),
            .o = layer_linear_from(parts + linear),
            .gate_up = layer_linear_from(parts + 2 * linear),
            .down = layer_linear_from(parts + 3 * linear),
            .tokens = tokens,
            .hidden = hidden,
            .heads = heads,
            .kv_heads = kv_heads,
            .head_dim = head_dim,
            .intermediate = intermediate,
            .eps = eps,
            .scale = values[i * LAYER_SCALARS + LAYER_SCALE],
            .positions = (const int64_t *)positions,
            .slots = (const int64_t *)slots,
            .cos = (const float *)(intptr_t)(own ? row[LAYER_COS] : cos),
            .sin = (const float *)(intptr_t)(own ? row[LAYER_SIN] : sin),
            .max_positions = own ? row[LAYER_COS_ROWS] : max_positions,
            .rotary_dims = own ? row[LAYER_ROTARY_DIMS] : rotary_dims,
            .qkv_bias = (const float *)(intptr_t)row[LAYER_QKV_BIAS],
            .q_norm = (const float *)(intptr_t)row[LAYER_Q_NORM],
            .k_norm = (const float *)(intptr_t)row[LAYER_K_NORM],
            .attention_output_norm = (const float *)(intptr_t)row[LAYER_ATTENTION_OUTPUT_NORM],
            .mlp_output_norm = (const float *)(intptr_t)row[LAYER_MLP_OUTPUT_NORM],
            .window = row[LAYER_WINDOW],
            .softcap = values[i * LAYER_SCALARS + LAYER_SOFTCAP],
            .activation = (int)row[LAYER_ACTIVATION],
            .sinks = (const float *)(intptr_t)row[LAYER_SINKS],
            .o_bias = (const float *)(intptr_t)row[LAYER_O_BIAS],
            .moe = row[LAYER_MOE] ? &moes[i] : NULL,
            .keys = (void *)(intptr_t)row[LAYER_KEYS],
            .values = (void *)(intptr_t)row[LAYER_VALUES],
            .kv_dtype = kv_dtype,
            .num_blocks = num_blocks,
            .block_size = block_size,
            .group_plans = (const AttentionGroupPlan *)plans,
            .groups = groups,
            .scratch = (float *)scratch,
            .isa = isa,
            .quantized_isa = quantized_isa,
            .integer_isa = integer_isa,
        };
        status = decoder_layer(&l, (int)threads);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(moes);
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---- integer K-quant products (integer_kquants.c) ------------------------------------------------ */

/* x [tokens, in] (rows x_stride apart) as quantize_row_q8k_halves's blocks into out (halves * in / 256
 * Q8KBlocks a row, rows contiguous): what every K product of that input reads. */
static PyObject *py_quantize_q8k_rows(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, x_stride, tokens, in, out, threads;
    int halves, isa;
    if (!PyArg_ParseTuple(args, "nnnnnini", &x, &x_stride, &tokens, &in, &out, &halves, &threads, &isa)) return NULL;
    if (tokens < 0 || in < 256 || in % 256 || x_stride < in || threads < 1 || halves < 1 || halves > 2)
        return invalid("quantize_q8k_rows", "in must be whole blocks of 256, rows at least `in` apart, halves 1 or 2");
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(tokens * in < 65536 ? 1 : (int)threads)
    for (Py_ssize_t t = 0; t < tokens; t++)
        quantize_row_q8k_halves(isa, (const float *)x + t * x_stride, in, halves, (Q8KBlock *)out + t * halves * (in / 256));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* y [tokens, out] = quantize_q8k_rows's rows times a K weight (integer_kquant_linear). */
static PyObject *py_integer_kquant_linear(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, blocks, y, tokens, in, out, threads;
    int type, halves, isa;
    if (!PyArg_ParseTuple(args, "nininnnnni", &x, &halves, &blocks, &type, &y, &tokens, &in, &out, &threads, &isa)) return NULL;
    if (!is_k_type(type)) return invalid("integer_kquant_linear", "the type must be Q4_K, Q5_K or Q6_K");
    if (halves < 1 || halves > 2) return invalid("integer_kquant_linear", "halves must be 1 or 2");
    if (tokens < 1 || out < 1 || threads < 1 || in < 256 || in % 256)
        return invalid("integer_kquant_linear", "sizes must be positive and `in` whole 256-value blocks");
    Py_BEGIN_ALLOW_THREADS
    integer_kquant_linear(type, halves, (const uint8_t *)blocks, (const Q8KBlock *)x, (float *)y, tokens, in, out, out, (int)threads, isa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* x [rows, in] as Q8_K blocks, their fields written to d [rows, in / 256], qs [rows, in] (int8) and
 * bsums [rows, in / 16] (int16). */
static PyObject *py_quantize_q8k(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t x, rows, in, d, qs, bsums;
    int isa;
    if (!PyArg_ParseTuple(args, "nnnnnni", &x, &rows, &in, &d, &qs, &bsums, &isa)) return NULL;
    if (rows < 0 || in < 256 || in % 256) return invalid("quantize_q8k", "`in` must be whole 256-value blocks");
    const int64_t nb = in / 256;
    Q8KBlock *q = malloc(sizeof(Q8KBlock) * (size_t)(rows * nb + 1));
    if (!q) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < rows; r++) quantize_row_q8k_isa(isa, (const float *)x + r * in, in, q + r * nb);
    for (int64_t b = 0; b < rows * nb; b++) {
        ((float *)d)[b] = q[b].d;
        memcpy((int8_t *)qs + 256 * b, q[b].qs, 256);
        memcpy((int16_t *)bsums + 16 * b, q[b].bsums, 32);
    }
    Py_END_ALLOW_THREADS
    free(q);
    Py_RETURN_NONE;
}
/* ---- end of the integer K-quant products ----------------------------------------------------- */

static PyMethodDef methods[] = {
    {"paged_attention", py_paged_attention, METH_VARARGS,
     "paged_attention(q, q_token_stride, keys, values, out, block_table, start_positions, rows, query_len, heads, "
     "kv_heads, head_dim, block_size, num_blocks, max_blocks, scale, window, softcap, threads, kv_dtype, portable, sinks, "
     "value_dim)"},
    {"rope_and_cache", py_rope_and_cache, METH_VARARGS,
     "rope_and_cache(qkv, channel_stride, token_stride, positions, slots, cos, sin, max_positions, q_out, keys, "
     "values, tokens, heads, kv_heads, head_dim, pool_slots, threads, kv_dtype, bias, q_norm, k_norm, norm_eps, "
     "rotary_dims)"},
    {"gated_rows", py_gated_rows, METH_VARARGS,
     "gated_rows(gate_up, channel_stride, token_stride, out, intermediate, tokens, activation, threads)"},
    {"clamped_swiglu_rows", py_clamped_swiglu_rows, METH_VARARGS,
     "clamped_swiglu_rows(gate_up, channel_stride, token_stride, out, intermediate, tokens, alpha, limit, threads)"},
    {"add_rms_norm", py_add_rms_norm, METH_VARARGS,
     "add_rms_norm(h, delta, delta_token_stride, delta_channel_stride, weight, out, tokens, hidden, eps, threads)"},
    {"float16_linear", py_float16_linear, METH_VARARGS,
     "float16_linear(x, x_stride, packed, y, tokens, in, out, threads, isa)"},
    {"quantized_linear", py_quantized_linear, METH_VARARGS,
     "quantized_linear(x, x_stride, blocks, type, y, tokens, in, out, threads, isa)"},
    {"moe_layer", py_moe_layer, METH_VARARGS,
     "moe_layer(x, expert_ids, expert_weights, gate_up, gate_up_type, gate_up_expert_bytes, down, down_type, "
     "down_expert_bytes, activation, out, tokens, k, experts, hidden, intermediate, threads, gate_up_halves, down_halves, "
     "isa, integer_isa, swiglu_alpha, swiglu_limit, gate_up_bias, down_bias)"},
    {"moe_route", py_moe_route, METH_VARARGS,
     "moe_route(x, router, router_bias, correction_bias, kind, scaling, normalize, tokens, hidden, experts, k, n_group, "
     "topk_group, expert_ids, expert_weights, threads, isa, shared_gate, shared_scale)"},
    {"quantize_q8", py_quantize_q8, METH_VARARGS, "quantize_q8(x, x_stride, tokens, in, out, halves, threads, isa)"},
    {"quantize_kquant_rows", py_quantize_kquant_rows, METH_VARARGS, "quantize_kquant_rows(type, x, rows, width, out, threads)"},
    {"integer_linear", py_integer_linear, METH_VARARGS,
     "integer_linear(x_blocks, x_stride_blocks, halves, blocks, type, y, tokens, in, out, threads, isa)"},
    {"integer_dot_isa", py_integer_dot_isa, METH_VARARGS, "integer_dot_isa(isa, granted): the level the integer kernels run at (granted -1: this CPU's)"},
    {"integer_dot_amx_trial", py_integer_dot_amx_trial, METH_VARARGS,
     "integer_dot_amx_trial(fault): whether a forked child ran AMX tile instructions and exited cleanly"},
    {"quantized_first_nonfinite_scale", py_quantized_first_nonfinite_scale, METH_VARARGS,
     "quantized_first_nonfinite_scale(type, data, blocks)"},
    {"quantized_rows", py_quantized_rows, METH_VARARGS,
     "quantized_rows(type, data, weight_rows, in, rows, count, out, threads, isa)"},
    {"check_decoder_round", py_check_decoder_round, METH_VARARGS,
     "check_decoder_round(positions, slots, tokens, max_positions, pool_slots, plans, groups, num_blocks, block_size, "
     "heads, kv_heads)"},
    {"decoder_layers", py_decoder_layers, METH_VARARGS,
     "decoder_layers(h, tokens, hidden, heads, kv_heads, head_dim, intermediate, eps, positions, slots, cos, sin, "
     "max_positions, rotary_dims, kv_dtype, num_blocks, block_size, plans, groups, scratch, threads, isa, quantized_isa, integer_isa, "
     "layers, scalars, count)"},
    {"quantize_q8k_rows", py_quantize_q8k_rows, METH_VARARGS, "quantize_q8k_rows(x, x_stride, tokens, in, out, halves, threads, isa)"},
    {"integer_kquant_linear", py_integer_kquant_linear, METH_VARARGS,
     "integer_kquant_linear(x, halves, blocks, type, y, tokens, in, out, threads, isa)"},
    {"quantize_q8k", py_quantize_q8k, METH_VARARGS, "quantize_q8k(x, rows, in, d, qs, bsums, isa)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "The engine's CPU kernels; use them through flare.engine.native, which checks the tensors.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "ATTENTION_KEY_RANGE", ATTENTION_KEY_RANGE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
