/* Q4_K and Q6_K blocks made from float32 rows, for `flare export --quantize q4_k_m`
 * (flare/preparation/kquants.py calls these where the extension is built, its numpy port where not).
 *
 * These are llama.cpp's reference quantizers, quantize_row_q4_K_ref and quantize_row_q6_K_ref
 * (ggml-quants.c), which llama-quantize runs without an importance matrix, with their searches
 * make_qkx2_quants and make_qx_quants, done in the same float32 operations in the same order:
 * sums left to right, each product rounded before the addition that reads it (ggml builds as ISO
 * C, which fuses nothing; here fusing is turned off below, whatever -march a build gives, and no
 * reduction is reordered without -ffast-math).
 *
 * Q4_K, per 32-value sub-block j with weights w_l = sqrt(mean x^2) + |x_l|: the affine grid
 * x ~ s L + m, L in 0..15, m <= 0, minimising sum_l w_l (s L_l + m - x_l)^2. The start is the
 * grid spanning [min(x, 0), max x]; then 21 trial scales (14 + 0.1 t) / span, t = 0..20, each
 * rounding x onto its grid and solving the 2 x 2 weighted least squares for (s, m) given those
 * L (m clamped to 0, s then sum w L x / sum w L^2), kept where the error falls. The 8 scales and
 * 8 mins are then stored as 6-bit multiples of float16 d = max s / 63 and dmin = max -m / 63, and
 * every value is rounded again against the stored (d sc_j, dmin mn_j).
 *
 * Q6_K, per 16-value group: the symmetric grid x ~ s L, L in -32..31, from 19 trial scales
 * -(32 + 0.1 t) / x_amax, t = -9..9, keeping the one that maximises (sum w x L)^2 / sum w L^2
 * (w = x^2: least squares of the best s for those L). The 16 scales are stored as int8 multiples
 * of float16 d = -max_abs s / 128, and every value rounded again against d sc_g.
 *
 * nearest() is ggml's nearest_int: adding 1.5 * 2^23 rounds to an integer (half to even) in the
 * float's low mantissa bits.
 */
#include <math.h>
#include <string.h>

#include "kernels.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

enum { QK_K = 256 };

static inline int nearest(float value) {
    const float shifted = value + 12582912.f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    return (bits & 0x007fffff) - 0x00400000;
}

static inline int clamp(int value, int low, int high) { return value < low ? low : value > high ? high : value; }

/* The affine grid of one 32-value sub-block: returns s, writes -m and L (make_qkx2_quants with
 * nmax 15, rmin -1, rdelta 0.1, 20 steps, squared error). */
static float affine_grid(const float *x, const float *w, uint8_t *L, float *negated_min) {
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < 32; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, 32);
        *negated_min = -min;
        return 0.f;
    }
    float iscale = 15 / (max - min), scale = 1 / iscale, best_error = 0;
    for (int i = 0; i < 32; i++) {
        L[i] = (uint8_t)clamp(nearest(iscale * (x[i] - min)), 0, 15);
        float diff = scale * L[i] + min - x[i];
        diff = diff * diff;
        best_error += w[i] * diff;
    }
    uint8_t trial[32];
    for (int step = 0; step <= 20; step++) {
        /* `min` as it stands: a better candidate's min moves the grid of the later steps */
        iscale = (-1.f + 0.1f * step + 15) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < 32; i++) {
            const int l = clamp(nearest(iscale * (x[i] - min)), 0, 15);
            trial[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float det = sum_w * sum_l2 - sum_l * sum_l;
        if (!(det > 0)) continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if (this_min > 0) {
            this_min = 0;
            this_scale = sum_xl / sum_l2;
        }
        float error = 0;
        for (int i = 0; i < 32; i++) {
            float diff = this_scale * trial[i] + this_min - x[i];
            diff = diff * diff;
            error += w[i] * diff;
        }
        if (error < best_error) {
            memcpy(L, trial, 32);
            best_error = error;
            scale = this_scale;
            min = this_min;
        }
    }
    *negated_min = -min;
    return scale;
}

/* One 256-value super-block of x as a 144-byte Q4_K block: d, dmin (float16), 12 bytes of 6-bit
 * scales and mins, 128 bytes of nibbles (chunk c of 64 values: the first 32 low, the rest high). */
