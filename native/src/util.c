/* Utilities at the bottom of the native core (see util.h). */
#define _GNU_SOURCE
#include <stdarg.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "util.h"

#define HUGE_PAGE ((size_t)2 << 20)
#define LARGE_BYTES ((size_t)32 << 20)

void *rs_malloc_large(size_t bytes) {
    if (bytes < LARGE_BYTES)
        return malloc(bytes ? bytes : 1);
    void *p = NULL;
    if (posix_memalign(&p, HUGE_PAGE, bytes) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    /* only advice: where the kernel has no transparent huge pages it changes nothing */
    madvise(p, (bytes / HUGE_PAGE) * HUGE_PAGE, MADV_HUGEPAGE);
#endif
    return p;
}

uint64_t rs_fnv1a(const void *data, size_t len) {
    const unsigned char *p = data;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < len; i++)
        h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

/* ---- string map ---- */

static uint64_t hash_string(const char *s) { return rs_fnv1a(s, strlen(s)); }

static size_t slot_of(const rs_map_t *m, const char *key) {
    size_t i = hash_string(key) & (m->capacity - 1);
    while (m->keys[i] && strcmp(m->keys[i], key) != 0)
        i = (i + 1) & (m->capacity - 1);
    return i;
}

void *rs_map_get(const rs_map_t *m, const char *key) {
    if (!m->capacity)
        return NULL;
    size_t i = slot_of(m, key);
    return m->keys[i] ? m->values[i] : NULL;
}

static int map_resize(rs_map_t *m, size_t capacity) {
    rs_map_t bigger = {0};
    bigger.capacity = capacity;
    bigger.keys = calloc(bigger.capacity, sizeof *bigger.keys);
    bigger.values = calloc(bigger.capacity, sizeof *bigger.values);
    if (!bigger.keys || !bigger.values) {
        free(bigger.keys);
        free(bigger.values);
        return -1;
    }
    for (size_t i = 0; i < m->capacity; i++) {
        if (!m->keys[i])
            continue;
        size_t j = slot_of(&bigger, m->keys[i]);
        bigger.keys[j] = m->keys[i];
        bigger.values[j] = m->values[i];
        bigger.count++;
    }
    free(m->keys);
    free(m->values);
    *m = bigger;
    return 0;
}

static int map_grow(rs_map_t *m) { return map_resize(m, m->capacity ? m->capacity * 2 : 64); }

int rs_map_reserve(rs_map_t *m, size_t count) {
    size_t capacity = m->capacity ? m->capacity : 64;
    while (capacity < 2 * count)
        capacity *= 2;
    return capacity == m->capacity ? 0 : map_resize(m, capacity);
}

int rs_map_put(rs_map_t *m, const char *key, void *value) {
    if ((m->count + 1) * 2 > m->capacity && map_grow(m) != 0)
        return -1;
    size_t i = slot_of(m, key);
    if (!m->keys[i]) {
        if (!(m->keys[i] = strdup(key)))
            return -1;
        m->count++;
    }
    m->values[i] = value;
    return 0;
}

void rs_map_remove(rs_map_t *m, const char *key) {
    if (!m->capacity)
        return;
    size_t i = slot_of(m, key);
    if (!m->keys[i])
        return;
    free(m->keys[i]);
    m->keys[i] = NULL;
    m->count--;
    /* Re-insert the rest of the cluster so that lookups do not stop at the hole. */
    for (size_t j = (i + 1) & (m->capacity - 1); m->keys[j]; j = (j + 1) & (m->capacity - 1)) {
        char *k = m->keys[j];
        void *v = m->values[j];
        m->keys[j] = NULL;
        size_t to = slot_of(m, k);
        m->keys[to] = k;
        m->values[to] = v;
    }
}

void rs_map_free(rs_map_t *m) {
    for (size_t i = 0; i < m->capacity; i++)
        free(m->keys[i]);
    free(m->keys);
    free(m->values);
    memset(m, 0, sizeof *m);
}

char *rs_strdup_printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *out = NULL;
    if (vasprintf(&out, fmt, ap) < 0)
        out = NULL;
    va_end(ap);
    return out;
}

/* ---- names for messages ---- */

const char *rs_dtype_name(int dtype) {
    static const char *names[] = {"uint8", "int8", "int32", "int64", "float16", "bfloat16",
                                  "float32", "float64", "bool", "int16", "uint16"};
    return dtype >= 0 && dtype < (int)(sizeof names / sizeof *names) ? names[dtype] : "unknown";
}

const char *rs_kind_name(int kind) {
    static const char *names[] = {"allreduce", "allgather", "broadcast", "reducescatter",
                                  "alltoall", "barrier", "join", "send", "recv", "tune",
                                  "refused call"};
    return kind >= 0 && kind < (int)(sizeof names / sizeof *names) ? names[kind] : "unknown";
}

const char *rs_op_name(int op) {
    static const char *names[] = {"Sum", "Average", "Min", "Max", "Product", "Adasum"};
    return op >= 0 && op < (int)(sizeof names / sizeof *names) ? names[op] : "unknown";
}

/* ---- rank lists and even splits ---- */

void rs_format_ranks(const unsigned char *flags, int n, int want, char *out, size_t cap) {
    size_t at = (size_t)snprintf(out, cap, "[");
    int first = 1;
    for (int r = 0; r < n && at < cap; r++)
        if ((flags[r] != 0) == (want != 0)) {
            at += (size_t)snprintf(out + at, cap - at, first ? "%d" : ", %d", r);
            first = 0;
        }
    if (at < cap)
        snprintf(out + at, cap - at, "]");
}

void rs_even_part(size_t count, int parts, int part, size_t *offset, size_t *length) {
    size_t base = count / (size_t)parts, extra = count % (size_t)parts, p = (size_t)part;
    *offset = p * base + (p < extra ? p : extra);
    *length = base + (p < extra);
}

int rs_signal_unclaimed(int signum) {
    struct sigaction now;
    if (sigaction(signum, NULL, &now) != 0)
        return 0;
    return !(now.sa_flags & SA_SIGINFO) &&
           (now.sa_handler == SIG_DFL || now.sa_handler == SIG_IGN);
}
