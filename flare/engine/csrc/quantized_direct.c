/* A few rows multiplied straight from ggml's blocks: each block is expanded in registers and
 * multiplied into the rows' sums at once, never stored (AVX-512: up to 6 rows, every type;
 * AVX2: one row of every type but Q5_K, up to 5 of the 32-value types, at the end of this file).
 * MXFP4 (gpt-oss's experts) too.
 *
 * quantized_linear.c expands a group's weight rows into a float32 buffer and runs the rows over
 * it, which pays for itself from about 8 rows on. At 1-6 rows (one stream, a short speculative
 * verification) the store and reload of every expanded value cost as much as the expansion, so
 * here each 16-value chunk of a block goes from its bytes to a register and straight into the
 * fused multiply-adds of every row.
 *
 * The bits are quantized_linear.c's: every weight is the value quantized_blocks.c gives
 * (gguf-py's), each (row, output) keeps the same 16 float32 lanes, lane l summing x[k] W[k] over
 * k = l mod 16 in increasing k with fused multiply-adds, and sum_lanes_512's tree adds them. So a
 * row's result does not depend on which path ran it, nor on its batch-mates
 * (tests/engine/test_quantized_linear.py holds every row count to the float64 product and to
 * the other ISAs' bits).
 *
 * The 4-bit and 5-bit types expand through a table: a block's (or sub-block's) 16 or 32 possible
 * values, d j + m (or (d sc) j - dmin m) for j = 0 .. 15 (31), are one fused multiply-add on
 * the vector 0 .. 15, rounded once as the expansion's own multiply-add rounds them, and
 * vpermps (vpermt2ps for 32) looks each quant up, reading only the index's low 4 (5) bits, so
 * a nibble needs no mask. That is 1 instruction a 16 values where the expansion took 3.
 */
#include <stdlib.h>
#include <string.h>

#include "integer_dot.h"
#include "kernels.h"
#include "quantized_lanes.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define QD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define QD_INLINE static inline __attribute__((always_inline)) QD_AVX512
/* What both ISAs' paths use is built for AVX2, which the AVX-512 functions inline too. */
#define QD_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QD2_INLINE static inline __attribute__((always_inline)) QD_AVX2

enum { QK = 32, QK_K = 256, GROUP = 4, MAX_TILE = 6, PREFETCH_GROUPS = 4 };

/* The sums of a tile: MT rows by GROUP outputs, 16 lanes each. */
typedef struct {
    __m512 lanes[MAX_TILE][GROUP];
} Sums;

QD2_INLINE float half_at(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8)); }

QD_INLINE __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* Output o's lanes of the MT rows take w (the weights k .. k + 15) times x[m, k .. k + 15]. */
QD_INLINE void multiply(Sums *s, int o, __m512 w, const float *x, int64_t xs, int64_t k, const int MT) {
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++) s->lanes[m][o] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * xs + k), s->lanes[m][o]);
}

/* Block i of the four 32-value nibble types (Q4_0, Q4_1, Q5_0, Q5_1; `type` a constant) of
 * output o: the table of its values, then the low nibbles (values 0-15) and high (16-31). */
QD_INLINE void nibble_block(Sums *s, int o, const uint8_t *b, const float *x, int64_t xs, int64_t k, const int type,
                            const int MT) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
    const __m512 d = _mm512_set1_ps(half_at(b));
    const __m512i q = bytes16(b + 2 + 2 * has_min + 4 * five);
    if (!five) {
        /* Q4_0: d (j - 8), exact; Q4_1: d j + m, one rounding (quantized_blocks.c's fmadd). */
        const __m512 table = has_min ? _mm512_fmadd_ps(d, iota, _mm512_set1_ps(half_at(b + 2)))
                                     : _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
        multiply(s, o, _mm512_permutexvar_ps(q, table), x, xs, k, MT);
        multiply(s, o, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), x, xs, k + 16, MT);
    } else {
        /* Q5_0: d (j - 16); Q5_1: d j + m; j = 0 .. 31, the fifth bit chosen by a mask. */
        const __m512 upper = _mm512_add_ps(iota, _mm512_set1_ps(16.0f));
        const __m512 low = has_min ? _mm512_fmadd_ps(d, iota, _mm512_set1_ps(half_at(b + 2)))
                                   : _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.0f)));
        const __m512 high = has_min ? _mm512_fmadd_ps(d, upper, _mm512_set1_ps(half_at(b + 2))) : _mm512_mul_ps(d, iota);
        const uint32_t qh = high_bits(b + 2 + 2 * has_min);
        const __m512i sixteen = _mm512_set1_epi32(16), low4 = _mm512_set1_epi32(0x0f);
        const __m512i nibbles = _mm512_and_si512(q, low4);
        const __m512i lo = _mm512_mask_or_epi32(nibbles, (__mmask16)(qh & 0xffff), nibbles, sixteen);
        const __m512i hi = _mm512_mask_or_epi32(_mm512_srli_epi32(q, 4), (__mmask16)(qh >> 16), _mm512_srli_epi32(q, 4), sixteen);
        multiply(s, o, _mm512_permutex2var_ps(low, lo, high), x, xs, k, MT);
        multiply(s, o, _mm512_permutex2var_ps(low, hi, high), x, xs, k + 16, MT);
    }
}

