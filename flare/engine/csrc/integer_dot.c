/* The integer dot-product kernels' shared parts (integer_dot.h). */
#include "integer_dot.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#define IDOT_AMX_LINUX 1
#endif

int integer_dot_level(int isa, int granted) {
    const int avx512 = (granted & IDOT_GRANTS_AVX2) && (granted & IDOT_GRANTS_AVX512_VNNI);
    if (isa >= IDOT_AMX && avx512 && (granted & IDOT_GRANTS_AMX)) return IDOT_AMX;
    if (isa >= IDOT_AVX512_VNNI && avx512) return IDOT_AVX512_VNNI;
    if (isa >= IDOT_AVX_VNNI && (granted & IDOT_GRANTS_AVX2) && (granted & IDOT_GRANTS_AVX_VNNI)) return IDOT_AVX_VNNI;
    if (isa >= IDOT_AVX2 && (granted & IDOT_GRANTS_AVX2)) return IDOT_AVX2;
    return IDOT_PORTABLE;
}

#ifdef IDOT_AMX_LINUX
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

/* Tiles 0, 1, 2: 16 rows of 64 bytes. */
static const IdotTileConfig trial_config = {.palette = 1, .colsb = {64, 64, 64}, .rows = {16, 16, 16}};

/* One 16 x 16 int32 product of ones, checked: 64 * 1 * 1 in every lane. */
__attribute__((target("amx-tile,amx-int8"))) static int amx_trial_product(void) {
    static int8_t ones[16 * 64];
    int32_t out[16 * 16];
    memset(ones, 1, sizeof ones);
    _tile_loadconfig(&trial_config);
    _tile_zero(0);
    _tile_loadd(1, ones, 64);
    _tile_loadd(2, ones, 64);
    _tile_dpbsud(0, 1, 2);
    _tile_stored(0, out, 64);
    _tile_release();
    for (int i = 0; i < 256; i++)
        if (out[i] != 64) return 0;
    return 1;
}

int integer_dot_amx_trial(int fault) {
    const pid_t child = fork();
    if (child < 0) return 0;
    if (child == 0) {
        /* the default action, whatever handler the parent installed (Python's faulthandler) */
        signal(SIGILL, SIG_DFL);
        signal(SIGSEGV, SIG_DFL);
        signal(SIGBUS, SIG_DFL);
        if (fault) __builtin_trap();
        _exit(amx_trial_product() ? 0 : 1);
    }
    int status = 0;
    pid_t done;
    do done = waitpid(child, &status, 0);
    while (done < 0 && errno == EINTR);
    return done == child && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static int amx_grant;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void ask_for_amx(void) {
    __builtin_cpu_init();
    unsigned a, b, c, d;
    /* CPUID.(EAX=7, ECX=0):EDX bit 24 amx-tile, bit 25 amx-int8 (GCC 12's __builtin_cpu_supports
     * has no names for them) */
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    const int advertised = (d >> 24 & 1) && (d >> 25 & 1);
    amx_grant = advertised && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 && integer_dot_amx_trial(0);
}

int integer_dot_amx_granted(void) {
    pthread_once(&amx_once, ask_for_amx);
    return amx_grant;
}
#else
int integer_dot_amx_trial(int fault) {
    (void)fault;
    return 0;
}

int integer_dot_amx_granted(void) { return 0; }
#endif

int integer_dot_grants(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    /* __builtin_cpu_supports also asks the OS (XGETBV) whether it saves the wide registers, so a
     * CPU that advertises AVX-512 under a kernel that does not enable it falls back. */
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    /* AMX only on top of AVX-512 VNNI (its kernels are AVX-512 around the tile products) */
    const int amx = avx2 && avx512 && integer_dot_amx_granted();
    return (avx2 ? IDOT_GRANTS_AVX2 : 0) | (__builtin_cpu_supports("avxvnni") ? IDOT_GRANTS_AVX_VNNI : 0) |
           (avx512 ? IDOT_GRANTS_AVX512_VNNI : 0) | (amx ? IDOT_GRANTS_AMX : 0);
#else
    return 0;
#endif
}

int integer_dot_isa(int isa) { return integer_dot_level(isa, integer_dot_grants()); }
