/* Wide tiles of K-quant products (Q4_K, Q5_K, Q6_K weights times Q8_K activation rows): 16 outputs
 * in the 32-bit lanes of a vector (two vectors of 8 at AVX-VNNI and AVX2), so that from a few rows
 * on no horizontal reduction is left.
 *
 * kquant_dot_rows (integer_kquants.c) unpacks a weight block per output and tile of at most 4 rows,
 * and reduces each row's lane sums to one integer per super-block: per row and output about 16
 * vector instructions for 256 products. Here a super-block of 16 outputs is unpacked once per 64
 * rows into 64 vectors, vector n holding quants 4n .. 4n + 3 of every output (a 16 x 16 dword
 * transpose of the blocks' quant bytes), and each row multiplies them by its activation dwords
 * broadcast: sub-block sums with vpdpbusd, times the 16 outputs' scales with vpmulld, the mins with
 * vpdpwssd, then the float step 16 outputs wide. Per row and 16 outputs about 90 instructions.
 *
 * The integers are the same exact sums kquant_dot_rows forms (any order: see its bounds) and the
 * float step is, lane by lane, its kquant_term and acc + t in increasing super-block order, each
 * operation rounded on its own (`rounded16`). So a tile gives the same bits as kquant_dot_rows at
 * every level, and a driver may choose either per row count: a row's result never depends on how
 * many rows share the call.
 *
 * Where AMX is granted (integer_dot_amx_granted), a call of 16 rows or more forms those integers
 * with tile products instead, 16 rows x 16 outputs x 64 quants an instruction: see "AMX" below. */
#include <string.h>

#include "integer_dot.h"
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")))
#define KT_INLINE static inline __attribute__((always_inline))

/* v as a value the compiler cannot see through: a product rounds to float32 before the subtraction
 * or addition that reads it (-ffp-contract=fast would fuse them, and kquant_term does not). */
KT_AVX512 KT_INLINE __m512 rounded16(__m512 v) {
    __asm__("" : "+v"(v));
    return v;
}

/* r[c] = column c of the 16 x 16 dword matrix whose row k is r[k]. */
KT_AVX512 KT_INLINE void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4 i + k], 128-bit lane L: column 4 L + k of rows 4 i .. 4 i + 3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), d = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
        r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(a, c, 0xdd);
        r[4 + k] = _mm512_shuffle_i32x4(b, d, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
}

/* The lanes of a tile hold its outputs in the order LANE_OUTPUT (lane 4 m + n: output m + 4 n, an
 * involution), the order in which transpose4x16 leaves them; the bigger transposes are fed the
 * blocks in that order too, and the results are put back in output order once per call. */
#define KT_LANE_OUTPUT 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15

/* Dwords at .. at + dwords - 1 (at most 16, the rest read as zero) of the 16 blocks b[k] (in lane
 * order), transposed: out[m] lane k is dword m of block k. */
KT_AVX512 KT_INLINE void gather16(const uint8_t *const b[16], int at, int dwords, __m512i out[16]) {
    const __mmask16 valid = (__mmask16)((1u << dwords) - 1);
    for (int k = 0; k < 16; k++) out[k] = _mm512_maskz_loadu_epi32(valid, b[k] + at);
    transpose16(out);
}

/* The 4 dwords at `at` of the 16 blocks b[k] (in output order), transposed into lane order: a
 * block's 16 bytes to each 128-bit lane, then a 4 x 4 transpose within the lanes. */
KT_AVX512 KT_INLINE void transpose4x16(const uint8_t *const b[16], int at, __m512i v[4]) {
    __m512i z[4];
    for (int g = 0; g < 4; g++) {
        z[g] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b[4 * g] + at)));
        for (int m = 1; m < 4; m++) z[g] = _mm512_inserti32x4(z[g], _mm_loadu_si128((const __m128i *)(b[4 * g + m] + at)), m);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2);
    v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3);
    v[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* One super-block of 16 outputs, unpacked: q[n] lane k holds quants 4 n .. 4 n + 3 of the output
 * of lane k (unsigned), with each type's scales and float16 scales as 16-lane vectors. */
typedef struct {
    __m512i q[64];
    __m512i scales[16]; /* Q4_K / Q5_K: 8 sub-block scales; Q6_K: 16 group scales (signed) */
    __m512i pairs[12];  /* Q4_K / Q5_K: mins 2m and 2m + 1 as two int16 (m < 4), then scale j twice (4 + j);
                         * Q6_K: scales 2m, 2m + 1 */
    __m512 d, dmin;
} Unpacked;

/* The low 16 bits of each lane of a and b's as one dword: [a, b] as int16. */
KT_AVX512 KT_INLINE __m512i pair16(__m512i a, __m512i b) {
    return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(b, 16));
}

/* Q4_K (five 0) and Q5_K: d, dmin, 12 bytes of 6-bit scales and mins (kernels.h's
 * scales_and_mins), [Q5_K: 32 bytes of fifth bits,] 128 bytes of nibbles, chunk c's low nibbles
 * sub-block 2 c and high ones 2 c + 1. `b` in output order, `bl` in lane order. */
KT_AVX512 KT_INLINE void nibbles(__m512i qd, int m, Unpacked *u) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const int c = m / 8, k = m % 8;
    u->q[16 * c + k] = _mm512_and_si512(qd, m4);
    u->q[16 * c + 8 + k] = _mm512_and_si512(_mm512_srli_epi32(qd, 4), m4);
}

