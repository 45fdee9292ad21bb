/* A linear layer with float16 weights and float32 activations, accumulated in float32:
 *
 *   y[t, o] = sum_k x[t, k] W[o, k]
 *
 * A decode round of a few rows is bound by reading the weights, and float16's bytes are half of
 * float32's. This kernel reads them at about the memory's speed for one row, and spares the
 * copy, allocation and dispatch that fbgemm's float16 GEMM pays around each product
 * (docs/kernels.md, "Engine: the float16 kernel").
 *
 * Layout: the weights are packed once (`native.pack_float16`) into blocks of BLOCK = 16 output
 * channels, block b holding W[16 b + j, k] at packed[(b * in + k) * 16 + j]: for every input k
 * the block's 16 weights are one 32-byte line. The product broadcasts x[t, k] and multiplies it
 * into the widened line (vcvtph2ps, exact), so each output is a sum over k in order whatever the
 * number of rows and however they are tiled: a row's result does not depend on its batch-mates.
 * Outputs past `out` in the last block are zero weights, computed and not stored.
 *
 * Registers: a tile of MT rows by NV vectors of 8 outputs keeps MT * NV accumulators, NV
 * widened weight vectors and one broadcast: at most 15 of the 16 ymm registers.
 *
 * Where AVX-512 may be used (`isa`, kernels.h) a block is one 16-wide vector and 32 registers
 * hold tiles of up to 8 rows: the same multiply-adds in the same order (the same bits), half the
 * instructions. A decode round of one row reads the weights at the memory's speed either way;
 * rows past the first cost about half as much.
 */
#include <math.h>
#include <omp.h>

#include "kernels.h"

/* BLOCK output channels per block; PREFETCH: how many inputs ahead a block's line is prefetched
 * (a layer's weights are read once a round, from memory, and the hardware prefetcher alone
 * starts too late). */
enum { BLOCK = 16, PREFETCH = 32 };

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define F16_TARGET __attribute__((target("avx2,fma,f16c")))

/* One tile: rows x[0 .. MT) (row stride xs) through NV vectors of weights starting at block
 * `w` (NV / 2 blocks of `in` lines), stored into the first `valid` outputs of y's rows (`ys`
 * floats apart). Always inlined with constant MT and NV, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) F16_TARGET void tile(const float *x, int64_t xs, const uint16_t *w,
                                                                   int64_t in, float *y, int64_t ys,
                                                                   int64_t valid, const int MT, const int NV) {
    __m256 acc[6][8];
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) acc[m][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in; k++) {
        __m256 wv[8];
#pragma GCC unroll 8
        for (int v = 0; v < NV; v += 2) _mm_prefetch((const char *)(w + ((v / 2) * in + k + PREFETCH) * BLOCK), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            wv[v] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + ((v / 2) * in + k) * BLOCK + (v % 2) * 8)));
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) {
            const __m256 a = _mm256_broadcast_ss(x + m * xs + k);
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) acc[m][v] = _mm256_fmadd_ps(a, wv[v], acc[m][v]);
        }
    }
    /* The accumulators leave their registers once, after the loop (a store inside it, which
     * GCC makes of an array it cannot prove is registers only, doubled the time at 32 rows). */
    float lanes[6][64];
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) _mm256_storeu_ps(lanes[m] + 8 * v, acc[m][v]);
    for (int m = 0; m < MT; m++) {
        memcpy(y + m * ys, lanes[m], sizeof(float) * (size_t)valid);
    }
}

/* A tile of `rows` (1 to 6) rows through one block (two vectors): the tile sizes as constants. */
static inline __attribute__((always_inline)) F16_TARGET void block_rows(const float *x, int64_t xs, int64_t rows,
                                                                         const uint16_t *w, int64_t in, float *y,
                                                                         int64_t ys, int64_t valid) {
    switch (rows) {
    case 1: tile(x, xs, w, in, y, ys, valid, 1, 2); break;
    case 2: tile(x, xs, w, in, y, ys, valid, 2, 2); break;
    case 3: tile(x, xs, w, in, y, ys, valid, 3, 2); break;
    case 4: tile(x, xs, w, in, y, ys, valid, 4, 2); break;
    case 5: tile(x, xs, w, in, y, ys, valid, 5, 2); break;
    default: tile(x, xs, w, in, y, ys, valid, 6, 2); break;
    }
}

/* Blocks [first, last) for every row. A tile wants 8 or more accumulators, or it waits on the
 * multiply-add latency (4 cycles, 2 issued a cycle): one row takes up to 4 blocks at a time, two
 * or three rows 2 blocks; more rows are cut into the fewest tiles of at most 6 rows, as even as
 * they go (8 rows as 4 + 4, not 6 + 2), each through a pair of blocks one
 * block at a time, so the pair's weights are read from memory once and then from cache. */
