/* integer_linear.c's products (the 32-value block types Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 by 8-bit
 * activation blocks) formed by AMX tile products, for calls of many activation rows: prefill,
 * wide verification rounds, many streams.
 *
 * The arithmetic is integer_dot.h's, so the bits are every other level's: for each (row, output)
 * and block i, in increasing i, acc = fma((float)isum_ih, dw_i dx_ih, acc) for each half h, then
 * acc = fma(mw_i, sx_i0, acc) for Q4_1 and Q5_1. Only the integers isum_ih come from the tile
 * unit: tdpbsud sums A's signed bytes times B's unsigned ones exactly in int32, as vpdpbusd does
 * (and as there, the offset types' integers are unsigned in B and the offset comes off afterwards:
 * isum = sum q_u a - offset sum a, offset 8 for Q4_0, 16 for Q5_0, 128 for Q8_0's bytes + 128).
 *
 * A tile product sums over up to 64 bytes, but each 32-value block has its own float16 scale, so
 * a product here is one block deep (K = 32): the A tile is 16 activation rows of a block's 32
 * quants (a row is a token's half: row H t + h, so with int8x2 a tile holds 8 tokens), the B tile
 * is 8 rows of 64 bytes, row j holding quants 4 j .. 4 j + 3 of each of 16 outputs (the layout
 * integer_linear.c's wide tiles build by transposing), and C is 16 rows x 16 outputs
 * of int32. Each C row then takes the float steps above, one vector of 16 outputs at a time, into
 * accumulators held in registers across the blocks.
 *
 * Schedule: the activation rows are packed once a call into tiles (16 rows x 32 bytes a block,
 * zero rows past the last); chunks of CHUNK_TILES row tiles go outermost, and in a chunk each
 * thread takes a contiguous range of 16-output groups, builds a group's B operands for every block
 * once (B_BYTES a block, in L1 / L2), and runs each row tile of the chunk over them. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "integer_dot.h"

#ifdef IDOT_AMX_TILES
#include <immintrin.h>
#include <omp.h>

/* Row tiles in a chunk: 8 tiles of 16 rows of 2048 quants are 256 KB, kept in L2 while every
 * output group passes over them. */
enum { TILE_ROWS = 16, CHUNK_TILES = 8, B_BYTES = 8 * 64, A_BYTES = TILE_ROWS * 32 };

#define IA_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define IA_INLINE static inline __attribute__((always_inline)) IA_AMX

/* Tiles 0 and 1: C (16 rows of 16 int32); 2 and 3: A (16 rows of 32 bytes); 4 and 5: B (8 rows of
 * 64 bytes). Consecutive blocks alternate between the pairs: a tile is not renamed, so a load into
 * it would wait for the product that reads it. */
static const IdotTileConfig tile_config = {
    .palette = 1,
    .colsb = {64, 64, 32, 32, 64, 64},
    .rows = {16, 16, 16, 16, 8, 8},
};

/* Block `at` (a byte offset along the rows) of a group's 16 weight rows, row o at base + rows[o],
 * as the B operand into b (row j: each output's integers 4 j .. 4 j + 3, unsigned), its 16 scales
 * and mins into dw and mw. Gathered a dword of each row at a time: the 4-bit types' dword j of
 * quants holds integers 4 j .. 4 j + 3 in its low nibbles and 16 + 4 j .. in its high ones (a Q5
 * type's fifth bits, bits 4 j .. 4 j + 3 of qh, spread to one a byte by a multiply: bit k of
 * (qh >> 4 j) & 15 times 1 + 2^7 + 2^14 + 2^21 lands on bit 8 k and nothing else on bits 0, 8, 16,
 * 24); Q8_0's dword j is integers 4 j .. 4 j + 3, offset by 128. Gathers replace unpacking each
 * row and transposing eight at a time (integer_linear.c's unpack_8), which cost more than the
 * tile products saved (docs/benchmarks.md, "Integer activations"). */
IA_INLINE void b_operand(const int type, const uint8_t *base, __m512i rows, int64_t at, uint8_t *b, float *dw, float *mw) {
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
    const uint8_t *block = base + at;
    const __m512i head = _mm512_i32gather_epi32(rows, block, 1); /* d, and m where the type has one */
    _mm512_store_ps(dw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(head, _mm512_set1_epi32(0xffff)))));
    _mm512_store_ps(mw, has_min ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))) : _mm512_setzero_ps());
    if (type == GGML_Q8_0) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            _mm512_store_si512(b + 64 * j, _mm512_xor_si512(_mm512_i32gather_epi32(rows, block + 2 + 4 * j, 1), _mm512_set1_epi8((char)0x80)));
        return;
    }
    const uint8_t *qs = block + 2 + 2 * has_min + 4 * five;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512i qh = _mm512_setzero_si512();
    if (five) qh = _mm512_i32gather_epi32(rows, block + 2 + 2 * has_min, 1);
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512i q = _mm512_i32gather_epi32(rows, qs + 4 * j, 1);
        __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_and_si512(_mm512_srli_epi32(q, 4), low4);
        if (five) {
            const __m512i spread = _mm512_set1_epi32(1 + (1 << 7) + (1 << 14) + (1 << 21)), ones = _mm512_set1_epi32(0x01010101);
            const __m512i flo = _mm512_and_si512(_mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 4 * j), _mm512_set1_epi32(15)), spread), ones);
            const __m512i fhi = _mm512_and_si512(_mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(qh, 16 + 4 * j), _mm512_set1_epi32(15)), spread), ones);
            lo = _mm512_or_si512(lo, _mm512_slli_epi32(flo, 4));
            hi = _mm512_or_si512(hi, _mm512_slli_epi32(fhi, 4));
        }
        _mm512_store_si512(b + 64 * j, lo);
        _mm512_store_si512(b + 64 * (4 + j), hi);
    }
}