KT_AVX512 KT_INLINE void unpack45(const uint8_t *const b[16], const uint8_t *const bl[16], const int five, Unpacked *u) {
    __m512i t[16], h[4], hb[8];
    gather16(bl, 0, 16, t);
    for (int j = 0; j < 4; j++) h[j] = t[j];
    if (five) {
        for (int k = 0; k < 8; k++) hb[k] = t[4 + k];
        for (int m = 0; m < 4; m++) nibbles(t[12 + m], m, u);
        gather16(bl, 64, 16, t);
        for (int m = 0; m < 16; m++) nibbles(t[m], 4 + m, u);
        gather16(bl, 128, 12, t);
        for (int m = 0; m < 12; m++) nibbles(t[m], 20 + m, u);
    } else {
        for (int m = 0; m < 12; m++) nibbles(t[4 + m], m, u);
        gather16(bl, 64, 16, t);
        for (int m = 0; m < 16; m++) nibbles(t[m], 12 + m, u);
        transpose4x16(b, 128, t);
        for (int m = 0; m < 4; m++) nibbles(t[m], 28 + m, u);
    }
    u->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h[0]));
    u->dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h[0], 16)));
    const __m512i six = _mm512_set1_epi32(63), four = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3);
    __m512i mn[8];
    for (int j = 0; j < 4; j++) {
        u->scales[j] = _mm512_and_si512(_mm512_srli_epi32(h[1], 8 * j), six);
        mn[j] = _mm512_and_si512(_mm512_srli_epi32(h[2], 8 * j), six);
        u->scales[4 + j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h[3], 8 * j), four),
                                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[1], 8 * j + 6), two), 4));
        mn[4 + j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h[3], 8 * j + 4), four),
                                    _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[2], 8 * j + 6), two), 4));
    }
    for (int m = 0; m < 4; m++) u->pairs[m] = pair16(mn[2 * m], mn[2 * m + 1]);
    for (int j = 0; j < 8; j++) u->pairs[4 + j] = pair16(u->scales[j], u->scales[j]);
    if (five) {
        const __m512i one = _mm512_set1_epi8(1);
        for (int j = 0; j < 8; j++)
            for (int k = 0; k < 8; k++)
                u->q[8 * j + k] = _mm512_or_si512(u->q[8 * j + k], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb[k], j), one), 4));
    }
}

/* Q6_K: 128 bytes ql, 64 bytes qh, 16 signed scales, d. Value 128 h + 32 s + 4 kk + e comes from
 * ql dword 16 h + 8 (s % 2) + kk, nibble s / 2, and qh dword 8 h + kk, bits 2 s. */
KT_AVX512 KT_INLINE void unpack6(const uint8_t *const b[16], const uint8_t *const bl[16], Unpacked *u) {
    __m512i h[4];
    transpose4x16(b, 192, h);
    uint16_t dh[16] __attribute__((aligned(32)));
    for (int k = 0; k < 16; k++) memcpy(dh + k, bl[k] + 208, 2);
    u->d = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)dh));
    u->dmin = _mm512_setzero_ps();
    for (int g = 0; g < 16; g++) u->scales[g] = _mm512_srai_epi32(_mm512_slli_epi32(h[g / 4], 24 - 8 * (g % 4)), 24);
    for (int m = 0; m < 8; m++) u->pairs[m] = pair16(u->scales[2 * m], u->scales[2 * m + 1]);
    __m512i ql[32], qh[16];
    gather16(bl, 0, 16, ql);
    gather16(bl, 64, 16, ql + 16);
    gather16(bl, 128, 16, qh);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    for (int half = 0; half < 2; half++)
        for (int s = 0; s < 4; s++)
            for (int kk = 0; kk < 8; kk++) {
                const __m512i low = _mm512_and_si512(_mm512_srli_epi32(ql[16 * half + 8 * (s % 2) + kk], 4 * (s / 2)), m4);
                const __m512i hb = qh[8 * half + kk];
                const __m512i high = s == 0   ? _mm512_slli_epi32(hb, 4)
                                     : s == 1 ? _mm512_slli_epi32(hb, 2)
                                     : s == 2 ? hb
                                              : _mm512_srli_epi32(hb, 2);
                u->q[32 * half + 8 * s + kk] = _mm512_or_si512(low, _mm512_and_si512(high, m30));
            }
}

/* kquant_term lane by lane, then acc + t. */
KT_AVX512 KT_INLINE __m512 add_term16(__m512 acc, const Unpacked *u, float xd, __m512i sumi, __m512i summins) {
    const __m512 x = _mm512_set1_ps(xd);
    const __m512 dd = rounded16(_mm512_mul_ps(u->d, x)), dm = rounded16(_mm512_mul_ps(u->dmin, x));
    const __m512 t = _mm512_sub_ps(rounded16(_mm512_mul_ps(dd, _mm512_cvtepi32_ps(sumi))), rounded16(_mm512_mul_ps(dm, _mm512_cvtepi32_ps(summins))));
    return _mm512_add_ps(acc, t);
}

/* Activation dwords, read where they lie (Q8KBlock's qs and bsums) */
typedef int32_t __attribute__((may_alias)) Dword;

/* Rows 0 .. R - 1 (x[r * xs], R <= 4, a constant once inlined) of a super-block of Q4_K (five 0) or
 * Q5_K: each quant vector is loaded once for the R rows. Sub-block j's sums per half (16 values:
 * |.| <= 16 * 15 * 127 < 2^15 for Q4_K) go to sumi as one vpdpwssd with the scale in both words;
 * Q5_K's (31 * 16 * 127 > 2^15) by vpmulld. Then the mins times the pairs of bsums (vpdpwssd). */
