/* SwiGLU from the gate/up linear layer's columns to the rows the down projection reads.
 *
 * gate_up[c, t] holds gate channels c < I and up channels I <= c < 2I for token t (model.py,
 * `linear_columns`). The down projection needs its input as rows, [t, i], row-major; the torch
 * path computes silu(gate) * up on the columns and then copies the transposed result. Here
 *
 *   out[t, i] = silu(g) * u = g u / (1 + e^-g),    g = gate_up[i, t], u = gate_up[I + i, t]
 *
 * is written straight into the rows. e^-g comes from `exp_nonpositive` of -|g|:
 * for g >= 0, silu(g) = g / (1 + e^-g); for g < 0, silu(g) = g e^g / (1 + e^g).
 */
#include <stdlib.h>

#include "kernels.h"

/* silu(g) * u for one channel over its tokens, into tmp: contiguous on both sides, so it vectorises. */
static inline void swiglu_channel(const float *g, const float *u, float *tmp, int64_t T) {
#pragma omp simd
    for (int64_t t = 0; t < T; t++) {
        const float x = g[t];
        const float e = exp_nonpositive(x < 0.0f ? x : -x);
        const float numerator = x < 0.0f ? x * e : x; /* selects, not branches: it vectorises */
        tmp[t] = numerator / (1.0f + e) * u[t];
    }
}

FLARE_TARGET_CLONES
int swiglu_rows(const float *gate_up, float *out, int64_t intermediate, int64_t tokens, int threads) {
    const int64_t I = intermediate, T = tokens;
    int failed = 0;
    /* Blocks of CHANNELS channels: computed along their tokens into a scratch block, then
     * transposed into the rows (a scattered store per element would keep the compiler from
     * vectorising the arithmetic). */
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
            for (int64_t c = 0; c < n; c++) swiglu_channel(gate_up + (first + c) * T, gate_up + (I + first + c) * T, tmp + c * T, T);
            for (int64_t t = 0; t < T; t++) {
                float *row = out + t * I + first;
                for (int64_t c = 0; c < n; c++) row[c] = tmp[c * T + t];
            }
        }
        free(tmp);
    }
    return failed ? -1 : 0;
}
