/* The disk tier's gather in one call: which rows come from the RAM tail, which from the block
 * cache, which blocks must be read (merged into runs across small gaps), the reads themselves
 * (all in flight at once through Linux native AIO, or one after another with pread where AIO
 * is unavailable), the cache admissions (CLOCK, second chance) and the copy of every record
 * into an output array. It runs without the Python interpreter lock, so the compute thread
 * goes on while it waits for the disk.
 *
 * It does exactly what infinigen.storage.disk_read.DiskReader does in Python (the fallback, which
 * the tests hold it to), with the same run merging and the same cache policy. Where each record
 * sits (in the file, or in the RAM tails) is computed by the file's layout
 * (infinigen.storage.layout.DiskLayout) and handed in: this file knows no layout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/aio_abi.h>
#include <sys/syscall.h>
#define HAVE_AIO 1
#else
#define HAVE_AIO 0
#endif

enum { STAT_BYTES = 0, STAT_READS = 1, STAT_DISK_ROWS = 2, STAT_RAM_ROWS = 3, STAT_NEED = 4 };
enum { MAX_BATCH = 128 };

uint64_t ig_aio_setup(int64_t depth) {
#if HAVE_AIO
    aio_context_t ctx = 0;
    if (syscall(SYS_io_setup, (long)depth, &ctx) < 0) return 0;
    return (uint64_t)ctx;
#else
    (void)depth;
    return 0;
#endif
}

void ig_aio_destroy(uint64_t ctx) {
#if HAVE_AIO
    if (ctx) syscall(SYS_io_destroy, (aio_context_t)ctx);
#else
    (void)ctx;
#endif
}

#if HAVE_AIO
/* Waits for the `inflight` requests still in the kernel's hands (after an error: their buffers
   must not be reused while the device writes into them). */
static void drain(uint64_t ctx, int64_t inflight, struct io_event *events) {
    while (inflight > 0) {
        long r = syscall(SYS_io_getevents, (aio_context_t)ctx, 1L, (long)(inflight < MAX_BATCH ? inflight : MAX_BATCH),
                         events, NULL);
        if (r < 0 && errno != EINTR) return;
        if (r > 0) inflight -= r;
    }
}
#endif

/* Read every (buffer, length, offset) request; 0, or -errno (-EIO for a short read). With Linux
   AIO, up to MAX_BATCH requests stay in flight: each one that completes frees its slot for the
   next, so the device's queue never drains between batches. */
