/* A thread's scratch memory, kept between calls and grown when a call needs more: the kernels
 * allocate nothing per call once warm. Each kernel file keeps its own thread-local arenas. */
#ifndef INFINIGEN_SCRATCH_H
#define INFINIGEN_SCRATCH_H

#include <stddef.h>
#include <stdlib.h>

typedef struct {
    void *p;
    size_t n;
} arena;

/* At least `bytes` of the arena (NULL when they cannot be had). */
static inline void *scratch(arena *a, size_t bytes) {
    if (bytes > a->n) {
        free(a->p);
        a->n = bytes + bytes / 4 + 4096;
        a->p = malloc(a->n);
        if (!a->p) a->n = 0;
    }
    return a->p;
}

#endif
