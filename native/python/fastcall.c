/* ringsync._fastcall: the native entry of an engine's hot calls, for numpy arrays.
 *
 * A 4-byte allreduce on the same-host lane takes under a microsecond in C, and the Python
 * that reached it through cffi (argument checks, the request cache's lookups, cffi's
 * conversions) took three times that; a batch of 200 small asynchronous allreduces spent
 * 4 us of Python per tensor to submit and 2.5 to wait. This module is the rest of those
 * paths in C: it takes the caller's numpy arrays, finds the requests the Python side
 * built and checked for arrays like them (ringsync/_submit.py remembers each one here),
 * fills in the buffers and calls the core (rs_engine_try_lane for a blocking allreduce,
 * rs_engine_submit once for a batch, rs_engine_wait / rs_engine_release over a handle's
 * ids) with the GIL released where it may wait.
 *
 * It knows nothing the Python side does not decide: whatever it cannot take as it is (an
 * array that is not an exact, C-contiguous numpy array, an argument that is not an int,
 * float or str, a request the Python side has not remembered yet) returns None, and the
 * caller takes the ordinary path, which checks everything and names what is wrong. It
 * is not linked against the core either: the functions' addresses come from the cffi
 * module (ffi.addressof), so the two extension modules stay independent. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "ringsync.h"

typedef rs_status_t (*try_lane_fn)(rs_engine_t *, const char *, const rs_request_t *, int *);
typedef rs_status_t (*submit_fn)(rs_engine_t *, const char **, const rs_request_t *, int,
                                 int64_t *);
typedef rs_status_t (*wait_fn)(rs_engine_t *, int64_t, double, int *);
typedef void (*release_fn)(rs_engine_t *, int64_t);

#define FORMAT_LEN 8   /* buffer format strings longer than this are not cached */
#define TABLE_SIZE 1024 /* requests remembered per engine (direct-mapped by key hash) */
#define BATCH_MAX 65536  /* tensors in one batch; larger ones go the ordinary way */

/* What decides a request: the arrays' element format and shape, the op and scale factors
 * (the Python cache's key, in buffer terms). Zeroed before filling, so memcmp compares. */
typedef struct {
    char format[FORMAT_LEN];
    Py_ssize_t itemsize;
    int ndim;
    int64_t shape[8];
    long op;
    double prescale, postscale;
    int blocking; /* the request's: blocking calls and asynchronous ones differ */
    int pad; /* (zeroed: the key is hashed and compared as whole words) */
} call_key_t;
_Static_assert(sizeof(call_key_t) % 8 == 0, "call_key_t is hashed in 8-byte words");

typedef struct {
    int used;
    call_key_t key;
    rs_request_t request; /* as the Python side built it; the buffers are filled per call */
} entry_t;

typedef struct {
    PyObject_HEAD
    rs_engine_t *engine; /* NULL once closed: every call then returns None */
    int has_lane;
    try_lane_fn try_lane;
    submit_fn submit;
    wait_fn wait;
    release_fn release;
    PyObject *ndarray; /* numpy.ndarray: only exact arrays are taken here */
    unsigned long long taken; /* calls that reached the core from here (tests read it) */
    entry_t *table;          /* TABLE_SIZE entries */
} Entry;

/* (word by word: a batch hashes a key per tensor, and a byte loop cost 0.25 us a key) */
static uint64_t key_hash(const call_key_t *k) {
    uint64_t words[sizeof *k / 8], h = 0x9e3779b97f4a7c15ULL;
    memcpy(words, k, sizeof words);
    for (size_t i = 0; i < sizeof words / 8; i++) {
        h ^= words[i];
        h *= 0xff51afd7ed558ccdULL;
        h ^= h >> 33;
    }
    return h;
}

