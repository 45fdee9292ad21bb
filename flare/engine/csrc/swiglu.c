/* SwiGLU from the gate/up linear layer's output to the rows the down projection reads.
 *
 * gate_up holds gate channels c < I and up channels I <= c < 2I for every token t, channel c of
 * token t at gate_up[c * channel_stride + t * token_stride]: columns from MKL's float32 product
 * (model.py, `linear_columns`: channel_stride = T, token_stride = 1), rows from the packed
 * formats' products (1, 2I). The down projection needs its input as rows, [t, i], row-major;
 * the torch path computes silu(gate) * up and then copies the transposed result. Here
 *
 *   out[t, i] = silu(g) * u = g u / (1 + e^-g),    g = gate_up[i, t], u = gate_up[I + i, t]
 *
 * is written straight into the rows. e^-g comes from `exp_nonpositive` of -|g|:
 * for g >= 0, silu(g) = g / (1 + e^-g); for g < 0, silu(g) = g e^g / (1 + e^g).
 *
 * GeGLU (Gemma) is the same with GELU-tanh for silu:
 *
 *   gelu_tanh(g) = 0.5 g (1 + tanh(z / 2)) = g sigmoid(z) = g / (1 + e^-z),
 *   z = 2 sqrt(2 / pi) (g + 0.044715 g^3)
 *
 * (1 + tanh(z / 2) = 2 / (1 + e^-z)), so it takes the sigmoid's selects above with z in the
 * exponent: no tanh, and no cancellation where 1 + tanh is small.
 *
 * gpt-oss's experts clamp both halves and add one to up (`clamped_swiglu_rows`, transformers'
 * GptOssExperts._apply_gate):
 *
 *   g' = min(g, limit),  u' = clamp(u, -limit, limit),  out = g' sigmoid(alpha g') (u' + 1)
 *
 * with alpha 1.702 and limit 7 in its config (`swiglu_alpha`, `swiglu_limit`); the sigmoid takes
 * the same selects. The clamps are selects too, so a NaN stays NaN as it does through torch.clamp.
 */
#include <stdlib.h>

#include "kernels.h"

/* silu(g) * u for n elements `stride` apart in g and u, into contiguous out. Always inlined, so
 * `swiglu_span` gets a copy for stride 1 that vectorises (a stride only known at run time keeps
 * the compiler to scalar code). */
static inline __attribute__((always_inline)) void swiglu_run(const float *g, const float *u, int64_t stride, float *out,
                                                             int64_t n, const int activation) {
#pragma omp simd
    for (int64_t k = 0; k < n; k++) {
        const float x = g[k * stride];
        /* The sigmoid's argument: x for silu, z for gelu_tanh (0.7978845608 = sqrt(2 / pi)). */
        const float z = activation == ACTIVATION_GELU_TANH ? 2.0f * 0.7978845608f * (x + 0.044715f * x * x * x) : x;
        const float e = exp_nonpositive(z < 0.0f ? z : -z);
        const float numerator = z < 0.0f ? x * e : x; /* selects, not branches: it vectorises */
        out[k] = numerator / (1.0f + e) * u[k * stride];
    }
}

static void swiglu_span(const float *g, const float *u, int64_t stride, float *out, int64_t n, int activation) {
    if (activation == ACTIVATION_GELU_TANH)
        swiglu_run(g, u, stride, out, n, ACTIVATION_GELU_TANH);
    else if (stride == 1)
        swiglu_run(g, u, 1, out, n, ACTIVATION_SILU);
    else
        swiglu_run(g, u, stride, out, n, ACTIVATION_SILU);
}

/* g' sigmoid(alpha g') (u' + 1) for n elements `stride` apart, into contiguous out. */
static inline __attribute__((always_inline)) void clamped_run(const float *g, const float *u, int64_t stride, float *out,
                                                              int64_t n, float alpha, float limit) {
#pragma omp simd
    for (int64_t k = 0; k < n; k++) {
        const float gate = g[k * stride], up = u[k * stride];
        const float x = gate > limit ? limit : gate;
        const float y = up > limit ? limit : up < -limit ? -limit : up;
        const float z = alpha * x;
        const float e = exp_nonpositive(z < 0.0f ? z : -z);
        const float numerator = z < 0.0f ? x * e : x;
        out[k] = numerator / (1.0f + e) * (y + 1.0f);
    }
}

FLARE_TARGET_CLONES
void clamped_swiglu_rows(const float *gate_up, int64_t channel_stride, int64_t token_stride, float *out, int64_t intermediate,
                         int64_t tokens, float alpha, float limit, int threads) {
    const int64_t I = intermediate, cs = channel_stride, ts = token_stride;
#pragma omp parallel for num_threads(threads) schedule(static) if (I * tokens >= 16384)
    for (int64_t t = 0; t < tokens; t++) {
        if (cs == 1)
            clamped_run(gate_up + t * ts, gate_up + t * ts + I, 1, out + t * I, I, alpha, limit);
        else
            clamped_run(gate_up + t * ts, gate_up + t * ts + I * cs, cs, out + t * I, I, alpha, limit);
    }
}

/* Rows in, rows out: each token's channels are contiguous, so a row is one vectorised run. */
static void swiglu_from_rows(const float *gate_up, int64_t token_stride, float *out, int64_t I, int64_t T, int activation,
                             int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (I * T >= 16384)
    for (int64_t t = 0; t < T; t++)
        swiglu_span(gate_up + t * token_stride, gate_up + t * token_stride + I, 1, out + t * I, I, activation);
}

FLARE_TARGET_CLONES
int gated_rows(const float *gate_up, int64_t channel_stride, int64_t token_stride, float *out, int64_t intermediate,
               int64_t tokens, int activation, int threads) {
    const int64_t I = intermediate, T = tokens, cs = channel_stride, ts = token_stride;
    if (cs == 1) {
        swiglu_from_rows(gate_up, ts, out, I, T, activation, threads);
        return 0;
    }
    if (T == 1) { /* one token's channels, `cs` apart (MKL's one-row product is a column view) */
        swiglu_span(gate_up, gate_up + I * cs, cs, out, I, activation);
        return 0;
    }
    int failed = 0;
    /* Columns: blocks of CHANNELS channels, computed along their tokens into a scratch block,
     * then transposed into the rows (a scattered store per element would keep the compiler
     * from vectorising the arithmetic). */
    enum { CHANNELS = 64 };
#pragma omp parallel num_threads(threads) if (I * T >= 65536)
    {
        float *tmp = malloc((size_t)(CHANNELS * T) * sizeof(float));
        if (!tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t first = 0; first < I; first += CHANNELS) {
            if (!tmp) continue;
            const int64_t n = first + CHANNELS < I ? CHANNELS : I - first;
            for (int64_t c = 0; c < n; c++)
                swiglu_span(gate_up + (first + c) * cs, gate_up + (I + first + c) * cs, ts, tmp + c * T, T, activation);
            for (int64_t t = 0; t < T; t++) {
                float *row = out + t * I + first;
                for (int64_t c = 0; c < n; c++) row[c] = tmp[c * T + t];
            }
        }
        free(tmp);
    }
    return failed ? -1 : 0;
}
