/* ggml's quantized blocks expanded into float32: the values gguf-py's `dequantize` gives.
 *
 * Each type's block layout and value formula is stated beside its portable expansion. Every
 * value is computed exactly or with one rounding: the float16 scale d has 11 significant bits
 * and a quant at most 6, so d q, and the K types' (d scale) q with a 6-bit (Q4_K, Q5_K) or
 * signed 8-bit (Q6_K) scale, fit float32's 24 bits; only `+ m` (Q4_1, Q5_1) and `- dmin m`
 * (Q4_K, Q5_K) round, once, the same in a fused multiply-add as in gguf-py's multiply then add.
 * So the AVX2 and AVX-512 expansions below give the portable loop's bits, which are gguf-py's
 * (tests/engine/test_quantized_linear.py holds all three to it). MXFP4's values are a small
 * integer times a power of two: exact wherever they do not overflow, so every ISA gives them too.
 */
#include <omp.h>

#include "kernels.h"

enum { QK = 32, QK_K = 256 };

/* A block's float16 field at byte offset `at`, widened exactly. */
static inline float half_at(const uint8_t *block, int at) {
    return float_from_half((uint16_t)(block[at] | (block[at + 1] << 8)));
}

/* Q4_0 (18 bytes): d, then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31;
 * value = d (q - 8). */
static inline void expand_q4_0(const uint8_t *b, float *out) {
    const float d = half_at(b, 0);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)((int)(qs[j] & 0x0f) - 8);
        out[j + QK / 2] = d * (float)((int)(qs[j] >> 4) - 8);
    }
}

/* Q4_1 (20 bytes): d, m, 16 bytes of nibbles; value = d q + m. */
static inline void expand_q4_1(const uint8_t *b, float *out) {
    const float d = half_at(b, 0), m = half_at(b, 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)(qs[j] & 0x0f) + m;
        out[j + QK / 2] = d * (float)(qs[j] >> 4) + m;
    }
}

/* Q5_0 (22 bytes): d, 4 bytes of fifth bits, 16 bytes of nibbles; value = d (q - 16). */
static inline void expand_q5_0(const uint8_t *b, float *out) {
    const float d = half_at(b, 0);
    const uint32_t qh = high_bits(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < QK / 2; j++) {
        const int lo = (qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + QK / 2)) & 1) << 4;
        out[j] = d * (float)(lo - 16);
        out[j + QK / 2] = d * (float)(hi - 16);
    }
}

/* Q5_1 (24 bytes): d, m, 4 bytes of fifth bits, 16 bytes of nibbles; value = d q + m. */
static inline void expand_q5_1(const uint8_t *b, float *out) {
    const float d = half_at(b, 0), m = half_at(b, 2);
    const uint32_t qh = high_bits(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < QK / 2; j++) {
        const int lo = (qs[j] & 0x0f) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + QK / 2)) & 1) << 4;
        out[j] = d * (float)lo + m;
        out[j + QK / 2] = d * (float)hi + m;
    }
}

/* Q8_0 (34 bytes): d, 32 signed bytes; value = d q. */
static inline void expand_q8_0(const uint8_t *b, float *out) {
    const float d = half_at(b, 0);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < QK; j++) out[j] = d * (float)qs[j];
}

/* MXFP4 (17 bytes): the E8M0 scale byte e, then 16 bytes whose low nibbles are values 0-15 and
 * high nibbles 16-31; value = MXFP4_VALUES[q] mxfp4_scale(e) (kernels.h). */
static inline void expand_mxfp4(const uint8_t *b, float *out) {
    const float d = mxfp4_scale(b[0]);
    const uint8_t *qs = b + 1;
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)MXFP4_VALUES[qs[j] & 0x0f];
        out[j + QK / 2] = d * (float)MXFP4_VALUES[qs[j] >> 4];
    }
}

/* Q4_K (144 bytes): d, dmin, 12 scale bytes, 128 bytes of nibbles: sub-block 2i the low nibbles
 * of bytes 32i .. 32i + 31, sub-block 2i + 1 their high nibbles; value = (d sc) q - dmin m. */