static F16_TARGET void blocks_avx2(const float *x, int64_t xs, int64_t tokens, const uint16_t *packed, int64_t in,
                                   int64_t out, float *y, int64_t ys, int64_t first, int64_t last) {
    const int64_t per_chunk = tokens == 1 ? 4 : 2;
    const int64_t tiles = (tokens + 5) / 6;
    for (int64_t b = first; b < last; b += per_chunk) {
        const int64_t n = b + per_chunk <= last ? per_chunk : last - b;
        const uint16_t *w = packed + b * in * BLOCK;
        float *yb = y + b * BLOCK;
        const int64_t valid = out - b * BLOCK < n * BLOCK ? out - b * BLOCK : n * BLOCK;
        if (tokens == 1) {
            switch (n) {
            case 4: tile(x, xs, w, in, yb, ys, valid, 1, 8); break;
            case 3: tile(x, xs, w, in, yb, ys, valid, 1, 6); break;
            case 2: tile(x, xs, w, in, yb, ys, valid, 1, 4); break;
            default: tile(x, xs, w, in, yb, ys, valid, 1, 2); break;
            }
            continue;
        }
        if (tokens <= 3 && n == 2) {
            if (tokens == 2)
                tile(x, xs, w, in, yb, ys, valid, 2, 4);
            else
                tile(x, xs, w, in, yb, ys, valid, 3, 4);
            continue;
        }
        for (int64_t i = 0, t = 0; i < tiles; i++) {
            const int64_t rows = (tokens - t) / (tiles - i);
            for (int64_t j = 0; j < n; j++)
                block_rows(x + t * xs, xs, rows, w + j * in * BLOCK, in, yb + t * ys + j * BLOCK, ys,
                           valid - j * BLOCK < BLOCK ? valid - j * BLOCK : BLOCK);
            t += rows;
        }
    }
}

/* AVX-512: the same sums with 16 outputs a vector, so a block is one zmm register and twice the
 * multiply-adds issue a cycle. 32 registers hold a tile of MT rows by NB blocks: MT * NB
 * accumulators, NB widened weight vectors and one broadcast; up to 9 rows (by 3 blocks) a tile,
 * so that a round of 8 decode rows and a draft is one pass over each weight, not two. */
#define F16_512_TARGET __attribute__((target("avx512f,fma,f16c")))

static inline __attribute__((always_inline)) F16_512_TARGET void tile512(const float *x, int64_t xs, const uint16_t *w,
                                                                         int64_t in, float *y, int64_t ys, int64_t valid,
                                                                         const int MT, const int NB) {
    __m512 acc[9][8];
#pragma GCC unroll 9
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 8
        for (int b = 0; b < NB; b++) acc[m][b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in; k++) {
        __m512 wv[8];
#pragma GCC unroll 8
        for (int b = 0; b < NB; b++) _mm_prefetch((const char *)(w + (b * in + k + PREFETCH) * BLOCK), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int b = 0; b < NB; b++) wv[b] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + (b * in + k) * BLOCK)));
#pragma GCC unroll 9
        for (int m = 0; m < MT; m++) {
            const __m512 a = _mm512_set1_ps(x[m * xs + k]);
#pragma GCC unroll 8
            for (int b = 0; b < NB; b++) acc[m][b] = _mm512_fmadd_ps(a, wv[b], acc[m][b]);
        }
    }
    float lanes[9][8 * BLOCK];
#pragma GCC unroll 9
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 8
        for (int b = 0; b < NB; b++) _mm512_storeu_ps(lanes[m] + BLOCK * b, acc[m][b]);
    for (int m = 0; m < MT; m++) memcpy(y + m * ys, lanes[m], sizeof(float) * (size_t)valid);
}

/* Blocks per tile for a tile of 1 to 9 rows: the most that fit the registers (see above). */
enum { MAX_TILE_ROWS = 9 };
static const int BLOCKS_FOR_ROWS[MAX_TILE_ROWS + 1] = {0, 8, 8, 7, 6, 5, 4, 3, 3, 3};

#define TILE512_ROWS(MT)                                                                          \
    switch (nb) {                                                                                 \
    case 8: tile512(x, xs, w, in, y, ys, valid, MT, 8); break;                                    \
    case 7: tile512(x, xs, w, in, y, ys, valid, MT, 7); break;                                    \
    case 6: tile512(x, xs, w, in, y, ys, valid, MT, 6); break;                                    \
    case 5: tile512(x, xs, w, in, y, ys, valid, MT, 5); break;                                    \
    case 4: tile512(x, xs, w, in, y, ys, valid, MT, 4); break;                                    \
    case 3: tile512(x, xs, w, in, y, ys, valid, MT, 3); break;                                    \
    case 2: tile512(x, xs, w, in, y, ys, valid, MT, 2); break;                                    \
    default: tile512(x, xs, w, in, y, ys, valid, MT, 1); break;                                   \
    }