/* Q8_0 block i of output o: d q, exact. */
QD_INLINE void q8_0_block(Sums *s, int o, const uint8_t *b, const float *x, int64_t xs, int64_t k, const int MT) {
    const __m512 d = _mm512_set1_ps(half_at(b));
    const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
    const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)));
    multiply(s, o, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), x, xs, k, MT);
    multiply(s, o, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), x, xs, k + 16, MT);
}

/* MXFP4 block i of output o: its 16 values MXFP4_VALUES[j] d (exact) as a table, each nibble
 * looked up by vpermps (which reads the index's low 4 bits). */
QD_INLINE void mxfp4_block(Sums *s, int o, const uint8_t *b, const float *x, int64_t xs, int64_t k, const int MT) {
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)MXFP4_VALUES)));
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(mxfp4_scale(b[0])), values);
    const __m512i q = bytes16(b + 1);
    multiply(s, o, _mm512_permutexvar_ps(q, table), x, xs, k, MT);
    multiply(s, o, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), x, xs, k + 16, MT);
}

/* Q4_K (five = 0) and Q5_K (five = 1): sub-block j's values are (d sc_j) q - dmin mn_j, its
 * table one fused multiply-subtract as quantized_blocks.c's. Q5_K's fifth bit (bit j of qh[l])
 * is moved to bit 4 of the index by one shift, and vpternlogd takes bits 0-3 from the nibble,
 * the rest from it; vpermt2ps reads bits 0-4 only. The group's four blocks go 64 values at a
 * time in turn, so each output's chain of multiply-adds waits on the others' less. */
typedef struct {
    float ds[8], ms[8];
} KScales;

QD2_INLINE void k_scales(const uint8_t *b, KScales *k) {
    /* scales_and_mins four bytes at a time: w0, w1, w2 the scale bytes 0-3, 4-7, 8-11; a byte's
     * top two bits (>> 6, << 4) are (w >> 2) & 0x30 in place. Then d sc_j and dmin mn_j, eight at
     * once, the scalar products quantized_blocks.c rounds. */
    uint32_t w0, w1, w2;
    memcpy(&w0, b + 4, 4), memcpy(&w1, b + 8, 4), memcpy(&w2, b + 12, 4);
    const uint32_t sc_low = w0 & 0x3f3f3f3f, sc_high = (w2 & 0x0f0f0f0f) | ((w0 >> 2) & 0x30303030);
    const uint32_t mn_low = w1 & 0x3f3f3f3f, mn_high = ((w2 >> 4) & 0x0f0f0f0f) | ((w1 >> 2) & 0x30303030);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)sc_low, (int)sc_high, 0, 0)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)mn_low, (int)mn_high, 0, 0)));
    _mm256_storeu_ps(k->ds, _mm256_mul_ps(_mm256_set1_ps(half_at(b)), sc));
    _mm256_storeu_ps(k->ms, _mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), mn));
}

/* Sub-blocks 2 g and 2 g + 1 (values 64 g .. + 63) of the block at b into output o's sums. */
QD_INLINE void k_quarter(Sums *s, int o, const uint8_t *b, const KScales *sc, int g, const float *x, int64_t xs, int64_t k,
                         const int five, const int MT) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    const __m512i raw[2] = {bytes16(qs + 32 * g), bytes16(qs + 32 * g + 16)};
