/* Integer products of K-quant weights (Q4_K, Q5_K, Q6_K) with Q8_K activation blocks
 * (integer_dot.h), and the activations' quantization.
 *
 * A 256-value super-block's product with one activation row is, exactly in integers,
 *   Q4_K / Q5_K: sumi = sum_j sc_j sum_l q_jl x_jl and summins = sum_j mn_j (bsums_2j + bsums_2j+1)
 *                (8 sub-blocks of 32, 6-bit scales sc_j and mins mn_j, q in 0..15 or 0..31),
 *   Q6_K:        sumi = sum_g sc_g sum_l q_gl x_gl - 32 sum_g sc_g bsums_g
 *                (16 groups of 16, signed 8-bit scales, q in 0..63 stored with an offset of 32),
 * and the float result is d x.d sumi - dmin x.d summins. Every level computes the same integers (any
 * order: integer sums are exact; no intermediate overflows, see the bounds at each step) and then the
 * same float32 operations in the same order: dd = d * x.d, dm = dmin * x.d, t = dd * (float)sumi -
 * dm * (float)summins (Q6_K: t = dd * (float)sumi), acc = acc + t over the super-blocks in increasing
 * order, each operation rounded on its own (`rounded` keeps -ffp-contract from fusing a product into
 * the next addition at the levels that have FMA). So every level gives the same bits, and a row's
 * result is its own whatever rows share the call.
 *
 * The weights' quants are unsigned (0..15, 0..31, 0..63) and the activations signed (-127..127), the
 * operand order of vpmaddubsw and vpdpbusd. AVX2 multiplies 32 pairs with vpmaddubsw (a pair's sum at
 * most 2 * 63 * 127 = 16002, no saturation) and scales them with vpmaddwd. The VNNI levels sum 4
 * products a lane with vpdpbusd (at most 4 * 63 * 127 = 32004), pack two such vectors into 16-bit
 * lanes (vpackssdw, exact below 32768) and multiply-add the scales with vpdpwssd: one 512-bit
 * multiplication port instruction and a half per 64 products. */
#include <math.h>
#include <string.h>

#include "integer_dot.h"
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KQ_X86 1
#define KQ_AVX2 __attribute__((target("avx2,f16c")))
#define KQ_AVX_VNNI __attribute__((target("avxvnni,avx2,f16c")))
/* AVX-VNNI's intrinsics came with GCC 11 and clang 12; older compilers run that level's loop on the
 * AVX2 kernel (the same bits). */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define KQ_HAS_AVX_VNNI 1
#endif
#define KQ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c")))
#endif

#define KQ_INLINE static inline __attribute__((always_inline))

#ifndef KQ_AHEAD
#define KQ_AHEAD 2048
#endif
/* Asks for the weight bytes KQ_AHEAD past a block's `bytes` (the rest of this row, then the next
 * rows, which the drivers read in order): a decode row is bound by reading the weights, and the
 * hardware prefetcher alone leaves the products waiting on memory. Past the weight's end a prefetch
 * is a no-op, never a fault. */
KQ_INLINE void prefetch_ahead(const uint8_t *b, int bytes) {
    for (int at = 0; at < bytes; at += 64) __builtin_prefetch(b + KQ_AHEAD + at, 0, 3);
}

/* Returns v as a value the compiler cannot see through, so a product is rounded to float32 before
 * the addition that reads it: the levels compiled with FMA would otherwise fuse it (-ffp-contract=fast)
 * and the portable one would not. */
KQ_INLINE float rounded(float v) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(v));
#elif defined(__aarch64__)
    __asm__("" : "+w"(v));
#else
    volatile float kept = v;
    v = kept;
#endif
    return v;
}

static inline float half_of(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return float_from_half(h);
}

/* A super-block's float term (Q4_K, Q5_K; Q6_K passes dmin = 0 and summins = 0, whose term is
 * dd * sumi - 0 = dd * sumi exactly). */
KQ_INLINE float kquant_term(float d, float dmin, float xd, int32_t sumi, int32_t summins) {
    const float dd = rounded(d * xd), dm = rounded(dmin * xd);
    return rounded(dd * (float)sumi) - rounded(dm * (float)summins);
}

static inline int block_bytes(int type) { return type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210; }

