/* The part of XLA's FFI C API (xla/ffi/api/c_api.h, API version 0.x) that xla_ffi.c uses,
 * declared here so that the core builds without jaxlib. XLA's structs begin with their
 * size and only grow, so a frame from a newer XLA still reads right;
 * tests/unit/test_xla_ffi.py compiles these declarations beside jaxlib's header and checks
 * every size and offset against it. */
#ifndef RS_XLA_FFI_ABI_H
#define RS_XLA_FFI_ABI_H

#include <stddef.h>
#include <stdint.h>

enum { XLA_EXT_METADATA = 1, XLA_STAGE_EXECUTE = 3, XLA_BUFFER = 1, XLA_API_MAJOR = 0,
       XLA_API_MINOR = 1 };
enum { XLA_ATTR_SCALAR = 3, XLA_ATTR_STRING = 4 };
enum { XLA_ERR_INVALID_ARGUMENT = 3, XLA_ERR_FAILED_PRECONDITION = 9, XLA_ERR_ABORTED = 10,
       XLA_ERR_INTERNAL = 13, XLA_ERR_UNAVAILABLE = 14, XLA_ERR_DEADLINE_EXCEEDED = 4 };
/* XLA's element types (xla_data.proto PrimitiveType) */
enum { XLA_S8 = 2, XLA_S16 = 3, XLA_S32 = 4, XLA_S64 = 5, XLA_U8 = 6, XLA_U16 = 7,
       XLA_F16 = 10, XLA_F32 = 11, XLA_F64 = 12, XLA_BF16 = 16 };

struct rs_xla_ext {
    size_t struct_size;
    int type;
    struct rs_xla_ext *next;
};

typedef struct {
    size_t struct_size;
    struct rs_xla_ext *extension_start;
    int major_version;
    int minor_version;
} rs_xla_version_t;

typedef struct {
    size_t struct_size;
    struct rs_xla_ext *extension_start;
    const char *message;
    int errc;
} rs_xla_error_args_t;

struct rs_xla_api {
    size_t struct_size;
    struct rs_xla_ext *extension_start;
    rs_xla_version_t api_version;
    const void *internal_api;
    void *(*error_create)(rs_xla_error_args_t *args); /* the first of the API's functions */
};

struct rs_xla_buffer {
    size_t struct_size;
    struct rs_xla_ext *extension_start;
    int dtype;
    void *data;
    int64_t rank;
    int64_t *dims;
};

struct rs_xla_list { /* XLA_FFI_Args and XLA_FFI_Rets */
    size_t struct_size;
    struct rs_xla_ext *extension_start;
    int64_t size;
    int *types;
    void **items;
};

struct rs_xla_span {
    const char *ptr;
    size_t len;
};

struct rs_xla_scalar {
    int dtype;
    void *value;
};

struct rs_xla_attrs {
    size_t struct_size;
    struct rs_xla_ext *extension_start;
    int64_t size;
    int *types;
    struct rs_xla_span **names;
    void **attrs;
};

struct rs_xla_frame {
    size_t struct_size;
    struct rs_xla_ext *extension_start;
    const struct rs_xla_api *api;
    void *ctx;
    int stage;
    struct rs_xla_list args;
    struct rs_xla_list rets;
    struct rs_xla_attrs attrs;
    void *future;
};

typedef struct {
    size_t struct_size;
    rs_xla_version_t api_version;
    uint32_t traits;
} rs_xla_metadata_t;

struct rs_xla_metadata_ext {
    struct rs_xla_ext extension_base;
    rs_xla_metadata_t *metadata;
};

#endif
