/* A linear layer of ggml's 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) multiplied by
 * 8-bit activation blocks with integer dot products (integer_dot.h gives the arithmetic):
 *
 *   y[t, o] ~ sum_i  dw_i dx_i sum_j q_ij a_tij  (+ mw_i sx_i),
 *
 * q the weight block's integers, a the activation block's (Q8Block, quantized once per layer
 * input by quantize_row_q8). Within a block the 32 products are summed exactly in int32 (vpdpbusd
 * with AVX-512 VNNI or AVX-VNNI, vpmaddubsw + vpmaddwd with AVX2, plain int in the portable
 * loop), so the order in which a level adds them does not matter; the blocks' sums are then
 * combined in float32 by one chain of fused multiply-adds per (row, output), in increasing
 * block order, the same at every level. So every level gives the same bits and a row's result
 * never depends on its batch-mates.
 *
 * A vector multiply-add of 8-bit integers does 4 (VNNI) or 2 (AVX2) products a 32-bit lane
 * where float32 FMA does 1, and the weights are never expanded to float.
 *
 * Schedule: the outputs in groups of GROUP (4), OpenMP threads over contiguous ranges of groups
 * as quantized_linear.c; for each block a group's four weight blocks are unpacked once into
 * registers and multiplied by every row of a tile of up to TILE (64) rows, whose four sums each
 * are added by one horizontal reduction (sum_4x8) and combined as a 4-wide vector.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "integer_dot.h"
#include "kernels.h"

enum { GROUP = 4, TILE = 64, QK = 32 };

int integer_linear_type(int type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q8_0;
}

static inline int64_t block_bytes(const int type) {
    return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : type == GGML_Q5_1 ? 24 : 34;
}

static inline uint16_t half_bits(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

void quantize_row_q8(const float *x, int64_t n, Q8Block *out) {
    for (int64_t i = 0; i < n / QK; i++) {
        const float *v = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK; j++) {
            /* round to nearest even by adding and subtracting 1.5 * 2^23 (|v id| <= 127 + rounding) */
            float r = (v[j] * id + 12582912.0f) - 12582912.0f;
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            out[i].qs[j] = (int8_t)(int)r;
            sum += (int)r;
        }
        out[i].d = d;
        out[i].sum = sum;
        out[i].s = d * (float)sum;
        out[i].unused = 0;
    }
}

/* The integers of a weight block's value j: q - 8 (Q4_0), q - 16 (Q5_0), q (Q4_1, Q5_1, and Q8_0's signed bytes). */
static inline int weight_int(const int type, const uint8_t *b, int j) {
    if (type == GGML_Q8_0) return (int8_t)b[2 + j];
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
    const uint8_t *qs = b + 2 + 2 * has_min + 4 * five;
    int q = j < 16 ? qs[j] & 0x0f : qs[j - 16] >> 4;
    if (five) q |= (int)((high_bits(b + 2 + 2 * has_min) >> j) & 1) << 4;
    return q - (type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : 0);
}

/* The portable loop: the arithmetic of integer_dot.h as it reads, one (row, output) at a time. */
static void tiles_portable(int type, const uint8_t *const w[GROUP], int64_t blocks, const Q8Block *x, int64_t xs,
                           int64_t tokens, float *y, int64_t ys, int count) {
    const int64_t size = block_bytes(type);
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
    for (int64_t t = 0; t < tokens; t++)
        for (int o = 0; o < count; o++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < blocks; i++) {
                const uint8_t *b = w[o] + i * size;
                const Q8Block *xb = x + t * xs + i;
                int32_t isum = 0;
                for (int j = 0; j < QK; j++) isum += weight_int(type, b, j) * xb->qs[j];
                acc = fmaf((float)isum, float_from_half(half_bits(b)) * xb->d, acc);
                if (has_min) acc = fmaf(float_from_half(half_bits(b + 2)), xb->s, acc);
            }
            y[t * ys + o] = acc;
        }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define ID_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ID_INLINE static inline __attribute__((always_inline)) ID_AVX2