KT_AVX512 KT_INLINE void rows45(const Unpacked *u, const Q8KBlock *x, int64_t xs, const int R, const int five, float *acc) {
    __m512i sumi[4], summins[4];
    for (int r = 0; r < R; r++) sumi[r] = summins[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
        __m512i lo[4], hi[4];
        for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            const __m512i a = u->q[8 * j + k], b = u->q[8 * j + 4 + k];
            for (int r = 0; r < R; r++) {
                const Dword *xq = (const Dword *)x[r * xs].qs;
                lo[r] = _mm512_dpbusd_epi32(lo[r], a, _mm512_set1_epi32(xq[8 * j + k]));
                hi[r] = _mm512_dpbusd_epi32(hi[r], b, _mm512_set1_epi32(xq[8 * j + 4 + k]));
            }
        }
        for (int r = 0; r < R; r++)
            sumi[r] = five ? _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(_mm512_add_epi32(lo[r], hi[r]), u->scales[j]))
                           : _mm512_dpwssd_epi32(sumi[r], _mm512_mask_blend_epi16(0xaaaaaaaau, lo[r], _mm512_slli_epi32(hi[r], 16)),
                                                 u->pairs[4 + j]);
    }
    for (int r = 0; r < R; r++) {
        int32_t bs[4];
        /* sums of bsums pairs (the 32-value sub-blocks), two int16 a dword: |.| <= 32 * 127 */
        const __m256i pairsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[r * xs].bsums), _mm256_set1_epi16(1));
        _mm_storeu_si128((__m128i *)bs, _mm_packs_epi32(_mm256_castsi256_si128(pairsum), _mm256_extracti128_si256(pairsum, 1)));
        for (int m = 0; m < 4; m++) summins[r] = _mm512_dpwssd_epi32(summins[r], u->pairs[m], _mm512_set1_epi32(bs[m]));
        _mm512_storeu_ps(acc + 16 * r, add_term16(_mm512_loadu_ps(acc + 16 * r), u, x[r * xs].d, sumi[r], summins[r]));
    }
}

/* Q6_K, rows as rows45: group sums of 16 (|.| <= 16 * 63 * 127) times the signed scales by
 * vpmulld, less 32 sum_g sc_g bsums_g (the quants' offset of 32, vpdpwssd over pairs of groups). */
KT_AVX512 KT_INLINE void rows6(const Unpacked *u, const Q8KBlock *x, int64_t xs, const int R, float *acc) {
    __m512i sumi[4], offset[4];
    for (int r = 0; r < R; r++) sumi[r] = offset[r] = _mm512_setzero_si512();
    for (int g = 0; g < 16; g += 2) {
        __m512i s[2][4];
        for (int r = 0; r < R; r++) s[0][r] = s[1][r] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            const __m512i a = u->q[4 * g + k], b = u->q[4 * g + 4 + k];
            for (int r = 0; r < R; r++) {
                const Dword *xq = (const Dword *)x[r * xs].qs;
                s[0][r] = _mm512_dpbusd_epi32(s[0][r], a, _mm512_set1_epi32(xq[4 * g + k]));
                s[1][r] = _mm512_dpbusd_epi32(s[1][r], b, _mm512_set1_epi32(xq[4 * g + 4 + k]));
            }
        }
        for (int r = 0; r < R; r++)
            sumi[r] = _mm512_add_epi32(sumi[r], _mm512_add_epi32(_mm512_mullo_epi32(s[0][r], u->scales[g]),
                                                                 _mm512_mullo_epi32(s[1][r], u->scales[g + 1])));
    }
    for (int r = 0; r < R; r++) {
        const Dword *bs = (const Dword *)x[r * xs].bsums;
        for (int m = 0; m < 8; m++) offset[r] = _mm512_dpwssd_epi32(offset[r], u->pairs[m], _mm512_set1_epi32(bs[m]));
        const __m512i total = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(offset[r], 5));
        _mm512_storeu_ps(acc + 16 * r, add_term16(_mm512_loadu_ps(acc + 16 * r), u, x[r * xs].d, total, _mm512_setzero_si512()));
    }
}

/* Every row of the tile, 4 at a time, then the 1 to 3 left (constants, so the row loops unroll). */
KT_AVX512 KT_INLINE void tile_rows(int type, const Unpacked *u, const Q8KBlock *x, int64_t xs, int rows, float *acc) {
    int r = 0;
#define KT_ROWS(R)                                                                                       \
    do {                                                                                                 \
        if (type == GGML_Q6_K) rows6(u, x + r * xs, xs, R, acc + 16 * r);                                 \
        else if (type == GGML_Q5_K) rows45(u, x + r * xs, xs, R, 1, acc + 16 * r);                        \
        else rows45(u, x + r * xs, xs, R, 0, acc + 16 * r);                                               \
    } while (0)
    for (; r + 4 <= rows; r += 4) KT_ROWS(4);
    switch (rows - r) {
    case 3: KT_ROWS(3); break;
    case 2: KT_ROWS(2); break;
    case 1: KT_ROWS(1); break;
    default: break;
    }
#undef KT_ROWS
}

#ifndef KT_LOCALITY
#define KT_LOCALITY 3
#endif

KT_AVX512 static void tile16_avx512(int type, const uint8_t *const w[16], int64_t blocks, const Q8KBlock *x, int64_t xs, int rows,
                                    const uint8_t *ahead, float *acc) {
    const int bytes = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210;
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + 16 * r, _mm512_setzero_ps());
    static const int lane_output[16] = {KT_LANE_OUTPUT};
    Unpacked u;
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b[16], *bl[16];
        for (int k = 0; k < 16; k++) b[k] = w[k] + (int64_t)bytes * i;
        /* The next tile's weights (16 rows, contiguous) in order, a 1 / blocks share a block: 16
         * rows streamed at once outrun the hardware prefetcher, one region in order does not. */
        if (ahead)
            for (int64_t at = 16 * bytes * i; at < 16 * bytes * (i + 1); at += 64) __builtin_prefetch(ahead + at, 0, KT_LOCALITY);
        for (int k = 0; k < 16; k++) bl[k] = b[lane_output[k]];
        if (type == GGML_Q6_K) unpack6(b, bl, &u);
        else unpack45(b, bl, type == GGML_Q5_K, &u);
        tile_rows(type, &u, x + i, xs, rows, acc);
    }
    /* lane k holds output lane_output[k], and lane_output is its own inverse */
    const __m512i order = _mm512_loadu_si512(lane_output);
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + 16 * r, _mm512_permutexvar_ps(order, _mm512_loadu_ps(acc + 16 * r)));
}
#endif