static void q4_k_block(const float *x, uint8_t *out) {
    uint8_t L[QK_K], packed[12] = {0};
    float weights[32], scales[8], mins[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *v = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += v[l] * v[l];
        const float average = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = average + fabsf(v[l]);
        scales[j] = affine_grid(v, weights, L + 32 * j, &mins[j]);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < 8; j++) {
        /* the nearest integer as a byte (what the C stores), then at most 63 */
        uint8_t ls = (uint8_t)nearest(inv_scale * scales[j]), lm = (uint8_t)nearest(inv_min * mins[j]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (j < 4) {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            packed[j - 4] |= (uint8_t)((ls >> 4) << 6);
            packed[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    const uint16_t d = half_from_float(max_scale / 63.f), dmin = half_from_float(max_min / 63.f);
    for (int j = 0; j < 8; j++) {
        const int sc = j < 4 ? packed[j] & 63 : (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4);
        const int mn = j < 4 ? packed[j + 4] & 63 : (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
        const float sub_d = float_from_half(d) * sc;
        if (!sub_d) continue;
        const float sub_m = float_from_half(dmin) * mn;
        for (int l = 0; l < 32; l++) L[32 * j + l] = (uint8_t)clamp(nearest((x[32 * j + l] + sub_m) / sub_d), 0, 15);
    }
    memcpy(out, &d, 2);
    memcpy(out + 2, &dmin, 2);
    memcpy(out + 4, packed, 12);
    uint8_t *q = out + 16;
    for (int c = 0; c < QK_K; c += 64, q += 32)
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[c + l] | (L[c + l + 32] << 4));
}

/* The symmetric grid of one 16-value group: returns s, writes L + 32 (make_qx_quants with nmax 32
 * and weights x^2). */
static float symmetric_grid(const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < 16; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) amax = ax, max = x[i];
    }
    if (amax < 1e-15f) {
        memset(L, 0, 16);
        return 0.f;
    }
    float iscale = -32 / max, sum_lx = 0, sum_l2 = 0;
    for (int i = 0; i < 16; i++) {
        const int l = clamp(nearest(iscale * x[i]), -32, 31);
        L[i] = (int8_t)(l + 32);
        const float w = x[i] * x[i];
        sum_lx += w * x[i] * l;
        sum_l2 += w * l * l;
    }
    float scale = sum_l2 ? sum_lx / sum_l2 : 0.0f, best = scale * sum_lx;
    for (int step = -9; step <= 9; step++) {
        if (step == 0) continue;
        iscale = -(32 + 0.1f * step) / max;
        sum_lx = sum_l2 = 0;
        for (int i = 0; i < 16; i++) {
            const int l = clamp(nearest(iscale * x[i]), -32, 31);
            const float w = x[i] * x[i];
            sum_lx += w * x[i] * l;
            sum_l2 += w * l * l;
        }
        if (sum_l2 > 0 && sum_lx * sum_lx > best * sum_l2) {
            for (int i = 0; i < 16; i++) L[i] = (int8_t)(32 + clamp(nearest(iscale * x[i]), -32, 31));
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    return scale;
}

/* One super-block as a 210-byte Q6_K block: 128 bytes of low nibbles, 64 of high bit pairs, 16
 * int8 scales, d (float16). */
static void q6_k_block(const float *x, uint8_t *out) {
    int8_t L[QK_K];
    float scales[16], max_scale = 0, max_abs_scale = 0;
    for (int g = 0; g < 16; g++) {
        scales[g] = symmetric_grid(x + 16 * g, L + 16 * g);
        if (fabsf(scales[g]) > max_abs_scale) max_abs_scale = fabsf(scales[g]), max_scale = scales[g];
    }
    memset(out, 0, 210);
    if (max_abs_scale < 1e-15f) return; /* d 0: every value 0 */
    const float iscale = -128.f / max_scale;
    const uint16_t d = half_from_float(1 / iscale);
    int8_t *stored = (int8_t *)(out + 192);
    for (int g = 0; g < 16; g++) {
        const int sc = nearest(iscale * scales[g]);
        stored[g] = (int8_t)(sc < 127 ? sc : 127);
    }
    for (int g = 0; g < 16; g++) {
        const float group_d = float_from_half(d) * stored[g];
        if (!group_d) continue;
        for (int l = 0; l < 16; l++) L[16 * g + l] = (int8_t)(clamp(nearest(x[16 * g + l] / group_d), -32, 31) + 32);
    }
    uint8_t *ql = out, *qh = out + 128;
    for (int c = 0; c < QK_K; c += 128, ql += 64, qh += 32)
        for (int l = 0; l < 32; l++) {
            const uint8_t *v = (const uint8_t *)L + c + l;
            ql[l] = (uint8_t)((v[0] & 0xF) | ((v[64] & 0xF) << 4));
            ql[l + 32] = (uint8_t)((v[32] & 0xF) | ((v[96] & 0xF) << 4));
            qh[l] = (uint8_t)((v[0] >> 4) | ((v[32] >> 4) << 2) | ((v[64] >> 4) << 4) | ((v[96] >> 4) << 6));
        }
    memcpy(out + 208, &d, 2);
}

void quantize_kquant_rows(int type, const float *x, int64_t rows, int64_t width, uint8_t *out, int threads) {
    const int64_t blocks = width / QK_K, bytes = type == GGML_Q4_K ? 144 : 210, total = rows * blocks;
#pragma omp parallel for schedule(static) num_threads(total < 64 ? 1 : threads)
    for (int64_t b = 0; b < total; b++) {
        if (type == GGML_Q4_K) q4_k_block(x + b * QK_K, out + b * bytes);
        else q6_k_block(x + b * QK_K, out + b * bytes);
    }
}
