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
#include <stdlib.h>
#include <string.h>

#include "integer_dot.h"
#include "kernels.h"

enum { GROUP = 4, WIDE = 16, TILE = 64, QK = 32 };
/* From this many rows the wide tiles run (benchmarks/quantized_linear.py --activations int8). */
enum { WIDE_FROM = 2 };
/* Activation rows (a token's two halves count as two) from which a call runs at AMX, where granted:
 * below, forming the B operands of every 16 outputs (integer_linear_amx.c) costs more than the tile
 * products save over AVX-512 VNNI's wide tiles; Q8_0's wide tiles need no unpacking, so AMX pays
 * later (benchmarks/quantized_linear.py --threads 1 --clock thread --formats q4_1+int8x2
 * q8_0+int8x2, FLARE_INTEGER_ISA amx against avx512_vnni). The bits are the same either way. */
#ifndef IL_AMX_FROM
#define IL_AMX_FROM 32
#endif
#ifndef IL_AMX_FROM_Q8_0
#define IL_AMX_FROM_Q8_0 48
#endif

/* How far ahead along its row each weight row is fetched: a group reads 4 or 16 rows as as many
 * interleaved streams, which the hardware prefetcher follows too late (as quantized_direct.c's). */
enum { PREFETCH_BYTES = 512 };

static inline uint16_t half_bits(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* ---- quantize_row_q8 --------------------------------------------------------------------------------
 * One block: d = max |v| / 127, qs = v / d rounded to nearest even (v times 1 / d, then adding and
 * subtracting 1.5 * 2^23, exact for |v / d| <= 127 plus rounding), clamped to [-127, 127], their
 * sum and d * sum. A block holding a NaN gets d = s = NaN and qs = sum = 0, so the NaN reaches
 * that row's outputs, as in the float product, and no other row's. Every step is one IEEE
 * operation on one value (the maximum and the integer sum are exact in any order), so the vector
 * loop below gives the portable loop's bits, several times faster: from a few rows on, the scalar
 * loop took a large share of the integer path's time (docs/benchmarks.md). The build contracts
 * multiply-adds (-ffp-contract=fast), which at a target with FMA would fuse v / d's product and
 * the residual's with the next step: not in this section. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static inline void block_ends(float amax, int nan, int32_t sum, Q8Block *out) {
    const float d = amax / 127.0f;
    out->d = nan ? __builtin_nanf("") : d;
    out->sum = nan ? 0 : sum;
    out->s = nan ? __builtin_nanf("") : d * (float)sum;
    out->unused = 0;
}

static void quantize_block(const float *v, Q8Block *out) {
    float amax = 0.0f;
    int nan = 0;
    for (int j = 0; j < QK; j++) {
        amax = fmaxf(amax, fabsf(v[j]));
        nan |= v[j] != v[j];
    }
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < QK; j++) {
        float r = (v[j] * id + 12582912.0f) - 12582912.0f;
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        const int q = nan ? 0 : (int)r;
        out->qs[j] = (int8_t)q;
        sum += q;
    }
    block_ends(amax, nan, sum, out);
}

static void quantize_row_portable(const float *x, int64_t n, int halves, Q8Block *out) {
    for (int64_t i = 0; i < n / QK; i++) {
        Q8Block *first = out + halves * i;
        quantize_block(x + i * QK, first);
        if (halves == 2) {
            /* The second half quantizes what the first left: v - d1 q1 (the product rounded, then
             * the difference). */
            float residual[QK];
            for (int j = 0; j < QK; j++) residual[j] = x[i * QK + j] - first->d * (float)first->qs[j];
            quantize_block(residual, first + 1);
            first->s = first->s + first[1].s;
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define Q8_AVX2 __attribute__((target("avx2,fma,f16c")))

/* The block's 32 values v (four vectors of 8) into out: qs, sum, d and s. */
static inline __attribute__((always_inline)) Q8_AVX2 void quantize_block_256(const __m256 v[4], Q8Block *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), m);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v[k], v[k], _CMP_UNORD_Q));
    }
    const int nan = _mm256_movemask_ps(unordered) != 0;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id), magic = _mm256_set1_ps(12582912.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        const __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[k], vid), magic), magic);
        q[k] = nan ? _mm256_setzero_si256() : _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
    }
    /* packs interleave the 128-bit lanes: the permutation puts the 32 bytes back in order */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)out->qs, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    block_ends(amax, nan, _mm_cvtsi128_si32(s4), out);
}