/* AMX: tile data needs Linux's permission (integer_dot_amx_granted). */
#ifdef IDOT_AMX_TILES
/* ---- AMX ------------------------------------------------------------------------------------------
 * The unpacked super-block's 64 quant vectors are, as they lie, the B operand of a tile dot product:
 * row n of B holds quants 4n .. 4n + 3 of each of the 16 outputs (64 bytes), the layout tdpb*d
 * reads, and A is 16 activation rows' quants (64 each, signed). A tile
 * product sums over 64 quants, but the scales change every 32 (Q6_K: 16) and differ per output, so
 * they go into B: each scale is split into digits small enough that quant times digit is a byte,
 *   Q4_K / Q5_K: sc = lo + 8 hi, lo and hi in 0..7:  q lo, q hi <= 31 * 7 = 217 (unsigned);
 *   Q6_K: sc = e0 + 8 e1 + 64 e2, each e in -3..4 (a balanced base 8, which holds -128..127), times
 *         the centred quants q - 32 in -32..31:  |(q - 32) e| <= 128, -128 only at 4 x -32 (signed),
 * and B_e holds each quant times its sub-block's digit e. Then 4 tile products (K = 256 in 4 x 64)
 * per digit give, exactly, C_e = sum_j e_j sum_l q_jl x_jl for 16 rows and 16 outputs, and
 *   Q4_K / Q5_K: sumi = C_lo + 8 C_hi,   Q6_K: sumi = C_0 + 8 C_1 + 64 C_2 (the offset of 32 inside),
 * the same integers rows45 and rows6 form (|C| <= 256 * 217 * 127 < 2^31). The mins (bsums pairs,
 * vpdpwssd) and the float step are rows45's and rows6's, lane by lane, so the bits are every other
 * level's. A reads the call's quants packed (kquant_pack_rows: a super-block's rows contiguous,
 * each 256 quants 64-byte aligned). The rows go 16 at a time, the last 16 ending where the call
 * does (a call of AMX has at least 16: KQ_AMX_FROM), so no tile reads past them. */
#define KT_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")))

/* All 8 tiles 16 rows of 64 bytes (amx_sums says which holds what). */
static const IdotTileConfig tile_config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

KT_AMX void kquant_amx_begin(void) { _tile_loadconfig(&tile_config); }

KT_AMX void kquant_amx_end(void) { _tile_release(); }

/* The 64 bytes of quants q times each lane's 16-bit word `digit` (both words of a dword the lane's
 * digit, 0..7): every byte's product is at most 31 * 7 < 256, so no carry crosses into the next. */
KT_AMX KT_INLINE __m512i times_digit(__m512i q, __m512i digit) { return _mm512_mullo_epi16(q, digit); }

/* (q - 32) e for quants q <= 63 and digits e in -3..4 (per lane: `magnitude` |e| in both words,
 * `negative` 0xff bytes where e < 0, `k` the bytes of negative + 32 e): q |e| <= 252 carries no
 * byte into the next; negated (x ^ 0xff - 0xff) where e < 0, less 32 e. */
KT_AMX KT_INLINE __m512i centred_times_digit(__m512i q, __m512i magnitude, __m512i negative, __m512i k) {
    return _mm512_sub_epi8(_mm512_xor_si512(_mm512_mullo_epi16(q, magnitude), negative), k);
}

/* A lane's int32 value v (0..255) in every byte of its dword. */
KT_AMX KT_INLINE __m512i bytes4(__m512i v) { return _mm512_mullo_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0xff)), _mm512_set1_epi32(0x01010101)); }

/* B_e for the super-block: bq[e][64 n ..] = quant vector n times its sub-block's digit e. */
KT_AMX KT_INLINE void digit_operands(const int type, const Unpacked *u, uint8_t (*bq)[64 * 64]) {
    if (type != GGML_Q6_K) {
        for (int j = 0; j < 8; j++) {
            const __m512i lo = _mm512_and_si512(u->pairs[4 + j], _mm512_set1_epi16(7));
            const __m512i hi = _mm512_srli_epi16(u->pairs[4 + j], 3);
            for (int n = 8 * j; n < 8 * j + 8; n++) {
                _mm512_store_si512(bq[0] + 64 * n, times_digit(u->q[n], lo));
                _mm512_store_si512(bq[1] + 64 * n, times_digit(u->q[n], hi));
            }
        }
        return;
    }
    const __m512i three = _mm512_set1_epi32(3), seven = _mm512_set1_epi32(7);
    for (int g = 0; g < 16; g++) {
        __m512i rest = u->scales[g];
        for (int e = 0; e < 3; e++) {
            const __m512i digit = e < 2 ? _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(rest, three), seven), three) : rest;
            rest = _mm512_srai_epi32(_mm512_sub_epi32(rest, digit), 3);
            const __m512i magnitude = _mm512_abs_epi32(digit);
            const __m512i negative = _mm512_srai_epi32(digit, 31); /* every byte 0xff where e < 0 */
            const __m512i k = _mm512_add_epi8(negative, bytes4(_mm512_slli_epi32(digit, 5)));
            const __m512i m16 = _mm512_or_si512(magnitude, _mm512_slli_epi32(magnitude, 16));
            for (int n = 4 * g; n < 4 * g + 4; n++) _mm512_store_si512(bq[e] + 64 * n, centred_times_digit(u->q[n], m16, negative, k));
        }
    }
}

/* sums[e][16 r + k] = C_e of row r (of the 16 at a) and lane k. Q4_K, Q5_K: A signed, B unsigned
 * (tdpbsud); Q6_K: both signed (tdpbssd). Tiles are not renamed: a load into a tile waits for the
 * products that read it, so consecutive 64-quant steps load into alternate tiles (Q4_K, Q5_K: A in
 * 2 and 3, B in 4, 5 and 6, 7; Q6_K: A in 3 and 7), each step's loads issued before the previous
 * step's products. */
