/* The Python module `flare.sampler._native`: the sampler's kernels of sampling.h.
 *
 * Arguments are data addresses and sizes, which flare/sampler/native_sampler.py takes from tensors it
 * has checked. Every kernel runs with the GIL released, so the daemon's event loop goes on while
 * a round computes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "sampling.h"

static PyObject *invalid(const char *function, const char *problem) {
    PyErr_Format(PyExc_ValueError, "%s: %s", function, problem);
    return NULL;
}

static PyObject *py_stream_uniforms(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t keys, rows, vocab, out, threads;
    if (!PyArg_ParseTuple(args, "nnnnn", &keys, &rows, &vocab, &out, &threads)) return NULL;
    if (rows < 0 || vocab < 0 || threads < 1) return invalid("stream_uniforms", "sizes must be non-negative");
    Py_BEGIN_ALLOW_THREADS
    stream_uniforms((const int32_t *)keys, rows, vocab, (float *)out, (int)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_top_p_threshold(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t scaled, mass, target, rows, vocab, out, threads;
    if (!PyArg_ParseTuple(args, "nnnnnnn", &scaled, &mass, &target, &rows, &vocab, &out, &threads)) return NULL;
    if (rows < 0 || vocab < 1 || threads < 1) return invalid("top_p_threshold", "sizes must be positive");
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = top_p_threshold((const float *)scaled, (const float *)mass, (const float *)target, rows, vocab, (float *)out,
                             (int)threads);
    Py_END_ALLOW_THREADS
    if (status) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_kept_gumbel_argmax(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t noise, scaled, position, threshold, exclude, rows, vocab, index, value, threads;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnn", &noise, &scaled, &position, &threshold, &exclude, &rows, &vocab, &index, &value,
                          &threads))
        return NULL;
    if (rows < 0 || vocab < 1 || threads < 1) return invalid("kept_gumbel_argmax", "sizes must be positive");
    Py_BEGIN_ALLOW_THREADS
    kept_gumbel_argmax((const float *)noise, (const float *)scaled, (const int64_t *)position, (const float *)threshold,
                       (const int64_t *)exclude, rows, vocab, (int64_t *)index, (float *)value, (int)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_greedy_tokens(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t logits, rows, positions, vocab, max_drafts, num_drafts, draft_tokens, temperature, top_p, min_p, repetition,
        presence, frequency, top_k, prompt_ids, prompt_width, output_ids, output_width, bias_ids, bias_values, bias_width,
        status_empty, status_nonfinite, status_invalid_draft, status_invalid, tokens, num_emitted, status, threads;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnnnnnnnnnnnnnnnnnn", &logits, &rows, &positions, &vocab, &max_drafts,
                          &num_drafts, &draft_tokens, &temperature, &top_p, &min_p, &repetition, &presence, &frequency,
                          &top_k, &prompt_ids, &prompt_width, &output_ids, &output_width, &bias_ids, &bias_values,
                          &bias_width, &status_empty, &status_nonfinite, &status_invalid_draft, &status_invalid, &tokens,
                          &num_emitted, &status, &threads))
        return NULL;
    if (rows < 0 || positions < rows || vocab < 1 || max_drafts < 0 || prompt_width < 0 || output_width < 0 ||
        bias_width < 0 || threads < 1)
        return invalid("greedy_tokens", "sizes must be positive");
    const GreedyRows in = {
        .logits = (const float *)logits, .rows = rows, .positions = positions, .vocab = vocab, .max_drafts = max_drafts,
        .num_drafts = (const int64_t *)num_drafts, .draft_tokens = (const int64_t *)draft_tokens,
        .temperature = (const float *)temperature, .top_p = (const float *)top_p, .min_p = (const float *)min_p,
        .repetition_penalty = (const float *)repetition, .presence_penalty = (const float *)presence,
        .frequency_penalty = (const float *)frequency, .top_k = (const int64_t *)top_k,
        .prompt_ids = (const int64_t *)prompt_ids, .output_ids = (const int64_t *)output_ids,
        .bias_ids = (const int64_t *)bias_ids, .prompt_width = prompt_width, .output_width = output_width,
        .bias_width = bias_width, .bias_values = (const float *)bias_values,
        .status_empty = (int32_t)status_empty, .status_nonfinite = (int32_t)status_nonfinite,
        .status_invalid_draft = (int32_t)status_invalid_draft, .status_invalid = (int32_t)status_invalid,
    };
    GreedyOut out = {.tokens = (int64_t *)tokens, .num_emitted = (int32_t *)num_emitted, .status = (int32_t *)status};
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = greedy_tokens(&in, &out, (int)threads);
    Py_END_ALLOW_THREADS
    if (failed == -2) return invalid("greedy_tokens", "the rows' positions (1 + drafts each) do not add up to the logits' rows");
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stream_uniforms", py_stream_uniforms, METH_VARARGS, "stream_uniforms(keys, rows, vocab, out, threads)"},
    {"top_p_threshold", py_top_p_threshold, METH_VARARGS,
     "top_p_threshold(scaled, mass, target, rows, vocab, out, threads)"},
    {"kept_gumbel_argmax", py_kept_gumbel_argmax, METH_VARARGS,
     "kept_gumbel_argmax(noise, scaled, position, threshold, exclude, rows, vocab, index, value, threads)"},
    {"greedy_tokens", py_greedy_tokens, METH_VARARGS,
     "greedy_tokens(logits, rows, positions, vocab, max_drafts, num_drafts, draft_tokens, temperature, top_p, "
     "min_p, repetition, presence, frequency, top_k, prompt_ids, prompt_width, output_ids, output_width, bias_ids, "
     "bias_values, bias_width, status_empty, status_nonfinite, status_invalid_draft, status_invalid, tokens, "
     "num_emitted, status, threads)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "The sampler's CPU kernels; use them through flare.sampler.native_sampler, which checks the tensors.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