static inline void expand_q4_k(const uint8_t *b, float *out) {
    const float d = half_at(b, 0), dmin = half_at(b, 2);
    int sc[8], mn[8];
    scales_and_mins(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int i = 0; i < 4; i++) {
        const float d0 = d * (float)sc[2 * i], m0 = dmin * (float)mn[2 * i];
        const float d1 = d * (float)sc[2 * i + 1], m1 = dmin * (float)mn[2 * i + 1];
        for (int l = 0; l < 32; l++) {
            out[64 * i + l] = d0 * (float)(qs[32 * i + l] & 0x0f) - m0;
            out[64 * i + 32 + l] = d1 * (float)(qs[32 * i + l] >> 4) - m1;
        }
    }
}

/* Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits after the scales (bit j of byte l is
 * value l of sub-block j) and the nibbles after them. */
static inline void expand_q5_k(const uint8_t *b, float *out) {
    const float d = half_at(b, 0), dmin = half_at(b, 2);
    int sc[8], mn[8];
    scales_and_mins(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int i = 0; i < 4; i++) {
        const float d0 = d * (float)sc[2 * i], m0 = dmin * (float)mn[2 * i];
        const float d1 = d * (float)sc[2 * i + 1], m1 = dmin * (float)mn[2 * i + 1];
        for (int l = 0; l < 32; l++) {
            const int lo = (qs[32 * i + l] & 0x0f) | ((qh[l] >> (2 * i)) & 1) << 4;
            const int hi = (qs[32 * i + l] >> 4) | ((qh[l] >> (2 * i + 1)) & 1) << 4;
            out[64 * i + l] = d0 * (float)lo - m0;
            out[64 * i + 32 + l] = d1 * (float)hi - m1;
        }
    }
}

/* Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 signed scales, d.
 * Value e (half h = e / 128, p = e % 64): low nibble of ql[64 h + p] shifted by 4 ((e / 64) % 2),
 * high pair of qh[32 h + e % 32] shifted by 2 ((e / 32) % 4); value = (d scale[e / 16]) (q - 32). */
static inline void expand_q6_k(const uint8_t *b, float *out) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half_at(b, 208);
    for (int h = 0; h < 2; h++) {
        for (int s = 0; s < 8; s++) {  /* the half's eight groups of 16 values */
            const float ds = d * (float)scales[8 * h + s];
            const int e0 = 16 * s;     /* offset inside the half */
            for (int l = 0; l < 16; l++) {
                const int e = e0 + l;
                const int low = (ql[64 * h + e % 64] >> (4 * (e / 64))) & 0x0f;
                const int high = (qh[32 * h + e % 32] >> (2 * (e / 32))) & 3;
                out[128 * h + e] = ds * (float)((low | high << 4) - 32);
            }
        }
    }
}

/* One row of `blocks` blocks of `type` into floats, a block at a time: the portable loop. */
static void expand_row_portable(int type, const uint8_t *row, int64_t blocks, float *out) {
    switch (type) {
    case GGML_Q4_0: for (int64_t i = 0; i < blocks; i++) expand_q4_0(row + 18 * i, out + QK * i); break;
    case GGML_Q4_1: for (int64_t i = 0; i < blocks; i++) expand_q4_1(row + 20 * i, out + QK * i); break;
    case GGML_Q5_0: for (int64_t i = 0; i < blocks; i++) expand_q5_0(row + 22 * i, out + QK * i); break;
    case GGML_Q5_1: for (int64_t i = 0; i < blocks; i++) expand_q5_1(row + 24 * i, out + QK * i); break;
    case GGML_Q8_0: for (int64_t i = 0; i < blocks; i++) expand_q8_0(row + 34 * i, out + QK * i); break;
    case GGML_Q4_K: for (int64_t i = 0; i < blocks; i++) expand_q4_k(row + 144 * i, out + QK_K * i); break;
    case GGML_Q5_K: for (int64_t i = 0; i < blocks; i++) expand_q5_k(row + 176 * i, out + QK_K * i); break;
    case GGML_MXFP4: for (int64_t i = 0; i < blocks; i++) expand_mxfp4(row + 17 * i, out + QK * i); break;
    default: for (int64_t i = 0; i < blocks; i++) expand_q6_k(row + 210 * i, out + QK_K * i); break;
    }
}