#pragma GCC unroll 2
    for (int nibble = 0; nibble < 2; nibble++) {
        const int j = 2 * g + nibble;
        const __m512 ds = _mm512_set1_ps(sc->ds[j]), ms = _mm512_set1_ps(sc->ms[j]);
        const __m512 table = _mm512_fmsub_ps(ds, iota, ms);
#pragma GCC unroll 2
        for (int part = 0; part < 2; part++) {
            const __m512i q = nibble ? _mm512_srli_epi32(raw[part], 4) : raw[part];
            __m512 w;
            if (five) {
                const __m512i h = bytes16(qh + 16 * part);
                const __m512i fifth = j <= 4 ? _mm512_slli_epi32(h, 4 - j) : _mm512_srli_epi32(h, j - 4);
                /* 0xca: a ? b : c bit by bit, so bits 0-3 (the mask 0x0f) from q, the rest from fifth. */
                const __m512i index = _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x0f), q, fifth, 0xca);
                const __m512 upper = _mm512_fmsub_ps(ds, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), ms);
                w = _mm512_permutex2var_ps(table, index, upper);
            } else {
                w = _mm512_permutexvar_ps(q, table);
            }
            multiply(s, o, w, x, xs, k + 32 * j + 16 * part, MT);
        }
    }
}

/* Q6_K block i of output o, in increasing k: quantized_blocks.c's expansion, each 16 values
 * straight into the sums. */