/* [bit j of qh ? 16 : 0 for j = 0 .. 31]: each byte picks its byte of qh, keeps its own bit. */
ID_INLINE __m256i fifth_bits_256(uint32_t qh) {
    const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* A weight block's 32 unsigned integers in value order (Q4_0's q, before its offset 8; Q8_0's signed bytes). */
ID_INLINE __m256i unpack_256(const int type, const uint8_t *b) {
    if (type == GGML_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 2 * has_min + 4 * five)), low4 = _mm_set1_epi8(0x0f);
    const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_and_si128(q, low4));
    return five ? _mm256_or_si256(w, fifth_bits_256(high_bits(b + 2 + 2 * has_min))) : w;
}

/* The totals of four vectors of 8 int32 lanes, [a0, a1, a2, a3]. */
ID_INLINE __m128i sum_4x8(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* A tile's sums [mt][4] into y (rows ys apart): the group's first `count` outputs. */
ID_INLINE void store_group(const __m128 *acc, int64_t mt, float *y, int64_t ys, int count) {
    for (int64_t m = 0; m < mt; m++) {
        if (count == GROUP) {
            _mm_storeu_ps(y + m * ys, acc[m]);
        } else {
            float v[GROUP];
            _mm_storeu_ps(v, acc[m]);
            memcpy(y + m * ys, v, sizeof(float) * (size_t)count);
        }
    }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define IDOT_TILES tiles_avx2
#define IDOT_DOT(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
#define IDOT_SIGNED_Q8 1
#include "integer_tiles.h"
#undef IDOT_TILES
#undef IDOT_DOT
#undef IDOT_SIGNED_Q8
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")
#define IDOT_TILES tiles_avx_vnni
#define IDOT_DOT(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x)
#define IDOT_SIGNED_Q8 0
#include "integer_tiles.h"
#undef IDOT_TILES
#undef IDOT_DOT
#undef IDOT_SIGNED_Q8
#pragma GCC pop_options

/* AVX-512 VNNI: two outputs' blocks a 512-bit register (output 2p in the low half, 2p + 1 in the
 * high), the activation block broadcast to both halves, one vpdpbusd for the pair. */
#define ID_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

static inline __attribute__((always_inline)) ID_512 void body_512(const int type, const uint8_t *const w[GROUP], int64_t blocks,
                                                                  const Q8Block *x, int64_t xs, int64_t tokens, float *y,
                                                                  int64_t ys, int count) {
    const int64_t size = block_bytes(type);
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
    const int offset = type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : type == GGML_Q8_0 ? 128 : 0;
    for (int64_t t0 = 0; t0 < tokens; t0 += TILE) {
        const int64_t mt = tokens - t0 < TILE ? tokens - t0 : TILE;
        __m128 acc[TILE];
        for (int64_t m = 0; m < mt; m++) acc[m] = _mm_setzero_ps();
        for (int64_t i = 0; i < blocks; i++) {
            __m256i wv[GROUP];
            uint16_t dh[GROUP], mh[GROUP];
#pragma GCC unroll 4
            for (int o = 0; o < GROUP; o++) {
                const uint8_t *b = w[o] + i * size;
                dh[o] = half_bits(b);
                mh[o] = has_min ? half_bits(b + 2) : 0;
                wv[o] = unpack_256(type, b);
            }
            __m512i pair[2];
#pragma GCC unroll 2
            for (int p = 0; p < 2; p++) {
                pair[p] = _mm512_inserti64x4(_mm512_castsi256_si512(wv[2 * p]), wv[2 * p + 1], 1);
                if (type == GGML_Q8_0) pair[p] = _mm512_xor_si512(pair[p], _mm512_set1_epi8((char)0x80));
            }
            const __m128 dw = _mm_cvtph_ps(_mm_setr_epi16((short)dh[0], (short)dh[1], (short)dh[2], (short)dh[3], 0, 0, 0, 0));
            const __m128 mw = _mm_cvtph_ps(_mm_setr_epi16((short)mh[0], (short)mh[1], (short)mh[2], (short)mh[3], 0, 0, 0, 0));
            for (int64_t m = 0; m < mt; m++) {
                const Q8Block *xb = x + (t0 + m) * xs + i;
                const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xb->qs));
                const __m512i s01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), pair[0], xv);
                const __m512i s23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), pair[1], xv);
                __m128i sums = sum_4x8(_mm512_castsi512_si256(s01), _mm512_extracti64x4_epi64(s01, 1),
                                       _mm512_castsi512_si256(s23), _mm512_extracti64x4_epi64(s23, 1));
                if (offset) sums = _mm_sub_epi32(sums, _mm_set1_epi32(offset * xb->sum));
                acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(dw, _mm_set1_ps(xb->d)), acc[m]);
                if (has_min) acc[m] = _mm_fmadd_ps(mw, _mm_set1_ps(xb->s), acc[m]);
            }
        }
        store_group(acc, mt, y + t0 * ys, ys, count);
    }
}