/* Block i's tile product into C tile i % 2 (its A and B in tiles 2 + i % 2 and 4 + i % 2): a tile is
 * not renamed, so a load into it would wait for the product that reads it. */
IA_INLINE void block_product(int64_t i, const int8_t *a, const uint8_t *bq) {
    if (i & 1) {
        _tile_loadd(3, a + A_BYTES * i, 32);
        _tile_loadd(5, bq + B_BYTES * i, 64);
        _tile_zero(1);
        _tile_dpbsud(1, 3, 5);
    } else {
        _tile_loadd(2, a + A_BYTES * i, 32);
        _tile_loadd(4, bq + B_BYTES * i, 64);
        _tile_zero(0);
        _tile_dpbsud(0, 2, 4);
    }
}

/* Block i's float steps for the tile's `tokens` tokens from its products `s` (C row H t + h). */
IA_INLINE void block_finish(const int type, const int H, int64_t i, const int32_t *s, const float *dws, const float *mws,
                            const Q8Block *x, int64_t xs, int tokens, __m512 acc[TILE_ROWS / H]) {
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
    const int offset = type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : type == GGML_Q8_0 ? 128 : 0;
    const __m512 dw = _mm512_load_ps(dws + 16 * i), mw = _mm512_load_ps(mws + 16 * i);
#pragma GCC unroll 16
    for (int t = 0; t < TILE_ROWS / H; t++) {
        if (t >= tokens) break;
        const Q8Block *x0 = x + t * xs + H * i;
#pragma GCC unroll 2
        for (int h = 0; h < H; h++) {
            __m512i isum = _mm512_load_si512(s + 16 * (H * t + h));
            if (offset) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset * x0[h].sum));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(x0[h].d)), acc[t]);
        }
        if (has_min) acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x0->s), acc[t]);
    }
}

/* One row tile (n of its 16 rows valid; rows H t + h) over a group's blocks: y rows t0 .. of the
 * 16 outputs (count of them stored). `a` the tile's packed quants, block i at a + A_BYTES i.
 * Pipelined: block i + 1's product is issued before block i's sums are stored, and block i - 1's
 * float steps read theirs after that (one block deep, the float steps reading right after the
 * store, measured the same). */
IA_INLINE void tile_rows(const int type, const int H, const uint8_t *bq, const float *dws, const float *mws, int64_t blocks,
                         const int8_t *a, const Q8Block *x, int64_t xs, int n, float *y, int64_t ys, int count) {
    const int tokens = (n + H - 1) / H;
    int32_t sums[2][TILE_ROWS * 16] __attribute__((aligned(64)));
    __m512 acc[TILE_ROWS / H];
#pragma GCC unroll 16
    for (int t = 0; t < TILE_ROWS / H; t++) acc[t] = _mm512_setzero_ps();
    block_product(0, a, bq);
    for (int64_t i = 0; i < blocks; i++) {
        if (i + 1 < blocks) block_product(i + 1, a, bq);
        if (i & 1) _tile_stored(1, sums[1], 64);
        else _tile_stored(0, sums[0], 64);
        if (i > 0) block_finish(type, H, i - 1, sums[(i - 1) & 1], dws, mws, x, xs, tokens, acc);
    }
    block_finish(type, H, blocks - 1, sums[(blocks - 1) & 1], dws, mws, x, xs, tokens, acc);
    for (int t = 0; t < tokens; t++) {
        if (count == 16) {
            _mm512_storeu_ps(y + t * ys, acc[t]);
        } else {
            float v[16];
            _mm512_storeu_ps(v, acc[t]);
            memcpy(y + t * ys, v, sizeof(float) * (size_t)count);
        }
    }
}

/* One group's B operands for every block (bq, dws, mws), then a chunk's row tiles over them (rows
 * rows of the packed `a`, tile k at a + k blocks A_BYTES). */
