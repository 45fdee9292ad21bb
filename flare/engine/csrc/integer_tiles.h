/* The 256-bit tiles of integer_linear.c, included once per level under that level's
 * `#pragma GCC target`: IDOT_TILES names the function, IDOT_DOT(w, x) gives the 8 int32 lanes of
 * a block product (lane l: bytes 4 l .. 4 l + 3 of unsigned w times signed x, summed), and
 * IDOT_SIGNED_Q8 says whether Q8_0's signed weights go through vpsignb (AVX2's vpmaddubsw
 * saturates on 128 + 127 weights) or are offset by 128 like the 4-bit ones (vpdpbusd does not
 * saturate). IDOT_ACC(s, w, x) adds IDOT_DOT's lanes to s. IDOT_NARROW_ONLY: no wide tiles.
 * Every variant gives the same integer sums, so the same bits. */

#define IDOT_CAT2(a, b) a##b
#define IDOT_CAT(a, b) IDOT_CAT2(a, b)
#define IDOT_BODY IDOT_CAT(IDOT_TILES, _body)
#define IDOT_NARROW IDOT_CAT(IDOT_TILES, _narrow)
#define IDOT_WIDE IDOT_CAT(IDOT_TILES, _wide)
#define IDOT_WIDE_BODY IDOT_CAT(IDOT_TILES, _wide_body)

static inline __attribute__((always_inline)) void IDOT_BODY(const int type, const int H, const uint8_t *const w[GROUP],
                                                            int64_t blocks, const Q8Block *x, int64_t xs, int64_t tokens, float *y,
                                                            int64_t ys, int count) {
    const int64_t size = integer_block_bytes(type);
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
    const int offset = type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : type == GGML_Q8_0 && !IDOT_SIGNED_Q8 ? 128 : 0;
    for (int64_t t0 = 0; t0 < tokens; t0 += TILE) {
        const int64_t mt = tokens - t0 < TILE ? tokens - t0 : TILE;
        __m128 acc[TILE];
        for (int64_t m = 0; m < mt; m++) acc[m] = _mm_setzero_ps();
        for (int64_t i = 0; i < blocks; i++) {
            __m256i wv[GROUP];
            uint16_t dh[GROUP], mh[GROUP];
#pragma GCC unroll 4
            for (int o = 0; o < GROUP; o++) {
                const uint8_t *b = w[o] + i * size;
                __builtin_prefetch(b + PREFETCH_BYTES);
                dh[o] = half_bits(b);
                mh[o] = has_min ? half_bits(b + 2) : 0;
                wv[o] = unpack_256(type, b);
                if (type == GGML_Q8_0 && !IDOT_SIGNED_Q8) wv[o] = _mm256_xor_si256(wv[o], _mm256_set1_epi8((char)0x80));
            }
            const __m128 dw = _mm_cvtph_ps(_mm_setr_epi16((short)dh[0], (short)dh[1], (short)dh[2], (short)dh[3], 0, 0, 0, 0));
            const __m128 mw = _mm_cvtph_ps(_mm_setr_epi16((short)mh[0], (short)mh[1], (short)mh[2], (short)mh[3], 0, 0, 0, 0));
            for (int64_t m = 0; m < mt; m++) {
                const Q8Block *x0 = x + (t0 + m) * xs + H * i;
#pragma GCC unroll 2
                for (int h = 0; h < H; h++) {
                    const Q8Block *xb = x0 + h;
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)xb->qs);
                    __m256i lanes[GROUP];
#pragma GCC unroll 4
                    for (int o = 0; o < GROUP; o++) {
                        if (type == GGML_Q8_0 && IDOT_SIGNED_Q8)
                            lanes[o] = IDOT_DOT(_mm256_sign_epi8(wv[o], wv[o]), _mm256_sign_epi8(xv, wv[o]));
                        else
                            lanes[o] = IDOT_DOT(wv[o], xv);
                    }
                    __m128i sums = sum_4x8(lanes[0], lanes[1], lanes[2], lanes[3]);
                    if (offset) sums = _mm_sub_epi32(sums, _mm_set1_epi32(offset * xb->sum));
                    acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(dw, _mm_set1_ps(xb->d)), acc[m]);
                }
                if (has_min) acc[m] = _mm_fmadd_ps(mw, _mm_set1_ps(x0->s), acc[m]);
            }
        }
        store_group(acc, mt, y + t0 * ys, ys, count);
    }
}

