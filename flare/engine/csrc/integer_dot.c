/* The integer dot-product kernels' shared parts (integer_dot.h). */
#include "integer_dot.h"

int integer_dot_isa(int isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* __builtin_cpu_supports also asks the OS (XGETBV) whether it saves the wide registers, so a
     * CPU that advertises AVX-512 under a kernel that does not enable it falls back. */
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa >= IDOT_AVX512_VNNI && avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        return IDOT_AVX512_VNNI;
    if (isa >= IDOT_AVX_VNNI && avx2 && __builtin_cpu_supports("avxvnni")) return IDOT_AVX_VNNI;
    if (isa >= IDOT_AVX2 && avx2) return IDOT_AVX2;
#else
    (void)isa;
#endif
    return IDOT_PORTABLE;
}