/* ---- quantize_row_q8k ----------------------------------------------------------------------------
 * d = max |x| / 127 and q = x / d rounded to nearest even, clamped to [-127, 127]: the division by
 * the stored d (not a multiplication by 127 / max) gives each q the integer nearest x / d, so
 * |x - d q| <= d / 2 for the d that the products use. A block holding a NaN gets d = NaN (its qs
 * are then all -127, the clamp's answer for NaN), so the NaN reaches that row's outputs, as in the
 * float product, and no other row's. */

static void quantize_block_portable(const float *x, Q8KBlock *out) {
    float amax = 0.0f;
    int nan = 0;
    for (int i = 0; i < 256; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
        nan |= x[i] != x[i];
    }
    if (amax == 0.0f && !nan) {
        memset(out, 0, sizeof *out);
        return;
    }
    const float d = nan ? __builtin_nanf("") : amax / 127.0f;
    out->d = d;
    for (int i = 0; i < 256; i++) {
        float q = rintf(x[i] / d);
        q = q > -127.0f ? q : -127.0f;
        q = q < 127.0f ? q : 127.0f;
        out->qs[i] = (int8_t)q;
    }
    for (int j = 0; j < 16; j++) {
        int s = 0;
        for (int l = 0; l < 16; l++) s += out->qs[16 * j + l];
        out->bsums[j] = (int16_t)s;
    }
}

#ifdef KQ_X86
KQ_AVX2 static void quantize_block_avx2(const float *x, Q8KBlock *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
    for (int i = 0; i < 256; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v), m);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    const int nan = _mm256_movemask_ps(unordered) != 0;
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    if (amax == 0.0f && !nan) {
        memset(out, 0, sizeof *out);
        return;
    }
    const float d = nan ? __builtin_nanf("") : amax / 127.0f;
    out->d = d;
    const __m256 vd = _mm256_set1_ps(d), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < 256; i += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8 * k), vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            /* max(q, -127) gives -127 for a NaN q (its second operand), as the portable clamp does. */
            q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
            v[k] = _mm256_cvtps_epi32(q);
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        const __m256i q8 = _mm256_permutevar8x32_epi32(p, order);
        _mm256_storeu_si256((__m256i *)(out->qs + i), q8);
        /* The two groups of 16: sums of bytes widened to 16 bits, then pairs to 32. */
        const __m256i wide = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
        /* wide's lanes 0-3 hold parts of group i / 16, lanes 4-7 of the next. */
        const __m128i a = _mm256_castsi256_si128(wide), b = _mm256_extracti128_si256(wide, 1);
        const __m128i ab = _mm_hadd_epi32(a, b);     /* [a0+a1, a2+a3, b0+b1, b2+b3] */
        const __m128i sums = _mm_hadd_epi32(ab, ab); /* [group 0, group 1, ...] */
        out->bsums[i / 16] = (int16_t)_mm_cvtsi128_si32(sums);
        out->bsums[i / 16 + 1] = (int16_t)_mm_extract_epi32(sums, 1);
    }
}
#endif

static void quantize_row_q8k_at(int vector, const float *x, int64_t n, Q8KBlock *out) {
#ifdef KQ_X86
    if (vector >= IDOT_AVX2) {
        for (int64_t i = 0; i < n / 256; i++) quantize_block_avx2(x + 256 * i, out + i);
        return;
    }
#else
    (void)vector;
#endif
    for (int64_t i = 0; i < n / 256; i++) quantize_block_portable(x + 256 * i, out + i);
}

void quantize_row_q8k(const float *x, int64_t n, Q8KBlock *out) { quantize_row_q8k_at(integer_dot_isa(IDOT_AVX512_VNNI), x, n, out); }

void quantize_row_q8k_isa(int isa, const float *x, int64_t n, Q8KBlock *out) { quantize_row_q8k_at(integer_dot_isa(isa), x, n, out); }

/* residual[l] = x[l] - d qs[l], the product rounded before the subtraction (no FMA at this target,
 * so the bits are the portable loop's). */
#ifdef KQ_X86
KQ_AVX2 static void residual_avx2(const float *x, const Q8KBlock *b, float *residual) {
    const __m256 d = _mm256_set1_ps(b->d);
    for (int l = 0; l < 256; l += 8) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b->qs + l))));
        _mm256_storeu_ps(residual + l, _mm256_sub_ps(_mm256_loadu_ps(x + l), _mm256_mul_ps(d, q)));
    }
}
#endif