int quantized_block_shape(int type, int64_t *block_size, int64_t *type_size) {
    switch (type) {
    case GGML_Q4_0: *block_size = QK, *type_size = 18; return 0;
    case GGML_Q4_1: *block_size = QK, *type_size = 20; return 0;
    case GGML_Q5_0: *block_size = QK, *type_size = 22; return 0;
    case GGML_Q5_1: *block_size = QK, *type_size = 24; return 0;
    case GGML_Q8_0: *block_size = QK, *type_size = 34; return 0;
    case GGML_Q4_K: *block_size = QK_K, *type_size = 144; return 0;
    case GGML_Q5_K: *block_size = QK_K, *type_size = 176; return 0;
    case GGML_Q6_K: *block_size = QK_K, *type_size = 210; return 0;
    case GGML_MXFP4: *block_size = QK, *type_size = 17; return 0;
    default: return -1;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define QB_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* AVX-512: 16 values a register. Bytes are widened to 32-bit lanes (vpmovzxbd / vpmovsxbd),
 * converted, scaled; a Q5 block's fifth bits are a 16-bit mask a half. */
static inline __attribute__((always_inline)) QB_AVX512 __m512i bytes16_512(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* A float16 field widened by F16C (exact, as float_from_half). */
static inline __attribute__((always_inline)) QB_AVX2 float half_f16c(const uint8_t *p) {
    return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8));
}

/* An MXFP4 block's 32 quants looked up in MXFP4_VALUES by pshufb: values 0-15 (the low nibbles)
 * in `lo`, 16-31 (the high) in `hi`, as signed bytes. */
static inline __attribute__((always_inline)) QB_AVX2 void mxfp4_quants(const uint8_t *qs, __m128i *lo, __m128i *hi) {
    const __m128i table = _mm_loadu_si128((const __m128i *)MXFP4_VALUES), low4 = _mm_set1_epi8(0x0f);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    *lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low4));
    *hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4));
}

static inline __attribute__((always_inline)) QB_AVX512 void mxfp4_blocks_512(const uint8_t *row, int64_t blocks, float *out) {
    for (int64_t i = 0; i < blocks; i++, out += QK) {
        const uint8_t *b = row + 17 * i;
        const __m512 d = _mm512_set1_ps(mxfp4_scale(b[0]));
        __m128i lo, hi;
        mxfp4_quants(b + 1, &lo, &hi);
        _mm512_storeu_ps(out, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo))));
        _mm512_storeu_ps(out + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi))));
    }
}

/* The four 32-value types with nibbles (Q4_0, Q4_1, Q5_0, Q5_1), `type` a constant. */
static inline __attribute__((always_inline)) QB_AVX512 void nibble_blocks_512(const uint8_t *row, int64_t blocks, float *out,
                                                                              const int type) {
    const __m512i low4 = _mm512_set1_epi32(0x0f);
    const int64_t size = type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : 24;
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
    const __m512i offset = _mm512_set1_epi32(type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : 0);
        for (int64_t i = 0; i < blocks; i++, out += QK) {
            const uint8_t *b = row + size * i;
            const __m512 d = _mm512_set1_ps(half_f16c(b));
            const __m512 m = _mm512_set1_ps(has_min ? half_f16c(b + 2) : 0.0f);
            const uint8_t *qs = b + 2 + 2 * has_min + 4 * five;
            const __m512i q = bytes16_512(qs);
            __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_srli_epi32(q, 4);
            if (five) {
                const uint32_t qh = high_bits(b + 2 + 2 * has_min);
                const __m512i sixteen = _mm512_set1_epi32(16);
                lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xffff), lo, sixteen);
                hi = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, sixteen);
            }
            lo = _mm512_sub_epi32(lo, offset);
            hi = _mm512_sub_epi32(hi, offset);
            if (has_min) {
                _mm512_storeu_ps(out, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m));
                _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m));
            } else {
                _mm512_storeu_ps(out, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
                _mm512_storeu_ps(out + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
            }
        }
}

