"""Sharded checkpoints, the format: every rank writes its own part, and a checkpoint saved
on N ranks loads on M. Framework-free: a framework's glue (ringsync.torch.checkpoint for
PyTorch models and optimizers) says what goes into the parts, and supplies a Codec (how its
tensors are copied, made, written and read).

`path` is a directory every rank of the set can reach (a shared file system across hosts).
A save writes generation k:

    path/gen-<k>/rank-<r>-of-<N>.pt    each rank's part: its slices of sharded tensors,
                                        rank 0's also the replicated state and `extra`;
                                        inside, the part's generation, rank and rank count
    path/gen-<k>/meta.json             by rank 0 once every part is on disk: the
                                        generation, the rank count, and each part's size
                                        and SHA-256
    path/checkpoint.json               then, by rank 0: the same, naming generation k

Every file is written to a temporary name, flushed to disk (fsync) and renamed into place,
so a crash or a killed rank at any point leaves checkpoint.json naming the previous
complete generation. The newest complete generation before k stays on disk (with its own
meta.json, so it loads without checkpoint.json: load(..., generation=k-1)); older ones are
removed after k is named.

A load checks the metadata, then every part's size and SHA-256 before it unpickles any
part, then each part's recorded generation and rank; the ranks of the set agree on the
outcome, so if any rank finds a problem, every rank raises the same CheckpointError naming
the file, what is wrong, and which generations are still intact.

A part holds slices of flat tensors ("pieces", each with the element range [a, b) of the
whole it covers) and whole values, under string keys. A load assembles the element ranges
its own ranks need from every saved part (Reader.range), so the rank count may change
between save and load.

Format 1 (before checksums: no sha256 in checkpoint.json, no meta.json, no identity in
the parts) is still read, with sizes checked only.
"""
import abc
import hashlib
import json
import os
import re
import shutil
from typing import NamedTuple, Optional

from ringsync._atomic import write_atomically
from ringsync.errors import CheckpointError
from ringsync.objects import allgather_object

__all__ = ["FORMAT", "META", "GENERATION_META", "CheckpointError", "Codec", "Parts", "Reader",
           "agreed", "generations", "open_checkpoint", "save_generation", "write_atomically"]

FORMAT = 2
_READABLE = (1, 2)
META = "checkpoint.json"
GENERATION_META = "meta.json"  # (gen-<k>/meta.json: the same content as checkpoint.json)
_MAX_RANKS = 1 << 20
_GENERATION = re.compile(r"gen-(\d+)$")
_SHA256 = re.compile(r"[0-9a-f]{64}$")
_MOVED = {"save": "ringsync.torch.checkpoint.save", "load": "ringsync.torch.checkpoint.load"}


def __getattr__(name):
    if name in _MOVED:  # (PyTorch's entry points live with the PyTorch glue)
        raise AttributeError(f"module 'ringsync.checkpoint' has no attribute '{name}': "
                             f"PyTorch models and optimizers are saved with {_MOVED[name]}")
    raise AttributeError(f"module 'ringsync.checkpoint' has no attribute '{name}'")


class Codec(abc.ABC):
    """What the format needs from a framework: its tensors flat on the host, new ones, and
    a part's bytes. A part is a dict of plain values and the framework's tensors."""

    @abc.abstractmethod
    def flat_copy(self, tensor):
        """A one-dimensional host copy of tensor (whatever its shape or device)."""

    @abc.abstractmethod
    def numel(self, tensor) -> int:
        """The number of elements of tensor."""

    @abc.abstractmethod
    def empty(self, n: int, like):
        """A one-dimensional host tensor of n elements of like's dtype."""

    @abc.abstractmethod
    def dumps(self, part: dict) -> bytes:
        """part as bytes (may raise: a value that cannot be saved)."""

    @abc.abstractmethod
    def load(self, file: str) -> dict:
        """What dumps wrote to file (may raise anything: the file is named unreadable)."""


# ---- the parts a rank writes ----

