/* Overflow-checked sizes and the well-formedness of tensor metadata (see checked.h). */
#include <math.h>

#include "checked.h"
#include "reduce.h"
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
static int has_data(int kind) {
    return kind != RS_KIND_BARRIER && kind != RS_KIND_JOIN && kind != RS_KIND_TUNE &&
           kind != RS_KIND_REFUSED;
}

/* A refusal carries nothing but the refused call's kind (in root): every other field as
 * rs_engine_refuse leaves it, so that ranks compare refusals bit for bit. */
static rs_status_t check_refusal(const rs_meta_t *m, rs_error_t *why) {
    if (m->root < RS_KIND_ALLREDUCE || m->root >= RS_KIND_REFUSED || m->ndim != 0)
        return rs_error_set(why, RS_ERR_USAGE, "a refusal of kind %d with %d dimensions",
                            (int)m->root, (int)m->ndim);
    return RS_OK;
}

/* A tune request's shape is a list of settings, not dimensions: each bounded on its own. */
static rs_status_t check_settings(const rs_meta_t *m, rs_error_t *why) {
    if (m->ndim != RS_TUNE_COUNT)
        return rs_error_set(why, RS_ERR_USAGE, "tune carries %d settings, not %d",
                            (int)m->ndim, (int)RS_TUNE_COUNT);
    for (int i = 0; i < RS_TUNE_COUNT; i++)
        if (m->shape[i] < 0 || m->shape[i] > RS_MAX_BYTES)
            return rs_error_set(why, RS_ERR_USAGE, "tune setting %d is %lld, not between 0 "
                                "and %lld", i, (long long)m->shape[i], (long long)RS_MAX_BYTES);
    return RS_OK;
}

static rs_status_t check_shape(const rs_meta_t *m, rs_error_t *why, int64_t *elements) {
    if (m->ndim < 0 || m->ndim > RS_MAX_DIMS)
        return rs_error_set(why, RS_ERR_USAGE, "%d dimensions; at most %d are supported",
                            (int)m->ndim, (int)RS_MAX_DIMS);
    int64_t n = 1;
    for (int d = 0; d < m->ndim; d++) {
        if (m->shape[d] < 0)
            return rs_error_set(why, RS_ERR_USAGE, "negative dimension %lld at axis %d",
                                (long long)m->shape[d], d);
        if (rs_mul_checked(n, m->shape[d], &n) != 0)
            return rs_error_set(why, RS_ERR_USAGE, "shape overflows: %lld elements and more "
                                "at axis %d", (long long)n, d);
    }
    *elements = n;
    return RS_OK;
}

rs_status_t rs_meta_check(const rs_meta_t *m, int size, rs_error_t *why, int64_t *elements,
                          int64_t *bytes) {
    const char *kind = rs_kind_name(m->kind);
    /* (a recv's metadata say "send": both ends of a message carry the same) */
    if (m->kind < RS_KIND_ALLREDUCE || m->kind > RS_KIND_REFUSED || m->kind == RS_KIND_RECV)
        return rs_error_set(why, RS_ERR_USAGE, "unknown collective kind %d", (int)m->kind);
    if (m->kind == RS_KIND_TUNE || m->kind == RS_KIND_REFUSED) {
        RS_CHECK(m->kind == RS_KIND_TUNE ? check_settings(m, why) : check_refusal(m, why));
        if (elements)
            *elements = 0;
        if (bytes)
            *bytes = 0;
        return RS_OK;
    }
    if (has_data(m->kind) && !(reduces(m->kind) ? rs_dtype_valid(m->dtype)
                                                  : rs_dtype_movable(m->dtype)))
        return rs_error_set(why, RS_ERR_USAGE, "dtype %s is not supported by %s",
                            rs_dtype_name(m->dtype), kind);
    if (reduces(m->kind) && !rs_op_valid(m->op))
        return rs_error_set(why, RS_ERR_USAGE, "unknown reduction op %d", (int)m->op);
    if (reduces(m->kind) && m->op == RS_OP_ADASUM && m->kind != RS_KIND_ALLREDUCE)
        return rs_error_set(why, RS_ERR_USAGE, "the Adasum op is only for allreduce, not %s",
                            kind);
    if (reduces(m->kind) && !rs_op_takes_dtype(m->op, m->dtype))
        return rs_error_set(why, RS_ERR_USAGE, "dtype %s is not supported by %s with the %s "
                            "op; it takes float16, bfloat16, float32 or float64",
                            rs_dtype_name(m->dtype), kind, rs_op_name(m->op));
    if (m->kind == RS_KIND_BROADCAST && (m->root < 0 || m->root >= size))
        return rs_error_set(why, RS_ERR_USAGE, "root rank %d is out of range for %d ranks",
                            (int)m->root, size);
    if (m->kind == RS_KIND_SEND && (m->root < 0 || m->root >= size || m->op < 0 ||
                                    m->op >= size || m->root == m->op))
        return rs_error_set(why, RS_ERR_USAGE, "send from rank %d to rank %d: not two "
                            "distinct ranks of %d", (int)m->root, (int)m->op, size);
    if (!isfinite(m->prescale) || !isfinite(m->postscale))
        return rs_error_set(why, RS_ERR_USAGE, "scale factors must be finite numbers, got "
                            "prescale %g postscale %g", m->prescale, m->postscale);
    int64_t n = 0, b;
    RS_CHECK(check_shape(m, why, &n));
    int64_t elem = has_data(m->kind) ? (int64_t)rs_dtype_size(m->dtype) : 0;
    if (rs_mul_checked(n, elem, &b) != 0)
        return rs_error_set(why, RS_ERR_USAGE, "%lld elements of %s are more than %lld bytes",
                            (long long)n, rs_dtype_name(m->dtype), (long long)RS_MAX_BYTES);
    if (elements)
        *elements = has_data(m->kind) ? n : 0;
    if (bytes)
        *bytes = b;
    return RS_OK;
}

rs_meta_t rs_refusal_meta(int kind) {
    rs_meta_t m = {0};
    m.kind = RS_KIND_REFUSED;
    m.root = kind >= RS_KIND_ALLREDUCE && kind < RS_KIND_REFUSED ? kind : RS_KIND_ALLREDUCE;
    m.prescale = m.postscale = 1.0;
    return m;
}