void quantize_row_q8k_halves(int isa, const float *x, int64_t n, int halves, Q8KBlock *out) {
    const int vector = integer_dot_isa(isa);
    quantize_row_q8k_at(vector, x, n, out);
    if (halves != 2) return;
    float residual[256];
    for (int64_t i = 0; i < n / 256; i++) {
        const Q8KBlock *b = out + i;
#ifdef KQ_X86
        if (vector >= IDOT_AVX2)
            residual_avx2(x + 256 * i, b, residual);
        else
#endif
            for (int l = 0; l < 256; l++) residual[l] = x[256 * i + l] - rounded(b->d * (float)b->qs[l]);
        quantize_row_q8k_at(vector, residual, 256, out + n / 256 + i);
    }
}

/* ---- the portable level ---------------------------------------------------------------------- */

/* One super-block's quants (unsigned, in value order) into q. */
static inline void unpack_portable(int type, const uint8_t *b, uint8_t q[256]) {
    if (type == GGML_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; h++)
            for (int e = 0; e < 128; e++) {
                const int low = (ql[64 * h + e % 64] >> (4 * (e / 64))) & 0x0f;
                const int high = (qh[32 * h + e % 32] >> (2 * (e / 32))) & 3;
                q[128 * h + e] = (uint8_t)(low | high << 4);
            }
        return;
    }
    const int five = type == GGML_Q5_K;
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 32; l++) {
            const int nibble = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0f;
            q[32 * j + l] = (uint8_t)(nibble | (five ? ((qh[l] >> j) & 1) << 4 : 0));
        }
}

static void kquant_rows_portable(int type, const uint8_t *w, int64_t blocks, const Q8KBlock *x, int64_t xs, int rows, float *acc) {
    const int bytes = block_bytes(type);
    uint8_t q[256];
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w + (int64_t)bytes * i;
        unpack_portable(type, b, q);
        for (int r = 0; r < rows; r++) {
            const Q8KBlock *xb = x + r * xs + i;
            if (type == GGML_Q6_K) {
                const int8_t *sc = (const int8_t *)(b + 192);
                int32_t sumi = 0;
                for (int g = 0; g < 16; g++) {
                    int32_t s = 0;
                    for (int l = 0; l < 16; l++) s += (int32_t)q[16 * g + l] * xb->qs[16 * g + l];
                    sumi += sc[g] * (s - 32 * xb->bsums[g]);
                }
                acc[r] = acc[r] + kquant_term(half_of(b + 208), 0.0f, xb->d, sumi, 0);
            } else {
                int sc[8], mn[8];
                scales_and_mins(b + 4, sc, mn);
                int32_t sumi = 0, summins = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t s = 0;
                    for (int l = 0; l < 32; l++) s += (int32_t)q[32 * j + l] * xb->qs[32 * j + l];
                    sumi += sc[j] * s;
                    summins += mn[j] * (xb->bsums[2 * j] + xb->bsums[2 * j + 1]);
                }
                acc[r] = acc[r] + kquant_term(half_of(b), half_of(b + 2), xb->d, sumi, summins);
            }
        }
    }
}

#ifdef KQ_X86
/* ---- AVX2 and AVX-VNNI (256-bit) ------------------------------------------------------------- */

/* A Q4_K / Q5_K super-block's 12 bytes of 6-bit scales and mins (at b + 4) as 16 bytes [sc0 .. sc7,
 * mn0 .. mn7], kernels.h's scales_and_mins, in vector operations: two byte shuffles pick each value's
 * low source byte and the byte holding its top two bits, masks and shifts within 16-bit lanes keep
 * the bits (a shifted-in neighbour's bits are masked off). The vector form keeps the block's scalar
 * work and its moves into vector registers off the shuffle port, which the products need. */
