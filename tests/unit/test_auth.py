"""Connection authentication (issue items 5 and 6), in one process.

First the handshake's SHA-256 and HMAC-SHA256 (native/src/auth.c) against Python's hashlib
and hmac: auth.c is compiled on its own with a small driver, since the public API does not
expose it (skipped where no C compiler is installed). Then the handshake itself, through
the public API: communicators of one ring on threads of this process, met by silent and
malformed clients, impostors that know the job id but not the secret (a guessed and a
reflected proof), a replayed recording of a real greeting, a rank with another secret,
and rogue listeners where a peer should be."""
import hashlib
import hmac
import os
import random
import shutil
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from ringsync._native import ffi, lib
from tests.faults import rogue_clients as wire

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE = os.path.join(ROOT, "native", "src", "auth.c")

# Reads lines "<split> <key hex> <data hex>" (an empty field is "-") and prints
# "<sha256(data) hex> <hmac(key, data) hex>", feeding data in two updates cut at <split>
# so that every way a message can straddle the 64-byte blocks is exercised.
DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "auth.h"

static size_t unhex(const char *text, unsigned char *out) {
    size_t n = 0;
    if (strcmp(text, "-") == 0)
        return 0;
    for (; text[2 * n]; n++)
        sscanf(text + 2 * n, "%2hhx", &out[n]);
    return n;
}

static void print_hex(const unsigned char *p, size_t n, char end) {
    for (size_t i = 0; i < n; i++)
        printf("%02x", p[i]);
    putchar(end);
}