/* A double from a float or an int (as Python's float() of them); 0 when it is neither. */
static int as_double(PyObject *o, double *out) {
    if (PyFloat_CheckExact(o)) {
        *out = PyFloat_AS_DOUBLE(o);
        return 1;
    }
    if (PyLong_CheckExact(o)) {
        *out = PyLong_AsDouble(o);
        if (*out == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return 1;
    }
    return 0;
}

/* The key of a call on `view` (1: one this module can look up). */
static int make_key(const Py_buffer *view, PyObject *op, PyObject *prescale,
                    PyObject *postscale, int blocking, call_key_t *key) {
    memset(key, 0, sizeof *key);
    key->blocking = blocking;
    const char *format = view->format ? view->format : "B";
    size_t len = strlen(format);
    if (len >= FORMAT_LEN || view->ndim > 8 || !PyLong_Check(op))
        return 0;
    memcpy(key->format, format, len);
    key->itemsize = view->itemsize;
    key->ndim = view->ndim;
    for (int i = 0; i < view->ndim; i++)
        key->shape[i] = view->shape[i];
    key->op = PyLong_AsLong(op);
    if (key->op == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return as_double(prescale, &key->prescale) && as_double(postscale, &key->postscale);
}

/* An exact numpy array's buffer, C-contiguous (and writable where asked); 0 otherwise. */
static int get_buffer(Entry *self, PyObject *x, Py_buffer *view, int writable) {
    if ((PyObject *)Py_TYPE(x) != self->ndarray)
        return 0;
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(x, view, flags) != 0) {
        PyErr_Clear(); /* (read-only or strided: the ordinary path says which) */
        return 0;
    }
    return 1;
}

static int same_layout(const Py_buffer *a, const Py_buffer *b) {
    if (a->ndim != b->ndim || a->itemsize != b->itemsize ||
        strcmp(a->format ? a->format : "B", b->format ? b->format : "B") != 0)
        return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return 0;
    return 1;
}

static int overlap(const Py_buffer *a, const Py_buffer *b) {
    const char *pa = a->buf, *pb = b->buf;
    return pa < pb + b->len && pb < pa + a->len;
}

/* Entry(engine, has_lane, (try_lane, submit, wait, release), ndarray): addresses of the
 * engine and of the core's functions, as ints (from the cffi module). */
static int Entry_init(Entry *self, PyObject *args, PyObject *kwargs) {
    unsigned long long engine, fn[4];
    int has_lane;
    PyObject *ndarray;
    if (!PyArg_ParseTuple(args, "Kp(KKKK)O:Entry", &engine, &has_lane, &fn[0], &fn[1],
                          &fn[2], &fn[3], &ndarray))
        return -1;
    if (!engine || !fn[0] || !fn[1] || !fn[2] || !fn[3] || !PyType_Check(ndarray)) {
        PyErr_SetString(PyExc_ValueError, "Entry(engine, has_lane, functions, ndarray): a null "
                                          "address, or ndarray is not a type");
        return -1;
    }
    if (!self->table && !(self->table = PyMem_Calloc(TABLE_SIZE, sizeof *self->table))) {
        PyErr_NoMemory();
        return -1;
    }
    self->engine = (rs_engine_t *)(uintptr_t)engine;
    self->has_lane = has_lane;
    self->try_lane = (try_lane_fn)(uintptr_t)fn[0];
    self->submit = (submit_fn)(uintptr_t)fn[1];
    self->wait = (wait_fn)(uintptr_t)fn[2];
    self->release = (release_fn)(uintptr_t)fn[3];
    Py_INCREF(ndarray);
    Py_XSETREF(self->ndarray, ndarray);
    return 0;
}

static void Entry_dealloc(Entry *self) {
    Py_XDECREF(self->ndarray);
    PyMem_Free(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The remembered request for a call on `view` (NULL: none). */
static const entry_t *lookup(Entry *self, const Py_buffer *view, PyObject *op,
                             PyObject *prescale, PyObject *postscale, int blocking) {
    call_key_t key;
    if (!make_key(view, op, prescale, postscale, blocking, &key))
        return NULL;
    const entry_t *entry = &self->table[key_hash(&key) % TABLE_SIZE];
    return entry->used && memcmp(&entry->key, &key, sizeof key) == 0 ? entry : NULL;
}

/* run(x, out, op, prescale, postscale, name): allreduce x into out (out may be x) on the
 * lane. Returns out when the lane ran it; None when this module cannot take the call (the
 * caller's ordinary path does it all, nothing was posted); an int status otherwise: 0 when
 * every rank found that the engine must run it (the caller submits it there), else the
 * core's error status (the engine's last error has the words). */
static PyObject *Entry_run(Entry *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "run(x, out, op, prescale, postscale, name)");
        return NULL;
    }
    PyObject *x = args[0], *out = args[1], *name = args[5];
    if (!self->engine || !self->has_lane || !PyUnicode_CheckExact(name))
        Py_RETURN_NONE;
    Py_ssize_t name_len;
    const char *c_name = PyUnicode_AsUTF8AndSize(name, &name_len);
    if (!c_name || (Py_ssize_t)strlen(c_name) != name_len) { /* (a NUL inside: refused there) */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer send, recv;
    if (!get_buffer(self, x, &send, x == out))
        Py_RETURN_NONE;
    if (x != out) {
        if (!get_buffer(self, out, &recv, 1)) {
            PyBuffer_Release(&send);
            Py_RETURN_NONE;
        }
        if (!same_layout(&send, &recv) || overlap(&send, &recv)) {
            PyBuffer_Release(&recv);
            PyBuffer_Release(&send);
            Py_RETURN_NONE;
        }
    }
    const entry_t *entry = lookup(self, &send, args[2], args[3], args[4], 1);
    if (!entry) {
        if (x != out)
            PyBuffer_Release(&recv);
        PyBuffer_Release(&send);
        Py_RETURN_NONE;
    }
    self->taken++;
    rs_request_t request = entry->request; /* (a copy: another thread may use the entry) */
    request.sendbuf = send.buf;
    request.recvbuf = x == out ? send.buf : recv.buf;
    rs_engine_t *engine = self->engine;
    int ran = 0;
    rs_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = self->try_lane(engine, c_name, &request, &ran);
    Py_END_ALLOW_THREADS
    if (x != out)
        PyBuffer_Release(&recv);
    PyBuffer_Release(&send);
    if (status == RS_OK && ran) {
        Py_INCREF(out);
        return out;
    }
    return PyLong_FromLong(status);
}

/* remember(x, op, prescale, postscale, request_address): calls like this one (x's element
 * format and shape, the op and scale factors) use this request, which the caller built and
 * checked (the bytes are copied). */
static PyObject *Entry_remember(Entry *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "remember(x, op, prescale, postscale, address)");
        return NULL;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (!address || !self->table || !get_buffer(self, args[0], &view, 0))
        Py_RETURN_FALSE;
    const rs_request_t *request = (const rs_request_t *)(uintptr_t)address;
    call_key_t key;
    int ok = make_key(&view, args[1], args[2], args[3], request->blocking, &key);
    PyBuffer_Release(&view);
    if (!ok)
        Py_RETURN_FALSE;
    entry_t *entry = &self->table[key_hash(&key) % TABLE_SIZE];
    entry->key = key;
    memcpy(&entry->request, request, sizeof entry->request);
    entry->request.sendbuf = NULL;
    entry->request.recvbuf = NULL;
    entry->used = 1;
    Py_RETURN_TRUE;
}

/* close(): the engine is going away; every later call returns None. */
static PyObject *Entry_close(Entry *self, PyObject *unused) {
    self->engine = NULL;
    if (self->table)
        memset(self->table, 0, TABLE_SIZE * sizeof *self->table);
    Py_RETURN_NONE;
}

/* ---- a batch of asynchronous in-place allreduces ---- */

typedef struct {
    Py_ssize_t n, got; /* tensors; buffers taken so far */
    Py_buffer *views;
    rs_request_t *requests;
    const char **names;
} batch_t;

static void batch_free(batch_t *b) {
    for (Py_ssize_t i = 0; i < b->got; i++)
        PyBuffer_Release(&b->views[i]);
    PyMem_Free(b->views);
    PyMem_Free(b->requests);
    PyMem_Free(b->names);
}

/* 1 when every tensor is an exact array with a remembered request and every name a str
 * without a NUL (the batch's requests then filled in); 0 otherwise. */
static int batch_fill(Entry *self, batch_t *b, PyObject *arrays, PyObject *names, PyObject *op,
                      PyObject *prescale, PyObject *postscale) {
    for (Py_ssize_t i = 0; i < b->n; i++) {
        PyObject *name = PyList_GET_ITEM(names, i);
        Py_ssize_t len;
        const char *c_name = PyUnicode_CheckExact(name) ? PyUnicode_AsUTF8AndSize(name, &len)
                                                         : NULL;
        if (!c_name || (Py_ssize_t)strlen(c_name) != len) {
            PyErr_Clear();
            return 0;
        }
        if (!get_buffer(self, PyList_GET_ITEM(arrays, i), &b->views[i], 1))
            return 0;
        b->got++;
        const entry_t *entry = lookup(self, &b->views[i], op, prescale, postscale, 0);
        if (!entry)
            return 0;
        b->requests[i] = entry->request;
        b->requests[i].sendbuf = b->requests[i].recvbuf = b->views[i].buf;
        b->names[i] = c_name;
    }
    return 1;
}

static PyObject *ids_list(const int64_t *ids, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        PyObject *id = PyLong_FromLongLong(ids[i]);
        if (!id) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, id);
    }
    return list;
}

