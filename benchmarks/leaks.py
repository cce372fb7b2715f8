"""What a process holds before and after many rings: init/shutdown cycles of 2 thread-rank
communicators (each path in turn: lane, TCP, engine over shared-memory rings, staged
segments; a blocking and an asynchronous allreduce each), and elastic recoveries of 3
thread ranks over ringsync's store (a rank dies, the survivors recover and take in its
replacement). The loops are tests/unit/test_leaks.py's (tests/common/leaks.py):

    python benchmarks/leaks.py                      # from the repository root
    python benchmarks/leaks.py --cycles 1000 --recoveries 100

Prints, per loop, the figures after the warm-up and after the loop (open descriptors, of
them sockets; Python threads; kernel tasks, which also counts native engine threads;
ringsync segments mapped and left in /dev/shm; resident MiB) and the time per cycle,
plus the keys the elastic job's store held at its start and end (its decisions on the
survivors are kept for good: one per recovery).
"""
import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RINGSYNC_LOG_LEVEL", "error")  # (a line per recovery otherwise)

from tests.common.leaks import (ResourceSnapshot, elastic_recoveries,  # noqa: E402
                                init_shutdown_cycles, passing_keys)

WARM_UP = 20


def measure(name: str, warm_up, loop, count: int):
    """Rows (name, when, figures) before and after `loop`, and the ms per cycle."""
    warm_up()
    before = ResourceSnapshot.take()
    started = time.perf_counter()
    result = loop()
    per_cycle_ms = (time.perf_counter() - started) / count * 1e3
    gc.collect()
    after = ResourceSnapshot.settled(before)
    return [(name, "before", before.row(), ""), (name, f"after {count}", after.row(),
                                                  f"{per_cycle_ms:.1f}")], after.leaks_since(
        before), result


def table(rows) -> str:
    columns = list(rows[0][2])
    header = ["loop", "when"] + columns + ["ms/cycle"]
    cells = [[name, when] + [str(figures[c]) for c in columns] + [ms]
             for name, when, figures, ms in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    return "\n".join([line, "-" * len(line)] + ["  ".join(c.ljust(w) for c, w in zip(r, widths))
                                              for r in cells])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--recoveries", type=int, default=100)
    args = parser.parse_args(argv)
    rows, problems = [], []
    cycle_rows, leaked, _ = measure(
        "init/shutdown x2 ranks", lambda: init_shutdown_cycles(WARM_UP),
        lambda: init_shutdown_cycles(args.cycles, first=WARM_UP), args.cycles)
    rows += cycle_rows
    problems += [f"init/shutdown: {p}" for p in leaked]
    elastic_rows, leaked, done = measure(
        "elastic x3 ranks", lambda: elastic_recoveries(3),
        lambda: elastic_recoveries(args.recoveries), args.recoveries)
    rows += elastic_rows
    problems += [f"elastic: {p}" for p in leaked]
    print(table(rows))
    seen = done["keys_seen"]
    print(f"\nelastic store: {seen[0]} per-generation keys at the first cycle, {max(seen)} at "
          f"most, {len(passing_keys(done['store_keys']))} at the end; "
          f"{len(done['store_keys'])} keys in all at the end (decisions kept: one per recovery)")
    if problems:
        print("\nLEAKED:\n" + "\n".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
