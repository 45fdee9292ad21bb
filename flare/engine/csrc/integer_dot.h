/* Integer dot products of ggml weight blocks with 8-bit activation blocks (the shared interface of
 * integer_dot.c, for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights, and integer_kquants.c, for Q4_K, Q5_K
 * and Q6_K weights).
 *
 * An activation row is quantized once per layer input and read by every product of that input
 * (q/k/v, gate/up). Within a block the products are exact integer sums (vpdpbusd with AVX-512 VNNI
 * or AVX-VNNI, vpmaddubsw + vpmaddwd on AVX2, plain int32 arithmetic in the portable loop); the
 * float scales then combine the blocks' integer sums in one fixed order, the same at every level,
 * so every level gives the same bits and a row's result never depends on its batch-mates. */
#ifndef FLARE_INTEGER_DOT_H
#define FLARE_INTEGER_DOT_H

#include <stdint.h>

#include "kernels.h" /* the GGML_* type ids */

/* The widest integer instructions a kernel may use: the portable loop, AVX2, AVX-VNNI (256-bit
 * vpdpbusd, Alder Lake and Zen 5 on), AVX-512 VNNI (Ice Lake and Zen 4 on) or AMX (AVX-512 VNNI
 * plus the tile instructions' tdpbsud, Sapphire Rapids on: the K products' wide tiles from 16
 * activation rows, the 32-value types' products from 32 (Q8_0 48), everything else AVX-512 VNNI's).
 * The kernel takes the widest of `isa` and what this CPU and its OS grant. */
enum { IDOT_PORTABLE = 0, IDOT_AVX2 = 1, IDOT_AVX_VNNI = 2, IDOT_AVX512_VNNI = 3, IDOT_AMX = 4 };

/* The tile kernels (integer_kquant_tiles.c, integer_linear_amx.c) are compiled where the compiler
 * has AMX's intrinsics (GCC 11 and clang 12 on) and Linux can grant the tile data. */
#if defined(__x86_64__) && defined(__linux__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define IDOT_AMX_TILES 1
#endif

/* A tile configuration (palette 1) as ldtilecfg reads it: 64 bytes. A kernel's configuration is a
 * static object: ldtilecfg's intrinsic names only the first 8 bytes of its operand, so one built on
 * the stack could lose the stores of the rest. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} IdotTileConfig;

/* The IDOT_* level the integer kernels run at: the widest of `isa` and what this CPU has. */
int integer_dot_isa(int isa);

/* What this CPU and its OS grant, as IDOT_GRANTS_* bits, and the level `isa` falls back to under
 * `granted` (integer_dot_isa is integer_dot_level(isa, integer_dot_grants())): apart, so that a
 * test can stand in for a CPU whose OS refuses an extension it advertises. */
enum { IDOT_GRANTS_AVX2 = 1, IDOT_GRANTS_AVX_VNNI = 2, IDOT_GRANTS_AVX512_VNNI = 4, IDOT_GRANTS_AMX = 8 };
int integer_dot_grants(void);
int integer_dot_level(int isa, int granted);

/* AMX's grant (IDOT_GRANTS_AMX's), asked once per process: the CPU advertises amx-tile and
 * amx-int8, Linux lets this process use the tile data (arch_prctl(ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA); without it the first tile instruction raises SIGILL), and a forked child that
 * runs tile instructions exits cleanly (a hypervisor that hides the state still faults there, and
 * only the child dies). The permission is the process's and its threads' (and a forked child's), so
 * it is asked for in the process that multiplies, before its first tile instruction. */
int integer_dot_amx_granted(void);
/* The trial child alone: 1 when it ran tile instructions and exited 0. `fault` 1 makes the child
 * execute an undefined instruction first (the tests' stand-in for a refusing OS): it dies of
 * SIGILL and this returns 0, the caller unharmed. */
int integer_dot_amx_trial(int fault);

