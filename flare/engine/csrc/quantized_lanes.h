/* The quantized products' 16 float32 lanes of one (row, output) added by one fixed tree: l + 8,
 * then + 4, + 2, + 1 (quantized_linear.c's sum_lanes), in registers. Shared by the buffered
 * path (quantized_linear.c) and the direct one (quantized_direct.c), whose bits must agree. */
#ifndef FLARE_QUANTIZED_LANES_H
#define FLARE_QUANTIZED_LANES_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* Lanes 0-7 in `lo`, 8-15 in `hi`. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) float sum_lanes_256(__m256 lo, __m256 hi) {
    const __m256 s8 = _mm256_add_ps(lo, hi);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) float sum_lanes_512(__m512 a) {
    return sum_lanes_256(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#endif

#endif
