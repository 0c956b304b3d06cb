/* The instruction path, chosen at run time (see isa.h). */
#include "isa.h"

static int cap = -1;

/* Whether this CPU (and its operating system, which CPUID's checks include) runs `path`. */
static int has(int path) {
    if (path == ISA_PORTABLE) return 1;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl");
    switch (path) {
    case ISA_AVX2: return avx2;
    case ISA_AVX_VNNI:
#if !defined(__clang__) && __GNUC__ >= 11
        return avx2 && __builtin_cpu_supports("avxvnni");
#else
        return 0;
#endif
    case ISA_AVX512: return avx512;
    case ISA_AVX512_VNNI: return avx512 && __builtin_cpu_supports("avx512vnni");
    }
#endif
    return 0;
}

int ig_isa_best(void) {
    for (int path = ISA_AVX512_VNNI; path > ISA_PORTABLE; path--)
        if (has(path)) return path;
    return ISA_PORTABLE;
}

int ig_isa(void) {
    for (int path = cap >= 0 && cap < ISA_AVX512_VNNI ? cap : ISA_AVX512_VNNI; path > ISA_PORTABLE; path--)
        if (has(path)) return path;
    return ISA_PORTABLE;
}

void ig_set_isa_cap(int level) { cap = level; }