IA_INLINE void group_type(const int type, const int H, const uint8_t *base, __m512i rows16, int64_t blocks, uint8_t *bq, float *dws,
                          float *mws, const int8_t *a, const Q8Block *x, int64_t xs, int64_t rows, float *y, int64_t ys, int count) {
    const int64_t size = integer_block_bytes(type);
    for (int64_t i = 0; i < blocks; i++) b_operand(type, base, rows16, i * size, bq + B_BYTES * i, dws + 16 * i, mws + 16 * i);
    for (int64_t r = 0; r < rows; r += TILE_ROWS) {
        const int n = (int)(rows - r < TILE_ROWS ? rows - r : TILE_ROWS);
        tile_rows(type, H, bq, dws, mws, blocks, a + r / TILE_ROWS * blocks * A_BYTES, x + r / H * xs, xs, n, y + r / H * ys, ys, count);
    }
}

/* group_type with the type and the halves constants. */
static IA_AMX void group(int type, int H, const uint8_t *base, __m512i rows16, int64_t blocks, uint8_t *bq, float *dws, float *mws,
                         const int8_t *a, const Q8Block *x, int64_t xs, int64_t rows, float *y, int64_t ys, int count) {
#define AMX_CASES(HH)                                                                                                       \
    switch (type) {                                                                                                         \
    case GGML_Q4_0: group_type(GGML_Q4_0, HH, base, rows16, blocks, bq, dws, mws, a, x, xs, rows, y, ys, count); break;   \
    case GGML_Q4_1: group_type(GGML_Q4_1, HH, base, rows16, blocks, bq, dws, mws, a, x, xs, rows, y, ys, count); break;   \
    case GGML_Q5_0: group_type(GGML_Q5_0, HH, base, rows16, blocks, bq, dws, mws, a, x, xs, rows, y, ys, count); break;   \
    case GGML_Q5_1: group_type(GGML_Q5_1, HH, base, rows16, blocks, bq, dws, mws, a, x, xs, rows, y, ys, count); break;   \
    default: group_type(GGML_Q8_0, HH, base, rows16, blocks, bq, dws, mws, a, x, xs, rows, y, ys, count); break;          \
    }
    if (H == 2) {
        AMX_CASES(2)
    } else {
        AMX_CASES(1)
    }
#undef AMX_CASES
}

IA_AMX int integer_linear_amx(const IntegerLinear *l, int threads) {
    const int H = l->halves;
    const int64_t blocks = l->in / 32, row_bytes = blocks * integer_block_bytes(l->type);
    const int64_t rows = l->tokens * H, tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t groups = (l->out + 15) / 16, y_stride = l->y_stride ? l->y_stride : l->out;
    /* the packed A operands: tile k's block i at (k blocks + i) A_BYTES, row H t + h its 32 quants */
    int8_t *a = aligned_alloc(64, (size_t)(tiles * blocks * A_BYTES));
    if (!a) return -2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < tiles; k++)
        for (int64_t i = 0; i < blocks; i++) {
            int8_t *into = a + (k * blocks + i) * A_BYTES;
            for (int r = 0; r < TILE_ROWS; r++) {
                const int64_t row = k * TILE_ROWS + r;
                if (row < rows) memcpy(into + 32 * r, l->x[row / H * l->x_stride + H * i + row % H].qs, 32);
                else memset(into + 32 * r, 0, 32);
            }
        }
    /* each thread's B operands, scales and mins for a group's blocks: allocated before the team,
     * since every thread must meet each chunk's work-sharing loop */
    const int team = groups < threads ? (int)groups : threads;
    const int64_t per_thread = blocks * (B_BYTES + 2 * 16 * (int64_t)sizeof(float));
    uint8_t *scratch = aligned_alloc(64, (size_t)(team * per_thread));
    if (!scratch) {
        free(a);
        return -2;
    }
#pragma omp parallel num_threads(team)
    {
        uint8_t *bq = scratch + omp_get_thread_num() * per_thread;
        float *dws = (float *)(bq + blocks * B_BYTES), *mws = dws + 16 * blocks;
        _tile_loadconfig(&tile_config);
        for (int64_t k0 = 0; k0 < tiles; k0 += CHUNK_TILES) {
            const int64_t r0 = k0 * TILE_ROWS, chunk = rows - r0 < CHUNK_TILES * TILE_ROWS ? rows - r0 : CHUNK_TILES * TILE_ROWS;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t o0 = 16 * g;
                const int count = (int)(l->out - o0 < 16 ? l->out - o0 : 16);
                /* a last, partial group repeats its last row in the lanes it does not store */
                const __m512i rows16 = _mm512_mullo_epi32(_mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                                           _mm512_set1_epi32(count - 1)),
                                                          _mm512_set1_epi32((int)row_bytes));
                group(l->type, H, l->blocks + o0 * row_bytes, rows16, blocks, bq, dws, mws, a + k0 * blocks * A_BYTES,
                      l->x + r0 / H * l->x_stride, l->x_stride, chunk, l->y + r0 / H * y_stride + o0, y_stride, count);
            }
        }
        _tile_release();
    }
    free(scratch);
    free(a);
    return 0;
}
#endif