QD_INLINE void q6_k_block(Sums *s, int o, const uint8_t *b, const float *x, int64_t xs, int64_t k, const int MT) {
    const uint8_t *ql = b, *qh = b + 128;
    /* The 16 d scale_j at once (each the scalar product quantized_blocks.c rounds); a chunk's is
     * picked by vpermps. d scale (q - 32) is one rounding of an exact value either way, so it
     * is computed as fma(q, ds, -32 ds), -32 ds exact (a power of two). */
    const __m512 ds_all = _mm512_mul_ps(_mm512_set1_ps(half_at(b + 208)),
                                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
    const __m512 m32_all = _mm512_mul_ps(ds_all, _mm512_set1_ps(-32.0f));
    const __m512i low4 = _mm512_set1_epi32(0x0f), pair = _mm512_set1_epi32(0x30);
    for (int h = 0; h < 2; h++) {
        const __m512i lq[4] = {bytes16(ql + 64 * h), bytes16(ql + 64 * h + 16), bytes16(ql + 64 * h + 32), bytes16(ql + 64 * h + 48)};
        const __m512i hq[2] = {bytes16(qh + 32 * h), bytes16(qh + 32 * h + 16)};
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {  /* values 128 h + 16 c .. + 15 */
            /* The low nibble (a byte widened to 32 bits: >> 4 needs no mask), and the high pair
             * (bits 2 (c / 2) .. + 1) moved to bits 4-5; vpternlogd 0xf8 is a | (b & c). */
            const __m512i low = c < 4 ? _mm512_and_si512(lq[c % 4], low4) : _mm512_srli_epi32(lq[c % 4], 4);
            const int at = 2 * (c / 2);
            const __m512i high = at < 4 ? _mm512_slli_epi32(hq[c % 2], 4 - at) : at > 4 ? _mm512_srli_epi32(hq[c % 2], at - 4) : hq[c % 2];
            const __m512 q = _mm512_cvtepi32_ps(_mm512_ternarylogic_epi32(low, high, pair, 0xf8));
            const __m512i j = _mm512_set1_epi32(8 * h + c);
            const __m512 w = _mm512_fmadd_ps(q, _mm512_permutexvar_ps(j, ds_all), _mm512_permutexvar_ps(j, m32_all));
            multiply(s, o, w, x, xs, k + 128 * h + 16 * c, MT);
        }
    }
}

/* MT rows of x by the GROUP weight rows at `rows` (`row_bytes` apart), `type` and MT constants:
 * the blocks in order, each block of the group's rows in turn (four independent chains of
 * multiply-adds per row keep the FMA units busy). */
QD_INLINE void tile(const int type, const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x, int64_t xs,
                    float *y, int64_t ys, const int MT) {
    Sums s;
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int o = 0; o < GROUP; o++) s.lanes[m][o] = _mm512_setzero_ps();
    const int64_t size = type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : type == GGML_Q5_1 ? 24
                         : type == GGML_Q8_0 ? 34 : type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176
                         : type == GGML_MXFP4 ? 17 : 210;
    const int64_t values = type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ? QK_K : QK;
    /* The group PREFETCH_GROUPS ahead is fetched a slice a block, while this one multiplies: the
     * four rows' blocks are read as four interleaved streams, which the hardware prefetcher
     * follows too late (docs/kernels.md gives the figures). A prefetch past the weight's end is harmless: it never faults. */
    const int64_t span = GROUP * row_bytes;
    const uint8_t *ahead = rows + PREFETCH_GROUPS * span;
    for (int64_t i = 0; i < blocks; i++) {
        for (int64_t at = span * i / blocks & ~(int64_t)63; at < span * (i + 1) / blocks; at += 64) __builtin_prefetch(ahead + at);
        if (type == GGML_Q4_K || type == GGML_Q5_K) {
            KScales sc[GROUP];
#pragma GCC unroll 4
            for (int o = 0; o < GROUP; o++) k_scales(rows + o * row_bytes + i * size, &sc[o]);
#pragma GCC unroll 1
            for (int g = 0; g < 4; g++)
#pragma GCC unroll 4
                for (int o = 0; o < GROUP; o++)
                    k_quarter(&s, o, rows + o * row_bytes + i * size, &sc[o], g, x, xs, i * QK_K, type == GGML_Q5_K, MT);
            continue;
        }
#pragma GCC unroll 4
        for (int o = 0; o < GROUP; o++) {
            const uint8_t *b = rows + o * row_bytes + i * size;
            const int64_t k = i * values;
            switch (type) {
            case GGML_Q8_0: q8_0_block(&s, o, b, x, xs, k, MT); break;
            case GGML_Q6_K: q6_k_block(&s, o, b, x, xs, k, MT); break;
            case GGML_MXFP4: mxfp4_block(&s, o, b, x, xs, k, MT); break;
            default: nibble_block(&s, o, b, x, xs, k, type, MT); break;
            }
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int o = 0; o < GROUP; o++) y[m * ys + o] = sum_lanes_512(s.lanes[m][o]);
}

/* One type's tiles over `tokens` rows: at most MAX_TILE rows a tile, as even as they go. */
#define TILES(TYPE)                                                                                                    \
    static QD_AVX512 void tiles_##TYPE(const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x,        \
                                       int64_t xs, int64_t tokens, float *y, int64_t ys) {                             \
        const int64_t count = (tokens + MAX_TILE - 1) / MAX_TILE;                                                      \
        for (int64_t i = 0, t = 0; i < count; i++) {                                                                   \
            const int64_t mt = (tokens - t) / (count - i);                                                             \
            switch (mt) {                                                                                              \
            case 1: tile(TYPE, rows, row_bytes, blocks, x + t * xs, xs, y + t * ys, ys, 1); break;                    \
            case 2: tile(TYPE, rows, row_bytes, blocks, x + t * xs, xs, y + t * ys, ys, 2); break;                    \
            case 3: tile(TYPE, rows, row_bytes, blocks, x + t * xs, xs, y + t * ys, ys, 3); break;                    \
            case 4: tile(TYPE, rows, row_bytes, blocks, x + t * xs, xs, y + t * ys, ys, 4); break;                    \
            case 5: tile(TYPE, rows, row_bytes, blocks, x + t * xs, xs, y + t * ys, ys, 5); break;                    \
            default: tile(TYPE, rows, row_bytes, blocks, x + t * xs, xs, y + t * ys, ys, 6); break;                   \
            }                                                                                                          \
            t += mt;                                                                                                   \
        }                                                                                                              \
    }
TILES(GGML_Q4_0)
TILES(GGML_Q4_1)
TILES(GGML_Q5_0)
TILES(GGML_Q5_1)
TILES(GGML_Q8_0)
TILES(GGML_Q4_K)
TILES(GGML_Q5_K)
TILES(GGML_Q6_K)
TILES(GGML_MXFP4)

