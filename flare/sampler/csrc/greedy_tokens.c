/* The tokens of a round whose rows are all greedy (or invalid), with their drafts verified: the
 * CPU counterpart of sample_round (round.py) for such rounds without a token mask, draft
 * probabilities or log-probabilities, with its results, in one call where the torch path takes a
 * few hundred operators (each of which, at one row, costs more to dispatch than to compute).
 *
 * Row r owns positions p_0 .. p_k of the logits (k = its drafts d_0 .. d_{k-1}). At position j,
 * on a private copy x of its logits:
 *
 *   x_i       += bias_i          (the row's logit_bias, duplicates summed in order as scatter_add)
 *   for every token i listed in the row's prompt, output or drafts before j (penalties.py):
 *     count_i  = occurrences in the output and in d_0 .. d_{j-1}
 *     seen_i   = i in the prompt, or count_i > 0
 *     x_i      = seen_i ? (x_i > 0 ? x_i / rep : x_i * rep) : x_i
 *     x_i      = (x_i - freq * count_i) - pres * [count_i > 0]
 *   a_j        = the lowest i with x_i = max x                                  (torch.argmax)
 *
 * Draft d_j is accepted while every earlier one was and d_j = a_j (greedy verification); after
 * the n accepted drafts the row emits a_n. The row's status is round_status's: a position whose
 * max x is not finite (NaN propagates) makes EMPTY_DISTRIBUTION, a NaN or infinite raw logit at
 * any position NONFINITE_LOGITS, a draft outside the vocabulary INVALID_DRAFT_TOKEN, invalid
 * parameters (row_kinds; their penalties are neutral) INVALID_SAMPLING_PARAMETERS, each winning
 * over the ones before. Every value is the torch path's float32 arithmetic step for step: the
 * file is compiled without multiply-add contraction, which would round `x - freq * count` once
 * instead of twice.
 */
#pragma GCC optimize("fp-contract=off")

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sampling.h"

enum { STATUS_OK = 0, IN_PROMPT = 1, DONE = 2 };

static int invalid_parameters(const GreedyRows *in, int64_t r) {
    const float t = in->temperature[r], top_p = in->top_p[r], min_p = in->min_p[r], rep = in->repetition_penalty[r];
    return !(t >= 0.0f) || isinf(t) || !(top_p > 0.0f && top_p <= 1.0f) || in->top_k[r] < -1 ||
           !(min_p >= 0.0f && min_p <= 1.0f) || !(rep > 0.0f) || isinf(rep) || !isfinite(in->presence_penalty[r]) ||
           !isfinite(in->frequency_penalty[r]);
}

/* The ids that the penalties of one position read: the row's prompt, its output and its valid
 * drafts before the position (-1, or any id outside the vocabulary, is skipped: the torch path
 * maps those to token 0 and rewrites token 0 with its own unchanged value). */
typedef struct {
    const int64_t *lists[3];
    int64_t widths[3];
} Listed;

