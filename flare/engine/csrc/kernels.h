/* The engine's CPU kernels: fused steps of one layer that torch's CPU operators run as several
 * passes over memory. Each is the counterpart of a torch expression in flare/engine/model.py,
 * which runs where this library was not built; tests/engine/test_native.py holds them equal.
 *
 * The kernels trust their arguments: flare/engine/native.py checks the tensors behind every
 * pointer (device, dtype, shape, strides) and module.c checks every index into the KV pool. */
#ifndef FLARE_KERNELS_H
#define FLARE_KERNELS_H

#include <stdint.h>
#include <string.h>

/* Compile the hot loops for AVX2 + FMA where the CPU has them and generic x86-64 elsewhere: the
 * loader picks the clone at run time, so one build runs on any x86-64 machine. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLARE_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FLARE_TARGET_CLONES
#endif

/* exp(x) for x <= 0, to about 2 ulp, in a form compilers vectorise (libm's expf is a scalar
 * call, slower than everything else these kernels do). Cody-Waite range reduction
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the polynomial of Cephes' expf (S. L. Moshier),
 * 2^n by writing the float's exponent bits. Below -87.3 the result would be denormal; it is
 * clamped there (e^-87.3 ~ 1e-38). NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    /* n = x / ln2 rounded to the nearest integer by adding and subtracting 1.5 * 2^23 (exact for
     * |x / ln2| < 2^22): plain adds, where floorf needs SSE4.1 and is a libm call per element in
     * code compiled for baseline x86-64, as OpenMP's outlined loop bodies are. */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* tanh(y) to a few ulp, vectorisable (libm's tanhf is a scalar call): an odd polynomial below
 * |y| = 0.1 (its first neglected term, 62/2835 y^9, is under 2^-37 |y| there), above it
 * (1 - e) / (1 + e) with e = exp(-2|y|) <= e^-0.2, where 1 - e loses no precision. */
static inline float tanh_float(float y) {
    const float a = y < 0.0f ? -y : y, y2 = y * y;
    const float small = y * (1.0f + y2 * (-1.0f / 3.0f + y2 * (2.0f / 15.0f - y2 * (17.0f / 315.0f))));
    const float e = exp_nonpositive(-2.0f * a);
    const float large = (1.0f - e) / (1.0f + e);
    return a < 0.1f ? small : (y < 0.0f ? -large : large);
}

/* How the KV pool stores its elements; native.py passes the code of the pool's dtype. A 16-bit
 * pool holds half the bytes of a float32 one, and attention over a long context is bound by
 * reading them. Everything is computed in float32: elements are widened when read and rounded
 * when written. */
typedef enum { KV_FLOAT32 = 0, KV_FLOAT16 = 1, KV_BFLOAT16 = 2 } KvDtype;

static inline float float_from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t bits_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* IEEE half to float, exact for every value (subnormals, infinities and NaN included), in
 * integer operations that vectorise (GCC 12 widens _Float16 one element at a time). The
 * exponent and mantissa shifted into a float's place are off by 2^(127 - 15) = 2^112, which one
 * multiplication puts right, subnormals included; infinity and NaN keep an all-ones exponent. */
static inline float float_from_half(uint16_t h) {
    const uint32_t magnitude = (uint32_t)(h & 0x7fff) << 13;
    float f = float_from_bits(magnitude) * 0x1p112f;
    uint32_t bits = bits_from_float(f) | (magnitude >= (0x7c00u << 13) ? 0x7f800000u : 0u);
    return float_from_bits(bits | (uint32_t)(h & 0x8000) << 16);
}

/* float to IEEE half, rounded to nearest even as torch's cast does (so the kernels write the
 * torch path's bits); beyond the largest half (65504, and from 65520 on by rounding) infinity,
 * NaN a quiet NaN. Normal results round by adding half an ulp less one plus the kept mantissa's
 * lowest bit, then dropping 13 bits; subnormal ones by adding 0.5, which puts the float's
 * rounding in the place of the half's last mantissa bit. */
static inline uint16_t half_from_float(float value) {
    const uint32_t bits = bits_from_float(value), sign = (bits >> 16) & 0x8000u, f = bits & 0x7fffffffu;
    const uint32_t special = f > 0x7f800000u ? 0x7e00u : 0x7c00u;
    const uint32_t subnormal = bits_from_float(float_from_bits(f) + 0.5f) - 0x3f000000u;
    const uint32_t normal = (f + 0xc8000fffu + ((f >> 13) & 1u)) >> 13;  /* 0xc8000000: exponent 127 -> 15 */
    const uint32_t half = f >= 0x47800000u ? special : (f < 0x38800000u ? subnormal : normal);
    return (uint16_t)(half | sign);
}

/* bfloat16 is a float's upper half: widening is exact; narrowing rounds to nearest even, as
 * torch does, with NaN kept a quiet NaN. */
static inline float float_from_bfloat16(uint16_t b) { return float_from_bits((uint32_t)b << 16); }

static inline uint16_t bfloat16_from_float(float value) {
    const uint32_t bits = bits_from_float(value);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

/* Element `i` of a pool of `dtype`, written from a float. */
static inline void kv_store(void *pool, int64_t i, float value, int dtype) {
    if (dtype == KV_FLOAT16)
        ((uint16_t *)pool)[i] = half_from_float(value);
    else if (dtype == KV_BFLOAT16)
        ((uint16_t *)pool)[i] = bfloat16_from_float(value);
    else
        ((float *)pool)[i] = value;
}

static inline int64_t kv_element_size(int dtype) { return dtype == KV_FLOAT32 ? 4 : 2; }

/* Paged attention of short rows: see paged_attention.c. */
typedef struct {
    const float *q;            /* [tokens, heads, head_dim]; tokens `q_token_stride` floats apart */
    int64_t q_token_stride;
    const void *keys;          /* [kv_heads, num_blocks * block_size, head_dim] of `kv_dtype` */
    const void *values;
    int kv_dtype;              /* a KvDtype */
    float *out;                /* [tokens, heads, value_dim or head_dim], contiguous */
    const int64_t *block_table;     /* [rows, max_blocks] */
    const int64_t *start_positions; /* [rows]: position of each row's first new token */
    int64_t rows, query_len, heads, kv_heads, head_dim, block_size, num_blocks, max_blocks;
    float scale;               /* the factor on q . k (head_dim ** -0.5 unless the model names another) */
    int64_t window;            /* 0, or the sliding window: query at position p sees keys p - window < k <= p */
    float softcap;             /* 0, or scores become softcap * tanh(score / softcap) after the scale */
    int portable;              /* run the loops for CPUs without AVX2 and FMA even where they are present */
    const float *sinks;        /* NULL, or [heads]: each head's learned sink logit joins its softmax's denominator (gpt-oss) */
    int64_t value_dim;         /* 0 (head_dim), or the values' width: the first value_dim of each row; out [.., value_dim] */
} Attention;

/* Returns 0, or -1 when scratch memory could not be allocated (nothing was written then). */
/* Keys are attended in ranges of this many positions (whole blocks) cut at fixed places; a
 * query whose keys reach past one is computed range by range and merged (paged_attention.c). */
#define ATTENTION_KEY_RANGE 1024

int paged_attention(const Attention *a, int64_t longest_row, int threads);

/* RoPE on q and k and the write of k and v into the KV pool: see rope_cache.c. */
typedef struct {
    /* A linear layer's output, channel c of token t at qkv[c * channel_stride + t * token_stride]:
     * columns (channel_stride = tokens, token_stride = 1) or rows (1, channels). */
    const float *qkv;
    int64_t channel_stride, token_stride;
    const int64_t *positions;  /* [tokens] */
    const int64_t *slots;      /* [tokens]: pool slot (block * block_size + offset) of each token */
    const float *cos, *sin;    /* [max_positions, rotary_dims / 2] */
    int64_t max_positions;
    float *q_out;              /* [tokens, heads, head_dim] */
    void *keys, *values;       /* [kv_heads, pool_slots, head_dim] of `kv_dtype` */
    int kv_dtype;              /* a KvDtype */
    int64_t tokens, heads, kv_heads, head_dim, pool_slots;
    /* The family features (Llama has none of them: NULL, NULL, NULL and rotary_dims = head_dim). */
    const float *bias;         /* NULL, or [(heads + 2 kv_heads) head_dim]: added to q, k and v first */
    const float *q_norm, *k_norm; /* NULL, or [head_dim]: RMSNorm of each q (k) head before RoPE, `norm_eps` */
    float norm_eps;
    int64_t rotary_dims;       /* the leading dims of each head that rotate (even, <= head_dim); the rest are copied */
} RopeCache;

void rope_and_cache(const RopeCache *r, int threads);

/* The gated MLP's activation: SwiGLU's silu(gate) * up, or GeGLU's gelu_tanh(gate) * up (Gemma);
 * gpt-oss's experts' clamped SwiGLU, which takes an alpha and a limit (clamped_swiglu_rows), only
 * in a MoE layer's experts (MoELayer). */
enum { ACTIVATION_SILU = 0, ACTIVATION_GELU_TANH = 1, ACTIVATION_CLAMPED_SWIGLU = 2 };

/* The gated activation from a gate/up linear layer's output (channel c of token t at
 * gate_up[c * channel_stride + t * token_stride]) to the rows the down projection reads: see
 * swiglu.c. Returns 0, or -1 when scratch memory could not be allocated. */
int gated_rows(const float *gate_up, int64_t channel_stride, int64_t token_stride, float *out, int64_t intermediate,
               int64_t tokens, int activation, int threads);
/* gpt-oss's clamped SwiGLU, laid out as gated_rows's input and output: see swiglu.c. */
void clamped_swiglu_rows(const float *gate_up, int64_t channel_stride, int64_t token_stride, float *out, int64_t intermediate,
                         int64_t tokens, float alpha, float limit, int threads);

/* The residual add and the RMSNorm after it: see rms_norm.c. */
typedef struct {
    float *h;                  /* [tokens, hidden], contiguous: the residual stream, updated in place */
    const float *delta;        /* NULL, or delta[t * delta_token_stride + i * delta_channel_stride] */
    int64_t delta_token_stride, delta_channel_stride;
    const float *weight;       /* [hidden] */
    float *out;                /* [tokens, hidden], contiguous */
    int64_t tokens, hidden;
    float eps;
} AddRmsNorm;

void add_rms_norm(const AddRmsNorm *n, int threads);

/* A linear layer of float16 weights packed in blocks of 16 output channels: see float16_linear.c. */
typedef struct {
    const float *x;            /* [tokens, in], rows `x_stride` floats apart */
    int64_t x_stride;
    const uint16_t *packed;    /* [ceil(out / 16), in, 16] float16 bits */
    float *y;                  /* [tokens, out], rows `y_stride` floats apart (0: out, contiguous) */
    int64_t tokens, in, out, y_stride;
} Float16Linear;

/* The widest instructions a kernel may use (it uses the widest of them this CPU has): the
 * portable loops, AVX2 with FMA and F16C, or AVX-512F. Each sums in the same order, so every
 * level gives the same bits (the tests hold them to it); a lower one stands in for an older CPU. */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

void float16_linear(const Float16Linear *l, int threads, int isa);

/* A linear layer multiplied from ggml's quantized blocks: see quantized_linear.c. Types are
 * ggml's type ids. */
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };
/* MXFP4 (gpt-oss's experts): 32 values a block, an E8M0 scale byte and 16 bytes of E2M1 nibbles. */
enum { GGML_MXFP4 = 39 };

/* Rows of x [rows, width] as Q4_K or Q6_K blocks (`type`) into out [rows, width / 256 * 144 or 210],
 * as llama-quantize makes them without an importance matrix (kquant_quantizers.c). The caller
 * checks the type and that the width is whole 256-value super-blocks. */
void quantize_kquant_rows(int type, const float *x, int64_t rows, int64_t width, uint8_t *out, int threads);

typedef struct {
    const float *x;            /* [tokens, in], rows `x_stride` floats apart */
    int64_t x_stride;
    const uint8_t *blocks;     /* [out, in / block_size * type_size] bytes, rows contiguous */
    int type;                  /* a GGML_* type id */
    float *y;                  /* [tokens, out], rows `y_stride` floats apart (0: out, contiguous) */
    int64_t tokens, in, out, y_stride;
} QuantizedLinear;

/* Block layout read by both quantized_blocks.c and quantized_direct.c. The fifth bits of a Q5 block: bit j of the little-endian 32-bit word is value j's. */
static inline uint32_t high_bits(const uint8_t *qh) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

/* The 8 six-bit scales and mins of a Q4_K / Q5_K block's 12 scale bytes: sub-blocks 0-3 in the
 * low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11
 * with their top two bits in the top bits of bytes 0-3 (scales) and 4-7 (mins). */
static inline void scales_and_mins(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | (s[j] >> 6) << 4;
        mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
    }
}