KT_AMX KT_INLINE void amx_sums(const int type, uint8_t (*bq)[64 * 64], const int8_t *a, int64_t stride, int32_t (*sums)[256]) {
    if (type == GGML_Q6_K) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int c = 0; c < 4; c += 2) {
            _tile_loadd(3, a + 64 * c, stride);
            _tile_loadd(7, a + 64 * (c + 1), stride);
            _tile_loadd(4, bq[0] + 1024 * c, 64);
            _tile_loadd(5, bq[1] + 1024 * c, 64);
            _tile_loadd(6, bq[2] + 1024 * c, 64);
            _tile_dpbssd(0, 3, 4);
            _tile_dpbssd(1, 3, 5);
            _tile_dpbssd(2, 3, 6);
            _tile_loadd(4, bq[0] + 1024 * (c + 1), 64);
            _tile_loadd(5, bq[1] + 1024 * (c + 1), 64);
            _tile_loadd(6, bq[2] + 1024 * (c + 1), 64);
            _tile_dpbssd(0, 7, 4);
            _tile_dpbssd(1, 7, 5);
            _tile_dpbssd(2, 7, 6);
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, a, stride);
        _tile_loadd(4, bq[0], 64);
        _tile_loadd(5, bq[1], 64);
        _tile_loadd(3, a + 64, stride);
        _tile_loadd(6, bq[0] + 1024, 64);
        _tile_loadd(7, bq[1] + 1024, 64);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 2, 5);
        _tile_loadd(2, a + 128, stride);
        _tile_loadd(4, bq[0] + 2048, 64);
        _tile_loadd(5, bq[1] + 2048, 64);
        _tile_dpbsud(0, 3, 6);
        _tile_dpbsud(1, 3, 7);
        _tile_loadd(3, a + 192, stride);
        _tile_loadd(6, bq[0] + 3072, 64);
        _tile_loadd(7, bq[1] + 3072, 64);
        _tile_dpbsud(0, 2, 4);
        _tile_dpbsud(1, 2, 5);
        _tile_dpbsud(0, 3, 6);
        _tile_dpbsud(1, 3, 7);
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
    }
}

/* Row r of the tile sums: sumi from the digits' sums, summins as rows45 forms it (from the row's
 * sub-block sums `pairs`, formed once a call by kquant_pack_rows, not once per 16 outputs), then
 * add_term16. */
KT_AMX KT_INLINE void amx_finish(const int type, const Unpacked *u, int32_t (*sums)[256], int r, const Q8KBlock *xb, const uint32_t *pairs,
                                 float *acc) {
    __m512i sumi = _mm512_add_epi32(_mm512_load_si512(sums[0] + 16 * r), _mm512_slli_epi32(_mm512_load_si512(sums[1] + 16 * r), 3));
    __m512i summins = _mm512_setzero_si512();
    if (type == GGML_Q6_K) {
        sumi = _mm512_add_epi32(sumi, _mm512_slli_epi32(_mm512_load_si512(sums[2] + 16 * r), 6));
    } else {
        /* the row's sub-block sums, two a dword (kquant_pack_rows), each broadcast from memory */
        for (int m = 0; m < 4; m++) summins = _mm512_dpwssd_epi32(summins, u->pairs[m], _mm512_set1_epi32((int)pairs[m]));
    }
    _mm512_storeu_ps(acc, add_term16(_mm512_loadu_ps(acc), u, xb->d, sumi, summins));
}

KT_AMX KT_INLINE void tile16_amx_type(const int type, const uint8_t *const w[16], int64_t blocks, const Q8KBlock *x, int64_t xs,
                                      int rows, const uint8_t *ahead, const int8_t *packed, const uint32_t *pairs, float *acc) {
    const int bytes = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210;
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + 16 * r, _mm512_setzero_ps());
    static const int lane_output[16] = {KT_LANE_OUTPUT};
    Unpacked u;
    uint8_t bq[3][64 * 64] __attribute__((aligned(64)));
    int32_t sums[3][256] __attribute__((aligned(64)));
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b[16], *bl[16];
        for (int k = 0; k < 16; k++) b[k] = w[k] + (int64_t)bytes * i;
        for (int k = 0; k < 16; k++) bl[k] = b[lane_output[k]];
        if (type == GGML_Q6_K) unpack6(b, bl, &u);
        else unpack45(b, bl, type == GGML_Q5_K, &u);
        digit_operands(type, &u, bq);
        /* the next tile's share of this block, 3 lines a row among the float steps: asked for all at
         * once they fill the line buffers, and the unpacking waits on them */
        int64_t at = 16 * bytes * i;
        const int64_t end = ahead ? at + 16 * bytes : at;
        for (int r0 = 0; r0 < rows; r0 += 16) {
            const int base = r0 + 16 <= rows ? r0 : rows - 16; /* the last 16 rows: a few again, the same sums */
            amx_sums(type, bq, packed + (i * rows + base) * 256, 256, sums);
            for (int r = r0; r < rows && r < r0 + 16; r++) {
                amx_finish(type, &u, sums, r - base, x + r * xs + i, pairs + 4 * (i * rows + r), acc + 16 * r);
                for (int l = 0; l < 3 && at < end; l++, at += 64) __builtin_prefetch(ahead + at, 0, KT_LOCALITY);
            }
        }
        for (; at < end; at += 64) __builtin_prefetch(ahead + at, 0, KT_LOCALITY);
    }
    const __m512i order = _mm512_loadu_si512(lane_output);
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + 16 * r, _mm512_permutexvar_ps(order, _mm512_loadu_ps(acc + 16 * r)));
}