class Parts:
    """What one rank saves: slices of flat tensors ("pieces", with the element range
    [a, b) of `total` they cover) and whole values, both under string keys."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.pieces, self.whole = {}, {}

    def add_piece(self, key, tensor, a, total):
        """Elements [a, a + numel(tensor)) of the flat tensor `key` of `total` elements (a
        rank may add several pieces of one key)."""
        flat = self.codec.flat_copy(tensor)
        self.pieces.setdefault(key, []).append(
            {"a": int(a), "b": int(a) + self.codec.numel(flat), "total": int(total),
             "tensor": flat})

    def as_dict(self, generation, rank, ranks):
        """The part as written: its identity (so a part copied over another generation's
        or rank's is recognised), pieces and whole values."""
        return {"format": FORMAT, "generation": generation, "rank": rank, "ranks": ranks,
                "pieces": self.pieces, "whole": self.whole}


class Reader:
    """Every saved part of one generation (checked by open_checkpoint), assembled by key and
    element range."""

    def __init__(self, parts, codec: Codec, generation: int):
        self.parts, self.codec, self.generation = parts, codec, generation

    def has_whole(self, key):
        return any(key in p["whole"] for p in self.parts)

    def whole(self, key):
        for part in self.parts:
            if key in part["whole"]:
                return part["whole"][key]
        raise CheckpointError(f"ringsync.checkpoint: the checkpoint has no '{key}'")

    def _pieces(self, key):
        return [piece for part in self.parts for piece in part["pieces"].get(key, ())]

    def total(self, key):
        totals = {piece["total"] for piece in self._pieces(key)}
        if len(totals) != 1:
            raise CheckpointError(f"ringsync.checkpoint: '{key}' has no single size in the "
                                  f"checkpoint (sizes found: {sorted(totals)})")
        return totals.pop()

    def range(self, key, a, b, total):
        """Elements [a, b) of the flat tensor `key` (of `total` elements), from whichever
        parts hold them; CheckpointError when the sizes differ or elements are missing.
        (Every piece lies inside [0, total) and holds b - a elements: _check_pieces.)"""
        found = self.total(key)
        if found != total:
            raise CheckpointError(f"ringsync.checkpoint: '{key}' has {found} elements in the "
                                  f"checkpoint, {total} here")
        out, covered = None, []
        for piece in self._pieces(key):
            t, pa, pb = piece["tensor"], piece["a"], piece["b"]
            out = self.codec.empty(b - a, t) if out is None else out
            lo, hi = max(a, pa), min(b, pb)
            if lo < hi:
                out[lo - a: hi - a] = t[lo - pa: hi - pa]
                covered.append((lo, hi))
        missing = _gaps(sorted(covered), a, b)
        if missing:
            raise CheckpointError(f"ringsync.checkpoint: elements {missing[:3]} of '{key}' are "
                                  "in no saved part")
        return out


def _gaps(spans, a, b):
    gaps, at = [], a
    for lo, hi in spans:
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    if at < b:
        gaps.append((at, b))
    return gaps


# ---- agreement: every rank of the set ends a save or load the same way ----

def agree(problem: Optional[str], process_set, name, cause=None):
    """problem: what went wrong on this rank (a whole message), or None. Raises one
    CheckpointError, the same on every rank of the set, if any rank has a problem: a rank
    that returned normally would train on (or wait in its next collective) while another
    stopped. cause: this rank's own exception, chained for its traceback."""
    problems = allgather_object(problem, name=name, process_set=process_set)
    ranks_of = {}
    for rank, text in enumerate(problems):
        if text is not None:
            ranks_of.setdefault(text, []).append(rank)
    if not ranks_of:
        return
    if len(problems) == 1:
        raise CheckpointError(problems[0]) from cause
    raise CheckpointError("; ".join(f"{text} (on rank{'s' if len(ranks) > 1 else ''} "
                                    f"{', '.join(map(str, ranks))})"
                                    for text, ranks in ranks_of.items())) from cause


def agreed(apply, process_set, name="ringsync.checkpoint.loaded"):
    """apply()'s value on every rank of the set, or the same CheckpointError on every rank
    if it raised on any (a model that does not fit the checkpoint, say). Glue runs the
    step that copies a Reader's values into its model under it."""
    try:
        value = apply()
    except CheckpointError as e:
        agree(str(e), process_set, name, e)
    except Exception as e:  # (a framework's own refusal: a shape that does not fit)
        agree(f"ringsync.checkpoint: the checkpoint does not load here: "
              f"{type(e).__name__}: {e}", process_set, name, e)
    else:
        agree(None, process_set, name)
        return value


# ---- save ----

def save_generation(path, parts: Parts, comm, process_set, write=None):
    """Write this rank's parts as the next generation in `path`, and (rank 0) name it in
    gen-<k>/meta.json and checkpoint.json once every rank's part is on disk; every rank of
    the set calls it. comm: the set's communicator (its rank and size); process_set: what
    the object exchanges run over. write: how a file is written (write_atomically).
    Returns the generation number written; CheckpointError on every rank if a rank could
    not write its part, or rank 0 could not name the generation."""
    write = write_atomically if write is None else write
    rank, size = comm.rank(), comm.size()
    generation = allgather_object(_next_generation(path) if rank == 0 else None,
                                  name="ringsync.checkpoint.generation",
                                  process_set=process_set)[0]
    outcome = _write_part(path, generation, rank, size, parts, write)
    outcomes = allgather_object(outcome, name="ringsync.checkpoint.written",
                                process_set=process_set)
    failed = [(r, o) for r, o in enumerate(outcomes) if isinstance(o, str)]
    if failed:
        raise CheckpointError("ringsync.checkpoint.save: " + "; ".join(
            f"rank {r} could not write its part: {why}" for r, why in failed))
    named = _name_generation(path, generation, outcomes, write) if rank == 0 else None
    # (also the barrier: returns once the checkpoint is named, on every rank)
    agree(named, process_set, "ringsync.checkpoint.named")
    return generation


def _next_generation(path):
    os.makedirs(path, exist_ok=True)
    return max(_generation_numbers(path), default=0) + 1


def _write_part(path, generation, rank, size, parts, write):
    """{"bytes": its size, "sha256": its digest}, or why the part could not be written."""
    try:
        folder = _folder(path, generation)
        os.makedirs(folder, exist_ok=True)
        data = parts.codec.dumps(parts.as_dict(generation, rank, size))
        write(os.path.join(folder, _part_name(rank, size)), data)
        return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    except Exception as e:  # (disk full, an unpicklable extra: every rank must hear of it)
        return f"{type(e).__name__}: {e}"


def _name_generation(path, generation, outcomes, write):
    """Rank 0, once every part is on disk: the generation's own meta.json (it loads by
    number even if checkpoint.json is lost later), then checkpoint.json naming it, then
    every generation but it and the newest complete one before it removed. None, or why
    the generation could not be named (the previous one is still named then)."""
    meta = {"format": FORMAT, "generation": generation, "ranks": len(outcomes),
            "bytes": [o["bytes"] for o in outcomes],
            "sha256": [o["sha256"] for o in outcomes]}
    data = json.dumps(meta).encode()
    previous = _complete_before(path, generation)  # (before checkpoint.json names another)
    try:
        write(os.path.join(_folder(path, generation), GENERATION_META), data)
        write(os.path.join(path, META), data)
    except Exception as e:
        return (f"ringsync.checkpoint.save: rank 0 could not name generation {generation} "
                f"in {path}: {type(e).__name__}: {e}")
    _remove_generations_but(path, {generation, previous})
    return None


def _complete_before(path, generation):
    """The newest generation before `generation` whose parts are all on disk: the one
    checkpoint.json names, or a newer one with its meta.json (named by a save that was
    stopped before it wrote checkpoint.json). None if there is none."""
    complete = [k for k in _generation_numbers(path) if k < generation and
                _readable_meta(os.path.join(_folder(path, k), GENERATION_META), k)]
    named = _readable_meta(os.path.join(path, META), None)
    if named is not None and named.generation < generation:
        complete.append(named.generation)
    return max(complete, default=None)


def _readable_meta(meta_file, generation):
    try:
        return _read_meta(meta_file, generation)
    except _Damage:
        return None


def _remove_generations_but(path, keep):
    for k in _generation_numbers(path):
        if k not in keep:
            shutil.rmtree(_folder(path, k), ignore_errors=True)


def _generation_numbers(path):
    try:
        entries = os.listdir(path)
    except OSError:
        return []
    return [int(m.group(1)) for m in map(_GENERATION.match, entries) if m]


def _folder(path, generation):
    return os.path.join(path, f"gen-{generation}")


def _part_name(rank, size):
    return f"rank-{rank}-of-{size}.pt"


# ---- load ----

class _Damage(Exception):
    """What is wrong with a checkpoint on this rank (before the ranks agree)."""


class _Meta(NamedTuple):
    format: int
    generation: int
    ranks: int
    sizes: list
    digests: Optional[list]  # None for format 1


def open_checkpoint(path, codec: Codec, process_set=None, *, generation=None):
    """A Reader over generation `generation` of `path` (None: the one checkpoint.json
    names), every part's size and SHA-256 checked before any is unpickled. Every rank of
    process_set (None: the job's) calls it; if any rank finds a problem, every rank
    raises the same CheckpointError naming the file, what is wrong, and the generations
    still intact."""
    try:
        reader, problem = _open_here(path, codec, generation), None
    except _Damage as e:
        reader, problem = None, f"ringsync.checkpoint: {e}{_intact_hint(path)}"
    agree(problem, process_set, "ringsync.checkpoint.opened")
    return reader


def generations(path):
    """The generations in `path` that load by number (load(..., generation=k)), newest
    first: each has its gen-<k>/meta.json and every part it records, of the recorded size
    and SHA-256 (every part is read to hash it). The generation checkpoint.json names is
    among them unless it is damaged (or of format 1, which had no meta.json)."""
    return [k for k in sorted(_generation_numbers(path), reverse=True) if _intact(path, k)]


def _intact(path, generation):
    meta_file = os.path.join(_folder(path, generation), GENERATION_META)
    try:
        meta = _read_meta(meta_file, generation)
        for rank, file in enumerate(_part_files(path, meta)):
            _check_part_bytes(path, file, rank, meta, meta_file)
    except _Damage:
        return False
    return True


def _intact_hint(path):
    """What else the user can load: '; generation 3 is intact: load(..., generation=3)'.
    (Checked by each generation's own meta.json: a damaged checkpoint.json leaves the
    generation it names loadable by number.)"""
    intact = generations(path)
    if not intact:
        return f"; no intact generation in {path}"
    more = f" (also intact: {', '.join(map(str, intact[1:]))})" if intact[1:] else ""
    return f"; generation {intact[0]} is intact: load(..., generation={intact[0]}){more}"


def _open_here(path, codec, generation):
    """This rank's Reader, or _Damage saying what is wrong."""
    if generation is None:
        meta_file = os.path.join(path, META)
    elif isinstance(generation, int) and not isinstance(generation, bool) and generation > 0:
        meta_file = os.path.join(_folder(path, generation), GENERATION_META)
    else:
        raise _Damage(f"generation must be a positive integer or None, not {generation!r}")
    meta = _read_meta(meta_file, generation)
    if not os.path.isdir(_folder(path, meta.generation)):
        raise _Damage(f"{meta_file} names generation {meta.generation}, but "
                      f"{_folder(path, meta.generation)} does not exist")
    files = _part_files(path, meta)
    for rank, file in enumerate(files):  # (every part, before any is unpickled)
        _check_part_bytes(path, file, rank, meta, meta_file)
    return Reader([_load_part(file, rank, meta, codec) for rank, file in enumerate(files)],
                  codec, meta.generation)


def _part_files(path, meta):
    return [os.path.join(_folder(path, meta.generation), _part_name(r, meta.ranks))
            for r in range(meta.ranks)]


def _read_meta(meta_file, generation):
    """The checked metadata in meta_file (checkpoint.json, or generation's meta.json)."""
    try:
        with open(meta_file, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if generation is None:
            raise _Damage(f"no checkpoint in {os.path.dirname(meta_file)} ({meta_file} is "
                          "missing)") from None
        folder = os.path.dirname(meta_file)
        raise _Damage(f"{meta_file} is missing" if os.path.isdir(folder) else
                      f"generation {generation}: {folder} does not exist") from None
    except OSError as e:
        raise _Damage(f"{meta_file} cannot be read ({e})") from e
    try:
        meta = json.loads(data)
    except ValueError as e:  # (UnicodeDecodeError included)
        raise _Damage(f"{meta_file} is not JSON ({e})") from e
    checked = _check_meta(meta, meta_file)
    if generation is not None and checked.generation != generation:
        raise _Damage(f"{meta_file} records generation {checked.generation}, not "
                      f"{generation}")
    return checked


def _check_meta(meta, where):
    """meta's fields, each checked (the file may have been edited or damaged)."""
    def bad(what):
        return _Damage(f"{where} is not a ringsync checkpoint's metadata: {what}")

    if not isinstance(meta, dict):
        raise bad(f"it holds a {type(meta).__name__}, not an object")
    fmt = meta.get("format")
    if not _is_int(fmt) or fmt not in _READABLE:
        raise bad(f"'format' is {fmt!r}; this ringsync reads formats {list(_READABLE)}")
    found = _count(meta, "generation", 1 << 62, bad)
    ranks = _count(meta, "ranks", _MAX_RANKS, bad)
    sizes = _list_of(meta, "bytes", ranks, lambda s: _is_int(s) and s > 0,
                     "a size in bytes", bad)
    digests = _list_of(meta, "sha256", ranks, lambda s: isinstance(s, str) and
                       _SHA256.match(s) is not None, "a SHA-256 in hex", bad) \
        if fmt >= 2 else None
    return _Meta(fmt, found, ranks, sizes, digests)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _count(meta, key, most, bad):
    value = meta.get(key)
    if not _is_int(value) or not 0 < value <= most:
        raise bad(f"'{key}' is {value!r}, not an integer in [1, {most}]")
    return value


def _list_of(meta, key, ranks, ok, what, bad):
    values = meta.get(key)
    if not isinstance(values, list) or len(values) != ranks:
        found = f"{len(values)} entries" if isinstance(values, list) else repr(values)
        raise bad(f"'{key}' has {found}; 'ranks' is {ranks}, one entry per rank expected")
    for i, value in enumerate(values):
        if not ok(value):
            raise bad(f"'{key}'[{i}] is {value!r}, not {what}")
    return values


def _check_part_bytes(path, file, rank, meta, meta_file):
    """The part's size and SHA-256 are those meta_file records (_Damage otherwise, saying
    whose bytes they are if they are another part's)."""
    try:
        found = os.path.getsize(file)
    except FileNotFoundError:
        raise _Damage(f"{file} is missing ({meta_file} records {meta.ranks} parts)") from None
    except OSError as e:
        raise _Damage(f"{file} cannot be read ({e})") from e
    if found != meta.sizes[rank]:
        raise _Damage(f"{file} has {found} bytes, {meta_file} records {meta.sizes[rank]} "
                      f"(truncated or replaced){_whose(path, file)}")
    if meta.digests is not None and _sha256(file) != meta.digests[rank]:
        raise _Damage(f"{file} does not match its SHA-256 in {meta_file} (damaged or "
                      f"replaced bytes){_whose(path, file)}")


def _sha256(file):
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _whose(path, file):
    """'; its bytes are gen-1/rank-0-of-2.pt's' when file holds another saved part (of
    another generation or rank, as recorded in that generation's meta.json)."""
    try:
        digest = _sha256(file)
    except OSError:
        return ""
    for k in sorted(_generation_numbers(path), reverse=True):
        meta = _readable_meta(os.path.join(_folder(path, k), GENERATION_META), k)
        for rank, recorded in enumerate((meta.digests or ()) if meta else ()):
            other = os.path.join(_folder(path, k), _part_name(rank, meta.ranks))
            if recorded == digest and other != file:
                return (f"; its bytes are those of gen-{k}/{_part_name(rank, meta.ranks)} "
                        f"(generation {k}, rank {rank} of {meta.ranks})")
    return ""


def _load_part(file, rank, meta, codec):
    """The part in file (its bytes already checked), and that it is the part meta expects:
    its format, generation, rank and rank count, and pieces inside their tensors."""
    try:
        part = codec.load(file)
    except Exception as e:  # (any framework or pickle failure: name the file)
        raise _Damage(f"{file} cannot be read ({type(e).__name__}: {e})") from e
    if not (isinstance(part, dict) and part.get("format") == meta.format and
            isinstance(part.get("pieces"), dict) and isinstance(part.get("whole"), dict)):
        raise _Damage(f"{file} is not a ringsync checkpoint part of format {meta.format}")
    if meta.format >= 2:
        found = tuple(part.get(k) for k in ("generation", "rank", "ranks"))
        if found != (meta.generation, rank, meta.ranks):
            raise _Damage(f"{file} holds the part of generation {found[0]}, rank {found[1]} "
                          f"of {found[2]}; generation {meta.generation}, rank {rank} of "
                          f"{meta.ranks} expected")
    _check_pieces(file, part, codec)
    return part


def _check_pieces(file, part, codec):
    for key, pieces in part["pieces"].items():
        for piece in pieces if isinstance(pieces, list) else [None]:
            try:
                a, b, total, n = (piece["a"], piece["b"], piece["total"],
                                  codec.numel(piece["tensor"]))
            except Exception:
                raise _Damage(f"{file}: '{key}' holds a piece that is not one "
                              f"({piece!r:.80})") from None
            if not (all(map(_is_int, (a, b, total))) and 0 <= a <= b <= total and
                    n == b - a):
                raise _Damage(f"{file}: '{key}' has a piece [{a}, {b}) of {n} elements, out "
                              f"of [0, {total})")
