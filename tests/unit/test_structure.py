"""The package's shape, read from its source with `ast` (nothing is imported):

- no import loop between its modules, counting imports inside functions (a loop hidden in
  a function still makes the modules one lump that cannot be read or tested apart);
- no module imports the package face (ringsync/__init__.py only hands names on; job state
  lives in ringsync/_context.py);
- no public function or method takes a parameter whose name starts with "_" (a private
  switch on a public call is a second entry point in disguise);
- nothing but the Communicator that owns it (_core.py) and _submit.py touches `_submitter`;
- no file over 800 lines, no class over 350.

The C core's layers are checked by test_native_layers.py.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ringsync"
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 350
# (_allreduce: the Communicator's allreduce family, a mixin of that class)
SUBMITTER_OWNERS = {"ringsync._submit", "ringsync._core", "ringsync._allreduce"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict:
    """{dotted name: (path, parsed tree)} for every .py file of the package."""
    return {module_name(p): (p, ast.parse(p.read_text(), str(p)))
            for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = package_modules()


def absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (resolving its dots against `module`)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, tree) -> list:
    """[(imported package module, line)] for every import statement anywhere in the file
    (module level, in functions, under `if`): `from a import b` counts as importing a.b
    when a.b is a module of the package, else as importing a."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = absolute(module, path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
    return [(name, line) for name, line in found if name in MODULES and name != module]


def import_graph() -> dict:
    return {name: imports_of(name, path, tree) for name, (path, tree) in MODULES.items()}


def strongly_connected(graph: dict) -> list:
    """Tarjan's algorithm: the graph's components of more than one module (the loops)."""
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _line in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return loops


def describe_loop(graph: dict, loop: list) -> str:
    members = set(loop)
    edges = [f"{a} -> {b} (line {line})" for a in loop for b, line in graph[a] if b in members]
    return "; ".join(edges)


def test_no_import_loop_between_modules():
    graph = import_graph()
    loops = strongly_connected(graph)
    assert not loops, "import loops:\n" + "\n".join(describe_loop(graph, loop) for loop in loops)


def test_no_module_imports_the_package_face():
    face_users = [f"{name} (line {line})" for name, edges in import_graph().items()
                  for imported, line in edges if imported == "ringsync"]
    assert not face_users, f"these import ringsync/__init__.py: {face_users}"


def public_functions(tree):
    """(qualified name, function node) for module-level functions and methods of classes
    (at any depth of classes) whose own name and enclosing classes' names are public;
    __init__ and __call__ count as public. Functions nested in functions are not API."""
    def public(name):
        return not name.startswith("_") or name in ("__init__", "__call__")

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and public(node.name):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                yield from walk(node.body, f"{prefix}{node.name}.")

    yield from walk(tree.body, "")


def underscore_parameters(function) -> list:
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return [n for n in names if n.startswith("_")]


def test_no_public_function_has_an_underscore_parameter():
    offenders = [f"{name}.{qualified}({', '.join(params)}) line {fn.lineno}"
                 for name, (_path, tree) in MODULES.items()
                 for qualified, fn in public_functions(tree)
                 for params in [underscore_parameters(fn)] if params]
    assert not offenders, f"public functions with '_' parameters: {offenders}"


def submitter_users(modules: dict) -> list:
    return [f"{name} line {node.lineno}" for name, (_path, tree) in modules.items()
            if name not in SUBMITTER_OWNERS for node in ast.walk(tree)
            if (isinstance(node, ast.Attribute) and node.attr == "_submitter")
            or (isinstance(node, ast.Name) and node.id == "_submitter")]


def test_only_the_communicator_touches_its_submitter():
    users = submitter_users(MODULES)
    assert not users, f"_submitter used outside {sorted(SUBMITTER_OWNERS)}: {users}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_file_and_classes_fit_their_limits(name):
    path, tree = MODULES[name]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{path}: {lines} lines (at most {MAX_FILE_LINES})"
    big = [f"{node.name}: {node.end_lineno - node.lineno + 1} lines (line {node.lineno})"
           for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
           and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"{path}: classes over {MAX_CLASS_LINES} lines: {big}"


# ---- the checks check: each finds what it is for in a small made-up source ----

def _tree(source: str):
    return ast.parse(source)


def test_the_loop_finder_sees_a_loop_through_a_function_level_import():
    graph = {"a": [("b", 1)], "b": [("c", 2)], "c": [("a", 3)], "d": [("a", 1)]}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": [("b", 1)], "b": []}) == []
    tree = _tree("def f():\n    from ._core import Communicator\n")
    assert imports_of("ringsync._context", PACKAGE / "_context.py", tree) == [
        ("ringsync._core", 2)]


def test_relative_imports_resolve_against_their_package():
    tree = _tree("from .. import errors\nfrom . import optimizer\nfrom ..ops import ReduceOp\n")
    path = PACKAGE / "torch" / "mpi_ops.py"
    assert [n for n, _ in imports_of("ringsync.torch.mpi_ops", path, tree)] == [
        "ringsync.errors", "ringsync.torch.optimizer", "ringsync.ops"]
    face = _tree("from . import allreduce\n")
    assert imports_of("ringsync.objects", PACKAGE / "objects.py", face) == [("ringsync", 1)]


def test_the_parameter_check_sees_methods_and_skips_nested_functions():
    tree = _tree("def f(x, _flag=1): pass\n"
                 "class C:\n    def m(self, *, _blocking=True): pass\n"
                 "    def _private(self, _x): pass\n"
                 "def g(x):\n    def inner(_unused): pass\n")
    found = {q: underscore_parameters(fn) for q, fn in public_functions(tree)}
    assert found == {"f": ["_flag"], "C.m": ["_blocking"], "g": []}


def test_the_submitter_check_sees_a_use_outside_its_owners():
    source = _tree("def f(comm):\n    return comm._submitter.run(comm, [], None, 'x')\n")
    assert submitter_users({"ringsync.torch.optimizer": (None, source)}) == [
        "ringsync.torch.optimizer line 2"]
    assert submitter_users({"ringsync._core": (None, source)}) == []