static Q8_AVX2 void quantize_row_256(const float *x, int64_t n, int halves, Q8Block *out) {
    for (int64_t i = 0; i < n / QK; i++) {
        Q8Block *first = out + halves * i;
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(x + i * QK + 8 * k);
        quantize_block_256(v, first);
        if (halves == 2) {
            const __m256 d = _mm256_set1_ps(first->d);
            for (int k = 0; k < 4; k++) {
                const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(first->qs + 8 * k))));
                v[k] = _mm256_sub_ps(v[k], _mm256_mul_ps(d, q));
            }
            quantize_block_256(v, first + 1);
            first->s = first->s + first[1].s;
        }
    }
}
#endif

void quantize_row_q8(int isa, const float *x, int64_t n, int halves, Q8Block *out) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* one 256-bit loop for every vector level: a 512-bit one measured within a few percent of it */
    if (integer_dot_isa(isa) >= IDOT_AVX2) return quantize_row_256(x, n, halves, out);
#else
    (void)isa;
#endif
    quantize_row_portable(x, n, halves, out);
}
#pragma GCC pop_options

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
static void tiles_portable(int type, int halves, const uint8_t *const w[GROUP], int64_t blocks, const Q8Block *x, int64_t xs,
                           int64_t tokens, float *y, int64_t ys, int count) {
    const int64_t size = integer_block_bytes(type);
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
    for (int64_t t = 0; t < tokens; t++)
        for (int o = 0; o < count; o++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < blocks; i++) {
                const uint8_t *b = w[o] + i * size;
                const Q8Block *x0 = x + t * xs + halves * i;
                for (int h = 0; h < halves; h++) {
                    int32_t isum = 0;
                    for (int j = 0; j < QK; j++) isum += weight_int(type, b, j) * x0[h].qs[j];
                    acc = fmaf((float)isum, float_from_half(half_bits(b)) * x0[h].d, acc);
                }
                if (has_min) acc = fmaf(float_from_half(half_bits(b + 2)), x0->s, acc);
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


/* Lane o of out[j] = dword j of in[o] (an 8 x 8 transpose of 32-bit elements). */
ID_INLINE void transpose_8x8(const __m256i in[8], __m256i out[8]) {
    __m256i t[8], u[8];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        t[2 * p] = _mm256_unpacklo_epi32(in[2 * p], in[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_epi32(in[2 * p], in[2 * p + 1]);
    }
#pragma GCC unroll 2
    for (int q = 0; q < 2; q++) {
        u[4 * q] = _mm256_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm256_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm256_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm256_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        out[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* Block `at` (a byte offset) of the 8 weight rows w: their integers transposed (lane o of c[j]:
 * row o's values 4 j .. 4 j + 3), their scales and mins. */
ID_INLINE void unpack_8(const int type, const uint8_t *const *w, int64_t at, __m256i c[8], __m256 *dw, __m256 *mw) {
    __m256i rows[8];
    uint16_t dh[8], mh[8];
#pragma GCC unroll 8
    for (int o = 0; o < 8; o++) {
        const uint8_t *b = w[o] + at;
        __builtin_prefetch(b + PREFETCH_BYTES);
        rows[o] = unpack_256(type, b);
        dh[o] = half_bits(b);
        mh[o] = type == GGML_Q4_1 || type == GGML_Q5_1 ? half_bits(b + 2) : 0;
    }
    transpose_8x8(rows, c);
    *dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
    *mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh));
}

/* A wide tile's sums [mt][2 halves of 8] into y (rows ys apart): the group's first `count` outputs. */
ID_INLINE void store_wide(__m256 (*acc)[2], int64_t mt, float *y, int64_t ys, int count) {
    for (int64_t m = 0; m < mt; m++) {
        if (count == WIDE) {
            _mm256_storeu_ps(y + m * ys, acc[m][0]);
            _mm256_storeu_ps(y + m * ys + 8, acc[m][1]);
        } else {
            float v[WIDE];
            _mm256_storeu_ps(v, acc[m][0]);
            _mm256_storeu_ps(v + 8, acc[m][1]);
            memcpy(y + m * ys, v, sizeof(float) * (size_t)count);
        }
    }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define IDOT_TILES tiles_avx2
#define IDOT_DOT(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
#define IDOT_ACC(s, w, x) _mm256_add_epi32(s, IDOT_DOT(w, x))
#define IDOT_SIGNED_Q8 1
#include "integer_tiles.h"
#undef IDOT_ACC
#undef IDOT_TILES
#undef IDOT_DOT
#undef IDOT_SIGNED_Q8
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avxvnni,avx2,fma,f16c")
#define IDOT_TILES tiles_avx_vnni
#define IDOT_DOT(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x)
#define IDOT_ACC(s, w, x) _mm256_dpbusd_avx_epi32(s, w, x)
#define IDOT_SIGNED_Q8 0
#include "integer_tiles.h"
#undef IDOT_ACC
#undef IDOT_TILES
#undef IDOT_DOT
#undef IDOT_SIGNED_Q8
#pragma GCC pop_options

/* AVX-512 VNNI's narrow tiles: the 256-bit ones with the EVEX vpdpbusd (avx512vl; a CPU may
 * have AVX-512 VNNI without AVX-VNNI), faster at a row or two than pairs of outputs in 512 bits. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#define IDOT_TILES tiles_avx512_256
#define IDOT_NARROW_ONLY 1
#define IDOT_DOT(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
#define IDOT_ACC(s, w, x) _mm256_dpbusd_epi32(s, w, x)
#define IDOT_SIGNED_Q8 0
#include "integer_tiles.h"
#undef IDOT_TILES
#undef IDOT_DOT
#undef IDOT_ACC
#undef IDOT_SIGNED_Q8
#undef IDOT_NARROW_ONLY
#pragma GCC pop_options

#define ID_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* AVX-512 VNNI, wide: the 16 outputs in one register's lanes, one vpdpbusd a dword of a row. */
static inline __attribute__((always_inline)) ID_512 void wide_512(const int type, const int H, const uint8_t *const w[WIDE],
                                                                  int64_t blocks, const Q8Block *x, int64_t xs, int64_t tokens,
                                                                  float *y, int64_t ys, int count) {
    const int64_t size = integer_block_bytes(type);
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
    const int offset = type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : type == GGML_Q8_0 ? 128 : 0;
    for (int64_t t0 = 0; t0 < tokens; t0 += TILE) {
        const int64_t mt = tokens - t0 < TILE ? tokens - t0 : TILE;
        __m512 acc[TILE];
        for (int64_t m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t i = 0; i < blocks; i++) {
            __m256i lo[8], hi[8];
            __m256 dlo, dhi, mlo, mhi;
            unpack_8(type, w, i * size, lo, &dlo, &mlo);
            unpack_8(type, w + 8, i * size, hi, &dhi, &mhi);
            __m512i c[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                c[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[j]), hi[j], 1);
                if (type == GGML_Q8_0) c[j] = _mm512_xor_si512(c[j], _mm512_set1_epi8((char)0x80));
            }
            const __m512 dw = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(dlo)), _mm256_castps_pd(dhi), 1));
            const __m512 mw = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(mlo)), _mm256_castps_pd(mhi), 1));
            for (int64_t m = 0; m < mt; m++) {
                const Q8Block *x0 = x + (t0 + m) * xs + H * i;
#pragma GCC unroll 2
                for (int h = 0; h < H; h++) {
                    const Q8Block *xb = x0 + h;
                    const int32_t *xd = (const int32_t *)xb->qs;
                    __m512i sums = _mm512_setzero_si512();
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++) sums = _mm512_dpbusd_epi32(sums, c[j], _mm512_set1_epi32(xd[j]));
                    if (offset) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(offset * xb->sum));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dw, _mm512_set1_ps(xb->d)), acc[m]);
                }
                if (has_min) acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x0->s), acc[m]);
            }
        }
        for (int64_t m = 0; m < mt; m++) {
            if (count == WIDE) {
                _mm512_storeu_ps(y + (t0 + m) * ys, acc[m]);
            } else {
                float v[WIDE];
                _mm512_storeu_ps(v, acc[m]);
                memcpy(y + (t0 + m) * ys, v, sizeof(float) * (size_t)count);
            }
        }
    }
}

