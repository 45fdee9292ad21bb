/* Two steps of the sampler over whole rows of the vocabulary, for the CPU: the counter-based
 * random stream's uniforms and the top-p threshold. Each is the counterpart of a torch twin in
 * flare/sampler/ (random_stream.py, distribution.py), computes the same bits, and replaces a
 * dozen passes of torch operators over [rows, vocab] with one (docs/kernels.md, "CPU cost").
 *
 * The uniforms: for stream key k (int32) and vocabulary index i,
 *
 *   x = mix32(k + i * GOLDEN)        (lowbias32 of a Weyl sequence, modulo 2^32)
 *   u = ((x >> 8) + 0.5) * 2^-24     (the top 24 bits; the + 0.5 rounded in float32, as torch adds)
 *
 * The top-p threshold: per row, the largest logit t whose tokens (logit >= t) carry at least
 * `target` of `mass`, by the twin's radix select on the logits' order keys (three digits of 11,
 * 11 and 10 bits, most significant first). Each pass sums the mass of the tokens that share the
 * digits chosen so far into a histogram of the next digit, in float32 and in token order, as
 * torch.bincount does; the suffix sums run from the top bin down in a double accumulator, each
 * rounded to float32, as torch.cumsum does, and the mass above the chosen prefix is added after
 * in float32, as the twin adds it. So the sums, and the threshold, are the twin's bits.
 *
 * The Gumbel-max candidate: per row, argmax_i (logit_i + G_i) over the kept tokens (Gumbel-max:
 * with G_i i.i.d. standard Gumbel that argmax is distributed as softmax(logit) on them), in one
 * pass where the twin (gumbel_max.py) copies the row, adds, compares, masks and reduces in five.
 * Each value is the one float32 addition the twin makes, and the first of equal maxima wins, as
 * in torch.argmax: the same index and value.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sampling.h"

enum { GOLDEN = 0x9E3779B9u, MIX_1 = 0x7FEB352Du, MIX_2 = 0x846CA68Bu };

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= MIX_1;
    x ^= x >> 15;
    x *= MIX_2;
    x ^= x >> 16;
    return x;
}

FLARE_TARGET_CLONES
void stream_uniforms(const int32_t *keys, int64_t rows, int64_t vocab, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * vocab >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const uint32_t key = (uint32_t)keys[r];
        float *u = out + r * vocab;
#pragma omp simd
        for (int64_t i = 0; i < vocab; i++) {
            const uint32_t bits = mix32(key + (uint32_t)i * GOLDEN);
            u[i] = ((float)(bits >> 8) + 0.5f) * 0x1p-24f;
        }
    }
}

/* The order key of a float: its bits, the magnitude bits flipped when negative (int32 keys
 * then order as the floats do). */
static inline int32_t order_key(float x) {
    int32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return ((bits >> 31) & 0x7FFFFFFF) ^ bits;
}

static inline float float_of_key(int32_t key) {
    const int32_t bits = ((key >> 31) & 0x7FFFFFFF) ^ key;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* One row; `histogram` holds 2048 floats. */
static float row_threshold(const float *scaled, const float *mass, int64_t vocab, float target, float *histogram) {
    static const int shifts[3] = {21, 10, 0}, widths[3] = {2048, 2048, 1024};
    float above = 0.0f;
    int64_t prefix = 0;
    for (int level = 0; level < 3; level++) {
        const int shift = shifts[level], width = widths[level];
        memset(histogram, 0, sizeof(float) * (size_t)width);
        if (level == 0) {
            /* The top digit carries the sign: key >> 21 is in [-1024, 1024). */
            for (int64_t i = 0; i < vocab; i++) histogram[(order_key(scaled[i]) >> 21) + 1024] += mass[i];
        } else {
            const int bits = level == 1 ? 11 : 10;
            const int32_t chosen_prefix = (int32_t)prefix;
            for (int64_t i = 0; i < vocab; i++) {
                const int32_t key = order_key(scaled[i]);
                if ((key >> (shift + bits)) == chosen_prefix) histogram[(key >> shift) & (width - 1)] += mass[i];
            }
        }
        /* Suffix sums (from the top bin down, the mass above the prefix added after), and the
         * largest digit whose suffix reaches the target: how many do, less one, as the twin
         * counts them (so a NaN in the mass makes the same choice as there). */
        double running = 0.0;
        int reaching = 0;
        for (int d = width - 1; d >= 0; d--) {
            running += histogram[d];
            histogram[d] = (float)running + above;
            reaching += histogram[d] >= target;
        }
        const int chosen = reaching > 0 ? reaching - 1 : 0;
        above = chosen + 1 < width ? histogram[chosen + 1] : above;
        prefix = level == 0 ? chosen - 1024 : prefix * width + chosen;
    }
    return float_of_key((int32_t)prefix);
}

int top_p_threshold(const float *scaled, const float *mass, const float *target, int64_t rows, int64_t vocab, float *out,
                    int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows > 1)
    {
        float *histogram = malloc(2048 * sizeof(float));
        if (!histogram) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (histogram) out[r] = row_threshold(scaled + r * vocab, mass + r * vocab, vocab, target[r], histogram);
        free(histogram);
    }
    return failed ? -1 : 0;
}

FLARE_TARGET_CLONES
void kept_gumbel_argmax(const float *noise, const float *scaled, const int64_t *position, const float *threshold,
                        const int64_t *exclude, int64_t rows, int64_t vocab, int64_t *index, float *value, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * vocab >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = noise + r * vocab, *logit = scaled + position[r] * vocab;
        const float kept_from = threshold[r];
        const int64_t left_out = exclude[r];
        float best = -INFINITY;
        int64_t at = 0;
        for (int64_t i = 0; i < vocab; i++) {
            const float v = logit[i] >= kept_from && i != left_out ? g[i] + logit[i] : -INFINITY;
            if (v > best) best = v, at = i;
        }
        index[r] = at;
        value[r] = best;
    }
}