static int64_t read_all(int fd, uint64_t ctx, int64_t n, uint8_t **bufs, const int64_t *lens, const int64_t *offs) {
#if HAVE_AIO
    if (ctx) {
        struct iocb cbs[MAX_BATCH];
        struct iocb *ptrs[MAX_BATCH];
        struct io_event events[MAX_BATCH];
        int64_t request_of[MAX_BATCH], free_slot[MAX_BATCH];
        int64_t nfree = MAX_BATCH, next = 0, done = 0, inflight = 0;
        for (int64_t s = 0; s < MAX_BATCH; s++) free_slot[s] = MAX_BATCH - 1 - s;
        while (done < n) {
            int64_t k = 0;
            while (next < n && nfree > 0) {
                const int64_t slot = free_slot[--nfree];
                memset(&cbs[slot], 0, sizeof(cbs[slot]));
                cbs[slot].aio_lio_opcode = IOCB_CMD_PREAD;
                cbs[slot].aio_fildes = (uint32_t)fd;
                cbs[slot].aio_buf = (uint64_t)(uintptr_t)bufs[next];
                cbs[slot].aio_nbytes = (uint64_t)lens[next];
                cbs[slot].aio_offset = offs[next];
                cbs[slot].aio_data = (uint64_t)slot;
                request_of[slot] = next++;
                ptrs[k++] = &cbs[slot];
            }
            int64_t submitted = 0;
            while (submitted < k) {
                long r = syscall(SYS_io_submit, (aio_context_t)ctx, (long)(k - submitted), ptrs + submitted);
                if (r < 0) {
                    if (errno == EINTR || errno == EAGAIN) continue;
                    const int err = errno;
                    if (done == 0 && inflight == 0 && submitted == 0) goto sync_fallback; /* e.g. no AIO here */
                    drain(ctx, inflight + submitted, events);
                    return -err;
                }
                submitted += r;
            }
            inflight += k;
            long r = syscall(SYS_io_getevents, (aio_context_t)ctx, 1L, (long)inflight, events, NULL);
            if (r < 0) {
                if (errno == EINTR) continue;
                const int err = errno;
                drain(ctx, inflight, events);
                return -err;
            }
            int64_t failed = 0;
            for (long e = 0; e < r; e++) {
                const int64_t slot = (int64_t)events[e].data, i = request_of[slot];
                if (events[e].res < 0) failed = failed ? failed : events[e].res;
                else if ((int64_t)events[e].res != lens[i]) failed = failed ? failed : -EIO;
                free_slot[nfree++] = slot;
            }
            inflight -= r;
            done += r;
            if (failed) {
                drain(ctx, inflight, events);
                return failed;
            }
        }
        return 0;
    }
sync_fallback:
#endif
    for (int64_t i = 0; i < n; i++) {
        int64_t got = 0;
        while (got < lens[i]) {
            ssize_t r = pread(fd, bufs[i] + got, (size_t)(lens[i] - got), (off_t)(offs[i] + got));
            if (r < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            if (r == 0) return -EIO;
            got += r;
        }
    }
    return 0;
}

/* A slot for a new block by CLOCK: skip slots used by this gather (ref 2), give a second
   chance to recently used ones (ref 1 -> 0), take the first unused; -1 when none is free. */
static int64_t clock_victim(int64_t slots, uint8_t *ref, int64_t *hand) {
    for (int64_t step = 0; step < 2 * slots + 1; step++) {
        const int64_t s = *hand;
        *hand = (s + 1) % slots;
        if (ref[s] == 2) continue;
        if (ref[s] == 1) { ref[s] = 0; continue; }
        return s;
    }
    return -1;
}

/* Records [m][rec]: row i is the record at file offset offs[i], or, where tail_at[i] >= 0, the
   one at byte tail_at[i] of the RAM tails (the caller computes both from the file's layout).
   The rows on disk come sorted ascending by file offset.
   Returns 0; a positive buffer size when `buf` is too small (nothing was done); or -errno. */
int64_t ig_gather_rows(int fd, int64_t blk, int64_t rec, int64_t m, const int64_t *offs, const int64_t *tail_at,
                       const uint8_t *tails, uint8_t *cache_data, int64_t slots, int64_t *slot_of,
                       int64_t *block_in, uint8_t *ref, int64_t *hand, int64_t gap, int64_t max_request,
                       uint64_t ctx, uint8_t *buf, int64_t buf_size, int64_t *blocks /* [m] work */,
                       int64_t *where /* [m] work */, uint8_t *rows, int64_t *stats) {
    for (int i = 0; i < 5; i++) stats[i] = 0;
    /* 1. the distinct disk blocks, and where each is found: cache slot, or offset in buf */
    int64_t nb = 0, last = -1;
    for (int64_t i = 0; i < m; i++) {
        if (tail_at[i] >= 0) continue;
        const int64_t b = offs[i] / blk;
        if (b < last) return -EINVAL; /* not sorted by file offset */
        if (b != last) { blocks[nb++] = b; last = b; }
    }
    /* 2. runs over the blocks the cache lacks */
    int64_t need = 0, prev = -1;
    for (int64_t j = 0; j < nb; j++) {
        const int64_t s = slots ? slot_of[blocks[j]] : -1;
        if (s >= 0) { where[j] = -1 - s; ref[s] = 2; continue; } /* a hit: encoded slot */
        if (prev >= 0 && blocks[j] - prev <= gap + 1) need += (blocks[j] - prev) * blk; /* extend the run */
        else need += blk;
        where[j] = need - blk;
        prev = blocks[j];
    }
    if (need > buf_size) {
        for (int64_t j = 0; j < nb; j++) if (where[j] < 0) ref[-1 - where[j]] = 1;
        stats[STAT_NEED] = need;
        return need;
    }
    /* 3. the reads: one request per run, split at max_request */
    int64_t nreq = 0, cap = 64;
    uint8_t **rb = malloc((size_t)cap * sizeof(*rb));
    int64_t *rl = malloc((size_t)cap * sizeof(*rl)), *ro = malloc((size_t)cap * sizeof(*ro));
    if (!rb || !rl || !ro) { free(rb); free(rl); free(ro); return -ENOMEM; }
    int64_t run_first = -1, run_last = -1, run_at = 0;
    for (int64_t j = 0; j <= nb; j++) { /* runs over the misses, exactly as step 2 laid them out */
        const int is_miss = j < nb && where[j] >= 0;
        if (is_miss && run_first >= 0 && blocks[j] - run_last <= gap + 1) { run_last = blocks[j]; continue; }
        if (run_first >= 0 && (is_miss || j == nb)) {
            const int64_t len = (run_last - run_first + 1) * blk;
            for (int64_t done = 0; done < len; done += max_request) {
                if (nreq == cap) {
                    cap *= 2;
                    uint8_t **b2 = realloc(rb, (size_t)cap * sizeof(*rb));
                    if (b2) rb = b2;
                    int64_t *l2 = realloc(rl, (size_t)cap * sizeof(*rl));
                    if (l2) rl = l2;
                    int64_t *o2 = realloc(ro, (size_t)cap * sizeof(*ro));
                    if (o2) ro = o2;
                    if (!b2 || !l2 || !o2) { free(rb); free(rl); free(ro); return -ENOMEM; }
                }
                rb[nreq] = buf + run_at + done;
                rl[nreq] = len - done < max_request ? len - done : max_request;
                ro[nreq] = run_first * blk + done;
                nreq++;
            }
            stats[STAT_BYTES] += len;
            run_first = -1;
        }
        if (is_miss) { run_first = run_last = blocks[j]; run_at = where[j]; }
    }
    int64_t rc = read_all(fd, ctx, nreq, rb, rl, ro);
    free(rb); free(rl); free(ro);
    if (rc < 0) {
        for (int64_t j = 0; j < nb; j++) if (where[j] < 0) ref[-1 - where[j]] = 1;
        return rc;
    }
    stats[STAT_READS] = nreq;
    /* 4. admit the blocks just read (they keep their place in buf for this gather) */
    for (int64_t j = 0; j < nb && slots; j++) {
        if (where[j] < 0) continue;
        const int64_t s = clock_victim(slots, ref, hand);
        if (s < 0) break;
        if (block_in[s] >= 0) slot_of[block_in[s]] = -1;
        block_in[s] = blocks[j];
        slot_of[blocks[j]] = s;
        memcpy(cache_data + s * blk, buf + where[j], (size_t)blk);
        ref[s] = 2;
    }
    /* 5. every record to its row */
    int64_t j = -1;
    last = -1;
    for (int64_t i = 0; i < m; i++) {
        const uint8_t *src;
        if (tail_at[i] >= 0) {
            src = tails + tail_at[i];
            stats[STAT_RAM_ROWS]++;
        } else {
            const int64_t off = offs[i];
            const int64_t b = off / blk;
            if (b != last) { j++; last = b; }
            if (where[j] < 0) {
                src = cache_data + (-1 - where[j]) * blk + off % blk;
                stats[STAT_RAM_ROWS]++;
            } else {
                src = buf + where[j] + off % blk;
                stats[STAT_DISK_ROWS]++;
            }
        }
        memcpy(rows + i * rec, src, (size_t)rec);
    }
    for (int64_t b2 = 0; b2 < nb; b2++) { /* this gather's slots: used, no longer pinned */
        const int64_t s = where[b2] < 0 ? -1 - where[b2] : (slots ? slot_of[blocks[b2]] : -1);
        if (s >= 0) ref[s] = 1;
    }
    return 0;
}