KQ_AVX2 KQ_INLINE __m128i scales_mins_q45(const uint8_t *b) {
    const __m128i s = _mm_loadu_si128((const __m128i *)(b + 4)); /* bytes 12 .. 15: the block's next bytes, unused */
    const __m128i low = _mm_shuffle_epi8(s, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i top = _mm_shuffle_epi8(s, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    /* sc j < 4: s[j] & 63; sc 4 + i: s[8 + i] & 15; mn j < 4: s[4 + j] & 63; mn 4 + i: s[8 + i] >> 4;
     * then each 4 + i also takes (s[i] >> 6) << 4 (sc) or (s[4 + i] >> 6) << 4 (mn) */
    const __m128i kept = _mm_and_si128(low, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i upper = _mm_and_si128(_mm_srli_epi16(low, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30));
    return _mm_or_si128(_mm_or_si128(kept, upper), high);
}

/* The byte shuffle of scales_mins_q45's bytes (in both 128-bit lanes) that gives word j of a block's
 * 16 bsums its min, min j / 2 (byte 8 + j / 2; -1 zeroes each word's high byte). */
#define KQ_PAIR_PICK                                                                                     \
    _mm256_setr_epi8(8, -1, 8, -1, 9, -1, 9, -1, 10, -1, 10, -1, 11, -1, 11, -1, 12, -1, 12, -1, 13, -1, 13, -1, 14, -1, 14, \
                     -1, 15, -1, 15, -1)

/* The sums of 4 vectors' lanes: [sum v0, sum v1, sum v2, sum v3]. */
KQ_AVX2 KQ_INLINE __m128i hsum4(const __m256i v[4]) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

KQ_AVX2 KQ_INLINE __m128 rounded4(__m128 v) {
    __asm__("" : "+x"(v));
    return v;
}

/* A super-block's d and dmin as [d, dmin, ., .]: Q4_K / Q5_K's first two halves in one vcvtph2ps
 * (exact, as half_of; the two halves after them are the block's scales, not read as floats), Q6_K's d
 * at byte 208 with dmin 0 (the block's last two bytes: nothing past them is read). */
KQ_AVX2 KQ_INLINE __m128 d_dmin_q45(const uint8_t *b) {
    uint32_t h;
    memcpy(&h, b, sizeof h);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)h));
}

KQ_AVX2 KQ_INLINE __m128 d_dmin_q6(const uint8_t *b) {
    uint16_t h;
    memcpy(&h, b + 208, sizeof h);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(h));
}

/* kquant_term for rows 0..3 in the lanes of one vector, then acc + term: each lane's multiply,
 * conversion, subtraction and addition round as the scalar ones do, so the bits are kquant_term's.
 * dh holds [d, dmin, ., .] (d_dmin_q45, d_dmin_q6); S[r] and M[r] row r's sumi and summins spread
 * over 8 lanes (zero for r >= rows). */
KQ_AVX2 KQ_INLINE __m128 add_terms4(__m128 acc, __m128 dh, const Q8KBlock *x, int64_t xs, const int rows, const __m256i S[4],
                                    const __m256i M[4]) {
    if (rows <= 2) {
        /* One reduction for both rows' sumi and summins, [S0, S1, M0, M1], met by [dd0, dd1, dm0, dm1]:
         * every lane's operations are the ones below, so the bits too; a token's two halves (int8x2)
         * are two rows, which this halves the horizontal sums of. Lanes 2 and 3 of the result add
         * dm r * summins r - itself (zero for finite values), never stored. */
        const float x0 = x[0].d, x1 = rows > 1 ? x[xs].d : 0.0f;
        const __m128 scale = rounded4(_mm_mul_ps(_mm_unpacklo_ps(dh, dh), _mm_setr_ps(x0, x1, x0, x1)));
        const __m256i v[4] = {S[0], S[1], M[0], M[1]};
        const __m128 p = rounded4(_mm_mul_ps(scale, _mm_cvtepi32_ps(hsum4(v))));
        return _mm_add_ps(acc, _mm_sub_ps(p, _mm_movehl_ps(p, p)));
    }
    const __m128 xd = _mm_setr_ps(x[0].d, rows > 1 ? x[xs].d : 0.0f, rows > 2 ? x[2 * xs].d : 0.0f, rows > 3 ? x[3 * xs].d : 0.0f);
    const __m128 d = _mm_shuffle_ps(dh, dh, 0x00), dmin = _mm_shuffle_ps(dh, dh, 0x55);
    const __m128 dd = rounded4(_mm_mul_ps(d, xd)), dm = rounded4(_mm_mul_ps(dmin, xd));
    const __m128 t = _mm_sub_ps(rounded4(_mm_mul_ps(dd, _mm_cvtepi32_ps(hsum4(S)))), rounded4(_mm_mul_ps(dm, _mm_cvtepi32_ps(hsum4(M)))));
    return _mm_add_ps(acc, t);
}

/* The two levels differ in one step: how 32 quants a and 32 quants b (unsigned, sub-block or group
 * A and B) meet their activations xa, xb and their 16-bit scales. `sa` and `sb` are the scales as
 * AVX2 wants them (every word of a 128-bit lane the scale of that lane's values); `sp` as the VNNI
 * path wants them (per 128-bit lane: four words of A's scale, then four of B's). */
