/* Small utilities at the bottom of the native core: they call nothing of the core, so
 * every other file may use them without making a loop. Retrying interrupted system calls,
 * a string map, formatting, the names of dtypes, ops and collective kinds, rank lists, and
 * the even split of a count. */
#ifndef RINGSYNC_UTIL_H
#define RINGSYNC_UTIL_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

/* ---- system calls a signal interrupts ----
 *
 * A signal that arrives during a system call may make it fail with EINTR having done
 * nothing: the call is simply made again. RS_RETRY_EINTR is for
 * calls that return -1 and set errno (read, send, recv, accept4, getrandom), with `result`
 * the variable that takes what the call returns; RS_RETRY_EINTR_CODE for those that return
 * the error number itself (posix_fallocate). Polls are not retried this way: for them EINTR
 * means "nothing ready yet", and their callers look at their deadlines and poll again. */
#define RS_RETRY_EINTR(result, call)                    \
    do {                                                \
        (result) = (call);                              \
    } while ((result) < 0 && errno == EINTR)

#define RS_RETRY_EINTR_CODE(error, call)                \
    do {                                                \
        (error) = (call);                               \
    } while ((error) == EINTR)

/* ---- a small string -> pointer map (open addressing) ---- */
typedef struct {
    char **keys;
    void **values;
    size_t capacity;
    size_t count;
} rs_map_t;

void *rs_map_get(const rs_map_t *m, const char *key);
int rs_map_put(rs_map_t *m, const char *key, void *value); /* key is copied; 0 on success */
/* Room for `count` entries without growing (a round's map is filled at once); 0 on success. */
int rs_map_reserve(rs_map_t *m, size_t count);
void rs_map_remove(rs_map_t *m, const char *key);
void rs_map_free(rs_map_t *m);

/* A formatted string on the heap (caller frees), or NULL without memory. */
char *rs_strdup_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* FNV-1a, 64 bits: names in hash maps, a check that a peer's bytes arrived as announced
 * (it detects misparsing, not forgery: connections are authenticated). */
uint64_t rs_fnv1a(const void *data, size_t len);

/* Names for messages ("unknown" outside the known range). */
const char *rs_dtype_name(int dtype);
const char *rs_kind_name(int kind);
const char *rs_op_name(int op);

/* "[0, 2]": the indices i < n where (flags[i] != 0) == want. */
void rs_format_ranks(const unsigned char *flags, int n, int want, char *out, size_t cap);

/* Part `part` of `count` split into `parts` nearly equal parts, the first count % parts
 * one larger: it starts at *offset and has *length elements. */
void rs_even_part(size_t count, int parts, int part, size_t *offset, size_t *length);

/* malloc for large buffers (a collective's result or work space): from 32 MiB on, where
 * glibc maps every allocation afresh, aligned to and advised into 2 MiB pages where the
 * kernel offers them, so that first touching it costs one page fault per 2 MiB instead of
 * one per 4 KiB (numpy does the same for its own large arrays). Below that glibc reuses
 * freed memory, and advising it measured slower. Released with free(). */
void *rs_malloc_large(size_t bytes);

#endif
