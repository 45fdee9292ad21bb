/* The sampler's CPU kernels over whole vocabulary rows: the counter-based random stream's
 * uniforms, the top-p threshold and the Gumbel-max candidate of kept tokens (sampling.c), and the
 * tokens of an all-greedy round with its drafts verified (greedy_tokens.c). Each computes the
 * results of its torch twin in flare/sampler/; flare/sampler/native_sampler.py checks the tensors
 * behind every pointer. */
#ifndef FLARE_SAMPLING_H
#define FLARE_SAMPLING_H

#include <stdint.h>

/* Compile the hot loops for AVX2 + FMA where the CPU has them and generic x86-64 elsewhere: the
 * loader picks the clone at run time, so one build runs on any x86-64 machine (as the engine's
 * kernels do, flare/engine/csrc/kernels.h). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FLARE_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FLARE_TARGET_CLONES
#endif

/* top_p_threshold returns 0, or -1 when scratch memory could not be allocated. */
void stream_uniforms(const int32_t *keys, int64_t rows, int64_t vocab, float *out, int threads);
int top_p_threshold(const float *scaled, const float *mass, const float *target, int64_t rows, int64_t vocab, float *out,
                    int threads);
/* Row r: the first index of the largest noise[r, i] + scaled[position[r], i] over the tokens with
 * scaled[position[r], i] >= threshold[r] (a NaN logit is not kept), token exclude[r] (-1: none)
 * left out; index 0 and -inf where no token is kept, as torch.argmax of a row of -inf answers. */
void kept_gumbel_argmax(const float *noise, const float *scaled, const int64_t *position, const float *threshold,
                        const int64_t *exclude, int64_t rows, int64_t vocab, int64_t *index, float *value, int threads);

/* An all-greedy round's inputs: [positions, vocab] float32 logits (row r's 1 + num_drafts[r]
 * positions in order), its drafts ([rows, max_drafts] int64, -1 padded), the SamplingBatch's
 * per-row parameters (float32; top_k int64), its padded id lists (int64, -1 padding; NULL when no
 * row is penalized, or has a bias) and the DeviceStatus codes to report. */
typedef struct {
    const float *logits;
    int64_t rows, positions, vocab, max_drafts;
    const int64_t *num_drafts, *draft_tokens;
    const float *temperature, *top_p, *min_p, *repetition_penalty, *presence_penalty, *frequency_penalty;
    const int64_t *top_k;
    const int64_t *prompt_ids, *output_ids, *bias_ids;
    int64_t prompt_width, output_width, bias_width;
    const float *bias_values;
    int32_t status_empty, status_nonfinite, status_invalid_draft, status_invalid;
} GreedyRows;

/* Its outputs: tokens [rows, max_drafts + 1] int64 (accepted drafts, the token, then -1),
 * emitted and status [rows] int32. */
typedef struct {
    int64_t *tokens;
    int32_t *num_emitted, *status;
} GreedyOut;

/* Returns 0; -1 when scratch memory could not be allocated, -2 when the rows' positions do not
 * add up to `positions`. */
int greedy_tokens(const GreedyRows *in, GreedyOut *out, int threads);

#endif