#define KQ_PAIR_AVX2(acc, a, xa, sa, b, xb, sb, sp)                                                      \
    acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a, xa), sa),     \
                                                 _mm256_madd_epi16(_mm256_maddubs_epi16(b, xb), sb)))
#define KQ_PAIR_VNNI(acc, a, xa, sa, b, xb, sb, sp)                                                      \
    acc = _mm256_dpwssd_avx_epi32(acc,                                                                   \
                                  _mm256_packs_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, xa), \
                                                     _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), b, xb)), \
                                  sp)

/* Q4_K (five = 0) and Q5_K (five = 1) at rows 1..4 (constants after inlining). */
#define KQ_Q45_256(NAME, TARGET, PAIR)                                                                   \
    TARGET KQ_INLINE void NAME(const uint8_t *w, int64_t blocks, const Q8KBlock *x, int64_t xs, const int rows, \
                               const int five, float *acc) {                                            \
        const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);                           \
        const __m256i pair_pick = KQ_PAIR_PICK;                                                         \
        const int bytes = five ? 176 : 144;                                                             \
        __m128 a = _mm_loadu_ps(acc);                                                                   \
        for (int64_t i = 0; i < blocks; i++) {                                                          \
            const uint8_t *b = w + (int64_t)bytes * i, *qs = b + (five ? 48 : 16);                      \
            prefetch_ahead(b, bytes);                                                                   \
            const __m256i sm = _mm256_broadcastsi128_si256(scales_mins_q45(b));                         \
            const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256(); \
            __m256i sum[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),   \
                              _mm256_setzero_si256()};                                                  \
            for (int c = 0; c < 4; c++) {                                                               \
                const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));                   \
                __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4); \
                if (five) {                                                                             \
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4)); \
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4)); \
                }                                                                                       \
                /* scale 2c, scale 2c + 1 in every word, and per lane four of each: byte shuffles of  \
                 * sm whose high index byte (0xff) zeroes each word's high byte */                    \
                const short ka = (short)(0xff00 | 2 * c), kb = (short)(0xff00 | (2 * c + 1));         \
                const __m256i sa = _mm256_shuffle_epi8(sm, _mm256_set1_epi16(ka));                     \
                const __m256i sb = _mm256_shuffle_epi8(sm, _mm256_set1_epi16(kb));                     \
                const __m256i sp = _mm256_shuffle_epi8(sm, _mm256_setr_epi16(ka, ka, ka, ka, kb, kb, kb, kb, ka, ka, ka, \
                                                                              ka, kb, kb, kb, kb));     \
                (void)sa, (void)sb, (void)sp;                                                           \
                for (int r = 0; r < rows; r++) {                                                        \
                    const int8_t *xq = x[r * xs + i].qs + 64 * c;                                       \
                    PAIR(sum[r], lo, _mm256_loadu_si256((const __m256i *)xq), sa, hi,                   \
                         _mm256_loadu_si256((const __m256i *)(xq + 32)), sb, sp);                       \
                }                                                                                       \
            }                                                                                           \
            const __m256i mins = _mm256_shuffle_epi8(sm, pair_pick);                                    \
            const __m128 dh = d_dmin_q45(b);                                                            \
            __m256i M[4];                                                                               \
            for (int r = 0; r < 4; r++)                                                                 \
                M[r] = r < rows ? _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[r * xs + i].bsums), mins) \
                                : _mm256_setzero_si256();                                               \
            a = add_terms4(a, dh, x + i, xs, rows, sum, M);                                        \
        }                                                                                               \
        _mm_storeu_ps(acc, a);                                                                          \
    }

/* Q6_K: per half of 128, values 32 k + l (k < 4) from ql[l + 32 (k % 2)] >> 4 (k / 2) and
 * qh[l] >> 2 k; the 32 values of step k span groups 2 k and 2 k + 1 (the 128-bit lanes). */
