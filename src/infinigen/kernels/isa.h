/* Which instruction path the kernels take, chosen when they run: the best the CPU has, capped by
 * ig_set_isa_cap (tests run the portable path beside the native one on the same machine). The
 * library is compiled for the CPU it runs on, and the wide paths are compiled with target
 * attributes, so a path is used only where CPUID says the CPU has it. */
#ifndef INFINIGEN_ISA_H
#define INFINIGEN_ISA_H

enum {
    ISA_PORTABLE = 0,    /* plain C: every CPU, what CI holds the others to */
    ISA_AVX2 = 1,        /* 256-bit integer multiply-adds (vpmaddubsw + vpmaddwd) */
    ISA_AVX_VNNI = 2,    /* 256-bit vpdpbusd (VEX: Alder Lake, Sapphire Rapids and later) */
    ISA_AVX512 = 3,      /* 512-bit, AVX-512 BW without VNNI (Skylake-X) */
    ISA_AVX512_VNNI = 4, /* 512-bit vpdpbusd (Cascade Lake, Ice Lake, Zen 4 and later) */
};

int ig_isa(void);             /* the path in use */
int ig_isa_best(void);        /* the best this CPU has */
void ig_set_isa_cap(int cap); /* use at most this path (-1: no cap) */

#endif
