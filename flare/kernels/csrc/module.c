/* The Python module `flare.kernels._native`: the sampler's kernels of sampling.h.
 *
 * Arguments are data addresses and sizes, which flare/kernels/native.py takes from tensors it
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

static PyMethodDef methods[] = {
    {"stream_uniforms", py_stream_uniforms, METH_VARARGS, "stream_uniforms(keys, rows, vocab, out, threads)"},
    {"top_p_threshold", py_top_p_threshold, METH_VARARGS,
     "top_p_threshold(scaled, mass, target, rows, vocab, out, threads)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "The sampler's CPU kernels; use them through flare.kernels.native, which checks the tensors.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
