/* The residual add before a norm, and the norm: one pass where torch's CPU operators take
 * several (the add, then rms_norm as pow, mean, add, rsqrt, two multiplies), twice a layer of
 * every round.
 *
 *   h[t] += delta[t]                                   (when delta is given)
 *   out[t, i] = h[t, i] * weight[i] / sqrt(mean_j(h[t, j]^2) + eps)
 *
 * as torch's `rms_norm` computes it in float32 (the sum of squares here is accumulated in
 * float32 by lanes, in another order: results agree to a few ulp). delta may be any strided
 * view: a linear layer's rows, or MKL's columns read transposed.
 */
#include <math.h>

#include "kernels.h"

static void add_norm_token(const AddRmsNorm *n, int64_t t) {
    const int64_t H = n->hidden;
    float *h = n->h + t * H;
    if (n->delta) {
        const float *d = n->delta + t * n->delta_token_stride;
        const int64_t cs = n->delta_channel_stride;
        if (cs == 1) { /* rows (the packed formats' products): a loop the compiler vectorises */
#pragma omp simd
            for (int64_t i = 0; i < H; i++) h[i] += d[i];
        } else {
            for (int64_t i = 0; i < H; i++) h[i] += d[i * cs];
        }
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < H; i++) sum += h[i] * h[i];
    const float scale = 1.0f / sqrtf(sum / (float)H + n->eps);
    float *out = n->out + t * H;
#pragma omp simd
    for (int64_t i = 0; i < H; i++) out[i] = h[i] * scale * n->weight[i];
}

FLARE_TARGET_CLONES
void add_rms_norm(const AddRmsNorm *n, int threads) {
    /* A decode round's few rows are cheaper on one thread than waking another. */
#pragma omp parallel for num_threads(threads) schedule(static) if (n->tokens * n->hidden >= 16384)
    for (int64_t t = 0; t < n->tokens; t++) add_norm_token(n, t);
}
