"""native/src/xla_ffi_abi.h declares the part of XLA's FFI C API that the core's custom
call reads (so that the core builds without jaxlib). Compiled beside jaxlib's own
xla/ffi/api/c_api.h, every size, offset and constant must agree with it."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "native", "src")

# (our struct, XLA's struct, fields both name alike)
STRUCTS = [
    ("struct rs_xla_ext", "XLA_FFI_Extension_Base", ["struct_size", "type", "next"]),
    ("rs_xla_version_t", "XLA_FFI_Api_Version",
     ["struct_size", "extension_start", "major_version", "minor_version"]),
    ("rs_xla_error_args_t", "XLA_FFI_Error_Create_Args",
     ["struct_size", "extension_start", "message", "errc"]),
    ("struct rs_xla_buffer", "XLA_FFI_Buffer",
     ["struct_size", "extension_start", "dtype", "data", "rank", "dims"]),
    ("struct rs_xla_list", "XLA_FFI_Args", ["struct_size", "extension_start", "size", "types"]),
    ("struct rs_xla_list", "XLA_FFI_Rets", ["struct_size", "extension_start", "size", "types"]),
    ("struct rs_xla_span", "XLA_FFI_ByteSpan", ["ptr", "len"]),
    ("struct rs_xla_scalar", "XLA_FFI_Scalar", ["dtype", "value"]),
    ("struct rs_xla_attrs", "XLA_FFI_Attrs",
     ["struct_size", "extension_start", "size", "types", "names", "attrs"]),
    ("struct rs_xla_frame", "XLA_FFI_CallFrame",
     ["struct_size", "extension_start", "api", "ctx", "stage", "args", "rets", "attrs",
      "future"]),
    ("rs_xla_metadata_t", "XLA_FFI_Metadata", ["struct_size", "api_version", "traits"]),
    ("struct rs_xla_metadata_ext", "XLA_FFI_Metadata_Extension",
     ["extension_base", "metadata"]),
    ("struct rs_xla_api", "XLA_FFI_Api",
     ["struct_size", "extension_start", "api_version", "internal_api"]),
]
# Our names for fields XLA names otherwise.
RENAMED = [("struct rs_xla_list", "XLA_FFI_Args", "items", "args"),
           ("struct rs_xla_list", "XLA_FFI_Rets", "items", "rets"),
           ("struct rs_xla_api", "XLA_FFI_Api", "error_create", "XLA_FFI_Error_Create")]
CONSTANTS = [("XLA_EXT_METADATA", "XLA_FFI_Extension_Metadata"),
             ("XLA_STAGE_EXECUTE", "XLA_FFI_ExecutionStage_EXECUTE"),
             ("XLA_BUFFER", "XLA_FFI_ArgType_BUFFER"), ("XLA_BUFFER", "XLA_FFI_RetType_BUFFER"),
             ("XLA_ATTR_SCALAR", "XLA_FFI_AttrType_SCALAR"),
             ("XLA_ATTR_STRING", "XLA_FFI_AttrType_STRING"),
             ("XLA_API_MAJOR", "XLA_FFI_API_MAJOR"),
             ("XLA_ERR_INVALID_ARGUMENT", "XLA_FFI_Error_Code_INVALID_ARGUMENT"),
             ("XLA_ERR_FAILED_PRECONDITION", "XLA_FFI_Error_Code_FAILED_PRECONDITION"),
             ("XLA_ERR_INTERNAL", "XLA_FFI_Error_Code_INTERNAL"),
             ("XLA_ERR_UNAVAILABLE", "XLA_FFI_Error_Code_UNAVAILABLE"),
             ("XLA_ERR_DEADLINE_EXCEEDED", "XLA_FFI_Error_Code_DEADLINE_EXCEEDED")] + [
    (f"XLA_{t}", f"XLA_FFI_DataType_{t}")
    for t in ["S8", "S16", "S32", "S64", "U8", "U16", "F16", "F32", "F64", "BF16"]]


def _checks():
    lines = []
    for ours, theirs, fields in STRUCTS:
        for field in fields:
            lines.append(f"_Static_assert(offsetof({ours}, {field}) == offsetof({theirs}, "
                         f"{field}), \"{ours}.{field}\");")
    for ours, theirs, our_field, their_field in RENAMED:
        lines.append(f"_Static_assert(offsetof({ours}, {our_field}) == offsetof({theirs}, "
                     f"{their_field}), \"{ours}.{our_field}\");")
    for ours, theirs in CONSTANTS:
        lines.append(f"_Static_assert((int){ours} == (int){theirs}, \"{ours}\");")
    # Our minor version may not be newer than the header's.
    lines.append('_Static_assert(XLA_API_MINOR <= XLA_FFI_API_MINOR, "minor version");')
    return "\n".join(lines)


def _compile(tmp_path, abi_dir):
    """gcc's verdict on the checks, with xla_ffi_abi.h taken from abi_dir."""
    ffi = pytest.importorskip("jax.ffi")
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        pytest.skip("needs a C compiler")
    source = tmp_path / "abi.c"
    source.write_text('#include <stddef.h>\n#include "xla/ffi/api/c_api.h"\n'
                      '#include "xla_ffi_abi.h"\n' + _checks() + "\nint main(void) { return 0; }\n")
    return subprocess.run([cc, "-std=c11", "-fsyntax-only", "-I", ffi.include_dir(),
                           "-I", str(abi_dir), str(source)], capture_output=True, text=True)


def test_declarations_match_jaxlibs_header(tmp_path):
    built = _compile(tmp_path, SRC)
    assert built.returncode == 0, built.stderr


def test_a_wrong_declaration_is_caught(tmp_path):
    """The check itself: two fields swapped fail to compile, naming the struct."""
    header = open(os.path.join(SRC, "xla_ffi_abi.h")).read()
    swapped = header.replace("    int64_t rank;\n    int64_t *dims;",
                             "    int64_t *dims;\n    int64_t rank;")
    assert swapped != header
    (tmp_path / "xla_ffi_abi.h").write_text(swapped)
    built = _compile(tmp_path, tmp_path)
    assert built.returncode != 0 and "rs_xla_buffer" in built.stderr, built.stderr
