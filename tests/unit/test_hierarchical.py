"""The hierarchical allreduce (native/src/hierarchical.c) on simulated hosts: ranks are
threads of this process (tests/thread_ranks.py) reporting host names through
RINGSYNC_HOST_NAME, so same-"host" ranks talk over shared memory and the others over TCP,
as on real hosts. Each layout runs with hierarchical forced on, auto and off; uneven
layouts and one rank per host must fall back to the flat ring. Communicator.traffic()
proves which algorithm ran: the bytes each rank sent over TCP and shared memory."""
import hashlib

import numpy as np
import pytest

import ringsync as rs

from tests.common.reference import FLOAT_DTYPES, assert_reduced, rank_input
from tests.thread_ranks import assert_ok, assert_ranks_ok, rank_config, run_threads

TIMEOUT = 300  # seconds for one whole run; a hang fails the test with every rank's stack
BASE_ENV = {"RINGSYNC_TIMEOUT_SECONDS": "60"}

# Host of each rank. Uniform layouts (2 hosts x 2, 3 x 2, 2 x 3) go hierarchical; the
# uneven one and one rank per host fall back to the flat ring.
LAYOUTS = {
    "2x2": "aabb",
    "3x2": "aabbcc",
    "2x3": "aaabbb",
    "uneven-3+1": "aaab",
    "1-per-host": "abc",
}
MODES = {"on": "on", "auto": "auto", "off": "0"}
DTYPES = ["int32", "float32", "float64", "float16", "int8"] + (
    ["bfloat16"] if "bfloat16" in FLOAT_DTYPES else [])
OPS = ["Sum", "Average", "Min", "Max", "Product"]
SMALL_SIZES = [0, 1, 7]  # 1 and 7: fewer elements than ranks, or not divisible by them
LARGE = 1000003  # a prime: no block split comes out even


def _hosts(layout):
    return lambda rank: {"RINGSYNC_HOST_NAME": "node-" + LAYOUTS[layout][rank]}


def _inputs(size, n, dtype, op):
    return [rank_input(r, (n,), dtype, op, "hier") for r in range(size)]


def _digest(x):
    return hashlib.sha256(np.ascontiguousarray(x).view(np.uint8)).hexdigest()


S_ELEMENTS = 1 << 20  # float32: S = 4 MiB
SLACK = 16 << 10  # the engine's negotiation (over the flat ring), not the data


def _traffic_of_one_allreduce(comm):
    """This rank's bytes sent per peer (TCP, shm) by one large allreduce."""
    x = np.full(S_ELEMENTS, comm.rank() + 1, dtype=np.float32)
    before = comm.traffic()
    got = comm.allreduce(x, op=rs.Sum, name="traffic")
    after = comm.traffic()
    assert np.all(got == sum(range(1, comm.size() + 1)))
    return {via: np.subtract(after[via], before[via]) for via in ("tcp", "shm")}


def _fits(hosts):
    """Whether the layout fits the hierarchical allreduce: >= 2 hosts, the same number
    (>= 2) of ranks on each."""
    counts = {h: hosts.count(h) for h in hosts}
    return len(counts) >= 2 and len(set(counts.values())) == 1 and min(counts.values()) >= 2


