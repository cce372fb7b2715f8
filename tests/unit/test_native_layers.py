"""The native core is layered: each source file calls only files listed before it in
native/build_native.py's SOURCES (so no two files call each other in a loop), and nothing
above the transports calls a transport's functions by name (only through the table)."""
import ast
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(ROOT, "native")
TRANSPORTS = {"transport_tcp", "transport_shm"}
# Files that may name a transport: the transports themselves and comm.c, which picks them.
TRANSPORT_USERS = TRANSPORTS | {"comm"}


def _sources():
    tree = ast.parse(open(os.path.join(NATIVE, "build_native.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "SOURCES":
            return [ast.literal_eval(e)[:-2] for e in node.value.elts]
    raise AssertionError("no SOURCES in build_native.py")


def _symbols(obj):
    """(defined, undefined) global symbols of an object file."""
    out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TDRB":
            defined.add(parts[2])
        elif len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
    return defined, undefined


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    """file -> {file it calls: [symbols]}, from the compiled objects."""
    if not (shutil.which("gcc") and shutil.which("nm")):
        pytest.skip("needs gcc and nm")
    out = tmp_path_factory.mktemp("objs")
    defined_in, needs = {}, {}
    for name in _sources():
        obj = str(out / f"{name}.o")
        subprocess.run(["gcc", "-std=c11", "-c", "-I", os.path.join(NATIVE, "include"),
                        os.path.join(NATIVE, "src", f"{name}.c"), "-o", obj], check=True)
        defined, needs[name] = _symbols(obj)
        defined_in.update({symbol: name for symbol in defined})
    graph = {}
    for name, undefined in needs.items():
        edges = {}
        for symbol in undefined:
            target = defined_in.get(symbol)
            if target and target != name:
                edges.setdefault(target, []).append(symbol)
        graph[name] = edges
    return graph


def test_every_file_calls_only_files_below_it(calls):
    order = {name: i for i, name in enumerate(_sources())}
    upward = [f"{name} -> {target} ({', '.join(sorted(symbols))})"
              for name, edges in calls.items() for target, symbols in edges.items()
              if order[target] > order[name]]
    assert not upward, "calls up the layers (a loop in the making):\n" + "\n".join(upward)


def test_nothing_above_the_transports_names_them(calls):
    by_name = [f"{name} -> {target} ({', '.join(sorted(symbols))})"
               for name, edges in calls.items() if name not in TRANSPORT_USERS
               for target, symbols in edges.items() if target in TRANSPORTS]
    assert not by_name, "transport functions called by name:\n" + "\n".join(by_name)


def test_every_source_file_is_built():
    on_disk = {f[:-2] for f in os.listdir(os.path.join(NATIVE, "src")) if f.endswith(".c")}
    assert on_disk == set(_sources())