/* An MXFP4 block's scale, in ggml's "half" form (ggml_e8m0_to_fp32_half, gguf-py's
 * e8m0_to_fp32_half): 2^(e - 128) for the E8M0 byte e, as float32 bits built directly, a
 * subnormal for e < 2. Halved because its values table MXFP4_VALUES holds E2M1's values doubled. */
static inline float mxfp4_scale(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* E2M1's 16 values doubled (ggml's kvalues_mxfp4): nibble j gives MXFP4_VALUES[j] d. */
static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* [byte][l]: 16 where bit l of `byte` is set, else 0: 8 values' fifth bits of a Q5 block as one
 * widening load (quantized_blocks.c; its AVX2 paths read it). */
extern const uint8_t QUANTIZED_FIFTH_BITS[256][8];

/* Elements per block and bytes per block of a type: 0, or -1 for a type this file does not read. */
int quantized_block_shape(int type, int64_t *block_size, int64_t *type_size);
/* The first of `blocks` blocks of `type` with a NaN or infinite float16 scale (MXFP4: the E8M0
 * NaN byte 0xff), -1 when none,
 * -2 for an unknown type. */
int64_t quantized_first_nonfinite_scale(int type, const uint8_t *data, int64_t blocks);
/* 0; -1 for an unknown type; -2 when scratch memory could not be allocated. */
int quantized_linear(const QuantizedLinear *l, int threads, int isa);
/* The most rows quantized_group_direct takes at ISA level `vector` for `type` (0: none). */
int quantized_direct_rows(int vector, int type);
/* `tokens` rows of x by the GROUP (4) weight rows at `rows` (`row_bytes` apart, `blocks` blocks
 * each) into y [tokens, 4] (rows `ys` apart), each block expanded in registers, with
 * quantized_linear's bits (quantized_direct.c); tokens at most quantized_direct_rows. */