/* start_group(arrays, names, op, prescale, postscale): asynchronous in-place allreduces of
 * the arrays (lists of equal length), submitted in one call (one group: negotiated and
 * fused as one unit). Returns the handle ids (a list); None when this module cannot take
 * the batch (nothing submitted: the ordinary path does it all); an int status when the
 * core refused it (its last error has the words). */
static PyObject *Entry_start_group(Entry *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "start_group(arrays: list, names: list, op, "
                                          "prescale, postscale)");
        return NULL;
    }
    batch_t b = {.n = PyList_GET_SIZE(args[0])};
    if (!self->engine || b.n < 1 || b.n > BATCH_MAX || PyList_GET_SIZE(args[1]) != b.n)
        Py_RETURN_NONE;
    b.views = PyMem_Calloc((size_t)b.n, sizeof *b.views);
    b.requests = PyMem_Malloc((size_t)b.n * sizeof *b.requests);
    b.names = PyMem_Malloc((size_t)b.n * sizeof *b.names);
    int64_t *ids = PyMem_Malloc((size_t)b.n * sizeof *ids);
    PyObject *result = NULL;
    if (!b.views || !b.requests || !b.names || !ids) {
        result = PyErr_NoMemory();
    } else if (!batch_fill(self, &b, args[0], args[1], args[2], args[3], args[4])) {
        Py_INCREF(Py_None);
        result = Py_None;
    } else {
        rs_status_t status = self->submit(self->engine, b.names, b.requests, (int)b.n, ids);
        self->taken += (unsigned long long)b.n;
        result = status == RS_OK ? ids_list(ids, b.n) : PyLong_FromLong(status);
    }
    batch_free(&b);
    PyMem_Free(ids);
    return result;
}

