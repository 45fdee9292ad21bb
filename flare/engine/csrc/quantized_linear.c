/* A linear layer multiplied straight from ggml's quantized blocks, float32 activations, float32
 * sums:
 *
 *   y[t, o] = sum_k x[t, k] W[o, k],  W[o, k] the value gguf-py's dequantize gives for its block.
 *
 * Weights: row o of W is in / B blocks of the ggml type (B = 32 for Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0; 256 for the K types Q4_K, Q5_K, Q6_K), exactly as the GGUF stores them. A block's values
 * are computed as gguf-py computes them, and every one of those computations is exact or rounds
 * once (the float16 scale d has 11 significant bits and the quant at most 6, so d * q, and the
 * K types' (d * scale) * q with a 6- or 8-bit scale, fit float32's 24 bits; only `+ m` / `- dm`
 * rounds): the expanded weights are gguf-py's float32 bits whichever instructions compute them,
 * fused multiply-add or not.
 *
 * The sum: each (row, output) keeps 16 float32 lanes, lane l summing x[k] W[k] over k = l mod 16
 * in increasing k with fused multiply-adds, and the lanes are added at the end by one fixed tree
 * (l + 8, then + 4, + 2, + 1). The AVX-512 loop holds the 16 lanes in one register, the AVX2 loop
 * in two, the portable loop in an array with fmaf: the same operations in the same order, so all
 * three give the same bits, and a row's result does not depend on how many rows share the call.
 *
 * Schedule: the outputs in groups of GROUP; a thread expands a group's weight rows once into a
 * float32 buffer (GROUP x in floats, in L1/L2), then runs every tile of rows over it, so at 8-32
 * rows each block is expanded once and reused by every row, and at one row each weight byte is
 * read once from memory. OpenMP threads take contiguous ranges of groups.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"

enum { GROUP = 4, LANES = 16, QK = 32, QK_K = 256 };

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

/* The fifth bits of a Q5 block: bit j of the little-endian 32-bit word is value j's. */
static inline uint32_t high_bits(const uint8_t *qh) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
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

/* The 8 six-bit scales and mins of a Q4_K / Q5_K block's 12 scale bytes: sub-blocks 0-3 in the
 * low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the nibbles of bytes 8-11
 * with their top two bits in the top bits of bytes 0-3 (scales) and 4-7 (mins). */
static inline void scales_and_mins(const uint8_t *s, int sc[8], int mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | (s[j] >> 6) << 4;
        mn[j + 4] = (s[j + 8] >> 4) | (s[j + 4] >> 6) << 4;
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

/* One row of `blocks` blocks of `type` into floats. Inlined into each ISA's clone below, where
 * the compiler vectorises the block loops for that ISA (the values are exact, so the same). */
static inline __attribute__((always_inline)) void expand_row_body(int type, const uint8_t *row, int64_t blocks, float *out) {
    switch (type) {
    case GGML_Q4_0: for (int64_t i = 0; i < blocks; i++) expand_q4_0(row + 18 * i, out + QK * i); break;
    case GGML_Q4_1: for (int64_t i = 0; i < blocks; i++) expand_q4_1(row + 20 * i, out + QK * i); break;
    case GGML_Q5_0: for (int64_t i = 0; i < blocks; i++) expand_q5_0(row + 22 * i, out + QK * i); break;
    case GGML_Q5_1: for (int64_t i = 0; i < blocks; i++) expand_q5_1(row + 24 * i, out + QK * i); break;
    case GGML_Q8_0: for (int64_t i = 0; i < blocks; i++) expand_q8_0(row + 34 * i, out + QK * i); break;
    case GGML_Q4_K: for (int64_t i = 0; i < blocks; i++) expand_q4_k(row + 144 * i, out + QK_K * i); break;
    case GGML_Q5_K: for (int64_t i = 0; i < blocks; i++) expand_q5_k(row + 176 * i, out + QK_K * i); break;
    default: for (int64_t i = 0; i < blocks; i++) expand_q6_k(row + 210 * i, out + QK_K * i); break;
    }
}

static void expand_row_portable(int type, const uint8_t *row, int64_t blocks, float *out) {
    expand_row_body(type, row, blocks, out);
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
    default: return -1;
    }
}

/* The lanes of one (row, output) summed by the fixed tree: l + 8, then + 4, + 2, + 1. */
static inline float sum_lanes(const float *a) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; l++) s8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* A tile of MT rows by NO expanded weight rows `w` (`in` floats apart) into `lanes`
 * [MT][NO][LANES]: the portable loop, one fmaf per lane and input. */