/* Q4_K (five = 0) and Q5_K (five = 1), `five` a constant: each 16 bytes of nibbles widened
 * once for the two sub-blocks they hold (low nibbles: sub-block 2 i, high: 2 i + 1). */
static inline __attribute__((always_inline)) QB_AVX512 void k_blocks_512(const uint8_t *row, int64_t blocks, float *out,
                                                                         const int five) {
    const __m512i low4 = _mm512_set1_epi32(0x0f), one = _mm512_set1_epi32(1);
    for (int64_t i = 0; i < blocks; i++, out += QK_K) {
        const uint8_t *b = row + (five ? 176 : 144) * i;
        const float d = half_f16c(b), dmin = half_f16c(b + 2);
        int sc[8], mn[8];
        scales_and_mins(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        const __m512i h[2] = {five ? bytes16_512(qh) : _mm512_setzero_si512(), five ? bytes16_512(qh + 16) : _mm512_setzero_si512()};
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) {
            const __m512i raw[2] = {bytes16_512(qs + 32 * g), bytes16_512(qs + 32 * g + 16)};
#pragma GCC unroll 2
            for (int nibble = 0; nibble < 2; nibble++) {
                const int j = 2 * g + nibble;
                const __m512 ds = _mm512_set1_ps(d * (float)sc[j]), ms = _mm512_set1_ps(dmin * (float)mn[j]);
#pragma GCC unroll 2
                for (int part = 0; part < 2; part++) {
                    __m512i q = _mm512_and_si512(_mm512_srli_epi32(raw[part], 4 * nibble), low4);
                    if (five) q = _mm512_or_si512(q, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[part], j), one), 4));
                    _mm512_storeu_ps(out + 32 * j + 16 * part, _mm512_fmsub_ps(ds, _mm512_cvtepi32_ps(q), ms));
                }
            }
        }
    }
}

static QB_AVX512 void expand_row_avx512_impl(int type, const uint8_t *row, int64_t blocks, float *out) {
    const __m512i low4 = _mm512_set1_epi32(0x0f), three = _mm512_set1_epi32(3);
    switch (type) {
    case GGML_Q4_0: nibble_blocks_512(row, blocks, out, GGML_Q4_0); break;
    case GGML_Q4_1: nibble_blocks_512(row, blocks, out, GGML_Q4_1); break;
    case GGML_Q5_0: nibble_blocks_512(row, blocks, out, GGML_Q5_0); break;
    case GGML_Q5_1: nibble_blocks_512(row, blocks, out, GGML_Q5_1); break;
    case GGML_Q8_0:
        for (int64_t i = 0; i < blocks; i++, out += QK) {
            const uint8_t *b = row + 34 * i;
            const __m512 d = _mm512_set1_ps(half_f16c(b));
            const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
            const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)));
            _mm512_storeu_ps(out, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
            _mm512_storeu_ps(out + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
        }
        break;
    case GGML_Q4_K: k_blocks_512(row, blocks, out, 0); break;
    case GGML_Q5_K: k_blocks_512(row, blocks, out, 1); break;
    case GGML_MXFP4: mxfp4_blocks_512(row, blocks, out); break;
    default: /* Q6_K */
        for (int64_t i = 0; i < blocks; i++, out += QK_K) {
            const uint8_t *b = row + 210 * i, *ql = b, *qh = b + 128;
            const int8_t *scales = (const int8_t *)(b + 192);
            const float d = half_f16c(b + 208);
            const __m512i thirty_two = _mm512_set1_epi32(32);
            for (int h = 0; h < 2; h++) {  /* each byte widened once, then shifted for every chunk it feeds */
                const __m512i lq[4] = {bytes16_512(ql + 64 * h), bytes16_512(ql + 64 * h + 16), bytes16_512(ql + 64 * h + 32),
                                       bytes16_512(ql + 64 * h + 48)};
                const __m512i hq[2] = {bytes16_512(qh + 32 * h), bytes16_512(qh + 32 * h + 16)};
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {  /* values 128 h + 16 k .. + 15 */
                    const __m512i low = _mm512_and_si512(_mm512_srli_epi32(lq[k % 4], 4 * (k / 4)), low4);
                    const __m512i high = _mm512_and_si512(_mm512_srli_epi32(hq[k % 2], 2 * (k / 2)), three);
                    const __m512i q = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), thirty_two);
                    const float ds = d * (float)scales[8 * h + k];
                    _mm512_storeu_ps(out + 128 * h + 16 * k, _mm512_mul_ps(_mm512_set1_ps(ds), _mm512_cvtepi32_ps(q)));
                }
            }
        }
        break;
    }
}