#define KQ_Q6_256(NAME, TARGET, PAIR)                                                                    \
    TARGET KQ_INLINE void NAME(const uint8_t *w, int64_t blocks, const Q8KBlock *x, int64_t xs, const int rows, float *acc) { \
        const __m256i m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);                        \
        __m128 a = _mm_loadu_ps(acc);                                                                   \
        for (int64_t i = 0; i < blocks; i++) {                                                          \
            const uint8_t *b = w + 210 * i;                                                             \
            prefetch_ahead(b, 210);                                                                     \
            const int8_t *scales = (const int8_t *)(b + 192);                                           \
            __m256i sum[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),   \
                              _mm256_setzero_si256()};                                                  \
            for (int h = 0; h < 2; h++) {                                                               \
                const __m256i A = _mm256_loadu_si256((const __m256i *)(b + 64 * h));                    \
                const __m256i B = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));               \
                const __m256i H = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));              \
                __m256i v[4];                                                                           \
                v[0] = _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m30)); \
                v[1] = _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m30)); \
                v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(H, m30)); \
                v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4),                   \
                                       _mm256_and_si256(_mm256_srli_epi16(H, 2), m30));                 \
                for (int p = 0; p < 2; p++) {                                                           \
                    const int g = 8 * h + 4 * p; /* groups g .. g + 3: v[2p] has g, g+1; v[2p+1] g+2, g+3 */ \
                    const __m256i sa = _mm256_setr_m128i(_mm_set1_epi16(scales[g]), _mm_set1_epi16(scales[g + 1])); \
                    const __m256i sb = _mm256_setr_m128i(_mm_set1_epi16(scales[g + 2]), _mm_set1_epi16(scales[g + 3])); \
                    const __m256i sp = _mm256_unpacklo_epi64(sa, sb);                                   \
                    (void)sp;                                                                           \
                    for (int r = 0; r < rows; r++) {                                                    \
                        const int8_t *xq = x[r * xs + i].qs + 128 * h + 64 * p;                         \
                        PAIR(sum[r], v[2 * p], _mm256_loadu_si256((const __m256i *)xq), sa, v[2 * p + 1], \
                             _mm256_loadu_si256((const __m256i *)(xq + 32)), sb, sp);                   \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));        \
            const __m128 dh = d_dmin_q6(b);                                                             \
            const __m256i M[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), \
                                  _mm256_setzero_si256()};                                              \
            for (int r = 0; r < rows; r++) {                                                            \
                const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)x[r * xs + i].bsums), sc16); \
                sum[r] = _mm256_sub_epi32(sum[r], _mm256_slli_epi32(offset, 5));                        \
            }                                                                                           \
            a = add_terms4(a, dh, x + i, xs, rows, sum, M);                                        \
        }                                                                                               \
        _mm_storeu_ps(acc, a);                                                                          \
    }

KQ_Q45_256(q45_avx2, KQ_AVX2, KQ_PAIR_AVX2)
KQ_Q6_256(q6_avx2, KQ_AVX2, KQ_PAIR_AVX2)
#ifdef KQ_HAS_AVX_VNNI
KQ_Q45_256(q45_avx_vnni, KQ_AVX_VNNI, KQ_PAIR_VNNI)
KQ_Q6_256(q6_avx_vnni, KQ_AVX_VNNI, KQ_PAIR_VNNI)
#endif

/* Each level's entry: the row count made a constant so the row loops unroll. */
#define KQ_ROWS_ENTRY(NAME, TARGET, Q45, Q6)                                                             \
    TARGET static void NAME(int type, const uint8_t *w, int64_t blocks, const Q8KBlock *x, int64_t xs, int rows, float *acc) { \
        switch (type * 8 + rows) {                                                                      \
        case GGML_Q4_K * 8 + 1: Q45(w, blocks, x, xs, 1, 0, acc); break;                                \
        case GGML_Q4_K * 8 + 2: Q45(w, blocks, x, xs, 2, 0, acc); break;                                \
        case GGML_Q4_K * 8 + 3: Q45(w, blocks, x, xs, 3, 0, acc); break;                                \
        case GGML_Q4_K * 8 + 4: Q45(w, blocks, x, xs, 4, 0, acc); break;                                \
        case GGML_Q5_K * 8 + 1: Q45(w, blocks, x, xs, 1, 1, acc); break;                                \
        case GGML_Q5_K * 8 + 2: Q45(w, blocks, x, xs, 2, 1, acc); break;                                \
        case GGML_Q5_K * 8 + 3: Q45(w, blocks, x, xs, 3, 1, acc); break;                                \
        case GGML_Q5_K * 8 + 4: Q45(w, blocks, x, xs, 4, 1, acc); break;                                \
        case GGML_Q6_K * 8 + 1: Q6(w, blocks, x, xs, 1, acc); break;                                    \
        case GGML_Q6_K * 8 + 2: Q6(w, blocks, x, xs, 2, acc); break;                                    \
        case GGML_Q6_K * 8 + 3: Q6(w, blocks, x, xs, 3, acc); break;                                    \
        default: Q6(w, blocks, x, xs, 4, acc); break;                                                   \
        }                                                                                               \
    }