/* `rows` (1 to 9) rows through `blocks` blocks (the first `outputs` outputs stored), in tiles of
 * at most BLOCKS_FOR_ROWS[rows] blocks, the tile sizes as constants. */
static F16_512_TARGET void tile512_any(const float *x, int64_t xs, int64_t rows, const uint16_t *weights, int64_t in,
                                       float *out, int64_t ys, int64_t outputs, int64_t blocks) {
    const int64_t most = BLOCKS_FOR_ROWS[rows < MAX_TILE_ROWS ? rows : MAX_TILE_ROWS];
    for (int64_t j = 0; j < blocks; j += most) {
        const int64_t nb = blocks - j < most ? blocks - j : most;
        const uint16_t *w = weights + j * in * BLOCK;
        float *y = out + j * BLOCK;
        const int64_t valid = outputs - j * BLOCK < nb * BLOCK ? outputs - j * BLOCK : nb * BLOCK;
        switch (rows) {
        case 1: TILE512_ROWS(1) break;
        case 2: TILE512_ROWS(2) break;
        case 3: TILE512_ROWS(3) break;
        case 4: TILE512_ROWS(4) break;
        case 5: TILE512_ROWS(5) break;
        case 6: TILE512_ROWS(6) break;
        case 7: TILE512_ROWS(7) break;
        case 8: TILE512_ROWS(8) break;
        default: TILE512_ROWS(9) break;
        }
    }
}

/* Blocks [first, last) for every row: the rows cut into the fewest tiles of at most 9, as even
 * as they go, each through the same chunk of blocks, so the chunk's weights are read from memory
 * once and then from cache. */
static F16_512_TARGET void blocks_avx512(const float *x, int64_t xs, int64_t tokens, const uint16_t *packed, int64_t in,
                                         int64_t out, float *y, int64_t ys, int64_t first, int64_t last) {
    const int64_t tiles = (tokens + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;
    const int64_t widest = (tokens + tiles - 1) / tiles;
    const int64_t per_chunk = BLOCKS_FOR_ROWS[widest];
    for (int64_t b = first; b < last; b += per_chunk) {
        const int64_t n = b + per_chunk <= last ? per_chunk : last - b;
        const uint16_t *w = packed + b * in * BLOCK;
        const int64_t valid = out - b * BLOCK < n * BLOCK ? out - b * BLOCK : n * BLOCK;
        for (int64_t i = 0, t = 0; i < tiles; i++) {
            const int64_t rows = (tokens - t) / (tiles - i);
            tile512_any(x + t * xs, xs, rows, w, in, y + t * ys + b * BLOCK, ys, valid, n);
            t += rows;
        }
    }
}
#endif

/* The same sums, in the same order, for CPUs without AVX2, FMA and F16C (where the engine
 * does not choose float16 weights unless asked: precision.py). */
static void blocks_generic(const float *x, int64_t xs, int64_t tokens, const uint16_t *packed, int64_t in, int64_t out,
                           float *y, int64_t ys, int64_t first, int64_t last) {
    for (int64_t b = first; b < last; b++) {
        const uint16_t *w = packed + b * in * BLOCK;
        for (int64_t t = 0; t < tokens; t++) {
            float acc[BLOCK] = {0};
            for (int64_t k = 0; k < in; k++) {
                const float a = x[t * xs + k];
                for (int j = 0; j < BLOCK; j++) acc[j] = fmaf(a, float_from_half(w[k * BLOCK + j]), acc[j]);
            }
            for (int j = 0; j < BLOCK && b * BLOCK + j < out; j++) y[t * ys + b * BLOCK + j] = acc[j];
        }
    }
}

void float16_linear(const Float16Linear *l, int threads, int isa) {
    const int64_t blocks = (l->out + BLOCK - 1) / BLOCK, ys = l->y_stride ? l->y_stride : l->out;
    int vector = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa >= ISA_AVX2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        vector = isa >= ISA_AVX512 && __builtin_cpu_supports("avx512f") ? ISA_AVX512 : ISA_AVX2;
#else
    (void)isa;
#endif
    /* One thread below about 64k multiply-adds: a thread team costs more than it saves. */
    const int team = l->tokens * l->in * l->out < 65536 ? 1 : threads;
#pragma omp parallel num_threads(team)
    {
        /* Each thread a contiguous range of blocks, split as evenly as blocks allow. */
        const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t first = blocks * i / n, last = blocks * (i + 1) / n;
#if defined(__x86_64__) && defined(__GNUC__)
        if (vector == ISA_AVX512)
            blocks_avx512(l->x, l->x_stride, l->tokens, l->packed, l->in, l->out, l->y, ys, first, last);
        else if (vector == ISA_AVX2)
            blocks_avx2(l->x, l->x_stride, l->tokens, l->packed, l->in, l->out, l->y, ys, first, last);
        else
#endif
            blocks_generic(l->x, l->x_stride, l->tokens, l->packed, l->in, l->out, l->y, ys, first, last);
    }
}