int main(void) {
    static char key_text[8192], data_text[8192];
    static unsigned char key[4096], data[4096];
    size_t split;
    while (scanf("%zu %8191s %8191s", &split, key_text, data_text) == 3) {
        size_t key_len = unhex(key_text, key), len = unhex(data_text, data);
        unsigned char digest[RS_SHA256_BYTES], mac[RS_SHA256_BYTES];
        rs_sha256_t s;
        rs_sha256_init(&s);
        rs_sha256_update(&s, data, split);
        rs_sha256_update(&s, data + split, len - split);
        rs_sha256_final(&s, digest);
        rs_hmac_t m;
        rs_hmac_init(&m, key, key_len);
        rs_hmac_update(&m, data, split);
        rs_hmac_update(&m, data + split, len - split);
        rs_hmac_final(&m, mac);
        print_hex(digest, sizeof digest, ' ');
        print_hex(mac, sizeof mac, '\n');
    }
    unsigned char a[32] = {1, 2, 3}, b[32] = {1, 2, 3};
    int same = rs_equal_secret(a, b, 32);
    b[31] ^= 0x80;
    int differ = !rs_equal_secret(a, b, 32);
    unsigned char r1[32], r2[32];
    int random_ok = rs_random_bytes(r1, 32) == 0 && rs_random_bytes(r2, 32) == 0 &&
                    memcmp(r1, r2, 32) != 0;
    printf("equal=%d differ=%d random=%d\n", same, differ, random_ok);
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler installed")
    work = tmp_path_factory.mktemp("auth")
    (work / "driver.c").write_text(DRIVER)
    exe = work / "auth_driver"
    subprocess.run([cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror",
                    "-I", os.path.dirname(SOURCE), SOURCE, str(work / "driver.c"), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=120)
    return str(exe)


def _cases():
    rng = random.Random(20240611)
    cases = []
    # Every data length up to 300 (around 1..4 blocks and each padding edge), keys of
    # lengths around the 64-byte block, including longer ones (which HMAC hashes first).
    key_lengths = [0, 1, 16, 32, 63, 64, 65, 100, 200, 1000]
    for length in range(301):
        data = rng.randbytes(length)
        key = rng.randbytes(key_lengths[length % len(key_lengths)])
        cases.append((rng.randint(0, length), key, data))
    for length in (1000, 2048):
        cases.append((length // 3, rng.randbytes(70), rng.randbytes(length)))
    cases.append((3, b"key", b"The quick brown fox jumps over the lazy dog"))
    return cases


def test_sha256_and_hmac_match_python(driver):
    cases = _cases()
    text = "".join(f"{split} {key.hex() or '-'} {data.hex() or '-'}\n"
                   for split, key, data in cases)
    out = subprocess.run([driver], input=text, capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    assert len(out) == len(cases) + 1, out[-3:]
    for (split, key, data), line in zip(cases, out):
        digest, mac = line.split()
        assert digest == hashlib.sha256(data).hexdigest(), f"sha256 of {len(data)} bytes"
        assert mac == hmac.new(key, data, hashlib.sha256).hexdigest(), \
            f"hmac with a {len(key)}-byte key over {len(data)} bytes (split at {split})"
    assert out[-1] == "equal=1 differ=1 random=1"


def test_known_vectors(driver):
    """FIPS 180-2 and RFC 4231 test case 2, in case hashlib and the driver agree wrongly."""
    text = "0 - 616263\n1 4a656665 7768617420646f2079612077616e7420666f72206e6f7468696e673f\n"
    out = subprocess.run([driver], input=text, capture_output=True, text=True, timeout=60,
                         check=True).stdout.splitlines()
    assert out[0].split()[0] == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert out[1].split()[1] == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"


# --------------------------------------------------------------------------- the handshake
# Two or three communicators in this one process (each connecting on its own thread; the
# native calls release the GIL), with rogue clients and listeners that speak the wire
# format of native/src/transport_tcp.c (tests/faults/rogue_clients.py).

HELLO, MAGIC, VERSION = wire.HELLO, wire.MAGIC, wire.VERSION
CHALLENGE_BYTES, recv_exact = wire.CHALLENGE_BYTES, wire.recv_exact
JOB_ID = 0x1234_5678_9ABC
SECRET = bytes(range(32))
HOST = "127.0.0.1"
WAIT_S = 60  # every wait on a thread or socket here ends by then


def hello(rank, acceptor=0, job_id=JOB_ID, **fields):
    return wire.hello(rank, acceptor, job_id, **fields)


def client(port, payload=b""):
    return wire.client(HOST, port, payload)


def Impostor(port, first, answer):
    return wire.Impostor(HOST, port, first, answer)


class Rank:
    """One communicator of a ring in this process, listening on loopback."""

    def __init__(self, rank, size, setup_s=30.0):
        self.rank, self.size = rank, size
        cptr, port = ffi.new("rs_comm_t **"), ffi.new("int *")
        assert lib.rs_comm_create(rank, size, HOST.encode(), 30.0, setup_s, cptr, port) == lib.RS_OK
        self.c, self.port = cptr[0], port[0]
        assert lib.rs_comm_set_transport(self.c, lib.RS_TRANSPORT_TCP) == lib.RS_OK
        self.status = self.error = self.seconds = None
        self.thread = None

    def start_connect(self, ports, job_id=JOB_ID, secret=SECRET):
        def run():
            keep = [ffi.new("char[]", HOST.encode()) for _ in ports]
            t0 = time.monotonic()
            self.status = lib.rs_comm_connect(self.c, ffi.new("const char *[]", keep),
                                              ffi.new("int[]", list(ports)),
                                              ffi.new("const char *[]", keep), job_id,
                                              secret, len(secret))
            self.seconds = time.monotonic() - t0
            self.error = ffi.string(lib.rs_comm_last_error(self.c)).decode()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), f"rank {self.rank}: connect did not return"
        return self.status

    def destroy(self):
        lib.rs_comm_destroy(self.c)


def connect_all(ranks, **kwargs):
    ports = [r.port for r in ranks]
    for r in ranks:
        r.start_connect(ports, **kwargs)
    return [r.join() for r in ranks]


def assert_allreduce_works(ranks):
    """Sum over the ring: proves every rank's sockets lead to the right peers."""
    outs = [np.zeros(1000) for _ in ranks]
    statuses = [None] * len(ranks)

    def run(i):
        data = np.full(1000, float(i + 1))
        statuses[i] = lib.rs_allreduce(ranks[i].c, ffi.from_buffer(data), ffi.from_buffer(outs[i]),
                                       1000, lib.RS_FLOAT64, lib.RS_OP_SUM, 1.0, 1.0)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert statuses == [lib.RS_OK] * len(ranks), [
        ffi.string(lib.rs_comm_last_error(r.c)).decode() for r in ranks]
    expected = sum(range(1, len(ranks) + 1))
    for out in outs:
        np.testing.assert_array_equal(out, np.full(1000, float(expected)))


@pytest.fixture
def ring():
    made = []

    def make(size, setup_s=30.0):
        made.extend(Rank(r, size, setup_s) for r in range(size))
        return made[-size:]
    yield make
    for r in made:
        r.destroy()


def test_ranks_with_the_secret_connect(ring):
    ranks = ring(3)
    assert connect_all(ranks) == [lib.RS_OK] * 3, [r.error for r in ranks]
    assert_allreduce_works(ranks)


def test_silent_and_malformed_clients_neither_stall_nor_fail_setup(ring, capfd):
    """More silent clients than greetings in progress at once, half greetings, and every
    kind of bad HELLO, all waiting in the backlog before the real peer: setup does not wait
    on any of them, and each one is dropped and logged, never blamed on a rank."""
    r0, r1 = ring(2, setup_s=30.0)
    bad = {
        "not a ringsync greeting": os.urandom(HELLO.size),
        "greeting of protocol version 7": hello(1, version=7),
        "greeting for another job": hello(1, job_id=JOB_ID + 1),
        "greeting meant for rank 5": hello(1, acceptor=5),
        "claims rank 0, which is no peer": hello(0),
        "claims rank 2, which is no peer": hello(2),
        "claims rank -1, which is no peer": hello(-1),
    }
    rogues = [client(r0.port, payload) for payload in bad.values()]
    rogues += [client(r0.port, hello(1)[:20])]  # stops halfway
    rogues += [client(r0.port) for _ in range(80)]  # port scanners that wait
    try:
        assert connect_all([r0, r1]) == [lib.RS_OK] * 2, [r0.error, r1.error]
        # The setup timeout is 30 s and a client's own deadline 5 s: far below both.
        assert r0.seconds < 4.5, r0.seconds
        assert_allreduce_works([r0, r1])
    finally:
        for s in rogues:
            s.close()
    err = capfd.readouterr().err
    assert "ringsync: rank 0: dropped a connection from 127.0.0.1:" in err, err
    for why in bad:
        assert why in err, (why, err)
    assert "more than 64 greetings in progress at once" in err, err
    assert "ringsync: rank 0: dropping more connections without logging them" in err, err
    assert "rank 1: dropped" not in err, err


@pytest.mark.parametrize("proof", ["random", "reflected"])
def test_impostor_without_the_secret_is_rejected(ring, capfd, proof):
    """An impostor that knows the public job id claims rank 2 before rank 2 connects: it
    gets a challenge but cannot answer it, neither with a guess nor by sending the
    acceptor's own MAC back. The real rank 2 then connects and the ring works. (Rank 2
    starts only once rank 0 has judged the impostor: setup cannot end before, so the
    verdict is the proof's, never "did not complete the greeting before setup ended".)"""
    ranks = ring(3)
    impostor = Impostor(ranks[0].port, hello(2),
                        lambda c: os.urandom(32) if proof == "random" else c[16:])
    ports = [r.port for r in ranks]
    for r in ranks[:2]:
        r.start_connect(ports)
    assert impostor.result() is False, "the impostor's connection was kept"
    ranks[2].start_connect(ports)
    assert [r.join() for r in ranks] == [lib.RS_OK] * 3, [r.error for r in ranks]
    assert_allreduce_works(ranks)
    err = capfd.readouterr().err
    assert "rank 0: dropped a connection from 127.0.0.1:" in err, err
    assert "claims rank 2 but did not prove that it knows the job's secret" in err, err


def test_recorded_greeting_replayed_later_is_rejected(ring, capfd):
    """Record what a real rank 1 sends through a relay, then replay it to a new ring of
    the same job (same id and secret): the acceptor's fresh nonce makes the old proof
    worthless."""
    first = ring(2)
    relay = socket.create_server((HOST, 0))
    relay.settimeout(WAIT_S)
    recorded = []

    def forward(src, dst, keep):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if keep is not None:
                    keep.append(data)
                dst.sendall(data)
        except OSError:
            pass  # the test closed the sockets
        dst.close()

    def run_relay():
        conn, _ = relay.accept()
        upstream = socket.create_connection((HOST, first[0].port), timeout=WAIT_S)
        conn.settimeout(WAIT_S)
        upstream.settimeout(WAIT_S)
        threading.Thread(target=forward, args=(upstream, conn, None), daemon=True).start()
        forward(conn, upstream, recorded)

    threading.Thread(target=run_relay, daemon=True).start()
    first[0].start_connect([first[0].port, first[1].port])
    first[1].start_connect([relay.getsockname()[1], first[1].port])
    assert [r.join() for r in first] == [lib.RS_OK] * 2, [r.error for r in first]
    assert_allreduce_works(first)
    greeting = b"".join(recorded)[:HELLO.size + 32]  # HELLO, then PROOF
    assert len(greeting) == HELLO.size + 32
    relay.close()

    second = ring(2)
    replay = Impostor(second[0].port, greeting[:HELLO.size], lambda c: greeting[HELLO.size:])
    assert connect_all(second) == [lib.RS_OK] * 2, [r.error for r in second]
    assert replay.result() is False, "the replayed greeting was accepted"
    assert_allreduce_works(second)
    err = capfd.readouterr().err
    assert "claims rank 1 but did not prove that it knows the job's secret" in err, err


def test_rank_with_another_secret_fails_at_once_and_is_named(ring, capfd):
    """A connector with the wrong secret finds out at once (the listener's MAC does not
    match, so it never answers); the acceptor drops the connection and, at its setup
    deadline, names rank 1 as the rank that never connected."""
    r0, r1 = ring(2, setup_s=3.0)
    ports = [r0.port, r1.port]
    r0.start_connect(ports)
    r1.start_connect(ports, secret=b"x" * 32)
    assert r1.join() == lib.RS_ERR_COMM
    assert r1.seconds < 2.5, r1.seconds
    assert "did not prove that it knows this job's secret" in r1.error, r1.error
    assert f"rank 0 (host {HOST})" in r1.error, r1.error
    assert r0.join() == lib.RS_ERR_TIMEOUT
    assert "rank 1 (host 127.0.0.1) never connected" in r0.error, r0.error
    assert "RINGSYNC_START_TIMEOUT_SECONDS=3" in r0.error, r0.error
    assert "rank 0: dropped a connection from 127.0.0.1:" in capfd.readouterr().err


@pytest.mark.parametrize("listener", ["wrong MAC", "silent"])
def test_connector_does_not_trust_or_wait_forever_on_a_rogue_listener(ring, listener):
    """Where rank 0 should listen, another program answers: with a made-up challenge the
    connector fails at once, naming that address; silent, it times out at the setup
    deadline naming rank 0, instead of blocking."""
    (r1,) = ring(2, setup_s=2.0)[1:]
    rogue = socket.create_server((HOST, 0))
    rogue.settimeout(WAIT_S)
    got = []

    def serve():
        conn, _ = rogue.accept()
        conn.settimeout(WAIT_S)
        got.append(recv_exact(conn, HELLO.size))
        if listener == "wrong MAC":
            conn.sendall(os.urandom(CHALLENGE_BYTES))
        got.append(conn.recv(100))  # the connector must not answer with a proof
        conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    rogue_port = rogue.getsockname()[1]
    r1.start_connect([rogue_port, r1.port])
    try:
        status = r1.join()
        server.join(WAIT_S)
    finally:
        rogue.close()
    magic, job_id, rank, version, acceptor, _ = HELLO.unpack(got[0])
    assert (magic, job_id, rank, version, acceptor) == (MAGIC, JOB_ID, 1, VERSION, 0)
    assert SECRET not in got[0] and got[1] == b"", got
    if listener == "wrong MAC":
        assert status == lib.RS_ERR_COMM and r1.seconds < 1.5, (r1.error, r1.seconds)
        assert f"listener at 127.0.0.1:{rogue_port}" in r1.error, r1.error
    else:
        assert status == lib.RS_ERR_TIMEOUT and 1.5 < r1.seconds < 10, (r1.error, r1.seconds)
        assert "rank 0 (host 127.0.0.1) did not answer our greeting" in r1.error, r1.error