KQ_ROWS_ENTRY(kquant_rows_avx2, KQ_AVX2, q45_avx2, q6_avx2)
#ifdef KQ_HAS_AVX_VNNI
KQ_ROWS_ENTRY(kquant_rows_avx_vnni, KQ_AVX_VNNI, q45_avx_vnni, q6_avx_vnni)
#else
#define kquant_rows_avx_vnni kquant_rows_avx2
#endif

/* ---- AVX-512 VNNI ---------------------------------------------------------------------------- */

/* Two vectors of 64 products (4 lanes of 4 for each 128-bit lane) packed to 16 bits and multiplied
 * by their scales: per 128-bit lane, four words of a's sums then four of b's (vpackssdw's order). */
#define KQ_PAIR_512(acc, a, xa, b, xb, s)                                                                \
    acc = _mm512_dpwssd_epi32(acc,                                                                       \
                              _mm512_packs_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, xa),      \
                                                 _mm512_dpbusd_epi32(_mm512_setzero_si512(), b, xb)),     \
                              s)
/* The first pair of a sum: vpmaddwd where the accumulator would be zero (the same integers, one
 * register copy fewer). */
#define KQ_FIRST_PAIR_512(acc, a, xa, b, xb, s)                                                          \
    acc = _mm512_madd_epi16(_mm512_packs_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, xa),       \
                                               _mm512_dpbusd_epi32(_mm512_setzero_si512(), b, xb)),      \
                            s)

/* Q4_K / Q5_K: chunk c's 32 bytes broadcast to both halves, the low nibbles kept in the low half
 * (sub-block 2c) and the high ones in the high half (2c + 1): 64 quants against 64 contiguous
 * activations. Chunks c and c + 1 pair up: per 128-bit lane k the packed words are four of chunk c's
 * sums (sub-block 2c + k / 2) then four of chunk c + 1's (2c + 2 + k / 2). The scale words come from
 * scales_mins_q45's bytes broadcast to every 128-bit lane, by byte shuffles whose -1 indexes zero
 * each word's high byte. */
KQ_AVX512 KQ_INLINE void q45_avx512(const uint8_t *w, int64_t blocks, const Q8KBlock *x, int64_t xs, const int rows,
                                    const int five, float *acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(16);
#define KQ_W(j) -1, (j), -1, (j), -1, (j), -1, (j) /* set order: each word high byte first */
    /* per lane k: 4 x sc(2c + k / 2) then 4 x sc(2c + 2 + k / 2), for c = 0 (s01) and c = 2 (s23) */
    const __m512i pick01 = _mm512_set_epi8(KQ_W(3), KQ_W(1), KQ_W(3), KQ_W(1), KQ_W(2), KQ_W(0), KQ_W(2), KQ_W(0));
    const __m512i pick23 = _mm512_set_epi8(KQ_W(7), KQ_W(5), KQ_W(7), KQ_W(5), KQ_W(6), KQ_W(4), KQ_W(6), KQ_W(4));
#undef KQ_W
    const __m256i pair_pick = KQ_PAIR_PICK;
    const int bytes = five ? 176 : 144;
    __m128 a = _mm_loadu_ps(acc);
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w + (int64_t)bytes * i, *qs = b + (five ? 48 : 16);
        prefetch_ahead(b, bytes);
        const __m512i sm = _mm512_broadcast_i32x4(scales_mins_q45(b));
        const __m512i s01 = _mm512_shuffle_epi8(sm, pick01), s23 = _mm512_shuffle_epi8(sm, pick23);
        const __m512i hb = five ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16))) : _mm512_setzero_si512();
        __m512i wq[4];
        for (int c = 0; c < 4; c++) {
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
            wq[c] = _mm512_and_si512(_mm512_mask_srli_epi16(q, (__mmask32)0xffff0000u, q, 4), m4);
            if (five) {
                const __m512i bit = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8((char)(1 << (2 * c)))),
                                                       _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
                wq[c] = _mm512_mask_add_epi8(wq[c], _mm512_test_epi8_mask(hb, bit), wq[c], sixteen);
            }
        }
        const __m128 dh = d_dmin_q45(b);
        const __m256i mins = _mm256_shuffle_epi8(_mm512_castsi512_si256(sm), pair_pick);
        __m256i S[4], M[4];
        for (int r = 0; r < 4; r++) {
            S[r] = M[r] = _mm256_setzero_si256();
            if (r >= rows) continue;
            const Q8KBlock *xb = x + r * xs + i;
            __m512i sum;
            KQ_FIRST_PAIR_512(sum, wq[0], _mm512_loadu_si512(xb->qs), wq[1], _mm512_loadu_si512(xb->qs + 64), s01);
            KQ_PAIR_512(sum, wq[2], _mm512_loadu_si512(xb->qs + 128), wq[3], _mm512_loadu_si512(xb->qs + 192), s23);
            S[r] = _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1));
            M[r] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), mins);
        }
        a = add_terms4(a, dh, x + i, xs, rows, S, M);
    }
    _mm_storeu_ps(acc, a);
}

