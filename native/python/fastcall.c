/* ringsync._fastcall: the native entry of a small blocking allreduce on the same-host lane.
 *
 * A 4-byte allreduce on the lane takes under a microsecond in C, and the Python that
 * reaches it through cffi (argument checks, the request cache's lookups, cffi's
 * conversions) took three times that. This module is the rest of that path in C: it
 * takes the caller's numpy arrays, finds the request the Python side built and checked
 * for arrays like them (ringsync/_submit.py remembers each one here), fills in the
 * buffers and calls the core's rs_engine_try_lane with the GIL released.
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

#define FORMAT_LEN 8   /* buffer format strings longer than this are not cached */
#define TABLE_SIZE 64  /* requests remembered per lane (direct-mapped by key hash) */

/* What decides a request: the arrays' element format and shape, the op and scale factors
 * (the Python cache's key, in buffer terms). Zeroed before filling, so memcmp compares. */
typedef struct {
    char format[FORMAT_LEN];
    Py_ssize_t itemsize;
    int ndim;
    int64_t shape[8];
    long op;
    double prescale, postscale;
} call_key_t;

typedef struct {
    int used;
    call_key_t key;
    rs_request_t request; /* as the Python side built it; the buffers are filled per call */
} entry_t;

typedef struct {
    PyObject_HEAD
    rs_engine_t *engine; /* NULL once closed: every call then returns None */
    try_lane_fn try_lane;
    PyObject *ndarray; /* numpy.ndarray: only exact arrays are taken here */
    unsigned long long taken; /* calls that reached the core from here (tests read it) */
    entry_t table[TABLE_SIZE];
} Lane;

static uint64_t key_hash(const call_key_t *k) {
    const unsigned char *p = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < sizeof *k; i++)
        h = (h ^ p[i]) * 1099511628211ULL;
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
                    PyObject *postscale, call_key_t *key) {
    memset(key, 0, sizeof *key);
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
static int get_buffer(Lane *self, PyObject *x, Py_buffer *view, int writable) {
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

static int Lane_init(Lane *self, PyObject *args, PyObject *kwargs) {
    unsigned long long engine, try_lane;
    PyObject *ndarray;
    if (!PyArg_ParseTuple(args, "KKO:Lane", &engine, &try_lane, &ndarray))
        return -1;
    if (!engine || !try_lane || !PyType_Check(ndarray)) {
        PyErr_SetString(PyExc_ValueError, "Lane(engine, try_lane, ndarray): null address or "
                                          "not a type");
        return -1;
    }
    self->engine = (rs_engine_t *)(uintptr_t)engine;
    self->try_lane = (try_lane_fn)(uintptr_t)try_lane;
    Py_INCREF(ndarray);
    Py_XSETREF(self->ndarray, ndarray);
    return 0;
}

static void Lane_dealloc(Lane *self) {
    Py_XDECREF(self->ndarray);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* run(x, out, op, prescale, postscale, name): allreduce x into out (out may be x) on the
 * lane. Returns out when the lane ran it; None when this module cannot take the call (the
 * caller's ordinary path does it all, nothing was posted); an int status otherwise: 0 when
 * every rank found that the engine must run it (the caller submits it there), else the
 * core's error status (the engine's last error has the words). */
static PyObject *Lane_run(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "run(x, out, op, prescale, postscale, name)");
        return NULL;
    }
    PyObject *x = args[0], *out = args[1], *name = args[5];
    if (!self->engine || !PyUnicode_CheckExact(name))
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
    call_key_t key;
    entry_t *entry = NULL;
    if (make_key(&send, args[2], args[3], args[4], &key)) {
        entry = &self->table[key_hash(&key) % TABLE_SIZE];
        if (!entry->used || memcmp(&entry->key, &key, sizeof key) != 0)
            entry = NULL;
    }
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
static PyObject *Lane_remember(Lane *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "remember(x, op, prescale, postscale, address)");
        return NULL;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (!address || !get_buffer(self, args[0], &view, 0))
        Py_RETURN_FALSE;
    call_key_t key;
    int ok = make_key(&view, args[1], args[2], args[3], &key);
    PyBuffer_Release(&view);
    if (!ok)
        Py_RETURN_FALSE;
    entry_t *entry = &self->table[key_hash(&key) % TABLE_SIZE];
    entry->key = key;
    memcpy(&entry->request, (const void *)(uintptr_t)address, sizeof entry->request);
    entry->request.sendbuf = NULL;
    entry->request.recvbuf = NULL;
    entry->used = 1;
    Py_RETURN_TRUE;
}

/* close(): the engine is going away; every later call returns None. */
static PyObject *Lane_close(Lane *self, PyObject *unused) {
    self->engine = NULL;
    memset(self->table, 0, sizeof self->table);
    Py_RETURN_NONE;
}

static PyMethodDef Lane_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Lane_run, METH_FASTCALL,
     "run(x, out, op, prescale, postscale, name): out | None | int status"},
    {"remember", (PyCFunction)(void (*)(void))Lane_remember, METH_FASTCALL,
     "remember(x, op, prescale, postscale, request_address) -> bool"},
    {"close", (PyCFunction)Lane_close, METH_NOARGS, "forget the engine"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Lane_members[] = {
    {"taken", T_ULONGLONG, offsetof(Lane, taken), READONLY,
     "calls handed to the core from here (the rest went the ordinary way)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject LaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ringsync._fastcall.Lane",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Small blocking allreduces of one engine, straight to its same-host lane.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lane_init,
    .tp_dealloc = (destructor)Lane_dealloc,
    .tp_methods = Lane_methods,
    .tp_members = Lane_members,
};

static struct PyModuleDef fastcall_module = {
    PyModuleDef_HEAD_INIT, "ringsync._fastcall",
    "The native entry of small blocking allreduces (see native/python/fastcall.c).", -1, NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void) {
    if (PyType_Ready(&LaneType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&fastcall_module);
    if (!module)
        return NULL;
    Py_INCREF(&LaneType);
    if (PyModule_AddObject(module, "Lane", (PyObject *)&LaneType) < 0) {
        Py_DECREF(&LaneType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