static ID_512 void tiles_avx512_vnni_wide(int type, int halves, const uint8_t *const w[WIDE], int64_t blocks, const Q8Block *x,
                                          int64_t xs, int64_t tokens, float *y, int64_t ys, int count) {
#define WIDE_CASES(H)                                                                                                  \
    switch (type) {                                                                                                    \
    case GGML_Q4_0: wide_512(GGML_Q4_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                            \
    case GGML_Q4_1: wide_512(GGML_Q4_1, H, w, blocks, x, xs, tokens, y, ys, count); break;                            \
    case GGML_Q5_0: wide_512(GGML_Q5_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                            \
    case GGML_Q5_1: wide_512(GGML_Q5_1, H, w, blocks, x, xs, tokens, y, ys, count); break;                            \
    default: wide_512(GGML_Q8_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                                   \
    }
    if (halves == 2) {
        WIDE_CASES(2)
    } else {
        WIDE_CASES(1)
    }
#undef WIDE_CASES
}
#endif

/* A group of up to WIDE outputs: the wide tiles from WIDE_FROM rows on (below, the transposes
 * cost more than they save), the narrow ones in groups of 4 under that; the same bits. */
static void group(int level, int type, int halves, const uint8_t *const w[WIDE], int64_t blocks, const Q8Block *x, int64_t xs,
                  int64_t tokens, float *y, int64_t ys, int count, int wide) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (wide && level >= IDOT_AVX512_VNNI) return tiles_avx512_vnni_wide(type, halves, w, blocks, x, xs, tokens, y, ys, count);
    if (wide && level == IDOT_AVX_VNNI) return tiles_avx_vnni_wide(type, halves, w, blocks, x, xs, tokens, y, ys, count);
    if (wide && level == IDOT_AVX2) return tiles_avx2_wide(type, halves, w, blocks, x, xs, tokens, y, ys, count);
#else
    (void)wide;
#endif
    for (int q = 0; q < WIDE / GROUP && GROUP * q < count; q++) {
        const int n = count - GROUP * q < GROUP ? count - GROUP * q : GROUP;
        const uint8_t *const *wq = w + GROUP * q;
        float *yq = y + GROUP * q;
#if defined(__x86_64__) && defined(__GNUC__)
        if (level >= IDOT_AVX512_VNNI) tiles_avx512_256_narrow(type, halves, wq, blocks, x, xs, tokens, yq, ys, n);
        else if (level == IDOT_AVX_VNNI) tiles_avx_vnni_narrow(type, halves, wq, blocks, x, xs, tokens, yq, ys, n);
        else if (level == IDOT_AVX2) tiles_avx2_narrow(type, halves, wq, blocks, x, xs, tokens, yq, ys, n);
        else
#endif
            tiles_portable(type, halves, wq, blocks, x, xs, tokens, yq, ys, n);
    }
}

/* Activation rows (Q8K rows: a token's halves count as rows) a thread runs all its outputs over before
 * the next: 128 rows of 2048 inputs are 292 KB, kept in L2 while the weights stream past. Without
 * the tiles a prefill's thousands of rows were read again from L3 or memory for every output. */
enum { KQ_ROW_TILE = 128 };

#ifndef KQ_TILES_FROM
#define KQ_TILES_FROM 6
#endif
#ifndef KQ_TILES_FROM_256
#define KQ_TILES_FROM_256 16
#endif
#ifndef KQ_AMX_ROWS
#define KQ_AMX_ROWS 128
#endif
#if KQ_AMX_ROWS % 2 || KQ_AMX_ROWS < 16
#error "KQ_AMX_ROWS must be even (a token's two halves share a row tile) and at least 16"
#endif
/* Rows in a product from which it runs at AMX. Q6_K's scales take three digit products a 64-quant
 * step (Q4_K's and Q5_K's two), so at 16 rows its tile products still cost more than the AVX-512
 * VNNI tiles, and AMX wins from about 20 (docs/benchmarks.md, "Integer K-quant products"). The
 * bits are the same either way. */
#ifndef KQ_AMX_FROM_Q6_K
#define KQ_AMX_FROM_Q6_K 20
#endif
static inline int kquant_amx_from(int type) { return type == GGML_Q6_K ? KQ_AMX_FROM_Q6_K : KQ_AMX_FROM; }
/* From KQ_TILES_FROM activation rows (int8x2: two a token) at AVX-512 VNNI and AMX, from
 * KQ_TILES_FROM_256 at AVX-VNNI and AVX2, the K products run in wide tiles of 16 outputs
 * (kquant_dot_tile16; at AMX, from KQ_AMX_FROM rows a tile call, tile products): the same bits as
 * the 4-row tiles, so the choice never changes a row's result. Below, the 4-row tiles win: a row or
 * two is bound by reading the weights, which one output's row streamed at a time does faster than
 * 16 rows at once, and a tile's transposes cost a few rows' products (benchmarks/integer_kquants.py). */
static void kquant_tiles(int level, int type, int halves, const uint8_t *blocks, int64_t row_bytes, int64_t kblocks, const Q8KBlock *x,
                         float *y, int64_t tokens, int64_t out, int64_t y_stride, int threads) {
    const int64_t qrows = tokens * halves, groups = (out + KQ_TILE_OUTPUTS - 1) / KQ_TILE_OUTPUTS;
    /* AMX's activations, each row tile's packed once for every output (kquant_pack_rows); without
     * the memory, the AVX-512 VNNI tiles (the same bits). AMX's row tiles are KQ_AMX_ROWS rows (even:
     * a token's two halves share a tile): its products cost less, so a super-block's unpacking
     * weighs more, and is shared by more rows. */
    /* the quants, then the sub-block sums: qrows kblocks (256 + 16) bytes, rounded up to the alignment */
    int8_t *packed = level >= IDOT_AMX && qrows >= kquant_amx_from(type) ? aligned_alloc(64, (size_t)((qrows * kblocks * (256 + 16) + 63) / 64 * 64)) : NULL;
    uint32_t *pairs = packed ? (uint32_t *)(packed + qrows * kblocks * 256) : NULL;
    const int64_t tile = packed ? KQ_AMX_ROWS : TILE;
    if (packed) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < qrows; t += tile)
            kquant_pack_rows(x + t * kblocks, kblocks, (int)(qrows - t < tile ? qrows - t : tile), kblocks, packed + t * kblocks * 256,
                             pairs + t * kblocks * 4);
    }
    /* Row tiles outermost: a tile's activations (at most 128 rows of 2048 or 8192 quants, in L2)
     * meet every output group before the next tile's, and each weight is streamed once a row tile;
     * output groups outermost, a prefill's activations (megabytes) were streamed once a group. */
#pragma omp parallel num_threads(groups < threads ? (int)groups : threads)
    {
        if (packed) kquant_amx_begin();
        float acc[(KQ_AMX_ROWS > TILE ? KQ_AMX_ROWS : TILE) * KQ_TILE_OUTPUTS];
        for (int64_t t = 0; t < qrows; t += tile) {
            const int n = (int)(qrows - t < tile ? qrows - t : tile);
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t o0 = g * KQ_TILE_OUTPUTS;
                const int count = (int)(out - o0 < KQ_TILE_OUTPUTS ? out - o0 : KQ_TILE_OUTPUTS);
                const uint8_t *w[KQ_TILE_OUTPUTS];
                for (int k = 0; k < KQ_TILE_OUTPUTS; k++) w[k] = blocks + (o0 + (k < count ? k : count - 1)) * row_bytes;
                /* the next group's rows follow these in memory: prefetched meanwhile */
                const uint8_t *next = g + 1 < groups ? blocks + (o0 + KQ_TILE_OUTPUTS) * row_bytes : NULL;
                kquant_dot_tile16(level, type, w, kblocks, x + t * kblocks, kblocks, n, next, packed ? packed + t * kblocks * 256 : NULL,
                                  packed ? pairs + t * kblocks * 4 : NULL, acc);
                /* a token's outputs, its two halves' rows added: contiguous loops the compiler vectorizes */
                for (int r = 0; r < n; r += halves) {
                    const float *a = acc + KQ_TILE_OUTPUTS * r, *b = a + KQ_TILE_OUTPUTS;
                    float *yr = y + (t + r) / halves * y_stride + o0;
                    if (halves == 1)
                        for (int k = 0; k < count; k++) yr[k] = a[k];
                    else
                        for (int k = 0; k < count; k++) yr[k] = a[k] + b[k];
                }
            }
        }
        if (packed) kquant_amx_end();
    }
    free(packed);
}