/* 256 activations of a K-quant product: d * qs[i] stands for x[i]; bsums[j] is the sum of
 * qs[16 j .. 16 j + 15] (the weights' mins multiply these). */
typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16];
} Q8KBlock;

/* x [n] (n a multiple of 256) as n / 256 Q8KBlocks: d = max |x| / 127, qs = round-to-nearest-even
 * of x / d. The same bits at every level. */
void quantize_row_q8k(const float *x, int64_t n, Q8KBlock *out);
/* quantize_row_q8k at the level integer_dot_isa(isa) (the tests force each; the bits are the same). */
void quantize_row_q8k_isa(int isa, const float *x, int64_t n, Q8KBlock *out);

/* out[r * out_stride] = the dot product of weight row `w` (`blocks` blocks of a K `type`, ggml's
 * type id) with activation row r (rows `x_stride` blocks apart), for r < rows (1 .. 4): the weight
 * block is unpacked once and multiplied by every row. Level `vector` from integer_dot_isa. */
void kquant_dot_rows(int vector, int type, const uint8_t *w, int64_t blocks, const Q8KBlock *x, int64_t x_stride, int rows,
                     float *out, int64_t out_stride);

/* The wide tiles (integer_kquant_tiles.c): 16 outputs at once, w[k] output k's weight row (a last,
 * partial tile repeats a row in the lanes it does not store). acc[16 r + k] = the dot product of
 * w[k] with activation row r (rows `x_stride` blocks apart), for r < rows, the same bits as
 * kquant_dot_rows. `ahead`: 16 rows of weight bytes to prefetch meanwhile (the next tile's), or NULL.
 * `packed` and `pairs`: the rows' quants and sub-block sums as kquant_pack_rows lays them out, which
 * AMX reads (NULL: no AMX; not NULL only in a thread between kquant_amx_begin and kquant_amx_end).
 * 1 when level `vector` has these tiles (AMX from KQ_AMX_FROM rows; AVX-512 VNNI; AVX-VNNI and AVX2
 * as two vectors of 8), else 0 (the portable level) and nothing written. */
enum { KQ_TILE_OUTPUTS = 16 };
int kquant_dot_tile16(int vector, int type, const uint8_t *const w[KQ_TILE_OUTPUTS], int64_t blocks, const Q8KBlock *x, int64_t x_stride,
                      int rows, const uint8_t *ahead, const int8_t *packed, const uint32_t *pairs, float *acc);

/* Rows in a tile call from which AMX multiplies (at least 16, a tile's rows). */
#ifndef KQ_AMX_FROM
#define KQ_AMX_FROM 16
#endif

/* out[(i rows + r) 256 + l] = quant l of row r's super-block i (x[r x_stride + i].qs[l]), r < rows,
 * i < blocks: a super-block's rows contiguous and 64-byte aligned (out aligned), the AMX tiles' A
 * operand. Q8KBlocks are 292 bytes, so in place every 64 quants of a row would straddle two lines.
 * pairs[4 (i rows + r) + m] = the sums of the row's 32-quant sub-blocks 2 m and 2 m + 1 as two int16
 * (low, high), what Q4_K's and Q5_K's mins multiply: formed once a call, not once per 16 outputs. */
void kquant_pack_rows(const Q8KBlock *x, int64_t x_stride, int rows, int64_t blocks, int8_t *out, uint32_t *pairs);

/* The AMX tiles' configuration, loaded by each thread (a thread's tile state is its own) before its
 * tile calls and released after: ldtilecfg costs about what a call's tile products do. Only at a
 * granted IDOT_AMX level (elsewhere they do nothing). */
void kquant_amx_begin(void);
void kquant_amx_end(void);

/* 32 activations of a 32-value block product: d * qs[i] stands for x[i] (d = max |x| / 127, qs
 * round-to-nearest-even of x / d, in -127 .. 127); sum = sum of qs and s = d * sum, what a weight
 * block's offset (Q4_0's 8, Q5_0's 16) and min (Q4_1, Q5_1) multiply. 48 bytes, qs 16-aligned. */