/* The penalties on x. `count` and `state` are zeroed scratch of `vocab` entries, left zeroed. */
static void penalize(const Listed *ids, int64_t vocab, float rep, float pres, float freq, float *x, int32_t *count,
                     uint8_t *state) {
    for (int64_t j = 0; j < ids->widths[0]; j++)
        if (ids->lists[0][j] >= 0 && ids->lists[0][j] < vocab) state[ids->lists[0][j]] |= IN_PROMPT;
    for (int l = 1; l < 3; l++)
        for (int64_t j = 0; j < ids->widths[l]; j++)
            if (ids->lists[l][j] >= 0 && ids->lists[l][j] < vocab) count[ids->lists[l][j]]++;
    for (int l = 0; l < 3; l++) {
        for (int64_t j = 0; j < ids->widths[l]; j++) {
            const int64_t i = ids->lists[l][j];
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
    for (int l = 0; l < 3; l++)
        for (int64_t j = 0; j < ids->widths[l]; j++)
            if (ids->lists[l][j] >= 0 && ids->lists[l][j] < vocab) count[ids->lists[l][j]] = 0, state[ids->lists[l][j]] = 0;
}

/* The row's bias added to x: the dense addend, summed from 0 in list order as scatter_add_ does,
 * then added to every token (0 for the unbiased ones, which changes no value but -0). */
static void add_bias(const GreedyRows *in, int64_t r, float *x) {
    const int64_t *ids = in->bias_ids + r * in->bias_width;
    const float *values = in->bias_values + r * in->bias_width;
    for (int64_t j = 0; j < in->bias_width; j++) {
        const int64_t i = ids[j];
        if (i < 0 || i >= in->vocab) continue;
        int first = 1;
        for (int64_t k = 0; k < j; k++) first &= ids[k] != i;
        if (!first) continue; /* added with the id's first entry */
        float sum = 0.0f;
        for (int64_t k = j; k < in->bias_width; k++)
            if (ids[k] == i) sum = sum + values[k];
        x[i] = x[i] + sum;
    }
}

FLARE_TARGET_CLONES
static void row_tokens(const GreedyRows *in, int64_t r, int64_t first_position, float *x, int32_t *count, uint8_t *state,
                       int64_t *valid_drafts, GreedyOut *out) {
    const int64_t vocab = in->vocab;
    int64_t drafts = in->num_drafts[r];
    drafts = drafts < 0 ? 0 : drafts > in->max_drafts ? in->max_drafts : drafts;
    const int invalid = invalid_parameters(in, r);
    const float rep = invalid ? 1.0f : in->repetition_penalty[r], pres = invalid ? 0.0f : in->presence_penalty[r],
                freq = invalid ? 0.0f : in->frequency_penalty[r];
    int invalid_draft = 0;
    for (int64_t j = 0; j < drafts; j++) {
        const int64_t d = in->draft_tokens[r * in->max_drafts + j];
        valid_drafts[j] = d >= 0 && d < vocab ? d : -1;
        invalid_draft |= valid_drafts[j] < 0;
    }
    int nonfinite = 0, empty = 0;
    int64_t accepted = 0, token = -1;
    for (int64_t j = 0; j <= drafts; j++) {
        const float *raw = in->logits + (first_position + j) * vocab;
#pragma omp simd reduction(| : nonfinite)
        for (int64_t i = 0; i < vocab; i++) nonfinite |= !isfinite(raw[i]);
        memcpy(x, raw, (size_t)vocab * sizeof(float));
        if (in->bias_ids != NULL) add_bias(in, r, x);
        if (in->prompt_ids != NULL) {
            const Listed ids = {{in->prompt_ids + r * in->prompt_width, in->output_ids + r * in->output_width, valid_drafts},
                                {in->prompt_width, in->output_width, j}};
            penalize(&ids, vocab, rep, pres, freq, x, count, state);
        }
        /* The max (NaN noted apart: it makes the position empty), then its first index. */
        float best = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
        for (int64_t i = 0; i < vocab; i++) {
            best = x[i] > best ? x[i] : best;
            nan |= x[i] != x[i];
        }
        int64_t best_index = 0;
        while (best_index < vocab - 1 && !(x[best_index] == best)) best_index++;
        empty |= nan || !isfinite(best);
        /* The argmax where verification stopped is the row's token; the later positions count
         * for the status only. */
        if (token < 0) {
            if (j < drafts && valid_drafts[j] == best_index) accepted++;
            else token = best_index;
        }
    }
    int32_t status = STATUS_OK;
    if (empty) status = in->status_empty;
    if (nonfinite) status = in->status_nonfinite;
    if (invalid_draft) status = in->status_invalid_draft;
    if (invalid) status = in->status_invalid;
    int64_t *tokens = out->tokens + r * (in->max_drafts + 1);
    for (int64_t k = 0; k <= in->max_drafts; k++) tokens[k] = -1;
    if (status == STATUS_OK) {
        for (int64_t k = 0; k < accepted; k++) tokens[k] = valid_drafts[k];
        tokens[accepted] = token;
    }
    out->num_emitted[r] = status == STATUS_OK ? (int32_t)(accepted + 1) : 0;
    out->status[r] = status;
}

int greedy_tokens(const GreedyRows *in, GreedyOut *out, int threads) {
    /* Row r's first position: its drafts clamped to [0, max_drafts], as position_layout does. */
    int64_t *first = malloc((size_t)(in->rows + 1) * sizeof(int64_t));
    if (first == NULL) return -1;
    first[0] = 0;
    for (int64_t r = 0; r < in->rows; r++) {
        const int64_t d = in->num_drafts[r] < 0 ? 0 : in->num_drafts[r] > in->max_drafts ? in->max_drafts : in->num_drafts[r];
        first[r + 1] = first[r] + d + 1;
    }
    if (first[in->rows] != in->positions) {
        free(first);
        return -2;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (in->positions >= 4) reduction(| : failed)
    {
        float *x = malloc((size_t)in->vocab * sizeof(float));
        int32_t *count = calloc((size_t)in->vocab, sizeof(int32_t));
        uint8_t *state = calloc((size_t)in->vocab, 1);
        int64_t *valid_drafts = malloc((size_t)(in->max_drafts + 1) * sizeof(int64_t));
        if (x == NULL || count == NULL || state == NULL || valid_drafts == NULL) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < in->rows; r++) row_tokens(in, r, first[r], x, count, state, valid_drafts, out);
        }
        free(x);
        free(count);
        free(state);
        free(valid_drafts);
    }
    free(first);
    return failed ? -1 : 0;
}