void integer_kquant_linear(int type, int halves, const uint8_t *blocks, const Q8KBlock *x, float *y, int64_t tokens, int64_t in,
                           int64_t out, int64_t y_stride, int threads, int isa) {
    const int64_t kblocks = in / 256, qrows = tokens * halves;
    const int64_t row_bytes = kblocks * (type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210);
    const int level = integer_dot_isa(isa);
    const int team = tokens * in * out < 65536 ? 1 : threads;
    if (level >= IDOT_AVX2 && qrows >= (level >= IDOT_AVX512_VNNI ? KQ_TILES_FROM : KQ_TILES_FROM_256))
        return kquant_tiles(level, type, halves, blocks, row_bytes, kblocks, x, y, tokens, out, y_stride, team);
    /* Each output of each row is one kquant_dot_rows lane, whichever rows share its call (a token's
     * two halves always do: tiles and groups are of 4 rows): the tiling changes no bits. */
#pragma omp parallel num_threads(team)
    {
        const int64_t n = omp_get_num_threads(), k = omp_get_thread_num();
        const int64_t first = out * k / n, last = out * (k + 1) / n;
        for (int64_t t0 = 0; t0 < qrows; t0 += KQ_ROW_TILE) {
            const int64_t t1 = qrows - t0 < KQ_ROW_TILE ? qrows : t0 + KQ_ROW_TILE;
            for (int64_t o = first; o < last; o++)
                for (int64_t t = t0; t < t1; t += 4) {
                    const int rows = (int)(t1 - t < 4 ? t1 - t : 4);
                    const uint8_t *w = blocks + o * row_bytes;
                    if (halves == 1) {
                        kquant_dot_rows(level, type, w, kblocks, x + t * kblocks, kblocks, rows, y + t * y_stride + o, y_stride);
                    } else {
                        float tile[4];
                        kquant_dot_rows(level, type, w, kblocks, x + t * kblocks, kblocks, rows, tile, 1);
                        for (int r = 0; r < rows; r += 2) y[(t + r) / 2 * y_stride + o] = tile[r] + tile[r + 1];
                    }
                }
        }
    }
}