/* AVX2: 8 values a register; a Q5 block's fifth bits are tested lane by lane against 1 << l. */
static inline __attribute__((always_inline)) QB_AVX2 __m256i bytes8_256(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* QUANTIZED_FIFTH_BITS[byte][l] (kernels.h): 16 where bit l of `byte` is set, else 0; a Q5 block's fifth bits for 8
 * values are then one widening load (bit tests on a broadcast took 5 instructions). */
#define FIFTH_BIT(i, l) ((((i) >> (l)) & 1) * 16)
#define FIFTH_ROW(i) {FIFTH_BIT(i, 0), FIFTH_BIT(i, 1), FIFTH_BIT(i, 2), FIFTH_BIT(i, 3), \
                      FIFTH_BIT(i, 4), FIFTH_BIT(i, 5), FIFTH_BIT(i, 6), FIFTH_BIT(i, 7)}
#define FIFTH_ROWS4(i) FIFTH_ROW(i), FIFTH_ROW(i + 1), FIFTH_ROW(i + 2), FIFTH_ROW(i + 3)
#define FIFTH_ROWS16(i) FIFTH_ROWS4(i), FIFTH_ROWS4(i + 4), FIFTH_ROWS4(i + 8), FIFTH_ROWS4(i + 12)
#define FIFTH_ROWS64(i) FIFTH_ROWS16(i), FIFTH_ROWS16(i + 16), FIFTH_ROWS16(i + 32), FIFTH_ROWS16(i + 48)
const uint8_t QUANTIZED_FIFTH_BITS[256][8] = {FIFTH_ROWS64(0), FIFTH_ROWS64(64), FIFTH_ROWS64(128), FIFTH_ROWS64(192)};

/* 16 in the lanes l (0-7) whose bit l of the low byte of `bits` is set. */
static inline __attribute__((always_inline)) QB_AVX2 __m256i fifth_bits_256(uint32_t bits) {
    return bytes8_256(QUANTIZED_FIFTH_BITS[bits & 0xff]);
}

static inline __attribute__((always_inline)) QB_AVX2 void nibble_blocks_256(const uint8_t *row, int64_t blocks, float *out,
                                                                            const int type) {
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    const int64_t size = type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : 24;
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
    const __m256i offset = _mm256_set1_epi32(type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : 0);
        for (int64_t i = 0; i < blocks; i++, out += QK) {
            const uint8_t *b = row + size * i;
            const __m256 d = _mm256_set1_ps(half_f16c(b));
            const __m256 m = _mm256_set1_ps(has_min ? half_f16c(b + 2) : 0.0f);
            const uint8_t *qs = b + 2 + 2 * has_min + 4 * five;
            const uint32_t qh = five ? high_bits(b + 2 + 2 * has_min) : 0;
            for (int part = 0; part < 2; part++) {  /* values 8 part .. + 7 and 16 + 8 part .. + 7 */
                const __m256i q = bytes8_256(qs + 8 * part);
                __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_srli_epi32(q, 4);
                if (five) {
                    lo = _mm256_or_si256(lo, fifth_bits_256(qh >> (8 * part)));
                    hi = _mm256_or_si256(hi, fifth_bits_256(qh >> (16 + 8 * part)));
                }
                lo = _mm256_sub_epi32(lo, offset);
                hi = _mm256_sub_epi32(hi, offset);
                if (has_min) {
                    _mm256_storeu_ps(out + 8 * part, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo), m));
                    _mm256_storeu_ps(out + 16 + 8 * part, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi), m));
                } else {
                    _mm256_storeu_ps(out + 8 * part, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
                    _mm256_storeu_ps(out + 16 + 8 * part, _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
                }
            }
        }
}