void quantized_group_direct(int vector, int type, const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x,
                            int64_t xs, int64_t tokens, float *y, int64_t ys);
/* The ISA_* level a quantized kernel runs at: the widest of `isa` and what this CPU has. */
int quantized_vector_isa(int isa);
/* One row of `blocks` blocks of `type` expanded into floats at ISA level `vector` (see
 * quantized_blocks.c: every level gives gguf-py's values). */
void expand_quantized_row(int vector, int type, const uint8_t *row, int64_t blocks, float *out);
/* Rows `rows[0 .. count)` of a [?, in] weight of `type` expanded into out [count, in]: 0, or -1
 * for an unknown type. */
int quantized_rows(int type, const uint8_t *data, int64_t in, const int64_t *rows, int64_t count, float *out, int threads,
                   int isa);

/* A round's mixture-of-experts MLP, experts of ggml blocks: see moe_layer.c. */
typedef struct {
    const float *x;                /* [tokens, hidden], contiguous */
    const int64_t *expert_ids;     /* [tokens, k]: each row's experts, each in [0, experts) */
    const float *expert_weights;   /* [tokens, k]: their weights */
    const uint8_t *gate_up;        /* experts x [2 intermediate, hidden] of `gate_up_type`, expert e at e * gate_up_expert_bytes */
    const uint8_t *down;           /* experts x [hidden, intermediate] of `down_type` */
    int gate_up_type, down_type;   /* GGML_* type ids */
    int64_t gate_up_expert_bytes, down_expert_bytes;
    int activation;                /* an ACTIVATION_*: CLAMPED_SWIGLU with swiglu_alpha and swiglu_limit */
    float swiglu_alpha, swiglu_limit;
    /* NULL, or gpt-oss's expert biases: [experts, 2 intermediate] added to gate/up's outputs,
     * [experts, hidden] to down's, each before what reads it. */
    const float *gate_up_bias, *down_bias;
    /* 0: the projection multiplies float32 activations (quantized_linear); 1 or 2: that many 8-bit
     * activation blocks per 32 (K types: 256) inputs, by integer dot products (integer_dot.h). */
    int gate_up_halves, down_halves;
    float *out;                    /* [tokens, hidden], contiguous */
    int64_t tokens, k, experts, hidden, intermediate;
} MoELayer;

