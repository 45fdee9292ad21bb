/* A linear layer multiplied straight from ggml's quantized blocks, float32 activations, float32
 * sums:
 *
 *   y[t, o] = sum_k x[t, k] W[o, k],  W[o, k] the value gguf-py's dequantize gives for its block.
 *
 * Weights: row o of W is in / B blocks of the ggml type (B = 32 for Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0; 256 for the K types Q4_K, Q5_K, Q6_K), exactly as the GGUF stores them, expanded into
 * gguf-py's float32 values by quantized_blocks.c (exactly, at every ISA).
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
 * read once from memory. OpenMP threads take contiguous ranges of groups. A few rows (AVX-512: up
 * to 6; AVX2: one of every type but Q5_K, up to 5 of the 32-value types) skip the buffer:
 * quantized_direct.c multiplies each block as it expands it in registers, to the same bits.
 * Figures against the float16 kernel and what was tried are in docs/benchmarks.md, "Quantized
 * linear layers".
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "kernels.h"
#include "quantized_lanes.h"

enum { GROUP = 4, LANES = 16 };

/* The lanes of one (row, output) summed by the fixed tree: l + 8, then + 4, + 2, + 1. */
static inline float sum_lanes(const float *a) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; l++) s8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* A tile of MT rows by NO expanded weight rows `w` (`in` floats apart) into `sums` (rows `ys` apart):
 * the portable loop, one fmaf per lane and input. */
static void tile_portable(const float *x, int64_t xs, const float *w, int64_t in, float *sums, int64_t ys, int MT, int NO) {
    for (int m = 0; m < MT; m++)
        for (int o = 0; o < NO; o++) {
            float acc[LANES] = {0};
            const float *xr = x + m * xs, *wr = w + o * in;
            for (int64_t k = 0; k < in; k += LANES)
                for (int l = 0; l < LANES; l++) acc[l] = fmaf(wr[k + l], xr[k + l], acc[l]);
            sums[m * ys + o] = sum_lanes(acc);
        }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define QL_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* AVX2: a lane set is two registers, lanes 0-7 and 8-15, whose sums are independent: each half
 * runs as its own pass over the inputs (k = 16 i + 8 half + l), MT rows by NO outputs, at most
 * 3 x 4 (12 accumulators, 4 weight registers; the inputs are read as memory operands), and the
 * two halves meet in sum_lanes_256. */
static inline __attribute__((always_inline)) QL_AVX2 void tile_avx2(const float *x, int64_t xs, const float *w, int64_t in,
                                                                     float *sums, int64_t ys, const int MT, const int NO) {
    __m256 halves[2][3][GROUP];
    for (int half = 0; half < 2; half++) {
        __m256 acc[3][GROUP];
#pragma GCC unroll 3
        for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
            for (int o = 0; o < NO; o++) acc[m][o] = _mm256_setzero_ps();
        for (int64_t k = 8 * half; k < in; k += LANES) {
            __m256 wv[GROUP];
#pragma GCC unroll 4
            for (int o = 0; o < NO; o++) wv[o] = _mm256_load_ps(w + o * in + k);
#pragma GCC unroll 3
            for (int m = 0; m < MT; m++) {
                const __m256 xv = _mm256_loadu_ps(x + m * xs + k);
#pragma GCC unroll 4
                for (int o = 0; o < NO; o++) acc[m][o] = _mm256_fmadd_ps(wv[o], xv, acc[m][o]);
            }
        }
#pragma GCC unroll 3
        for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
            for (int o = 0; o < NO; o++) halves[half][m][o] = acc[m][o];
    }
#pragma GCC unroll 3
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int o = 0; o < NO; o++) sums[m * ys + o] = sum_lanes_256(halves[0][m][o], halves[1][m][o]);
}

/* AVX-512: a lane set is one register; MT rows by NO outputs, at most 6 x 4 (24 accumulators,
 * 4 weight registers, 1 input). */
static inline __attribute__((always_inline)) QL_AVX512 void tile_avx512(const float *x, int64_t xs, const float *w,
                                                                         int64_t in, float *sums, int64_t ys, const int MT,
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
        for (int o = 0; o < NO; o++) sums[m * ys + o] = sum_lanes_512(acc[m][o]);
}

/* A group's GROUP expanded rows for `rows` rows, tiles of constant size (at most 6 rows a
 * tile, as even as they go). */
static QL_AVX512 void group_avx512(const float *x, int64_t xs, int64_t rows, const float *w, int64_t in, float *sums,
                                   int64_t ys) {
    const int64_t tiles = (rows + 5) / 6;
    for (int64_t i = 0, t = 0; i < tiles; i++) {
        const int64_t mt = (rows - t) / (tiles - i);
        float *into = sums + t * ys;
        switch (mt) {
        case 1: tile_avx512(x + t * xs, xs, w, in, into, ys, 1, GROUP); break;
        case 2: tile_avx512(x + t * xs, xs, w, in, into, ys, 2, GROUP); break;
        case 3: tile_avx512(x + t * xs, xs, w, in, into, ys, 3, GROUP); break;
        case 4: tile_avx512(x + t * xs, xs, w, in, into, ys, 4, GROUP); break;
        case 5: tile_avx512(x + t * xs, xs, w, in, into, ys, 5, GROUP); break;
        default: tile_avx512(x + t * xs, xs, w, in, into, ys, 6, GROUP); break;
        }
        t += mt;
    }
}