/* ---- waiting for handles ---- */

/* wait(ids, slice_seconds): wait for every handle of the list (with the GIL released, in
 * slices, Python's signal handlers run between them: Ctrl-C gets through). Returns None
 * when all succeeded, else the list of their statuses. */
static PyObject *Entry_wait(Entry *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "wait(ids: list, slice_seconds)");
        return NULL;
    }
    double slice = PyFloat_AsDouble(args[1]);
    if (slice == -1.0 && PyErr_Occurred())
        return NULL;
    if (!self->engine) {
        PyErr_SetString(PyExc_ValueError, "wait: the engine is closed");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    int failed = 0;
    rs_status_t *statuses = PyMem_Calloc((size_t)(n ? n : 1), sizeof *statuses);
    if (!statuses)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = PyLong_AsLongLong(PyList_GET_ITEM(args[0], i));
        if (id == -1 && PyErr_Occurred())
            goto error;
        int done = 0;
        rs_status_t st;
        for (;;) {
            rs_engine_t *engine = self->engine;
            if (!engine) { /* (closed by another thread between slices) */
                PyErr_SetString(PyExc_ValueError, "wait: the engine is closed");
                goto error;
            }
            Py_BEGIN_ALLOW_THREADS
            st = self->wait(engine, id, slice, &done);
            Py_END_ALLOW_THREADS
            if (st != RS_OK || done)
                break;
            if (PyErr_CheckSignals() < 0)
                goto error;
        }
        statuses[i] = st;
        failed |= st != RS_OK;
    }
    PyObject *result = Py_None;
    if (failed) {
        result = PyList_New(n);
        for (Py_ssize_t i = 0; result && i < n; i++)
            PyList_SET_ITEM(result, i, PyLong_FromLong(statuses[i]));
    } else {
        Py_INCREF(result);
    }
    PyMem_Free(statuses);
    return result;