/* Q4_K and Q5_K with AVX2: each 8 bytes of nibbles widened once for its two sub-blocks, the
 * fifth bits' 32 bytes once a block. */
static inline __attribute__((always_inline)) QB_AVX2 void k_blocks_256(const uint8_t *row, int64_t blocks, float *out,
                                                                       const int five) {
    const __m256i low4 = _mm256_set1_epi32(0x0f), one = _mm256_set1_epi32(1);
    for (int64_t i = 0; i < blocks; i++, out += QK_K) {
        const uint8_t *b = row + (five ? 176 : 144) * i;
        const float d = half_f16c(b), dmin = half_f16c(b + 2);
        int sc[8], mn[8];
        scales_and_mins(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
        __m256i h[4];
        for (int part = 0; part < 4; part++) h[part] = five ? bytes8_256(qh + 8 * part) : _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            const __m256 d0 = _mm256_set1_ps(d * (float)sc[2 * g]), m0 = _mm256_set1_ps(dmin * (float)mn[2 * g]);
            const __m256 d1 = _mm256_set1_ps(d * (float)sc[2 * g + 1]), m1 = _mm256_set1_ps(dmin * (float)mn[2 * g + 1]);
#pragma GCC unroll 4
            for (int part = 0; part < 4; part++) {
                const __m256i raw = bytes8_256(qs + 32 * g + 8 * part);
                __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_srli_epi32(raw, 4);
                if (five) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h[part], 2 * g), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h[part], 2 * g + 1), one), 4));
                }
                _mm256_storeu_ps(out + 64 * g + 8 * part, _mm256_fmsub_ps(d0, _mm256_cvtepi32_ps(lo), m0));
                _mm256_storeu_ps(out + 64 * g + 32 + 8 * part, _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(hi), m1));
            }
        }
    }
}

static inline __attribute__((always_inline)) QB_AVX2 void mxfp4_blocks_256(const uint8_t *row, int64_t blocks, float *out) {
    for (int64_t i = 0; i < blocks; i++, out += QK) {
        const uint8_t *b = row + 17 * i;
        const __m256 d = _mm256_set1_ps(mxfp4_scale(b[0]));
        __m128i lo, hi;
        mxfp4_quants(b + 1, &lo, &hi);
        _mm256_storeu_ps(out, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
        _mm256_storeu_ps(out + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
        _mm256_storeu_ps(out + 16, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
        _mm256_storeu_ps(out + 24, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
    }
}

static QB_AVX2 void expand_row_avx2_impl(int type, const uint8_t *row, int64_t blocks, float *out) {
    const __m256i low4 = _mm256_set1_epi32(0x0f), three = _mm256_set1_epi32(3);
    switch (type) {
    case GGML_Q4_0: nibble_blocks_256(row, blocks, out, GGML_Q4_0); break;
    case GGML_Q4_1: nibble_blocks_256(row, blocks, out, GGML_Q4_1); break;
    case GGML_Q5_0: nibble_blocks_256(row, blocks, out, GGML_Q5_0); break;
    case GGML_Q5_1: nibble_blocks_256(row, blocks, out, GGML_Q5_1); break;
    case GGML_Q8_0:
        for (int64_t i = 0; i < blocks; i++, out += QK) {
            const uint8_t *b = row + 34 * i;
            const __m256 d = _mm256_set1_ps(half_f16c(b));
            for (int part = 0; part < 4; part++) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * part)));
                _mm256_storeu_ps(out + 8 * part, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
        }
        break;
    case GGML_Q4_K: k_blocks_256(row, blocks, out, 0); break;
    case GGML_Q5_K: k_blocks_256(row, blocks, out, 1); break;
    case GGML_MXFP4: mxfp4_blocks_256(row, blocks, out); break;
    default: /* Q6_K */
        for (int64_t i = 0; i < blocks; i++, out += QK_K) {
            const uint8_t *b = row + 210 * i, *ql = b, *qh = b + 128;
            const int8_t *scales = (const int8_t *)(b + 192);
            const float d = half_f16c(b + 208);
            const __m256i thirty_two = _mm256_set1_epi32(32);
            for (int h = 0; h < 2; h++) {
                for (int j = 0; j < 8; j++) {  /* ql bytes 8 j .. + 7 of the half feed 8-chunks j and j + 8 */
                    const __m256i lq = bytes8_256(ql + 64 * h + 8 * j);
                    const __m256i hq = bytes8_256(qh + 32 * h + 8 * (j % 4));
#pragma GCC unroll 2
                    for (int up = 0; up < 2; up++) {  /* 8-chunk k = j + 8 up: values 128 h + 8 k .. + 7 */
                        const int k = j + 8 * up;
                        const __m256i low = _mm256_and_si256(_mm256_srli_epi32(lq, 4 * up), low4);
                        const __m256i high = _mm256_and_si256(_mm256_srli_epi32(hq, 2 * (k / 4)), three);
                        const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), thirty_two);
                        const float ds = d * (float)scales[8 * h + k / 2];
                        _mm256_storeu_ps(out + 128 * h + 8 * k, _mm256_mul_ps(_mm256_set1_ps(ds), _mm256_cvtepi32_ps(q)));
                    }
                }
            }
        }
        break;
    }
}
#endif