/* rows >= 16, in a thread between kquant_amx_begin and kquant_amx_end. */
KT_AMX static void tile16_amx(int type, const uint8_t *const w[16], int64_t blocks, const Q8KBlock *x, int64_t xs, int rows,
                              const uint8_t *ahead, const int8_t *packed, const uint32_t *pairs, float *acc) {
    if (type == GGML_Q6_K) tile16_amx_type(GGML_Q6_K, w, blocks, x, xs, rows, ahead, packed, pairs, acc);
    else if (type == GGML_Q5_K) tile16_amx_type(GGML_Q5_K, w, blocks, x, xs, rows, ahead, packed, pairs, acc);
    else tile16_amx_type(GGML_Q4_K, w, blocks, x, xs, rows, ahead, packed, pairs, acc);
}
#define KT_HAS_AMX 1
#endif

#if defined(__x86_64__) && defined(__GNUC__)
/* ---- 256-bit levels: AVX-VNNI and AVX2 -----------------------------------------------------------
 * The same tile of 16 outputs as two vectors of 8 lanes (outputs 0-7 and 8-15), each activation
 * dword broadcast once for both. AVX2 forms vpdpbusd's sums with vpmaddubsw (pairs: at most
 * 2 * 63 * 128, no saturation), added in 16 bits while they stay exact, and vpmaddwd by ones
 * (scale_sums_in16), and vpdpwssd's with vpmaddwd and an addition: the same integers. */
#define KT_AVX2 __attribute__((target("avx2,f16c,fma")))
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define KT_AVX_VNNI __attribute__((target("avxvnni,avx2,f16c,fma")))
#define KT_HAS_AVX_VNNI 1
#endif

KT_AVX2 KT_INLINE __m256 rounded8(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

/* r[c] = column c of the 8 x 8 dword matrix whose row k is r[k]. */
KT_AVX2 KT_INLINE void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4 i + k], 128-bit lane L: column 4 L + k of rows 4 i .. 4 i + 3 */
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x20);
        r[4 + k] = _mm256_permute2x128_si256(u[k], u[4 + k], 0x31);
    }
}

/* Dwords at .. at + dwords - 1 (at most 8, the rest zero) of blocks b[0..7], transposed. */
KT_AVX2 KT_INLINE void gather8(const uint8_t *const b[8], int at, int dwords, __m256i out[8]) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(dwords), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int k = 0; k < 8; k++) out[k] = _mm256_maskload_epi32((const int *)(b[k] + at), mask);
    transpose8(out);
}

/* Dwords at .. at + n - 1 of blocks b[0..7], transposed, n = 8 per call: out[m], m < n. */
KT_AVX2 KT_INLINE void gather_run8(const uint8_t *const b[8], int at, int n, __m256i *out) {
    for (int m = 0; m < n; m += 8) {
        __m256i t[8];
        gather8(b, at + 4 * m, n - m < 8 ? n - m : 8, t);
        for (int k = 0; k < 8 && m + k < n; k++) out[m + k] = t[k];
    }
}

typedef struct {
    __m256i q[64];
    __m256i scales[16];
    __m256i pairs[12];
    __m256 d, dmin;
} Unpacked8;

KT_AVX2 KT_INLINE __m256i pair16x8(__m256i a, __m256i b) {
    return _mm256_or_si256(_mm256_and_si256(a, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(b, 16));
}

/* Outputs b[0..7] of a super-block, as unpack45 / unpack6 do for 16. */
KT_AVX2 KT_INLINE void unpack8(int type, const uint8_t *const b[8], Unpacked8 *u) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    if (type == GGML_Q6_K) {
        __m256i ql[32], qh[16], h[4];
        gather_run8(b, 0, 32, ql);
        gather_run8(b, 128, 16, qh);
        gather_run8(b, 192, 4, h);
        uint16_t dh[8];
        for (int k = 0; k < 8; k++) memcpy(dh + k, b[k] + 208, 2);
        u->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
        u->dmin = _mm256_setzero_ps();
        for (int g = 0; g < 16; g++) u->scales[g] = _mm256_srai_epi32(_mm256_slli_epi32(h[g / 4], 24 - 8 * (g % 4)), 24);
        for (int m = 0; m < 8; m++) u->pairs[m] = pair16x8(u->scales[2 * m], u->scales[2 * m + 1]);
        const __m256i m30 = _mm256_set1_epi8(0x30);
        for (int half = 0; half < 2; half++)
            for (int sq = 0; sq < 4; sq++)
                for (int kk = 0; kk < 8; kk++) {
                    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(ql[16 * half + 8 * (sq % 2) + kk], 4 * (sq / 2)), m4);
                    const __m256i hb = qh[8 * half + kk];
                    const __m256i high = sq == 0   ? _mm256_slli_epi32(hb, 4)
                                         : sq == 1 ? _mm256_slli_epi32(hb, 2)
                                         : sq == 2 ? hb
                                                   : _mm256_srli_epi32(hb, 2);
                    u->q[32 * half + 8 * sq + kk] = _mm256_or_si256(low, _mm256_and_si256(high, m30));
                }
        return;
    }
    const int five = type == GGML_Q5_K;
    __m256i h[4], qd[32], hb[8];
    gather_run8(b, 0, 4, h);
    gather_run8(b, five ? 48 : 16, 32, qd);
    if (five) gather_run8(b, 16, 8, hb);
    {
        uint32_t w[8];
        uint16_t dv[8], mv[8];
        _mm256_storeu_si256((__m256i *)w, h[0]);
        for (int k = 0; k < 8; k++) dv[k] = (uint16_t)w[k], mv[k] = (uint16_t)(w[k] >> 16);
        u->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dv));
        u->dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mv));
    }
    const __m256i six = _mm256_set1_epi32(63), four = _mm256_set1_epi32(15), two = _mm256_set1_epi32(3);
    __m256i mn[8];
    for (int j = 0; j < 4; j++) {
        u->scales[j] = _mm256_and_si256(_mm256_srli_epi32(h[1], 8 * j), six);
        mn[j] = _mm256_and_si256(_mm256_srli_epi32(h[2], 8 * j), six);
        u->scales[4 + j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(h[3], 8 * j), four),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h[1], 8 * j + 6), two), 4));
        mn[4 + j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(h[3], 8 * j + 4), four),
                                    _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h[2], 8 * j + 6), two), 4));
    }
    for (int m = 0; m < 4; m++) u->pairs[m] = pair16x8(mn[2 * m], mn[2 * m + 1]);
    for (int m = 0; m < 32; m++) {
        const int c = m / 8, k = m % 8;
        u->q[16 * c + k] = _mm256_and_si256(qd[m], m4);
        u->q[16 * c + 8 + k] = _mm256_and_si256(_mm256_srli_epi32(qd[m], 4), m4);
    }
    if (five) {
        const __m256i one = _mm256_set1_epi8(1);
        for (int j = 0; j < 8; j++)
            for (int k = 0; k < 8; k++)
                u->q[8 * j + k] = _mm256_or_si256(u->q[8 * j + k], _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hb[k], j), one), 4));
    }
}

