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

/* The widest integer instructions a kernel may use: the portable loop, AVX2, AVX-VNNI (256-bit
 * vpdpbusd, Alder Lake and Zen 5 on) or AVX-512 VNNI (Ice Lake and Zen 4 on). The kernel takes the
 * widest of `isa` and what this CPU has. */
enum { IDOT_PORTABLE = 0, IDOT_AVX2 = 1, IDOT_AVX_VNNI = 2, IDOT_AVX512_VNNI = 3 };

/* The IDOT_* level the integer kernels run at: the widest of `isa` and what this CPU has. */
int integer_dot_isa(int isa);

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

#endif