static void tile_portable(const float *x, int64_t xs, const float *w, int64_t in, float *lanes, int MT, int NO) {
    for (int m = 0; m < MT; m++)
        for (int o = 0; o < NO; o++) {
            float acc[LANES] = {0};
            const float *xr = x + m * xs, *wr = w + o * in;
            for (int64_t k = 0; k < in; k += LANES)
                for (int l = 0; l < LANES; l++) acc[l] = fmaf(wr[k + l], xr[k + l], acc[l]);
            memcpy(lanes + (m * NO + o) * LANES, acc, sizeof acc);
        }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define QL_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

static QL_AVX2 void expand_row_avx2(int type, const uint8_t *row, int64_t blocks, float *out) {
    expand_row_body(type, row, blocks, out);
}

static QL_AVX512 void expand_row_avx512(int type, const uint8_t *row, int64_t blocks, float *out) {
    expand_row_body(type, row, blocks, out);
}

/* AVX2: a lane set is two registers (lanes 0-7, 8-15); MT rows by NO outputs, at most 3 x 2
 * (12 accumulators, 4 weight registers; the inputs are read as memory operands). */
static inline __attribute__((always_inline)) QL_AVX2 void tile_avx2(const float *x, int64_t xs, const float *w, int64_t in,
                                                                     float *lanes, const int MT, const int NO) {
    __m256 acc[3][2][2];
#pragma GCC unroll 3
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 2
        for (int o = 0; o < NO; o++) acc[m][o][0] = acc[m][o][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; k += LANES) {
        __m256 w0[2], w1[2];
#pragma GCC unroll 2
        for (int o = 0; o < NO; o++) {
            w0[o] = _mm256_load_ps(w + o * in + k);
            w1[o] = _mm256_load_ps(w + o * in + k + 8);
        }
#pragma GCC unroll 3
        for (int m = 0; m < MT; m++) {
#pragma GCC unroll 2
            for (int o = 0; o < NO; o++) {
                acc[m][o][0] = _mm256_fmadd_ps(w0[o], _mm256_loadu_ps(x + m * xs + k), acc[m][o][0]);
                acc[m][o][1] = _mm256_fmadd_ps(w1[o], _mm256_loadu_ps(x + m * xs + k + 8), acc[m][o][1]);
            }
        }
    }
#pragma GCC unroll 3
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 2
        for (int o = 0; o < NO; o++) {
            _mm256_storeu_ps(lanes + (m * NO + o) * LANES, acc[m][o][0]);
            _mm256_storeu_ps(lanes + (m * NO + o) * LANES + 8, acc[m][o][1]);
        }
}

/* AVX-512: a lane set is one register; MT rows by NO outputs, at most 6 x 4 (24 accumulators,
 * 4 weight registers, 1 input). */
static inline __attribute__((always_inline)) QL_AVX512 void tile_avx512(const float *x, int64_t xs, const float *w,
                                                                         int64_t in, float *lanes, const int MT,
                                                                         const int NO) {
    __m512 acc[6][GROUP];
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int o = 0; o < NO; o++) acc[m][o] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k += LANES) {
        __m512 wv[GROUP];
#pragma GCC unroll 4
        for (int o = 0; o < NO; o++) wv[o] = _mm512_load_ps(w + o * in + k);
#pragma GCC unroll 6
        for (int m = 0; m < MT; m++) {
            const __m512 xv = _mm512_loadu_ps(x + m * xs + k);
#pragma GCC unroll 4
            for (int o = 0; o < NO; o++) acc[m][o] = _mm512_fmadd_ps(wv[o], xv, acc[m][o]);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int o = 0; o < NO; o++) _mm512_storeu_ps(lanes + (m * NO + o) * LANES, acc[m][o]);
}

/* A group's GROUP expanded rows for `rows` rows, tiles of constant size (at most 6 rows a
 * tile, as even as they go). */
static QL_AVX512 void group_avx512(const float *x, int64_t xs, int64_t rows, const float *w, int64_t in, float *lanes) {
    const int64_t tiles = (rows + 5) / 6;
    for (int64_t i = 0, t = 0; i < tiles; i++) {
        const int64_t mt = (rows - t) / (tiles - i);
        float *into = lanes + t * GROUP * LANES;
        switch (mt) {
        case 1: tile_avx512(x + t * xs, xs, w, in, into, 1, GROUP); break;
        case 2: tile_avx512(x + t * xs, xs, w, in, into, 2, GROUP); break;
        case 3: tile_avx512(x + t * xs, xs, w, in, into, 3, GROUP); break;
        case 4: tile_avx512(x + t * xs, xs, w, in, into, 4, GROUP); break;
        case 5: tile_avx512(x + t * xs, xs, w, in, into, 5, GROUP); break;
        default: tile_avx512(x + t * xs, xs, w, in, into, 6, GROUP); break;
        }
        t += mt;
    }
}