KT_AVX2 KT_INLINE __m256 add_term8(__m256 acc, const Unpacked8 *u, float xd, __m256i sumi, __m256i summins) {
    const __m256 x = _mm256_set1_ps(xd);
    const __m256 dd = rounded8(_mm256_mul_ps(u->d, x)), dm = rounded8(_mm256_mul_ps(u->dmin, x));
    const __m256 t = _mm256_sub_ps(rounded8(_mm256_mul_ps(dd, _mm256_cvtepi32_ps(sumi))), rounded8(_mm256_mul_ps(dm, _mm256_cvtepi32_ps(summins))));
    return _mm256_add_ps(acc, t);
}

/* s[h]: the sums of quant dwords at .. at + group - 1 (one scale's) of half h times the row's
 * activation dwords, by vpdpbusd. */
#ifdef KT_HAS_AVX_VNNI
KT_AVX_VNNI KT_INLINE void scale_sums_avx_vnni(int type, const Unpacked8 u[2], const Dword *xq, int at, int group, __m256i s[2]) {
    (void)type;
    s[0] = s[1] = _mm256_setzero_si256();
    for (int k = at; k < at + group; k++) {
        const __m256i xv = _mm256_set1_epi32(xq[k]);
        s[0] = _mm256_dpbusd_avx_epi32(s[0], u[0].q[k], xv);
        s[1] = _mm256_dpbusd_avx_epi32(s[1], u[1].q[k], xv);
    }
}
#endif

/* The same with AVX2: vpmaddubsw's pair sums (quant q <= qmax unsigned, activation >= -128: at most
 * 2 * 128 * qmax in magnitude) are added as int16 `per` at a time, as many as stay exact (Q4_K, q <= 15:
 * 8 x 3,840; Q5_K, 31: 4 x 7,936; Q6_K, 63: 2 x 16,128; all below 2^15), before vpmaddwd by ones widens
 * them: the same integers in fewer instructions than widening every pair sum. */
KT_AVX2 KT_INLINE void scale_sums_in16(const Unpacked8 u[2], const Dword *xq, int at, const int group, const int per, __m256i s[2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    s[0] = s[1] = _mm256_setzero_si256();
    for (int k0 = at; k0 < at + group; k0 += per) {
        __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();
        for (int k = k0; k < k0 + per; k++) {
            const __m256i xv = _mm256_set1_epi32(xq[k]);
            t0 = _mm256_add_epi16(t0, _mm256_maddubs_epi16(u[0].q[k], xv));
            t1 = _mm256_add_epi16(t1, _mm256_maddubs_epi16(u[1].q[k], xv));
        }
        s[0] = _mm256_add_epi32(s[0], _mm256_madd_epi16(t0, ones));
        s[1] = _mm256_add_epi32(s[1], _mm256_madd_epi16(t1, ones));
    }
}

KT_AVX2 KT_INLINE void scale_sums_avx2(int type, const Unpacked8 u[2], const Dword *xq, int at, int group, __m256i s[2]) {
    (void)group;
    if (type == GGML_Q4_K) scale_sums_in16(u, xq, at, 8, 8, s);
    else if (type == GGML_Q5_K) scale_sums_in16(u, xq, at, 8, 4, s);
    else scale_sums_in16(u, xq, at, 4, 2, s);
}

/* One row against both halves: sumi as rows45 / rows6 form it (Q4_K's scales by vpmulld here: the
 * 16-bit packing saves nothing at 8 lanes), then the float step. SUMS: a scale's sums (above), given
 * the first dword and the count though each level uses one of type and count: deriving both from
 * the type inside them compiled the AVX-VNNI loop slower (docs/benchmarks.md); DW: vpdpwssd. */
#define KT_ROW8(NAME, TARGET, SUMS, DW)                                                                  \
    TARGET KT_INLINE void NAME(int type, const Unpacked8 u[2], const Q8KBlock *xb, float *acc) {          \
        const Dword *xq = (const Dword *)xb->qs;                                                          \
        __m256i sumi[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                              \
        __m256i summins[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};                           \
        const int group = type == GGML_Q6_K ? 4 : 8; /* dwords a scale covers */                         \
        for (int g = 0; g < 64 / group; g++) {                                                            \
            __m256i s[2];                                                                                 \
            SUMS(type, u, xq, group * g, group, s);                                                       \
            for (int h = 0; h < 2; h++) sumi[h] = _mm256_add_epi32(sumi[h], _mm256_mullo_epi32(s[h], u[h].scales[g])); \
        }                                                                                                 \
        int32_t bs[8];                                                                                    \
        int pairs = 8;                                                                                    \
        if (type == GGML_Q6_K) {                                                                          \
            memcpy(bs, xb->bsums, sizeof bs);                                                             \
        } else {                                                                                          \
            const __m256i ps = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), _mm256_set1_epi16(1)); \
            _mm_storeu_si128((__m128i *)bs, _mm_packs_epi32(_mm256_castsi256_si128(ps), _mm256_extracti128_si256(ps, 1))); \
            pairs = 4;                                                                                    \
        }                                                                                                 \
        for (int m = 0; m < pairs; m++) {                                                                 \
            const __m256i bv = _mm256_set1_epi32(bs[m]);                                                  \
            for (int h = 0; h < 2; h++) summins[h] = DW(summins[h], u[h].pairs[m], bv);                  \
        }                                                                                                 \
        for (int h = 0; h < 2; h++) {                                                                     \
            __m256i total = sumi[h], mins = summins[h];                                                   \
            if (type == GGML_Q6_K) total = _mm256_sub_epi32(total, _mm256_slli_epi32(mins, 5)), mins = _mm256_setzero_si256(); \
            _mm256_storeu_ps(acc + 8 * h, add_term8(_mm256_loadu_ps(acc + 8 * h), &u[h], xb->d, total, mins)); \
        }                                                                                                 \
    }