typedef struct {
    float d, s;
    int32_t sum, unused;
    int8_t qs[32];
} Q8Block;

/* x [n] (n a multiple of 32) as halves * n / 32 Q8Blocks at level integer_dot_isa(isa), the same
 * bits at every level. halves 1: one block per 32 values. halves 2: two per 32 values, block 2 i
 * quantizing x and 2 i + 1 its residual x - d q (the two 8-bit halves of a ~15-bit value),
 * block 2 i's s then the sum of both blocks' s. */
void quantize_row_q8(int isa, const float *x, int64_t n, int halves, Q8Block *out);

/* The ggml types integer_linear multiplies (the 32-value ones: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): 1, else
 * 0. Inline, so that a kernel specialized on a constant type folds it. */
static inline int integer_linear_type(int type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q8_0;
}

/* The bytes of a block of one of those types. */
static inline int64_t integer_block_bytes(int type) {
    return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : type == GGML_Q5_1 ? 24 : 34;
}

/* y[t, o] = sum over the blocks i of row o, in increasing i, of
 *     for each half h:  acc = fmaf((float)isum_ih, dw_i * dx_ih, acc)
 *     then, for Q4_1 and Q5_1:  acc = fmaf(mw_i, sx_i0, acc)
 * from acc = 0, isum_ih the exact integer dot product of the weight block's integers (q - 8 for
 * Q4_0, q - 16 for Q5_0, q for the others) with half h of activation block i of row t, dw_i and
 * mw_i the block's float16 scale and min, dx_ih and sx_i0 the activation blocks' d and s. */
typedef struct {
    const Q8Block *x;          /* [tokens, halves * in / 32] blocks, rows `x_stride` blocks apart */
    int halves;                /* 1 or 2 activation blocks per 32 inputs (quantize_row_q8) */
    int64_t x_stride;
    const uint8_t *blocks;     /* [out, in / 32 * type_size] bytes, rows contiguous */
    int type;                  /* a GGML_* type id integer_linear_type takes */
    float *y;                  /* [tokens, out], rows `y_stride` floats apart (0: out, contiguous) */
    int64_t tokens, in, out, y_stride;
} IntegerLinear;

/* 0; -1 for a type integer_linear_type refuses, -2 when scratch memory could not be allocated. At
 * level integer_dot_isa(isa). */
int integer_linear(const IntegerLinear *l, int threads, int isa);

#ifdef IDOT_AMX_TILES
/* integer_linear at AMX (integer_linear_amx.c), the same bits: 0, or -2 when memory could not be
 * allocated. Only where AMX is granted, for calls of many activation rows (integer_linear.c says
 * how many). */
int integer_linear_amx(const IntegerLinear *l, int threads);
#endif

/* x [n] (n a multiple of 256) as halves * n / 256 Q8KBlocks at level integer_dot_isa(isa): halves 1,
 * quantize_row_q8k; halves 2, those n / 256 blocks followed by n / 256 more of the residual
 * x - d qs (the two 8-bit halves of a ~15-bit value; the residual in plain float32 operations, so the
 * same bits at every level). */
void quantize_row_q8k_halves(int isa, const float *x, int64_t n, int halves, Q8KBlock *out);

/* y [tokens, out] (rows y_stride apart) = x's rows (quantize_row_q8k_halves of each: halves * in / 256
 * blocks, rows contiguous) times a K weight of `type` [out, in]: kquant_dot_rows for each output,
 * 4 Q8K rows at a time; with halves 2 a row's two products added, y = y_x + y_residual. */
void integer_kquant_linear(int type, int halves, const uint8_t *blocks, const Q8KBlock *x, float *y, int64_t tokens, int64_t in,
                           int64_t out, int64_t y_stride, int threads, int isa);

#endif