def _assert_algorithm(t, rank, hosts, hierarchical):
    """What rank sent in one allreduce of S bytes. Hierarchical, with H hosts of L ranks:
    2(L-1)/L * S to its host's ring over shm, and 2(H-1)/H * S/L over TCP to its peers of
    the same local rank, nothing over TCP to its own host. The flat ring: 2(N-1)/N * S to
    its right neighbour, nothing but negotiation's few bytes to anyone else."""
    s, n = 4 * S_ELEMENTS, len(hosts)
    tcp, shm = (int(t["tcp"].sum()), int(t["shm"].sum()))
    if hierarchical:
        h, per_host = len(set(hosts)), n // len(set(hosts))
        assert abs(tcp - 2 * (h - 1) * s // (h * per_host)) <= SLACK, (rank, t)
        assert abs(shm - 2 * (per_host - 1) * s // per_host) <= SLACK, (rank, t)
        local = [p for p in range(n) if hosts[p] == hosts[rank]]
        assert not any(t["tcp"][p] for p in local), (rank, t)
        return
    right = (rank + 1) % n
    sent = t["tcp"] + t["shm"]
    assert abs(int(sent[right]) - 2 * (n - 1) * s // n) <= SLACK, (rank, t)
    # (negotiation's log-step gathers send a few hundred bytes to other peers)
    assert int(sent.sum() - sent[right]) <= SLACK, (rank, t)


def _cases():
    """(dtype, op, n, prescale, postscale): every dtype x op at the small sizes and at the
    large prime, scale factors on some."""
    for dtype in DTYPES:
        for op in OPS:
            for n in SMALL_SIZES + [LARGE]:
                scaled = op in ("Sum", "Average") and n in (7, LARGE)
                yield dtype, op, n, (0.5, 3.0) if scaled else (1.0, 1.0)


def _allreduce_matrix(comm, layout, mode):
    """Every case on this rank; returns {case: digest of the result}. Rank 0 checks each
    result against the numpy reference; the test then checks that every rank's bytes are
    the same, so every rank's result is right. First, the traffic of a large allreduce
    shows that the expected algorithm runs."""
    me, size, digests = comm.rank(), comm.size(), {}
    hierarchical = _fits(LAYOUTS[layout]) and mode != "off"
    _assert_algorithm(_traffic_of_one_allreduce(comm), me, LAYOUTS[layout], hierarchical)
    for dtype, op, n, (pre, post) in _cases():
        inputs = _inputs(size, n, dtype, op)
        what = f"allreduce {dtype} {op} n={n} scale={pre},{post} on {size} ranks"
        got = comm.allreduce(inputs[me], op=getattr(rs, op), prescale_factor=pre,
                             postscale_factor=post, name=what)
        if me == 0:
            assert_reduced(got, inputs, op, pre, post, what=what)
        digests[what] = _digest(got)
    return digests


# Every mode on 2x2; forced on elsewhere (auto and off on a layout that takes the flat
# ring anyway, or off anywhere, run the flat ring the thread-collectives matrix covers).
MATRIX = [("2x2", mode) for mode in MODES] + [(layout, "on") for layout in LAYOUTS
                                               if layout != "2x2"]


@pytest.mark.parametrize("layout,mode", MATRIX)
def test_allreduce_on_every_layout_is_right_and_the_same_on_every_rank(layout, mode):
    size = len(LAYOUTS[layout])
    env = {**BASE_ENV, "RINGSYNC_HIERARCHICAL_ALLREDUCE": MODES[mode]}
    digests = assert_ranks_ok(_allreduce_matrix, size, timeout=TIMEOUT, env=env,
                              rank_env=_hosts(layout), args=(layout, mode))
    for rank, theirs in enumerate(digests[1:], 1):
        differ = [what for what in digests[0] if theirs[what] != digests[0][what]]
        assert not differ, f"rank {rank}'s bytes differ from rank 0's: {differ[:3]}"


# ---------------------------------------------------------------- which bytes went where


def _run_traffic(mode, layout="2x2", hierarchical_bytes=None):
    env = {**BASE_ENV, "RINGSYNC_HIERARCHICAL_ALLREDUCE": mode}
    if hierarchical_bytes is not None:
        env["RINGSYNC_HIERARCHICAL_BYTES"] = str(hierarchical_bytes)
    return assert_ranks_ok(_traffic_of_one_allreduce, len(LAYOUTS[layout]), timeout=TIMEOUT,
                           env=env, rank_env=_hosts(layout))


def _host_tcp(traffic, hosts, host):
    """TCP bytes that the ranks of `host` sent out of it."""
    return sum(int(t["tcp"].sum()) for r, t in enumerate(traffic) if hosts[r] == host)


def _assert_same_host_bytes_on_shm(traffic, hosts):
    for r, t in enumerate(traffic):
        for peer in range(len(hosts)):
            if hosts[peer] == hosts[r]:
                assert t["tcp"][peer] == 0, f"rank {r} sent TCP bytes to same-host {peer}: {t}"
            else:
                assert t["shm"][peer] == 0, f"rank {r} sent shm bytes to rank {peer}: {t}"


def test_hierarchical_sends_the_link_bound_across_hosts_and_the_flat_ring_more():
    """2 hosts x 2 ranks, S bytes: hierarchical, each rank allreduces S/L across H hosts,
    sending 2(H-1)/H * S/L = S/2 over TCP to its one peer of the same local rank, and each
    host S in all; the flat ring sends 2(N-1)/N * S = 1.5 S out of each host."""
    hosts, s = LAYOUTS["2x2"], 4 * S_ELEMENTS
    hier, flat = _run_traffic("on"), _run_traffic("off")
    cross_peer = {0: 2, 1: 3, 2: 0, 3: 1}
    for r, t in enumerate(hier):
        _assert_algorithm(t, r, hosts, hierarchical=True)
        assert abs(int(t["tcp"][cross_peer[r]]) - s // 2) <= SLACK, (r, t)
    for r, t in enumerate(flat):
        _assert_algorithm(t, r, hosts, hierarchical=False)
    _assert_same_host_bytes_on_shm(hier, hosts)
    _assert_same_host_bytes_on_shm(flat, hosts)
    for host in "ab":
        assert abs(_host_tcp(hier, hosts, host) - s) <= 2 * SLACK
        assert abs(_host_tcp(flat, hosts, host) - 3 * s // 2) <= 2 * SLACK
    assert max(int(t["tcp"].sum()) for t in flat) > s


def test_auto_goes_hierarchical_from_its_threshold_only():
    s = 4 * S_ELEMENTS
    for r, t in enumerate(_run_traffic("auto", hierarchical_bytes=s)):
        _assert_algorithm(t, r, LAYOUTS["2x2"], hierarchical=True)
    for r, t in enumerate(_run_traffic("auto", hierarchical_bytes=s + 1)):
        _assert_algorithm(t, r, LAYOUTS["2x2"], hierarchical=False)


@pytest.mark.parametrize("layout", ["uneven-3+1", "1-per-host"])
def test_layouts_that_do_not_fit_take_the_flat_ring(layout):
    """Forced on, an uneven layout or one rank per host sends what the flat ring does:
    2(N-1)/N * S from each rank to its right neighbour, nothing but negotiation's few
    bytes to anyone else."""
    for r, t in enumerate(_run_traffic("on", layout)):
        _assert_algorithm(t, r, LAYOUTS[layout], hierarchical=False)


def _expect_init_error(env, rank_env, fragments):
    def rank_main(rendezvous):
        config = rank_config(env, rank_env, rendezvous.rank)
        with pytest.raises(rs.UsageError) as caught:
            rs.Communicator(rendezvous=rendezvous, config=config).shutdown()
        for fragment in fragments:
            assert fragment in str(caught.value), (fragment, str(caught.value))
    return rank_main


def test_ranks_that_disagree_on_hierarchical_fail_init_naming_it():
    rank_env = lambda rank: {"RINGSYNC_HIERARCHICAL_ALLREDUCE": "on" if rank == 0 else "off"}
    assert_ok(run_threads(_expect_init_error(
        BASE_ENV, rank_env, ["ranks must agree", "RINGSYNC_HIERARCHICAL_ALLREDUCE is 'on' on "
                             "rank 0 but 'off' on rank 1"]), 2, TIMEOUT), "disagree", TIMEOUT)
    rank_env = lambda rank: {"RINGSYNC_HIERARCHICAL_BYTES": str(1000 + rank)}
    assert_ok(run_threads(_expect_init_error(
        BASE_ENV, rank_env, ["RINGSYNC_HIERARCHICAL_BYTES is 1000 on rank 0 but 1001"]),
        2, TIMEOUT), "disagree on bytes", TIMEOUT)


def test_a_bad_hierarchical_mode_fails_init_naming_it():
    assert_ok(run_threads(_expect_init_error(
        {**BASE_ENV, "RINGSYNC_HIERARCHICAL_ALLREDUCE": "sometimes"}, None,
        ["RINGSYNC_HIERARCHICAL_ALLREDUCE='sometimes'"]), 2, TIMEOUT), "bad mode", TIMEOUT)


def _spelling_of_rank(rank):
    return {"RINGSYNC_HIERARCHICAL_ALLREDUCE": ["1", "ON"][rank % 2],
            "RINGSYNC_HOST_NAME": "node-" + LAYOUTS["2x2"][rank]}


def test_one_and_on_are_the_same_setting():
    """Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE=1 spelling agrees with `on`."""
    traffic = assert_ranks_ok(_traffic_of_one_allreduce, 4, timeout=TIMEOUT, env=BASE_ENV,
                              rank_env=_spelling_of_rank)
    for r, t in enumerate(traffic):
        _assert_algorithm(t, r, LAYOUTS["2x2"], hierarchical=True)
