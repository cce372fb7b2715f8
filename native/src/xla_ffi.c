/* The blocking allreduce as an XLA FFI handler: a custom call of a compiled JAX program
 * (ringsync/jax/_xla.py registers it for the CPU platform), so that a jitted step reduces
 * its gradients without a Python callback.
 *
 * XLA hands a handler its call frame and nothing else: no user data. So the engines the
 * calls run on are found in one process-wide table of slots, one per process set the
 * programs name (an attribute of each call). Python fills a slot when a call first finds it
 * empty (rs_xla_refill, a cffi callback: once per communicator, not per call) and empties
 * every slot of an engine before destroying it (rs_xla_forget); handlers hold a read lock
 * while they use an engine. This table is the core's one process-wide mutable state: XLA's
 * handler signature leaves it no other place.
 *
 * The few structs of XLA's FFI C API used here are declared in xla_ffi_abi.h, so that the
 * core builds without jaxlib. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "ringsync.h"
#include "xla_ffi.h"
#include "xla_ffi_abi.h"

/* ---- the slots ---- */

typedef struct {
    rs_engine_t *engine;
    rs_comm_t *comm; /* the engine's ring: a broken one may have been replaced */
    int rank;
} slot_t;

static pthread_rwlock_t slots_lock = PTHREAD_RWLOCK_INITIALIZER;
static slot_t slots[RS_XLA_SLOTS];
static int running[RS_XLA_SLOTS]; /* calls of each slot in progress (atomic) */

rs_status_t rs_xla_bind(int slot, rs_engine_t *engine, rs_comm_t *comm, int rank) {
    if (slot < 0 || slot >= RS_XLA_SLOTS || !engine != !comm)
        return RS_ERR_USAGE;
    pthread_rwlock_wrlock(&slots_lock);
    slots[slot].engine = engine;
    slots[slot].comm = comm;
    slots[slot].rank = rank;
    pthread_rwlock_unlock(&slots_lock);
    return RS_OK;
}

void rs_xla_forget(rs_engine_t *engine) {
    pthread_rwlock_wrlock(&slots_lock); /* waits for the handlers using it */
    for (int i = 0; i < RS_XLA_SLOTS; i++)
        if (slots[i].engine == engine)
            slots[i].engine = NULL, slots[i].comm = NULL;
    pthread_rwlock_unlock(&slots_lock);
}

/* ---- reading the call frame ---- */

static void *xla_error(const struct rs_xla_frame *f, int code, const char *text) {
    rs_xla_error_args_t args = {sizeof args, NULL, text, code};
    return f->api->error_create(&args);
}

static void *describe_metadata(const struct rs_xla_frame *f) {
    struct rs_xla_metadata_ext *ext = (struct rs_xla_metadata_ext *)f->extension_start;
    /* (XLA's sizes count up to the last field they define, without the padding after it) */
    if (ext->metadata->struct_size < offsetof(rs_xla_metadata_t, traits) + sizeof(uint32_t))
        return xla_error(f, XLA_ERR_INVALID_ARGUMENT, "ringsync: XLA's metadata is too small");
    rs_xla_version_t version = {sizeof version, NULL, XLA_API_MAJOR, XLA_API_MINOR};
    ext->metadata->api_version = version;
    ext->metadata->traits = 0;
    return NULL;
}

/* The attribute called `name` (XLA sorts them by name; there are few), or NULL. */
static void *find_attr(const struct rs_xla_frame *f, const char *name, int type) {
    size_t len = strlen(name);
    for (int64_t i = 0; i < f->attrs.size; i++)
        if (f->attrs.types[i] == type && f->attrs.names[i]->len == len &&
            memcmp(f->attrs.names[i]->ptr, name, len) == 0)
            return f->attrs.attrs[i];
    return NULL;
}

static int scalar_int(const struct rs_xla_frame *f, const char *name, int64_t *out) {
    struct rs_xla_scalar *s = find_attr(f, name, XLA_ATTR_SCALAR);
    if (!s || s->dtype != XLA_S64)
        return 0;
    memcpy(out, s->value, sizeof *out);
    return 1;
}

static int scalar_double(const struct rs_xla_frame *f, const char *name, double *out) {
    struct rs_xla_scalar *s = find_attr(f, name, XLA_ATTR_SCALAR);
    if (!s || s->dtype != XLA_F64)
        return 0;
    memcpy(out, s->value, sizeof *out);
    return 1;
}

