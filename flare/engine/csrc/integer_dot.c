/* The integer dot-product kernels' shared parts (integer_dot.h). */
#include "integer_dot.h"

int integer_dot_level(int isa, int granted) {
    if (isa >= IDOT_AVX512_VNNI && (granted & IDOT_GRANTS_AVX2) && (granted & IDOT_GRANTS_AVX512_VNNI)) return IDOT_AVX512_VNNI;
    if (isa >= IDOT_AVX_VNNI && (granted & IDOT_GRANTS_AVX2) && (granted & IDOT_GRANTS_AVX_VNNI)) return IDOT_AVX_VNNI;
    if (isa >= IDOT_AVX2 && (granted & IDOT_GRANTS_AVX2)) return IDOT_AVX2;
    return IDOT_PORTABLE;
}

int integer_dot_grants(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* __builtin_cpu_supports also asks the OS (XGETBV) whether it saves the wide registers, so a
     * CPU that advertises AVX-512 under a kernel that does not enable it falls back. */
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return (avx2 ? IDOT_GRANTS_AVX2 : 0) | (__builtin_cpu_supports("avxvnni") ? IDOT_GRANTS_AVX_VNNI : 0) |
           (avx512 ? IDOT_GRANTS_AVX512_VNNI : 0);
#else
    return 0;
#endif
}

int integer_dot_isa(int isa) { return integer_dot_level(isa, integer_dot_grants()); }