/* 0, or -1 when scratch memory could not be allocated or a type is unknown. `isa` caps the float32
 * products (ISA_*), `integer_isa` the integer ones (IDOT_*). */
int moe_layer(const MoELayer *m, int threads, int isa, int integer_isa);

/* How a router's logits become each row's k experts and weights (routing.py's kinds, model_config.ROUTINGS). */
typedef enum { ROUTING_SOFTMAX = 0, ROUTING_SOFTMAX_GROUP_MAX = 1, ROUTING_SIGMOID_GROUP = 2, ROUTING_TOPK_SOFTMAX = 3 } RoutingKind;

/* A mixture-of-experts layer's route: see moe_route.c. */
typedef struct {
    const float *x;               /* [tokens, hidden], contiguous */
    const float *router;          /* [experts, hidden], contiguous */
    const float *router_bias;     /* [experts], or NULL */
    const float *correction_bias; /* [experts] (sigmoid_group's choice only), or NULL */
    int kind;                     /* RoutingKind */
    int normalize;                /* norm_topk_prob */
    double scaling;               /* routed_scaling_factor */
    int isa;                      /* ISA_*: the widest instructions the logits' loop may use */
    int64_t tokens, hidden, experts, k;
    int64_t n_group, topk_group;  /* experts % n_group == 0, 1 <= topk_group <= n_group; 1 and 1 without groups */
    int64_t *expert_ids;          /* out [tokens, k]: each row's experts, ascending */
    float *expert_weights;        /* out [tokens, k]: their weights */
    const float *shared_gate;     /* [hidden], or NULL: the shared expert's gate (Qwen2-MoE) */
    float *shared_scale;          /* out [tokens] with a shared gate: sigmoid(shared_gate . x) */
} MoERoute;