static ID_512 void tiles_avx512_vnni(int type, const uint8_t *const w[GROUP], int64_t blocks, const Q8Block *x, int64_t xs,
                                     int64_t tokens, float *y, int64_t ys, int count) {
    switch (type) {
    case GGML_Q4_0: body_512(GGML_Q4_0, w, blocks, x, xs, tokens, y, ys, count); break;
    case GGML_Q4_1: body_512(GGML_Q4_1, w, blocks, x, xs, tokens, y, ys, count); break;
    case GGML_Q5_0: body_512(GGML_Q5_0, w, blocks, x, xs, tokens, y, ys, count); break;
    case GGML_Q5_1: body_512(GGML_Q5_1, w, blocks, x, xs, tokens, y, ys, count); break;
    default: body_512(GGML_Q8_0, w, blocks, x, xs, tokens, y, ys, count); break;
    }
}
#endif

int integer_linear(const IntegerLinear *l, int threads, int isa) {
    if (!integer_linear_type(l->type)) return -1;
    const int64_t blocks = l->in / QK, row_bytes = blocks * block_bytes(l->type);
    const int64_t groups = (l->out + GROUP - 1) / GROUP, y_stride = l->y_stride ? l->y_stride : l->out;
    const int level = integer_dot_isa(isa);
    /* One thread below about 64k multiply-adds: a thread team costs more than it saves. */
    const int team = l->tokens * l->in * l->out < 65536 ? 1 : threads;
#pragma omp parallel num_threads(team)
    {
        const int64_t n = omp_get_num_threads(), k = omp_get_thread_num();
        for (int64_t g = groups * k / n; g < groups * (k + 1) / n; g++) {
            const int64_t o0 = g * GROUP;
            const int count = (int)(l->out - o0 < GROUP ? l->out - o0 : GROUP);
            /* A last, partial group repeats its last row in the vector lanes it does not store. */
            const uint8_t *w[GROUP];
            for (int o = 0; o < GROUP; o++) w[o] = l->blocks + (o0 + (o < count ? o : count - 1)) * row_bytes;
            float *y = l->y + o0;
#if defined(__x86_64__) && defined(__GNUC__)
            if (level == IDOT_AVX512_VNNI)
                tiles_avx512_vnni(l->type, w, blocks, l->x, l->x_stride, l->tokens, y, y_stride, count);
            else if (level == IDOT_AVX_VNNI)
                tiles_avx_vnni(l->type, w, blocks, l->x, l->x_stride, l->tokens, y, y_stride, count);
            else if (level == IDOT_AVX2)
                tiles_avx2(l->type, w, blocks, l->x, l->x_stride, l->tokens, y, y_stride, count);
            else
#endif
                tiles_portable(l->type, w, blocks, l->x, l->x_stride, l->tokens, y, y_stride, count);
        }
    }
    return 0;
}