static int core_dtype(int xla_dtype) {
    switch (xla_dtype) {
    case XLA_U8: return RS_UINT8;
    case XLA_S8: return RS_INT8;
    case XLA_U16: return RS_UINT16;
    case XLA_S16: return RS_INT16;
    case XLA_S32: return RS_INT32;
    case XLA_S64: return RS_INT64;
    case XLA_F16: return RS_FLOAT16;
    case XLA_BF16: return RS_BFLOAT16;
    case XLA_F32: return RS_FLOAT32;
    case XLA_F64: return RS_FLOAT64;
    default: return -1;
    }
}

/* What one custom call asks for, read and checked from its frame: its arrays' common
 * attributes here, each array's request by array_request. */
typedef struct {
    rs_request_t request;
    int64_t slot;
    int64_t arrays; /* reduced one after another, in place where XLA aliased them */
    char base[200];
    char name[256];
} call_t;

static const char *read_call(const struct rs_xla_frame *f, call_t *c) {
    /* k results; k operands, then perhaps one more: the calls this one waits for (never
     * read) */
    c->arrays = f->rets.size;
    if (c->arrays < 1 || (f->args.size != c->arrays && f->args.size != c->arrays + 1))
        return "ringsync: the allreduce custom call takes one operand per result";
    for (int64_t i = 0; i < f->args.size; i++)
        if (f->args.types[i] != XLA_BUFFER || (i < c->arrays && f->rets.types[i] != XLA_BUFFER))
            return "ringsync: the allreduce custom call takes and returns arrays only";
    int64_t op;
    struct rs_xla_span *name = find_attr(f, "name", XLA_ATTR_STRING);
    if (!scalar_int(f, "slot", &c->slot) || !scalar_int(f, "op", &op) || !name ||
        !scalar_double(f, "prescale", &c->request.prescale) ||
        !scalar_double(f, "postscale", &c->request.postscale))
        return "ringsync: the allreduce custom call lacks one of its attributes";
    snprintf(c->base, sizeof c->base, "%.*s", (int)(name->len < 199 ? name->len : 199),
             name->ptr);
    c->request.kind = RS_KIND_ALLREDUCE;
    c->request.op = (int)op;
    c->request.start_now = 1;
    c->request.blocking = 1;
    return NULL;
}

/* The request for array i of the call (its name: the base, then ".i" when there are
 * several). */
static const char *array_request(const struct rs_xla_frame *f, int64_t i, call_t *c) {
    const struct rs_xla_buffer *in = f->args.items[i], *out = f->rets.items[i];
    if (in->rank > 8 || in->rank != out->rank || in->dtype != out->dtype ||
        core_dtype(in->dtype) < 0 || (in->rank && memcmp(in->dims, out->dims,
                                                         (size_t)in->rank * sizeof(int64_t))))
        return "ringsync: the allreduce custom call's array and result do not match";
    if (c->arrays == 1)
        snprintf(c->name, sizeof c->name, "%s", c->base);
    else
        snprintf(c->name, sizeof c->name, "%s.%lld", c->base, (long long)i);
    c->request.dtype = core_dtype(in->dtype);
    c->request.ndim = (int)in->rank;
    for (int d = 0; d < in->rank; d++)
        c->request.shape[d] = in->dims[d];
    c->request.sendbuf = in->data;
    c->request.recvbuf = out->data;
    return NULL;
}

/* ---- running it ---- */

static int error_code(rs_status_t st) {
    return st == RS_ERR_USAGE ? XLA_ERR_FAILED_PRECONDITION
           : st == RS_ERR_TIMEOUT ? XLA_ERR_DEADLINE_EXCEEDED
           : st == RS_ERR_NOMEM ? XLA_ERR_INTERNAL : XLA_ERR_UNAVAILABLE;
}

/* The engine's account of a failure, worded as the Python side words it, with the class
 * a Python caller would have seen (the text is all that crosses XLA). */
static void *failure(const struct rs_xla_frame *f, const call_t *c, int rank, rs_status_t st,
                     const char *detail) {
    const char *cls = st == RS_ERR_USAGE ? "MismatchError" /* (found by the ranks together) */
                      : st == RS_ERR_TIMEOUT ? "CommunicationTimeout"
                      : st == RS_ERR_NOMEM ? "OutOfMemoryError" : "CommunicationError";
    char text[1400];
    snprintf(text, sizeof text, "ringsync.errors.%s: ringsync.jax.allreduce for tensor '%s' "
             "failed on rank %d: %.1000s", cls, c->name, rank, detail);
    return xla_error(f, error_code(st), text);
}