#define KT_DW_AVX2(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
KT_ROW8(row8_avx2, KT_AVX2, scale_sums_avx2, KT_DW_AVX2)
#ifdef KT_HAS_AVX_VNNI
KT_ROW8(row8_avx_vnni, KT_AVX_VNNI, scale_sums_avx_vnni, _mm256_dpwssd_avx_epi32)
#endif

/* NAME##_type is inlined with `type` a constant (NAME picks it): a tile's loops then have constant
 * bounds and offsets, which the AVX-VNNI tiles measurably need (docs/benchmarks.md, the 1B file). */
#define KT_TILE8(NAME, TARGET, ROW)                                                                      \
    TARGET KT_INLINE void NAME##_type(const int type, const uint8_t *const w[16], int64_t blocks, const Q8KBlock *x, int64_t xs, \
                                      int rows, const uint8_t *ahead, float *acc) {                     \
        const int bytes = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210;                       \
        for (int r = 0; r < 16 * rows; r++) acc[r] = 0.0f;                                                \
        Unpacked8 u[2];                                                                                   \
        for (int64_t i = 0; i < blocks; i++) {                                                            \
            const uint8_t *b[16];                                                                         \
            for (int k = 0; k < 16; k++) b[k] = w[k] + (int64_t)bytes * i;                                \
            if (ahead)                                                                                    \
                for (int64_t at = 16 * bytes * i; at < 16 * bytes * (i + 1); at += 64) __builtin_prefetch(ahead + at, 0, 3); \
            unpack8(type, b, &u[0]);                                                                      \
            unpack8(type, b + 8, &u[1]);                                                                  \
            for (int r = 0; r < rows; r++) ROW(type, u, x + r * xs + i, acc + 16 * r);                    \
        }                                                                                                 \
    }                                                                                                     \
    TARGET static void NAME(int type, const uint8_t *const w[16], int64_t blocks, const Q8KBlock *x, int64_t xs, int rows, \
                            const uint8_t *ahead, float *acc) {                                          \
        if (type == GGML_Q6_K) NAME##_type(GGML_Q6_K, w, blocks, x, xs, rows, ahead, acc);                \
        else if (type == GGML_Q5_K) NAME##_type(GGML_Q5_K, w, blocks, x, xs, rows, ahead, acc);           \
        else NAME##_type(GGML_Q4_K, w, blocks, x, xs, rows, ahead, acc);                                  \
    }
KT_TILE8(tile16_avx2, KT_AVX2, row8_avx2)
#ifdef KT_HAS_AVX_VNNI
KT_TILE8(tile16_avx_vnni, KT_AVX_VNNI, row8_avx_vnni)
#else
#define tile16_avx_vnni tile16_avx2
#endif
#endif

#ifndef KT_HAS_AMX
void kquant_amx_begin(void) {}
void kquant_amx_end(void) {}
#endif

void kquant_pack_rows(const Q8KBlock *x, int64_t x_stride, int rows, int64_t blocks, int8_t *out, uint32_t *pairs) {
    for (int64_t i = 0; i < blocks; i++)
        for (int r = 0; r < rows; r++) {
            const Q8KBlock *b = x + r * x_stride + i;
            memcpy(out + (i * rows + r) * 256, b->qs, 256);
            /* |bsums[2 j] + bsums[2 j + 1]| <= 32 * 127: exact in int16 */
            for (int m = 0; m < 4; m++) {
                const int lo = b->bsums[4 * m] + b->bsums[4 * m + 1], hi = b->bsums[4 * m + 2] + b->bsums[4 * m + 3];
                pairs[4 * (i * rows + r) + m] = (uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16;
            }
        }
}

#if KQ_AMX_FROM < 16
#error "KQ_AMX_FROM must be at least 16: the AMX tiles read 16 activation rows at a time"
#endif
int kquant_dot_tile16(int vector, int type, const uint8_t *const w[KQ_TILE_OUTPUTS], int64_t blocks, const Q8KBlock *x, int64_t x_stride,
                      int rows, const uint8_t *ahead, const int8_t *packed, const uint32_t *pairs, float *acc) {
#if defined(__x86_64__) && defined(__GNUC__)
#ifdef KT_HAS_AMX
    if (vector >= IDOT_AMX && rows >= KQ_AMX_FROM && packed) {
        tile16_amx(type, w, blocks, x, x_stride, rows, ahead, packed, pairs, acc);
        return 1;
    }
#endif
    if (vector >= IDOT_AVX512_VNNI) {
        tile16_avx512(type, w, blocks, x, x_stride, rows, ahead, acc);
        return 1;
    }
    if (vector == IDOT_AVX_VNNI) {
        tile16_avx_vnni(type, w, blocks, x, x_stride, rows, ahead, acc);
        return 1;
    }
    if (vector == IDOT_AVX2) {
        tile16_avx2(type, w, blocks, x, x_stride, rows, ahead, acc);
        return 1;
    }
#else
    (void)vector, (void)type, (void)w, (void)blocks, (void)x, (void)x_stride, (void)rows, (void)ahead, (void)packed, (void)pairs, (void)acc;
#endif
    return 0;
}