/* Q6_K: per half h, the 64 bytes of ql as one vector: low nibbles are values 0..63 of the half
 * (groups 8h .. 8h + 3 in the 128-bit lanes), high nibbles values 64..127 (groups 8h + 4 .. 8h + 7);
 * the high pairs of qh broadcast and shifted per half. Per 128-bit lane k the packed words are four
 * of group 8h + k's sums, then four of group 8h + 4 + k's. */
KQ_AVX512 KQ_INLINE void q6_avx512(const uint8_t *w, int64_t blocks, const Q8KBlock *x, int64_t xs, const int rows, float *acc) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    /* per lane k: 4 x k then 4 x (4 + k) */
    const __m512i pick = _mm512_set_epi32(0x00070007, 0x00070007, 0x00030003, 0x00030003, 0x00060006, 0x00060006,
                                          0x00020002, 0x00020002, 0x00050005, 0x00050005, 0x00010001, 0x00010001,
                                          0x00040004, 0x00040004, 0x00000000, 0x00000000);
    const __m512i eight = _mm512_set1_epi16(8);
    __m128 a = _mm_loadu_ps(acc);
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = w + 210 * i;
        prefetch_ahead(b, 210);
        const __m128i scales = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(scales);
        const __m256i sc_m32 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16, 5));
        const __m512i sc = _mm512_castsi256_si512(sc16);
        const __m512i s0 = _mm512_permutexvar_epi16(pick, sc), s1 = _mm512_permutexvar_epi16(_mm512_add_epi16(pick, eight), sc);
        __m512i lo[2], hi[2];
        for (int h = 0; h < 2; h++) {
            const __m512i L = _mm512_loadu_si512(b + 64 * h);
            const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
            lo[h] = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_and_si512(_mm512_sllv_epi16(H, left), m30));
            hi[h] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4), _mm512_and_si512(_mm512_srlv_epi16(H, right), m30));
        }
        const __m128 dh = d_dmin_q6(b);
        __m256i S[4], M[4];
        for (int r = 0; r < 4; r++) {
            S[r] = M[r] = _mm256_setzero_si256();
            if (r >= rows) continue;
            const Q8KBlock *xb = x + r * xs + i;
            __m512i sum;
            KQ_FIRST_PAIR_512(sum, lo[0], _mm512_loadu_si512(xb->qs), hi[0], _mm512_loadu_si512(xb->qs + 64), s0);
            KQ_PAIR_512(sum, lo[1], _mm512_loadu_si512(xb->qs + 128), hi[1], _mm512_loadu_si512(xb->qs + 192), s1);
            const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), sc_m32);
            S[r] = _mm256_add_epi32(_mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1)), offset);
        }
        a = add_terms4(a, dh, x + i, xs, rows, S, M);
    }
    _mm_storeu_ps(acc, a);
}

KQ_ROWS_ENTRY(kquant_rows_avx512, KQ_AVX512, q45_avx512, q6_avx512)
#endif

void kquant_dot_rows(int vector, int type, const uint8_t *w, int64_t blocks, const Q8KBlock *x, int64_t x_stride, int rows,
                     float *out, int64_t out_stride) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    rows = rows < 1 ? 1 : rows > 4 ? 4 : rows;
#ifdef KQ_X86
    if (vector >= IDOT_AVX512_VNNI)
        kquant_rows_avx512(type, w, blocks, x, x_stride, rows, acc);
    else if (vector == IDOT_AVX_VNNI)
        kquant_rows_avx_vnni(type, w, blocks, x, x_stride, rows, acc);
    else if (vector == IDOT_AVX2)
        kquant_rows_avx2(type, w, blocks, x, x_stride, rows, acc);
    else
#endif
        kquant_rows_portable(type, w, blocks, x, x_stride, rows, acc);
    for (int r = 0; r < rows; r++) out[r * out_stride] = acc[r];
}