static QD_AVX512 void group_avx512(int type, const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x,
                                   int64_t xs, int64_t tokens, float *y, int64_t ys) {
    switch (type) {
    case GGML_Q4_0: tiles_GGML_Q4_0(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q4_1: tiles_GGML_Q4_1(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q5_0: tiles_GGML_Q5_0(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q5_1: tiles_GGML_Q5_1(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q8_0: tiles_GGML_Q8_0(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q4_K: tiles_GGML_Q4_K(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q5_K: tiles_GGML_Q5_K(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_MXFP4: tiles_GGML_MXFP4(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    default: tiles_GGML_Q6_K(rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    }
}

/* AVX2: one row of every type but Q5_K (the default package's types, the commonest files' and
 * Q4_K_M's with its Q5_0 fallbacks), and 2-5 rows of the 32-value types (a short verify row, a
 * few streams): quantized_linear.c's AVX2 loop keeps a (row, output)'s 16 lanes as two 8-lane
 * halves, half h summing the k with (k / 8) % 2 == h in increasing k, and so does this; the
 * values are quantized_blocks.c's AVX2 expansion (d (q - 8), d (q - 16), d q + m, d q). A tile is
 * MT rows by NO outputs, each block expanded once for all its rows: one row by the group's 4
 * outputs, 2-3 rows by 2, 4-5 rows by 1 (8 to 12 accumulators of the 16 registers, and at least
 * 8 independent chains of multiply-adds). From 6 rows the buffered path, which expands each block
 * once into memory and runs tiles of 3 rows by 4 outputs over it, is as fast (docs/benchmarks.md,
 * "Quantized linear layers"), and takes them, as it takes Q5_K. */
enum { AVX2_TILE = 5 };

typedef struct {
    __m256 half[AVX2_TILE][GROUP][2];
} Halves;

/* Output o's half (c / 8) % 2 of the MT rows takes w (the weights k + c .. + 7, k a multiple of
 * 16) times x. */
QD2_INLINE void multiply_256(Halves *s, int o, __m256 w, const float *x, int64_t xs, int64_t k, const int c, const int MT) {
#pragma GCC unroll 5
    for (int m = 0; m < MT; m++)
        s->half[m][o][(c / 8) % 2] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * xs + k + c), s->half[m][o][(c / 8) % 2]);
}

QD2_INLINE void block_256(Halves *s, int o, const uint8_t *b, const float *x, int64_t xs, int64_t k, const int type, const int MT) {
    if (type == GGML_MXFP4) {  /* quantized_blocks.c's AVX2 expansion: pshufb into MXFP4_VALUES, times d */
        const __m256 d = _mm256_set1_ps(mxfp4_scale(b[0]));
        const __m128i table = _mm_loadu_si128((const __m128i *)MXFP4_VALUES), low4 = _mm_set1_epi8(0x0f);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 1));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low4));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4));
        multiply_256(s, o, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))), x, xs, k, 0, MT);
        multiply_256(s, o, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))), x, xs, k, 8, MT);
        multiply_256(s, o, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))), x, xs, k, 16, MT);
        multiply_256(s, o, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))), x, xs, k, 24, MT);
        return;
    }
    const __m256 d = _mm256_set1_ps(half_at(b));
    if (type == GGML_Q8_0) {
#pragma GCC unroll 4
        for (int c = 0; c < QK; c += 8) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + c)));
            multiply_256(s, o, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), x, xs, k, c, MT);
        }
        return;
    }
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
    const __m256 m = _mm256_set1_ps(has_min ? half_at(b + 2) : 0.0f);
    const __m256i low4 = _mm256_set1_epi32(0x0f);
    const __m256i offset = _mm256_set1_epi32(type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : 0);
    const uint8_t *qs = b + 2 + 2 * has_min + 4 * five;
    const uint32_t qh = five ? high_bits(b + 2 + 2 * has_min) : 0;
