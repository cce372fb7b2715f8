"""The native core is layered: each source file calls only files listed before it in
native/build_native.py's SOURCES (so no two files call each other in a loop), and nothing
above the transports calls a transport's functions by name (only through the table).

The #include lines follow the same layers. A header belongs to the source files that
define the functions (and variables) it names: status.h to status.c, engine.h to
engine.c. A file may include a header only if every file the header belongs to is at or
below it in SOURCES, counting what the header includes in turn. A header that names no
function of the core (types and constants: comm.h, transport.h, work.h) belongs to no file
and may be included anywhere its own includes allow. The public ringsync.h is the API's
contract and may be included everywhere (the calls themselves are checked above). And a
header is one concern: x.h names functions of x.c only (or of no file)."""
import ast
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(ROOT, "native")
SRC = os.path.join(NATIVE, "src")
PUBLIC_HEADER = "ringsync.h"
TRANSPORTS = {"tcp_setup", "transport_tcp", "transport_shm"}
# Files that may name a transport: the transports themselves and comm.c, which picks them.
TRANSPORT_USERS = TRANSPORTS | {"comm"}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


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
def objects(tmp_path_factory):
    """(symbol -> the file that defines it, file -> the symbols it needs), compiled."""
    if not (shutil.which("gcc") and shutil.which("nm")):
        pytest.skip("needs gcc and nm")
    out = tmp_path_factory.mktemp("objs")
    defined_in, needs = {}, {}
    for name in _sources():
        obj = str(out / f"{name}.o")
        subprocess.run(["gcc", "-std=c11", "-c", "-I", os.path.join(NATIVE, "include"),
                        os.path.join(SRC, f"{name}.c"), "-o", obj], check=True)
        defined, needs[name] = _symbols(obj)
        defined_in.update({symbol: name for symbol in defined})
    return defined_in, needs


@pytest.fixture(scope="module")
def calls(objects):
    """file -> {file it calls: [symbols]}, from the compiled objects."""
    defined_in, needs = objects
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
    on_disk = {f[:-2] for f in os.listdir(SRC) if f.endswith(".c")}
    assert on_disk == set(_sources())


# ---- #include lines ----

def _code(text):
    """C text without comments and string or character literals (their words name
    nothing)."""
    return re.sub(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', " ", text,
                  flags=re.S)


def _read(name):
    return open(os.path.join(SRC, name)).read()


def _headers():
    return sorted(f for f in os.listdir(SRC) if f.endswith(".h"))


def _includes(name):
    """The core's headers that `name` (a file in native/src) includes, ringsync.h aside."""
    found = INCLUDE.findall(_read(name))
    unknown = [h for h in found if h != PUBLIC_HEADER and not os.path.exists(os.path.join(SRC, h))]
    assert not unknown, f"{name} includes headers that are not in native/src: {unknown}"
    return [h for h in found if h != PUBLIC_HEADER]


def _owners(header, defined_in):
    """The source files whose functions or variables `header` itself names."""
    names = set(re.findall(r"[A-Za-z_]\w*", _code(_read(header))))
    return {defined_in[n] for n in names if n in defined_in}


def _header_levels(defined_in, order):
    """header -> the highest place in SOURCES of a file it belongs to, through what it
    includes too (-1: it belongs to no file)."""
    levels = {}

    def level(header, seen=()):
        if header in levels:
            return levels[header]
        assert header not in seen, f"headers include each other: {' -> '.join(seen + (header,))}"
        own = [order[f] for f in _owners(header, defined_in)]
        inner = [level(h, seen + (header,)) for h in _includes(header)]
        levels[header] = max(own + inner + [-1])
        return levels[header]

    for h in _headers():
        level(h)
    return levels


def include_violations(defined_in, sources):
    """Every #include of a header that belongs to a file above the includer in `sources`
    (or, outside the transports and comm.c, to a transport), in words."""
    order = {name: i for i, name in enumerate(sources)}
    levels = _header_levels(defined_in, order)
    top = {h: max((order[f] for f in _owners(h, defined_in)), default=None) for h in _headers()}
    bad = []
    # A source file sits at its place in SOURCES; a header that belongs to files, at the
    # highest of them (it may include what they may); one that belongs to none is judged
    # where it is included.
    includers = [(f"{name}.c", order[name], name) for name in sources]
    includers += [(h, top[h], None) for h in _headers() if top[h] is not None]
    for includer, place, name in includers:
        for header in _includes(includer):
            if levels[header] > place:
                above = sorted(f for f in _owners_through(header, defined_in)
                               if order[f] > place)
                bad.append(f"{includer} includes {header}, which needs {', '.join(above)}: "
                           f"above it in SOURCES")
            if name is not None and name not in TRANSPORT_USERS:
                named = sorted(_owners_through(header, defined_in) & TRANSPORTS)
                if named:
                    bad.append(f"{includer} includes {header}, a transport's "
                               f"({', '.join(named)}): only comm.c picks transports")
    return bad


def _owners_through(header, defined_in, seen=None):
    """The files a header belongs to, itself or through what it includes."""
    seen = seen if seen is not None else set()
    if header in seen:
        return set()
    seen.add(header)
    owners = set(_owners(header, defined_in))
    for inner in _includes(header):
        owners |= _owners_through(inner, defined_in, seen)
    return owners


def test_every_file_includes_only_headers_of_files_below_it(objects):
    defined_in, _ = objects
    bad = include_violations(defined_in, _sources())
    assert not bad, "#include up the layers:\n" + "\n".join(bad)


def test_a_header_is_its_own_files_or_no_files(objects):
    """One header per concern: x.h names functions of x.c only; a header with no x.c of
    its own names none of the core's (types and constants only)."""
    defined_in, _ = objects
    sources = set(_sources())
    bad = []
    for header in _headers():
        owners, own = _owners(header, defined_in), header[:-2]
        allowed = {own} if own in sources else set()
        if owners - allowed:
            bad.append(f"{header} names functions of {', '.join(sorted(owners - allowed))}")
    assert not bad, "headers that mix concerns:\n" + "\n".join(bad)


def test_the_include_check_finds_an_include_up_the_layers(objects):
    """The check above is no formality: moving a file below a header it includes (here:
    engine.c under negotiate.c, whose header it includes) is reported."""
    defined_in, _ = objects
    sources = _sources()
    moved = [s for s in sources if s != "engine"]
    moved.insert(moved.index("negotiate"), "engine")
    bad = include_violations(defined_in, moved)
    assert any(line.startswith("engine.c includes") and "negotiate" in line for line in bad), bad
