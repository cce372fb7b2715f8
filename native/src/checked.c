/* Overflow-checked sizes and the well-formedness of tensor metadata (see checked.h). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include "checked.h"
#include "internal.h"
#include "util.h"

int rs_mul_checked(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0 || (b != 0 && a > RS_MAX_BYTES / b))
        return -1;
    *out = a * b;
    return 0;
}

int rs_add_checked(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0 || a > RS_MAX_BYTES - b)
        return -1;
    *out = a + b;
    return 0;
}

static int reduces(int kind) { return kind == RS_KIND_ALLREDUCE || kind == RS_KIND_REDUCESCATTER; }
static int has_data(int kind) { return kind != RS_KIND_BARRIER && kind != RS_KIND_JOIN; }

/* Record why m is malformed; always returns -1. */
__attribute__((format(printf, 3, 4)))
static int problem(char *why, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, cap, fmt, ap);
    va_end(ap);
    return -1;
}

static int check_shape(const rs_meta_t *m, char *why, size_t cap, int64_t *elements) {
    if (m->ndim < 0 || m->ndim > RS_MAX_DIMS)
        return problem(why, cap, "%d dimensions; at most %d are supported", (int)m->ndim,
                       (int)RS_MAX_DIMS);
    int64_t n = 1;
    for (int d = 0; d < m->ndim; d++) {
        if (m->shape[d] < 0)
            return problem(why, cap, "negative dimension %lld at axis %d",
                           (long long)m->shape[d], d);
        if (rs_mul_checked(n, m->shape[d], &n) != 0)
            return problem(why, cap, "shape overflows: %lld elements and more at axis %d",
                           (long long)n, d);
    }
    *elements = n;
    return 0;
}

int rs_meta_check(const rs_meta_t *m, int size, char *why, size_t cap, int64_t *elements,
                  int64_t *bytes) {
    const char *kind = rs_kind_name(m->kind);
    if (m->kind < RS_KIND_ALLREDUCE || m->kind > RS_KIND_JOIN)
        return problem(why, cap, "unknown collective kind %d", (int)m->kind);
    if (has_data(m->kind) && !(reduces(m->kind) ? rs_dtype_valid(m->dtype)
                                                  : rs_dtype_movable(m->dtype)))
        return problem(why, cap, "dtype %s is not supported by %s", rs_dtype_name(m->dtype), kind);
    if (reduces(m->kind) && !rs_op_valid(m->op))
        return problem(why, cap, "unknown reduction op %d", (int)m->op);
    if (m->kind == RS_KIND_BROADCAST && (m->root < 0 || m->root >= size))
        return problem(why, cap, "root rank %d is out of range for %d ranks", (int)m->root, size);
    if (!isfinite(m->prescale) || !isfinite(m->postscale))
        return problem(why, cap, "scale factors must be finite numbers, got prescale %g "
                       "postscale %g", m->prescale, m->postscale);
    int64_t n = 0, b;
    if (check_shape(m, why, cap, &n) != 0)
        return -1;
    int64_t elem = has_data(m->kind) ? (int64_t)rs_dtype_size(m->dtype) : 0;
    if (rs_mul_checked(n, elem, &b) != 0)
        return problem(why, cap, "%lld elements of %s are more than %lld bytes", (long long)n,
                       rs_dtype_name(m->dtype), (long long)RS_MAX_BYTES);
    if (elements)
        *elements = has_data(m->kind) ? n : 0;
    if (bytes)
        *bytes = b;
    return 0;
}