#pragma GCC unroll 2
    for (int part = 0; part < 2; part++) {  /* values 8 part .. + 7 (low nibbles) and 16 + 8 part .. + 7 (high) */
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * part)));
        __m256i low = _mm256_and_si256(q, low4), high = _mm256_srli_epi32(q, 4);
        if (five) {  /* the fifth bits, 16 where set, from the table quantized_blocks.c's AVX2 loop reads */
            low = _mm256_or_si256(low, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)QUANTIZED_FIFTH_BITS[(qh >> (8 * part)) & 0xff])));
            high = _mm256_or_si256(high, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)QUANTIZED_FIFTH_BITS[(qh >> (16 + 8 * part)) & 0xff])));
        }
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(low, offset));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(high, offset));
        multiply_256(s, o, has_min ? _mm256_fmadd_ps(d, lo, m) : _mm256_mul_ps(d, lo), x, xs, k, 8 * part, MT);
        multiply_256(s, o, has_min ? _mm256_fmadd_ps(d, hi, m) : _mm256_mul_ps(d, hi), x, xs, k, 16 + 8 * part, MT);
    }
}

/* Q4_K block of output o, in increasing k: sub-block j's values (d sc_j) q - dmin mn_j (its
 * scales from k_scales, shared with AVX-512), 8 at a time as quantized_blocks.c's AVX2 expansion. */
QD2_INLINE void q4_k_block_256(Halves *s, int o, const uint8_t *b, const KScales *sc, const float *x, int64_t xs, int64_t k,
                                const int MT) {
    const uint8_t *qs = b + 16;
    const __m256i low4 = _mm256_set1_epi32(0x0f);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const __m256 ds = _mm256_set1_ps(sc->ds[j]), ms = _mm256_set1_ps(sc->ms[j]);
#pragma GCC unroll 4
        for (int c = 0; c < 32; c += 8) {  /* bytes 32 (j / 2) + c: low nibbles for even j, high for odd */
            const __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 32 * (j / 2) + c)));
            const __m256i q = j % 2 ? _mm256_srli_epi32(raw, 4) : _mm256_and_si256(raw, low4);
            multiply_256(s, o, _mm256_fmsub_ps(ds, _mm256_cvtepi32_ps(q), ms), x, xs, k + 32 * j, c, MT);
        }
    }
}

/* Q6_K block of output o, in increasing k: value e of half h from ql[64 h + e % 64] (its nibble
 * e / 64) and qh[32 h + e % 32] (its pair e / 32), (d scale[e / 16]) (q - 32), 8 at a time. */
QD2_INLINE void q6_k_block_256(Halves *s, int o, const uint8_t *b, const float *x, int64_t xs, int64_t k, const int MT) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = half_at(b + 208);
    const __m256i low4 = _mm256_set1_epi32(0x0f), three = _mm256_set1_epi32(3), thirty_two = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; h++) {
#pragma GCC unroll 16
        for (int e = 0; e < 128; e += 8) {
            const __m256i lq = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 64 * h + e % 64)));
            const __m256i hq = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + 32 * h + e % 32)));
            const __m256i low = _mm256_and_si256(_mm256_srli_epi32(lq, 4 * (e / 64)), low4);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi32(hq, 2 * (e / 32)), three);
            const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), thirty_two);
            const __m256 ds = _mm256_set1_ps(d * (float)scales[8 * h + e / 16]);
            multiply_256(s, o, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(q)), x, xs, k + 128 * h, e, MT);
        }
    }
}

QD2_INLINE void tile_256(const int type, const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x, int64_t xs,
                         float *y, int64_t ys, const int MT, const int NO) {
    Halves s;
#pragma GCC unroll 5
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int o = 0; o < NO; o++) s.half[m][o][0] = s.half[m][o][1] = _mm256_setzero_ps();
    const int64_t size = type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : type == GGML_Q5_1 ? 24
                         : type == GGML_Q8_0 ? 34 : type == GGML_Q4_K ? 144 : type == GGML_MXFP4 ? 17 : 210;
    const int64_t values = type == GGML_Q4_K || type == GGML_Q6_K ? QK_K : QK;
    /* the tile's share of the group PREFETCH_GROUPS ahead */
    const int64_t span = NO * row_bytes;
    const uint8_t *ahead = rows + PREFETCH_GROUPS * GROUP * row_bytes;
    for (int64_t i = 0; i < blocks; i++) {
        for (int64_t at = span * i / blocks & ~(int64_t)63; at < span * (i + 1) / blocks; at += 64) __builtin_prefetch(ahead + at);
        if (type == GGML_Q4_K) {
            KScales sc[GROUP];
#pragma GCC unroll 4
            for (int o = 0; o < NO; o++) k_scales(rows + o * row_bytes + i * size, &sc[o]);
#pragma GCC unroll 1
            for (int o = 0; o < NO; o++) q4_k_block_256(&s, o, rows + o * row_bytes + i * size, &sc[o], x, xs, i * QK_K, MT);
        } else if (type == GGML_Q6_K) {
#pragma GCC unroll 1
            for (int o = 0; o < NO; o++) q6_k_block_256(&s, o, rows + o * row_bytes + i * size, x, xs, i * QK_K, MT);
        } else {
#pragma GCC unroll 4
            for (int o = 0; o < NO; o++) block_256(&s, o, rows + o * row_bytes + i * size, x, xs, i * values, type, MT);
        }
    }