int integer_linear(const IntegerLinear *l, int threads, int isa) {
    if (!integer_linear_type(l->type) || l->halves < 1 || l->halves > 2) return -1;
    const int64_t blocks = l->in / QK, row_bytes = blocks * integer_block_bytes(l->type);
    const int64_t groups = (l->out + WIDE - 1) / WIDE, y_stride = l->y_stride ? l->y_stride : l->out;
    const int level = integer_dot_isa(isa), wide = l->tokens >= WIDE_FROM;
    /* One thread below about 64k multiply-adds: a thread team costs more than it saves. */
    const int team = l->tokens * l->in * l->out < 65536 ? 1 : threads;
#ifdef IDOT_AMX_TILES
    /* (the tiles gather a group's 16 rows by int32 offsets: rows under 143 MB) */
    const int64_t amx_from = l->type == GGML_Q8_0 ? IL_AMX_FROM_Q8_0 : IL_AMX_FROM;
    if (level >= IDOT_AMX && l->tokens * l->halves >= amx_from && 15 * row_bytes <= INT32_MAX) return integer_linear_amx(l, team);
#endif
#pragma omp parallel num_threads(team)
    {
        const int64_t n = omp_get_num_threads(), k = omp_get_thread_num();
        for (int64_t g = groups * k / n; g < groups * (k + 1) / n; g++) {
            const int64_t o0 = g * WIDE;
            const int count = (int)(l->out - o0 < WIDE ? l->out - o0 : WIDE);
            /* A last, partial group repeats its last row in the lanes it does not store. */
            const uint8_t *w[WIDE];
            for (int o = 0; o < WIDE; o++) w[o] = l->blocks + (o0 + (o < count ? o : count - 1)) * row_bytes;
            group(level, l->type, l->halves, w, blocks, l->x, l->x_stride, l->tokens, l->y + o0, y_stride, count, wide);
        }
    }
    return 0;
}
