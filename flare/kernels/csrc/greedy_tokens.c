/* The tokens of a round whose rows are all greedy (or invalid), one position each, without
 * drafts, token mask or log-probabilities: the CPU counterpart of `greedy_round` (round.py), with
 * its results, in one call where the twin takes a few dozen torch operators (each of which, at one
 * row, costs more in dispatch than its arithmetic).
 *
 * Per row r, on a private copy of its logits x:
 *
 *   nonfinite  = some raw x_i is NaN or infinite                       (NONFINITE_LOGITS)
 *   x_i       += bias_i          (the row's logit_bias, duplicates summed in order as scatter_add)
 *   for every token i listed in the row's prompt or output ids (penalties.py, _penalize_):
 *     seen_i   = i in the prompt, or count_i > 0      (count_i: occurrences in the output)
 *     x_i      = seen_i ? (x_i > 0 ? x_i / rep : x_i * rep) : x_i
 *     x_i      = (x_i - freq * count_i) - pres * [count_i > 0]
 *   empty      = max_i x_i is not finite (NaN propagates)                (EMPTY_DISTRIBUTION)
 *   token      = the lowest i with x_i = max                                  (torch.argmax)
 *
 * and invalid parameters (row_kinds) win over both, with neutral penalties. Every value is the
 * twin's float32 arithmetic step for step: the file is compiled without multiply-add
 * contraction, which would round `x - freq * count` once instead of twice.
 */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sampling.h"

enum { STATUS_OK = 0 };

static int invalid_parameters(const GreedyRows *in, int64_t r) {
    const float t = in->temperature[r], top_p = in->top_p[r], min_p = in->min_p[r], rep = in->repetition_penalty[r];
    return !(t >= 0.0f) || isinf(t) || !(top_p > 0.0f && top_p <= 1.0f) || in->top_k[r] < -1 ||
           !(min_p >= 0.0f && min_p <= 1.0f) || !(rep > 0.0f) || isinf(rep) || !isfinite(in->presence_penalty[r]) ||
           !isfinite(in->frequency_penalty[r]);
}

/* The penalties of row r on x, from its padded id lists (-1, or any id outside the vocabulary,
 * is skipped: the twin maps those to token 0 and rewrites token 0 with its own unchanged value).
 * `count` and `state` are zeroed scratch of `vocab` entries, left zeroed again. */
static void penalize(const GreedyRows *in, int64_t r, float rep, float pres, float freq, float *x, int32_t *count,
                     uint8_t *state) {
    enum { IN_PROMPT = 1, DONE = 2 };
    const int64_t vocab = in->vocab;
    const int64_t *prompt = in->prompt_ids + r * in->prompt_width;
    const int64_t *output = in->output_ids + r * in->output_width;
    for (int64_t j = 0; j < in->prompt_width; j++)
        if (prompt[j] >= 0 && prompt[j] < vocab) state[prompt[j]] |= IN_PROMPT;
    for (int64_t j = 0; j < in->output_width; j++)
        if (output[j] >= 0 && output[j] < vocab) count[output[j]]++;
    for (int pass = 0; pass < 2; pass++) {
        const int64_t *ids = pass == 0 ? prompt : output;
        const int64_t width = pass == 0 ? in->prompt_width : in->output_width;
        for (int64_t j = 0; j < width; j++) {
            const int64_t i = ids[j];
            if (i < 0 || i >= vocab || (state[i] & DONE)) continue;
            const int32_t c = count[i];
            float v = x[i];
            if ((state[i] & IN_PROMPT) || c > 0) v = v > 0.0f ? v / rep : v * rep;
            const float by_count = freq * (float)c;
            const float by_presence = pres * (c > 0 ? 1.0f : 0.0f);
            v = v - by_count;
            x[i] = v - by_presence;
            state[i] |= DONE;
        }
    }
    for (int pass = 0; pass < 2; pass++) {
        const int64_t *ids = pass == 0 ? prompt : output;
        const int64_t width = pass == 0 ? in->prompt_width : in->output_width;
        for (int64_t j = 0; j < width; j++)
            if (ids[j] >= 0 && ids[j] < vocab) count[ids[j]] = 0, state[ids[j]] = 0;
    }
}

static void row_tokens(const GreedyRows *in, int64_t r, float *x, int32_t *count, uint8_t *state, GreedyOut *out) {
    const int64_t vocab = in->vocab;
    const float *raw = in->logits + r * vocab;
    int nonfinite = 0;
    for (int64_t i = 0; i < vocab; i++) nonfinite |= !isfinite(raw[i]);
    const int invalid = invalid_parameters(in, r);
    memcpy(x, raw, (size_t)vocab * sizeof(float));
    if (in->bias_ids != NULL) {
        /* The dense addend, summed from 0 in list order as scatter_add_ does, then added to
         * every token (0 for the unbiased ones). */
        const int64_t *ids = in->bias_ids + r * in->bias_width;
        const float *values = in->bias_values + r * in->bias_width;
        for (int64_t j = 0; j < in->bias_width; j++) {
            const int64_t i = ids[j];
            if (i < 0 || i >= vocab) continue;
            int first = 1;
            for (int64_t k = 0; k < j; k++) first &= ids[k] != i;
            if (!first) continue; /* added with the id's first entry */
            float sum = 0.0f;
            for (int64_t k = j; k < in->bias_width; k++)
                if (ids[k] == i) sum = sum + values[k];
            x[i] = x[i] + sum;
        }
    }
    if (in->prompt_ids != NULL)
        penalize(in, r, invalid ? 1.0f : in->repetition_penalty[r], invalid ? 0.0f : in->presence_penalty[r],
                 invalid ? 0.0f : in->frequency_penalty[r], x, count, state);
    float best = x[0];
    int64_t best_index = 0;
    int nan = isnan(best);
    for (int64_t i = 1; i < vocab; i++) {
        nan |= isnan(x[i]);
        if (x[i] > best) best = x[i], best_index = i;
    }
    int32_t status = STATUS_OK;
    if (nan || !isfinite(best)) status = in->status_empty;
    if (nonfinite) status = in->status_nonfinite;
    if (invalid) status = in->status_invalid;
    int64_t *tokens = out->tokens + r * out->width;
    for (int64_t k = 0; k < out->width; k++) tokens[k] = -1;
    if (status == STATUS_OK) tokens[0] = best_index;
    out->num_emitted[r] = status == STATUS_OK;
    out->status[r] = status;
}

int greedy_tokens(const GreedyRows *in, GreedyOut *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (in->rows >= 4) reduction(| : failed)
    {
        float *x = malloc((size_t)in->vocab * sizeof(float));
        int32_t *count = calloc((size_t)in->vocab, sizeof(int32_t));
        uint8_t *state = calloc((size_t)in->vocab, 1);
        if (x == NULL || count == NULL || state == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < in->rows; r++) row_tokens(in, r, x, count, state, out);
        }
        free(x);
        free(count);
        free(state);
    }
    return failed ? -1 : 0;
}