error:
    PyMem_Free(statuses);
    return NULL;
}

/* release(ids): release every handle of the list. */
static PyObject *Entry_release(Entry *self, PyObject *ids) {
    if (!PyList_CheckExact(ids)) {
        PyErr_SetString(PyExc_TypeError, "release(ids: list)");
        return NULL;
    }
    for (Py_ssize_t i = 0; self->engine && i < PyList_GET_SIZE(ids); i++) {
        int64_t id = PyLong_AsLongLong(PyList_GET_ITEM(ids, i));
        if (id == -1 && PyErr_Occurred())
            return NULL;
        self->release(self->engine, id);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Entry_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Entry_run, METH_FASTCALL,
     "run(x, out, op, prescale, postscale, name): out | None | int status"},
    {"remember", (PyCFunction)(void (*)(void))Entry_remember, METH_FASTCALL,
     "remember(x, op, prescale, postscale, request_address) -> bool"},
    {"start_group", (PyCFunction)(void (*)(void))Entry_start_group, METH_FASTCALL,
     "start_group(arrays, names, op, prescale, postscale): ids | None | int status"},
    {"wait", (PyCFunction)(void (*)(void))Entry_wait, METH_FASTCALL,
     "wait(ids, slice_seconds): None | statuses"},
    {"release", (PyCFunction)Entry_release, METH_O, "release(ids)"},
    {"close", (PyCFunction)Entry_close, METH_NOARGS, "forget the engine"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Entry_members[] = {
    {"taken", T_ULONGLONG, offsetof(Entry, taken), READONLY,
     "calls handed to the core from here (the rest went the ordinary way)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ringsync._fastcall.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The native entry of one engine's hot calls (see native/python/fastcall.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Entry_init,
    .tp_dealloc = (destructor)Entry_dealloc,
    .tp_methods = Entry_methods,
    .tp_members = Entry_members,
};

static struct PyModuleDef fastcall_module = {
    PyModuleDef_HEAD_INIT, "ringsync._fastcall",
    "The native entry of an engine's hot calls (see native/python/fastcall.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void) {
    if (PyType_Ready(&EntryType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&fastcall_module);
    if (!module)
        return NULL;
    Py_INCREF(&EntryType);
    if (PyModule_AddObject(module, "Entry", (PyObject *)&EntryType) < 0) {
        Py_DECREF(&EntryType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