/* The same with AVX2: tiles of at most 3 rows by 2 outputs, lanes stored [row][GROUP][LANES]. */
static QL_AVX2 void group_avx2(const float *x, int64_t xs, int64_t rows, const float *w, int64_t in, float *lanes) {
    float tile[3 * 2 * LANES];
    for (int64_t t = 0; t < rows; t += 3) {
        const int64_t mt = rows - t < 3 ? rows - t : 3;
        for (int o = 0; o < GROUP; o += 2) {
            switch (mt) {
            case 1: tile_avx2(x + t * xs, xs, w + o * in, in, tile, 1, 2); break;
            case 2: tile_avx2(x + t * xs, xs, w + o * in, in, tile, 2, 2); break;
            default: tile_avx2(x + t * xs, xs, w + o * in, in, tile, 3, 2); break;
            }
            for (int64_t m = 0; m < mt; m++)
                memcpy(lanes + ((t + m) * GROUP + o) * LANES, tile + m * 2 * LANES, sizeof(float) * 2 * LANES);
        }
    }
}
#endif

static void group_portable(const float *x, int64_t xs, int64_t rows, const float *w, int64_t in, float *lanes) {
    for (int64_t t = 0; t < rows; t++) tile_portable(x + t * xs, xs, w, in, lanes + t * GROUP * LANES, 1, GROUP);
}

/* The ISA a call runs: the widest of `isa` and what this CPU has. */
static int vector_isa(int isa) {
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

static void expand_row(int vector, int type, const uint8_t *row, int64_t blocks, float *out) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (vector == ISA_AVX512) return expand_row_avx512(type, row, blocks, out);
    if (vector == ISA_AVX2) return expand_row_avx2(type, row, blocks, out);
#endif
    expand_row_portable(type, row, blocks, out);
}

int quantized_linear(const QuantizedLinear *l, int threads, int isa) {
    int64_t block_size, type_size;
    if (quantized_block_shape(l->type, &block_size, &type_size)) return -1;
    const int64_t blocks = l->in / block_size, row_bytes = blocks * type_size;
    const int64_t groups = (l->out + GROUP - 1) / GROUP;
    const int vector = vector_isa(isa);
    /* One thread below about 64k multiply-adds: a thread team costs more than it saves. */
    const int team = l->tokens * l->in * l->out < 65536 ? 1 : threads;
    int failed = 0;
#pragma omp parallel num_threads(team) reduction(| : failed)
    {
        const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t first = groups * i / n, last = groups * (i + 1) / n;
        /* The group's expanded rows (64-byte aligned: the vector loops load them aligned) and the
         * lanes of every (row, output) of the group. */
        float *w = aligned_alloc(64, sizeof(float) * (size_t)(GROUP * l->in));
        float *lanes = malloc(sizeof(float) * (size_t)(l->tokens * GROUP * LANES));
        if (!w || !lanes) {
            failed = 1;
        } else {
            for (int64_t g = first; g < last; g++) {
                const int64_t o0 = g * GROUP, count = l->out - o0 < GROUP ? l->out - o0 : GROUP;
                for (int64_t o = 0; o < count; o++)
                    expand_row(vector, l->type, l->blocks + (o0 + o) * row_bytes, blocks, w + o * l->in);
                memset(w + count * l->in, 0, sizeof(float) * (size_t)((GROUP - count) * l->in));
#if defined(__x86_64__) && defined(__GNUC__)
                if (vector == ISA_AVX512)
                    group_avx512(l->x, l->x_stride, l->tokens, w, l->in, lanes);
                else if (vector == ISA_AVX2)
                    group_avx2(l->x, l->x_stride, l->tokens, w, l->in, lanes);
                else
#endif
                    group_portable(l->x, l->x_stride, l->tokens, w, l->in, lanes);
                for (int64_t t = 0; t < l->tokens; t++)
                    for (int64_t o = 0; o < count; o++) l->y[t * l->out + o0 + o] = sum_lanes(lanes + (t * GROUP + o) * LANES);
            }
        }
        free(w);
        free(lanes);
    }
    return failed ? -2 : 0;
}

int quantized_rows(int type, const uint8_t *data, int64_t in, const int64_t *rows, int64_t count, float *out, int threads) {
    int64_t block_size, type_size;
    if (quantized_block_shape(type, &block_size, &type_size)) return -1;
    const int64_t blocks = in / block_size, row_bytes = blocks * type_size;
    const int vector = vector_isa(ISA_AVX512);
    const int team = count * in < 65536 ? 1 : threads;
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t r = 0; r < count; r++) expand_row(vector, type, data + rows[r] * row_bytes, blocks, out + r * in);
    return 0;
}
