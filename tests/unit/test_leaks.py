"""No leaks: many init/shutdown cycles of thread-rank communicators, and many elastic
recoveries, leave this process's file descriptors, threads, shared-memory segments and
resident memory where a short warm-up left them (tests/common/leaks.py counts them;
benchmarks/leaks.py prints the figures).

Counts must come back exactly (after waiting for threads that were told to end); resident
memory within RSS_SLACK_MIB, which allocator caches and Python's own free lists stay far
below. A socket left for the garbage collector to close is a leak too (its
ResourceWarning): it stays open until a collection that may never come in time.
"""
import gc
import warnings

import pytest

from tests.common.leaks import (ResourceSnapshot, elastic_recoveries, init_shutdown_cycles,
                                passing_keys)

WARM_UP = 20
RSS_SLACK_MIB = 64.0
SIZE = 3  # elastic ranks


class NothingLeft:
    """Within: the loop; after: its snapshot compared with the one before, and every
    ResourceWarning it caused."""

    def __enter__(self):
        self.before = ResourceSnapshot.take()
        self._warnings = warnings.catch_warnings(record=True)
        self.caught = self._warnings.__enter__()
        warnings.simplefilter("always", ResourceWarning)
        return self

    def __exit__(self, kind, *rest):
        gc.collect()  # (what is left for the collector warns now, not in a later test)
        self._warnings.__exit__(kind, *rest)
        if kind is not None:
            return False
        after = ResourceSnapshot.settled(self.before, rss_slack_mib=RSS_SLACK_MIB)
        problems = after.leaks_since(self.before, rss_slack_mib=RSS_SLACK_MIB)
        problems += [f"left for the garbage collector: {w.message}" for w in self.caught
                     if issubclass(w.category, ResourceWarning)]
        assert not problems, "leaked:\n" + "\n".join(problems)
        return False


@pytest.mark.parametrize("cycles", [100, 1000])
def test_init_shutdown_cycles_leave_nothing_behind(cycles):
    """2 thread ranks per cycle, each path in turn (lane, TCP, engine over shared-memory
    rings, staged segments): a blocking and an asynchronous allreduce, checked."""
    init_shutdown_cycles(WARM_UP)
    with NothingLeft():
        init_shutdown_cycles(cycles, first=WARM_UP)


@pytest.mark.parametrize("recoveries", [20, 100])
def test_elastic_recoveries_leave_nothing_behind(recoveries):
    """SIZE thread ranks over ringsync's store lose a rank and take in its replacement
    `recoveries` times (tests/common/leaks.py ElasticJob says how). The store, too, keeps
    no more per recovery than its decision on the survivors."""
    elastic_recoveries(3, SIZE)
    with NothingLeft():
        done = elastic_recoveries(recoveries, SIZE)
    assert done["recovered"] == 2 * recoveries  # (two survivors each time)
    # At a cycle's start the store may hold, besides what it keeps for good: each rank's
    # liveness key and each replacement's registration (held by their connections), and
    # one exchange of the rebuild whose last reader has yet to delete it (size + 1 keys).
    seen = done["keys_seen"]
    assert max(seen) <= 3 * SIZE + 1, f"keys in the store at each cycle: {seen}"
    assert passing_keys(done["store_keys"]) == [], done["store_keys"]