/* 0, or -1 when scratch memory could not be allocated. */
int moe_route(const MoERoute *m, int threads);

/* One attention group of a round (model.py's AttentionGroup): `rows` rows of `query_len` new
 * tokens from flat token `start`, their block table [rows, max_blocks] and start positions. */
typedef struct {
    int64_t start, rows, query_len, max_blocks, longest;
    const int64_t *block_table, *start_positions;
} AttentionGroupPlan;

/* A run of a layer's linear weight's output rows: packed float16 (Float16Linear) or ggml blocks
 * (QuantizedLinear) of `type`, `out` rows. ggml's type 0 (F32) is never a part's, so it names
 * packed float16 here. */
enum { LINEAR_PACKED_FLOAT16 = 0, LAYER_LINEAR_PARTS = 3 };
/* Added to a block part's type, times 1 or 2: its products take that many 8-bit activation blocks
 * per 32 inputs (integer_linear.c, quantize_row_q8's halves) where the type has integer kernels,
 * float32 activations (quantized_linear.c) otherwise. */
enum { LINEAR_INTEGER_ACTIVATIONS = 256 };

typedef struct {
    int64_t type;              /* LINEAR_PACKED_FLOAT16 or a GGML_* type id */
    const void *data;
    int64_t out;               /* 0: no part */
} LinearPart;