int quantized_vector_isa(int isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa >= ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return isa >= ISA_AVX512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl")
                   ? ISA_AVX512
                   : ISA_AVX2;
#else
    (void)isa;
#endif
    return ISA_PORTABLE;
}

void expand_quantized_row(int vector, int type, const uint8_t *row, int64_t blocks, float *out) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (vector == ISA_AVX512) return expand_row_avx512_impl(type, row, blocks, out);
    if (vector == ISA_AVX2) return expand_row_avx2_impl(type, row, blocks, out);
#else
    (void)vector;
#endif
    expand_row_portable(type, row, blocks, out);
}

int quantized_rows(int type, const uint8_t *data, int64_t in, const int64_t *rows, int64_t count, float *out, int threads,
                   int isa) {
    int64_t block_size, type_size;
    if (quantized_block_shape(type, &block_size, &type_size)) return -1;
    const int64_t blocks = in / block_size, row_bytes = blocks * type_size;
    const int vector = quantized_vector_isa(isa);
    const int team = count * in < 65536 ? 1 : threads;
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t r = 0; r < count; r++) expand_quantized_row(vector, type, data + rows[r] * row_bytes, blocks, out + r * in);
    return 0;
}

int64_t quantized_first_nonfinite_scale(int type, const uint8_t *data, int64_t blocks) {
    int64_t block_size, type_size;
    if (quantized_block_shape(type, &block_size, &type_size)) return -2;
    /* MXFP4's E8M0 scale byte 0xff is NaN (OCP MX v1.0); ggml would read it as 2^127. */
    if (type == GGML_MXFP4) {
        for (int64_t i = 0; i < blocks; i++)
            if (data[i * type_size] == 0xff) return i;
        return -1;
    }
    /* Byte offsets of the block's float16 scales: d, and m / dmin where the type has one. */
    const int first = type == GGML_Q6_K ? 208 : 0;
    const int second = type == GGML_Q4_1 || type == GGML_Q5_1 || type == GGML_Q4_K || type == GGML_Q5_K ? 2 : -1;
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = data + i * type_size;
        /* A float16 is NaN or infinite when its five exponent bits (0x7c00) are all ones. */
        if ((b[first + 1] & 0x7c) == 0x7c || (second >= 0 && (b[second + 1] & 0x7c) == 0x7c)) return i;
    }
    return -1;
}
