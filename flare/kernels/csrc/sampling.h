/* The sampler's CPU kernels over whole vocabulary rows: the counter-based random stream's
 * uniforms and the top-p threshold (sampling.c). Each computes the bits of its torch twin in
 * flare/kernels/; flare/kernels/native.py checks the tensors behind every pointer. */
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

#endif