#pragma GCC unroll 5
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int o = 0; o < NO; o++) y[m * ys + o] = sum_lanes_256(s.half[m][o][0], s.half[m][o][1]);
}

/* A 32-value type's group at 2 to 5 rows: tiles of 2 outputs (2-3 rows) or 1 (4-5 rows), each
 * of every row, so that each block is expanded once and a tile keeps 8 to 12 accumulators. */
QD2_INLINE void rows_256(const int type, const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x, int64_t xs,
                         int64_t tokens, float *y, int64_t ys) {
    const int outputs = tokens <= 3 ? 2 : 1;
#pragma GCC unroll 1
    for (int o = 0; o < GROUP; o += outputs) {
        const uint8_t *at = rows + o * row_bytes;
        switch (tokens) {
        case 2: tile_256(type, at, row_bytes, blocks, x, xs, y + o, ys, 2, 2); break;
        case 3: tile_256(type, at, row_bytes, blocks, x, xs, y + o, ys, 3, 2); break;
        case 4: tile_256(type, at, row_bytes, blocks, x, xs, y + o, ys, 4, 1); break;
        default: tile_256(type, at, row_bytes, blocks, x, xs, y + o, ys, 5, 1); break;
        }
    }
}

/* One group at `type` a constant: 2-5 rows of a 32-value type in rows_256's tiles, else one row
 * (quantized_direct_rows allows more only for those types) by the group's 4 outputs. */
QD2_INLINE void group_256(const int type, const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x, int64_t xs,
                          int64_t tokens, float *y, int64_t ys) {
    if (integer_linear_type(type) && tokens > 1) rows_256(type, rows, row_bytes, blocks, x, xs, tokens, y, ys);
    else tile_256(type, rows, row_bytes, blocks, x, xs, y, ys, 1, GROUP);
}

static QD_AVX2 void group_avx2(int type, const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x, int64_t xs,
                               int64_t tokens, float *y, int64_t ys) {
    switch (type) {
    case GGML_Q4_0: group_256(GGML_Q4_0, rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q4_1: group_256(GGML_Q4_1, rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q5_0: group_256(GGML_Q5_0, rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q5_1: group_256(GGML_Q5_1, rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q4_K: group_256(GGML_Q4_K, rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_Q6_K: group_256(GGML_Q6_K, rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    case GGML_MXFP4: group_256(GGML_MXFP4, rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    default: group_256(GGML_Q8_0, rows, row_bytes, blocks, x, xs, tokens, y, ys); break;
    }
}
#endif

int quantized_direct_rows(int vector, int type) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* Past these, expanding a group once for every row wins (`benchmarks/quantized_linear.py
     * --rows 1 2 4 6 8`); Q5_K's fifth bits make its limit 4. */
    if (vector == ISA_AVX512) return type == GGML_Q5_K ? 4 : MAX_TILE;
    if (vector == ISA_AVX2) return integer_linear_type(type) ? AVX2_TILE : type != GGML_Q5_K;
#else
    (void)vector, (void)type;
#endif
    return 0;
}

void quantized_group_direct(int vector, int type, const uint8_t *rows, int64_t row_bytes, int64_t blocks, const float *x,
                            int64_t xs, int64_t tokens, float *y, int64_t ys) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (vector == ISA_AVX512) group_avx512(type, rows, row_bytes, blocks, x, xs, tokens, y, ys);
    else if (vector == ISA_AVX2) group_avx2(type, rows, row_bytes, blocks, x, xs, tokens, y, ys);
#else
    (void)vector, (void)type, (void)rows, (void)row_bytes, (void)blocks, (void)x, (void)xs, (void)tokens, (void)y, (void)ys;
#endif
}