/* The same with AVX2: tiles of at most 3 rows by the group's 4 outputs. */
static QL_AVX2 void group_avx2(const float *x, int64_t xs, int64_t rows, const float *w, int64_t in, float *sums,
                               int64_t ys) {
    const int64_t tiles = (rows + 2) / 3;
    for (int64_t i = 0, t = 0; i < tiles; i++) {
        const int64_t mt = (rows - t) / (tiles - i);
        float *into = sums + t * ys;
        switch (mt) {
        case 1: tile_avx2(x + t * xs, xs, w, in, into, ys, 1, GROUP); break;
        case 2: tile_avx2(x + t * xs, xs, w, in, into, ys, 2, GROUP); break;
        default: tile_avx2(x + t * xs, xs, w, in, into, ys, 3, GROUP); break;
        }
        t += mt;
    }
}
#endif

static void group_portable(const float *x, int64_t xs, int64_t rows, const float *w, int64_t in, float *sums, int64_t ys) {
    for (int64_t t = 0; t < rows; t++) tile_portable(x + t * xs, xs, w, in, sums + t * ys, ys, 1, GROUP);
}

int quantized_linear(const QuantizedLinear *l, int threads, int isa) {
    int64_t block_size, type_size;
    if (quantized_block_shape(l->type, &block_size, &type_size)) return -1;
    const int64_t blocks = l->in / block_size, row_bytes = blocks * type_size;
    const int64_t groups = (l->out + GROUP - 1) / GROUP, y_stride = l->y_stride ? l->y_stride : l->out;
    const int vector = quantized_vector_isa(isa);
    /* Few rows skip the buffer: quantized_direct.c multiplies each whole group straight from its
     * blocks, to the same bits. */
    const int direct = l->tokens >= 1 && l->tokens <= quantized_direct_rows(vector, l->type);
    /* One thread below about 64k multiply-adds: a thread team costs more than it saves. */
    const int team = l->tokens * l->in * l->out < 65536 ? 1 : threads;
    int failed = 0;
#pragma omp parallel num_threads(team) reduction(| : failed)
    {
        const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t first = groups * i / n, last = groups * (i + 1) / n;
        /* The group's expanded rows (64-byte aligned: the vector loops load them aligned) and the
         * sums of every (row, output) of the group; the direct path needs them only for a last,
         * partial group. */
        const int buffered = !direct || (l->out % GROUP && last == groups);
        float *w = buffered ? aligned_alloc(64, sizeof(float) * (size_t)(GROUP * l->in)) : NULL;
        float *sums = buffered ? malloc(sizeof(float) * (size_t)(l->tokens * GROUP)) : NULL;
        if (buffered && (!w || !sums)) {
            failed = 1;
        } else {
            /* The direct path fetches the group four ahead as it goes; a thread's first four are
             * asked for here, before the first is needed (a one-row round's 120 calls each began
             * on a miss). */
            if (direct)
                for (int64_t at = first * GROUP * row_bytes; at < (last < first + 4 ? last : first + 4) * GROUP * row_bytes; at += 64)
                    __builtin_prefetch(l->blocks + at);
            for (int64_t g = first; g < last; g++) {
                const int64_t o0 = g * GROUP, count = l->out - o0 < GROUP ? l->out - o0 : GROUP;
                if (direct && count == GROUP) {
                    quantized_group_direct(vector, l->type, l->blocks + o0 * row_bytes, row_bytes, blocks, l->x, l->x_stride, l->tokens,
                                           l->y + o0, y_stride);
                    continue;
                }
                for (int64_t o = 0; o < count; o++)
                    expand_quantized_row(vector, l->type, l->blocks + (o0 + o) * row_bytes, blocks, w + o * l->in);
                memset(w + count * l->in, 0, sizeof(float) * (size_t)((GROUP - count) * l->in));
                /* The next group's blocks are fetched while this group's rows multiply: at 8-32 rows
                 * the product is long enough to hide the memory's latency. */
                if (l->tokens > 1 && g + 1 < last)
                    for (int64_t at = 0; at < GROUP * row_bytes; at += 64)
                        __builtin_prefetch(l->blocks + (o0 + GROUP) * row_bytes + at);
                /* A whole group's sums go straight into y; the last, partial group's through `sums`. */
                float *into = count == GROUP ? l->y + o0 : sums;
                const int64_t ys = count == GROUP ? y_stride : GROUP;
#if defined(__x86_64__) && defined(__GNUC__)
                if (vector == ISA_AVX512)
                    group_avx512(l->x, l->x_stride, l->tokens, w, l->in, into, ys);
                else if (vector == ISA_AVX2)
                    group_avx2(l->x, l->x_stride, l->tokens, w, l->in, into, ys);
                else
#endif
                    group_portable(l->x, l->x_stride, l->tokens, w, l->in, into, ys);
                if (count < GROUP)
                    for (int64_t t = 0; t < l->tokens; t++) memcpy(l->y + t * y_stride + o0, sums + t * GROUP, sizeof(float) * (size_t)count);
            }
        }
        free(w);
        free(sums);
    }
    return failed ? -2 : 0;
}