static rs_status_t submit_and_wait(rs_engine_t *engine, call_t *c, const char **detail) {
    const char *names[1] = {c->name};
    int64_t handle;
    rs_status_t st = rs_engine_submit(engine, names, &c->request, 1, &handle);
    if (st != RS_OK) {
        *detail = rs_engine_last_error(engine);
        return st;
    }
    int done = 0;
    while ((st = rs_engine_wait(engine, handle, 1.0, &done)) == RS_OK && !done) {
    }
    if (st != RS_OK) {
        *detail = rs_engine_handle_error(engine, handle);
        if (!*detail || !**detail)
            *detail = rs_engine_last_error(engine);
    }
    rs_engine_release(engine, handle);
    return st;
}

/* The engine of a slot, read-locked (NULL: none, unlocked). An empty slot, or one whose
 * ring is broken (an elastic recovery may have replaced it), is refilled by Python once;
 * a ring still broken after that fails the call as it would any caller's. */
static rs_engine_t *locked_engine(int64_t slot, int *rank) {
    for (int attempt = 0; attempt < 2; attempt++) {
        pthread_rwlock_rdlock(&slots_lock);
        slot_t s = slots[slot];
        if (s.engine && (attempt == 1 || !rs_comm_is_broken(s.comm))) {
            *rank = s.rank;
            return s.engine;
        }
        pthread_rwlock_unlock(&slots_lock);
        if (attempt == 0 && !rs_xla_refill((int)slot) && !s.engine)
            break;
    }
    return NULL;
}

static void *run_call(const struct rs_xla_frame *f, rs_engine_t *engine, call_t *c,
                      int rank) {
    for (int64_t i = 0; i < c->arrays; i++) {
        const char *bad = array_request(f, i, c);
        if (bad)
            return xla_error(f, XLA_ERR_INVALID_ARGUMENT, bad);
        int ran = 0;
        const char *detail = "";
        rs_status_t st = rs_engine_try_lane(engine, c->name, &c->request, &ran);
        if (st != RS_OK)
            detail = rs_engine_last_error(engine);
        else if (!ran)
            st = submit_and_wait(engine, c, &detail);
        if (st != RS_OK) /* (every rank stops at the same array: they fail it together) */
            return failure(f, c, rank, st, detail);
    }
    return NULL;
}

/* Another call of this process set is running: the two were not ordered (separate
 * programs, or traces that nothing chains), so the ranks may run them in different
 * orders. This one is refused in its place in the call order (the peers' matching call
 * fails too, naming it), so that no pair meets the wrong peer. */
static void *refuse_concurrent(const struct rs_xla_frame *f, rs_engine_t *engine,
                               call_t *c, int rank) {
    static const char why[] =
        "another collective of its process set was running at the same time (collectives "
        "of two compiled programs, or of separate jitted functions or loop bodies, that "
        "nothing orders); order them by data, wait for the first program's results, or set "
        "RINGSYNC_JAX_ORDERED=1";
    snprintf(c->name, sizeof c->name, "%s", c->base);
    rs_engine_refuse(engine, c->name, RS_KIND_ALLREDUCE, why, 1);
    return failure(f, c, rank, RS_ERR_USAGE, why);
}

static void *run_allreduce(struct rs_xla_frame *f) {
    call_t c;
    memset(&c, 0, sizeof c);
    const char *bad = read_call(f, &c);
    if (bad)
        return xla_error(f, XLA_ERR_INVALID_ARGUMENT, bad);
    if (c.slot < 0 || c.slot >= RS_XLA_SLOTS)
        return xla_error(f, XLA_ERR_INVALID_ARGUMENT, "ringsync: no such process-set slot");
    int rank = -1;
    rs_engine_t *engine = locked_engine(c.slot, &rank);
    if (!engine)
        return xla_error(f, XLA_ERR_FAILED_PRECONDITION,
                         "ringsync.errors.NotInitializedError: ringsync.jax.allreduce: the "
                         "process set of this compiled call has no communicator (call "
                         "ringsync.init() first)");
    void *error = __atomic_fetch_add(&running[c.slot], 1, __ATOMIC_ACQ_REL) > 0
                      ? refuse_concurrent(f, engine, &c, rank) : run_call(f, engine, &c, rank);
    __atomic_fetch_sub(&running[c.slot], 1, __ATOMIC_ACQ_REL);
    pthread_rwlock_unlock(&slots_lock);
    return error;
}

void *rs_xla_allreduce(void *call_frame) {
    struct rs_xla_frame *f = call_frame;
    if (f->extension_start && f->extension_start->type == XLA_EXT_METADATA)
        return describe_metadata(f);
    if (f->stage != XLA_STAGE_EXECUTE)
        return NULL;
    return run_allreduce(f);
}

void *rs_xla_allreduce_handler(void) { return (void *)rs_xla_allreduce; }