static void IDOT_NARROW(int type, int halves, const uint8_t *const w[GROUP], int64_t blocks, const Q8Block *x, int64_t xs,
                  int64_t tokens, float *y, int64_t ys, int count) {
#define IDOT_CASES(H)                                                                                                  \
    switch (type) {                                                                                                    \
    case GGML_Q4_0: IDOT_BODY(GGML_Q4_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                          \
    case GGML_Q4_1: IDOT_BODY(GGML_Q4_1, H, w, blocks, x, xs, tokens, y, ys, count); break;                          \
    case GGML_Q5_0: IDOT_BODY(GGML_Q5_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                          \
    case GGML_Q5_1: IDOT_BODY(GGML_Q5_1, H, w, blocks, x, xs, tokens, y, ys, count); break;                          \
    default: IDOT_BODY(GGML_Q8_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                                 \
    }
    if (halves == 2) {
        IDOT_CASES(2)
    } else {
        IDOT_CASES(1)
    }
#undef IDOT_CASES
}


#ifndef IDOT_NARROW_ONLY
/* The wide tiles: WIDE (16) outputs, as two halves of 8. For each block a half's 8 weight blocks
 * are unpacked and transposed (transpose_8x8) so that 32-bit lane o of register j holds output
 * o's bytes 4 j .. 4 j + 3; each row's activation dword j, broadcast, then multiplies all 8
 * outputs at once, and the lanes are the outputs' block sums, with no reduction. */
static inline __attribute__((always_inline)) void IDOT_WIDE_BODY(const int type, const int H, const uint8_t *const w[WIDE],
                                                                 int64_t blocks, const Q8Block *x, int64_t xs, int64_t tokens,
                                                                 float *y, int64_t ys, int count) {
    const int64_t size = integer_block_bytes(type);
    const int has_min = type == GGML_Q4_1 || type == GGML_Q5_1;
    const int offset = type == GGML_Q4_0 ? 8 : type == GGML_Q5_0 ? 16 : type == GGML_Q8_0 && !IDOT_SIGNED_Q8 ? 128 : 0;
    for (int64_t t0 = 0; t0 < tokens; t0 += TILE) {
        const int64_t mt = tokens - t0 < TILE ? tokens - t0 : TILE;
        __m256 acc[TILE][2];
        for (int64_t m = 0; m < mt; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
        for (int64_t i = 0; i < blocks; i++) {
#pragma GCC unroll 1
            for (int h = 0; h < 2; h++) {
                __m256i c[8];
                __m256 dw, mw;
                unpack_8(type, w + 8 * h, i * size, c, &dw, &mw);
                if (type == GGML_Q8_0 && !IDOT_SIGNED_Q8)
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++) c[j] = _mm256_xor_si256(c[j], _mm256_set1_epi8((char)0x80));
                __m256i a[8];
                if (type == GGML_Q8_0 && IDOT_SIGNED_Q8)
#pragma GCC unroll 8
                    for (int j = 0; j < 8; j++) a[j] = _mm256_sign_epi8(c[j], c[j]);
                for (int64_t m = 0; m < mt; m++) {
                    const Q8Block *x0 = x + (t0 + m) * xs + H * i;
#pragma GCC unroll 2
                    for (int part = 0; part < H; part++) {
                        const Q8Block *xb = x0 + part;
                        const int32_t *xd = (const int32_t *)xb->qs;
                        __m256i sums = _mm256_setzero_si256();
#pragma GCC unroll 8
                        for (int j = 0; j < 8; j++) {
                            const __m256i xj = _mm256_set1_epi32(xd[j]);
                            if (type == GGML_Q8_0 && IDOT_SIGNED_Q8)
                                sums = _mm256_add_epi32(sums, IDOT_DOT(a[j], _mm256_sign_epi8(xj, c[j])));
                            else
                                sums = IDOT_ACC(sums, c[j], xj);
                        }
                        if (offset) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(offset * xb->sum));
                        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), acc[m][h]);
                    }
                    if (has_min) acc[m][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x0->s), acc[m][h]);
                }
            }
        }
        store_wide(acc, mt, y + t0 * ys, ys, count);
    }
}

static void IDOT_WIDE(int type, int halves, const uint8_t *const w[WIDE], int64_t blocks, const Q8Block *x, int64_t xs,
                  int64_t tokens, float *y, int64_t ys, int count) {
#define IDOT_CASES(H)                                                                                                  \
    switch (type) {                                                                                                    \
    case GGML_Q4_0: IDOT_WIDE_BODY(GGML_Q4_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                          \
    case GGML_Q4_1: IDOT_WIDE_BODY(GGML_Q4_1, H, w, blocks, x, xs, tokens, y, ys, count); break;                          \
    case GGML_Q5_0: IDOT_WIDE_BODY(GGML_Q5_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                          \
    case GGML_Q5_1: IDOT_WIDE_BODY(GGML_Q5_1, H, w, blocks, x, xs, tokens, y, ys, count); break;                          \
    default: IDOT_WIDE_BODY(GGML_Q8_0, H, w, blocks, x, xs, tokens, y, ys, count); break;                                 \
    }
    if (halves == 2) {
        IDOT_CASES(2)
    } else {
        IDOT_CASES(1)
    }
#undef IDOT_CASES
}

#endif

#undef IDOT_WIDE_BODY
#undef IDOT_WIDE
#undef IDOT_NARROW
#undef IDOT_BODY
#undef IDOT_CAT
#undef IDOT_CAT2