/* A linear layer of a decoder layer: up to LAYER_LINEAR_PARTS parts stacked on the output (the
 * q/k/v of a Q4_K_M layer, whose v is Q6_K), their outputs side by side in each row of y. */
typedef struct {
    LinearPart parts[LAYER_LINEAR_PARTS];
} LayerLinear;

/* A decoder layer's mixture-of-experts MLP in place of its gated MLP: the route and the experts'
 * call as moe_route.c and moe_layer.c take them, every field but a round's (x, tokens, the route's
 * outputs, out) filled once from the layer's table (module.c, MOE_*). A shared expert is the
 * layer's own gate_up and down, scaled by the route's shared_scale where it has a gate. */
typedef struct {
    MoERoute route;
    MoELayer layer;
} LayerMoE;

/* One decoder layer of a round of short rows: see decoder_layer.c. */
typedef struct {
    float *h;                                  /* [tokens, hidden] residual stream, updated in place */
    const float *input_norm, *post_norm;       /* [hidden] */
    LayerLinear qkv, o, gate_up, down;
    int64_t tokens, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    const int64_t *positions, *slots;          /* [tokens] */
    const float *cos, *sin;                    /* this layer's tables [max_positions, rotary_dims / 2] */
    int64_t max_positions, rotary_dims;
    /* The family features, each NULL or 0 where the layer has none (Llama's layers). */
    const float *qkv_bias;                     /* [(heads + 2 kv_heads) head_dim] */
    const float *q_norm, *k_norm;              /* [head_dim] */
    const float *attention_output_norm;        /* [hidden]: RMSNorm of the attention's output before the residual add */
    const float *mlp_output_norm;              /* [hidden]: the same for the MLP's */
    int64_t window;                            /* the layer's sliding window */
    float softcap;                             /* of the attention scores */
    const float *sinks;                        /* [heads]: each head's sink logit in its softmax (gpt-oss) */
    const float *o_bias;                       /* [hidden]: added to the o projection's output (gpt-oss) */
    int activation;                            /* ACTIVATION_SILU or ACTIVATION_GELU_TANH */
    const LayerMoE *moe;                       /* the MoE MLP in place of gate_up and down, or NULL */
    void *keys, *values;                       /* this layer's pools [kv_heads, num_blocks, block_size, head_dim] */
    int kv_dtype;
    int64_t num_blocks, block_size;
    const AttentionGroupPlan *group_plans;
    int64_t groups;
    float *scratch;                            /* tokens * (2 hidden + qkv channels + 2 heads * head_dim + 3 intermediate) floats */
    int isa;                                   /* the float16 linear layers' widest instructions (float16_linear) */
    int quantized_isa;                         /* the block ones' (quantized_linear) */
    int integer_isa;                           /* the integer ones' (integer_linear), an IDOT_* level */
} DecoderLayerRound;

/* Returns 0, or -1 when scratch memory could not be allocated or a part's type is unknown. */
int decoder_layer(const DecoderLayerRound *l, int threads);

#endif
