"""cffi build script: compiles native/ into the extension module ringsync._native.

Out-of-line API mode: setuptools runs this through `cffi_modules` in setup.py, so
`pip install .` (or an editable install) builds the core with no separate make step.
"""
import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(HERE, "include")
# Bottom to top: each file calls only files listed before it, and includes only their
# headers (or headers that belong to no file); tests/unit/test_native_layers.py checks both.
#   util, reduce, status, checked, auth   the bottom: strings and maps, kernels, error
#                                         records, checked sizes, the handshake's hashes
#   progress                              transfers through the transport table
#   tcp_socket, tcp_setup, transport_tcp, transport_shm
#                                         the transports (only comm.c names them)
#   topology, comm                        where the ranks sit; the communicator's life
#   adasum, ring, gather_log, doubling, pipeline, hierarchical, ordered, algorithms
#                                         the collective algorithms
#   timeline, records, negotiate, lane, execute
#                                         what the engine thread uses (and the lane, on
#                                         calling threads); records: the flight recorder
#                                         and straggler events
#   engine, submit, observe               the engine thread; the calling threads' side;
#                                         their view of its records and hang reports
#   xla_ffi                               the blocking allreduce as an XLA custom call
SOURCES = ["util.c", "reduce.c", "status.c", "checked.c", "auth.c", "progress.c",
           "tcp_socket.c", "tcp_setup.c", "transport_tcp.c", "transport_shm.c", "topology.c", "comm.c",
           "adasum.c", "ring.c", "gather_log.c", "doubling.c", "pipeline.c", "hierarchical.c", "ordered.c",
           "algorithms.c", "timeline.c", "records.c", "negotiate.c", "lane.c", "execute.c",
           "engine.c", "submit.c", "observe.c", "xla_ffi.c"]


def public_declarations():
    """The public header minus preprocessor lines, which cffi's cdef cannot read."""
    with open(os.path.join(INCLUDE, "ringsync.h")) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


ffibuilder = FFI()
ffibuilder.cdef(public_declarations())
# Called by xla_ffi.c when a slot is empty; ringsync/jax/_xla.py attaches the Python side.
ffibuilder.cdef('extern "Python+C" int rs_xla_refill(int slot);')
ffibuilder.set_source(
    "ringsync._native",
    '#include "ringsync.h"',
    # Paths relative to the project root, where setuptools runs the build.
    sources=[os.path.relpath(os.path.join(HERE, "src", s)) for s in SOURCES],
    include_dirs=[os.path.relpath(INCLUDE)],
    extra_compile_args=["-O3", "-flto", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-O3", "-flto"],
    libraries=["m", "pthread", "rt"],  # rt: shm_open on glibc before 2.34
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
