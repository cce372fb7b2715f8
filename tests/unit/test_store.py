"""ringsync.store: the authenticated key-value store ranks meet through without MPI.

Servers run in this process on 127.0.0.1, port 0. The semantics tests run on both the TCP
store and the file store, and add/compare_set are checked against torch's TCPStore. The
rogue clients speak the wire protocol written out again here (handshake, frames, HMACs
computed in the test), so that they can send what StoreClient never would; after each,
the store must be as it was and still serve a good client. Every wait has a deadline."""
import hashlib
import hmac
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from ringsync.errors import (CommunicationError, CommunicationTimeout, StoreLostError,
                             UsageError)
from ringsync.store import (MAX_KEY_BYTES, MAX_VALUE_BYTES, FileStore, StoreClient,
                            StoreServer, connect, load_secret)
from ringsync.store._wire import OP_ADD, OP_CHECK, OP_DELETE, OP_GET, OP_SET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET_TEXT = "test-secret-0123456789abcdef"
SECRET = SECRET_TEXT.encode()
DEADLINE_S = 10.0


def eventually(condition, seconds=DEADLINE_S, what="the condition"):
    """Poll condition() until it is true; fail the test at the deadline."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.005)


def in_thread(body):
    """Run body() on a daemon thread; returns (thread, outcome dict: value or error)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = body()
        except BaseException as exc:  # (the test looks at it)
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def child_env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


@pytest.fixture
def server():
    with StoreServer(SECRET, handshake_seconds=0.3, served_by="the test") as srv:
        yield srv


@pytest.fixture
def client(server):
    with StoreClient(*server.address, SECRET, timeout=DEADLINE_S) as c:
        yield c


@pytest.fixture(params=["tcp", "file"])
def store(request, tmp_path):
    """Either kind of store, through connect() and its url."""
    if request.param == "tcp":
        srv = StoreServer(SECRET).start()
        request.addfinalizer(srv.close)
        url = srv.url
    else:
        url = "file://" + str(tmp_path / "store")
    s = connect(url, SECRET, timeout=DEADLINE_S, connect_timeout=DEADLINE_S)
    request.addfinalizer(s.close)
    return s


# --- semantics, on both stores --------------------------------------------------------

def test_set_get_check_delete_round_trip(store):
    data = {"plain": b"value", "empty": b"", "binary": bytes(range(256)) * 3,
            "big": os.urandom(1 << 20), "unicode/ключ": "text".encode()}
    for key, value in data.items():
        store.set(key, value)
    assert {key: store.get(key) for key in data} == data
    assert store.check(list(data)) and not store.check(list(data) + ["absent"])
    store.set("plain", b"replaced")
    assert store.get("plain") == b"replaced"
    assert store.delete_key("plain") is True
    assert store.delete_key("plain") is False
    assert not store.check(["plain"]) and store.check(["empty"])


def torch_semantics_script(store):
    """add and compare_set through their corner cases; every answer, in order."""
    out = [store.add("c", 5), store.add("c", -2), store.add("c", 0), store.get("c")]
    out += [store.compare_set("x", b"", b"first"), store.compare_set("x", b"wrong", b"2nd"),
            store.compare_set("x", b"first", b"2nd"), store.get("x"),
            store.compare_set("missing", b"expected", b"d"), store.check(["missing"]),
            store.compare_set("x", b"", b"3rd")]
    store.set("n", b"7")
    out += [store.add("n", 3), store.get("n")]
    out += [store.delete_key("c"), store.delete_key("c"), store.add("c", 1)]
    store.set("neg", b"-4")
    out += [store.add("neg", 1), store.check(["c", "x"]), store.check(["c", "gone"])]
    return out


def test_add_and_compare_set_answer_as_torchs_tcpstore(store):
    dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta
    reference = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    expected = torch_semantics_script(reference)
    assert expected[4:6] == [b"first", b"first"]  # (the script means what it says)
    assert torch_semantics_script(store) == expected


def test_add_refuses_a_value_that_is_not_a_counter(store):
    store.set("text", b"twelve")
    with pytest.raises(UsageError, match="text"):
        store.add("text", 1)
    assert store.get("text") == b"twelve"


def test_get_times_out_naming_the_key(store):
    store.set_timeout(0.2)
    start = time.monotonic()
    with pytest.raises(CommunicationTimeout, match="'no/such/key'"):
        store.get("no/such/key")
    assert 0.2 <= time.monotonic() - start < DEADLINE_S


def test_wait_names_only_the_missing_keys(store):
    store.set("here", b"1")
    with pytest.raises(CommunicationTimeout) as info:
        store.wait(["here", "absent-1", "absent-2"], timeout=0.2)
    assert "absent-1" in str(info.value) and "absent-2" in str(info.value)
    assert "'here'" not in str(info.value)
    store.wait(["here"], timeout=0.2)


def test_get_returns_a_key_set_later_by_another_thread(store):
    getter, outcome = in_thread(lambda: store.get("late"))
    # (another connection: one client's requests go one at a time, as torch's do)
    with connect(store.url, SECRET) as other:
        other.set("late", b"worth the wait")
    getter.join(DEADLINE_S)
    assert outcome == {"value": b"worth the wait"}


def test_set_timeout_takes_a_timedelta(store):
    from datetime import timedelta
    store.set_timeout(timedelta(milliseconds=150))
    assert store.timeout == pytest.approx(0.15)
    with pytest.raises(UsageError):
        store.set_timeout("soon")


def test_bad_keys_and_values_are_usage_errors(store):
    with pytest.raises(UsageError, match="MAX_KEY_BYTES"):
        store.set("k" * (MAX_KEY_BYTES + 1), b"v")
    with pytest.raises(UsageError):
        store.set(b"bytes-key", b"v")
    with pytest.raises(UsageError):
        store.set("key", 12)
    store.set("k" * MAX_KEY_BYTES, b"longest")  # (the limit itself is fine)
    assert store.get("k" * MAX_KEY_BYTES) == b"longest"


# --- the TCP store --------------------------------------------------------------------

def test_get_waits_on_the_server_for_a_key_set_later(server, client):
    getter, outcome = in_thread(lambda: client.get("later"))
    eventually(lambda: server._table.waiting >= 1, what="the get waiting on the server")
    with StoreClient(*server.address, SECRET) as other:
        other.set("later", b"here now")
    getter.join(DEADLINE_S)
    assert outcome == {"value": b"here now"}


def test_many_clients_add_to_one_counter(server):
    clients = [StoreClient(*server.address, SECRET) for _ in range(8)]

    def add_fifty(c):
        return [c.add("counter", 1) for _ in range(50)]

    threads = [in_thread(lambda c=c: add_fifty(c)) for c in clients]
    for thread, _ in threads:
        thread.join(DEADLINE_S * 3)
    seen = [n for _, outcome in threads for n in outcome["value"]]
    assert sorted(seen) == list(range(1, 401))  # every add saw a distinct total
    assert clients[0].get("counter") == b"400"
    for c in clients:
        c.close()


def test_one_client_is_shared_by_threads(client):
    def work(i):
        for j in range(25):
            client.set(f"t{i}/{j}", f"{i}:{j}".encode())
            client.add("shared", 1)
        return [client.get(f"t{i}/{j}") for j in range(25)]

    threads = [in_thread(lambda i=i: work(i)) for i in range(4)]
    for thread, _ in threads:
        thread.join(DEADLINE_S * 3)
    for i, (_, outcome) in enumerate(threads):
        assert outcome["value"] == [f"{i}:{j}".encode() for j in range(25)]
    assert client.get("shared") == b"100"


def test_held_key_goes_when_its_client_closes(server, client):
    holder = StoreClient(*server.address, SECRET)
    holder.hold("alive/1", b"yes")
    client.set("plain", b"stays")
    assert client.get("alive/1") == b"yes"
    holder.close()
    eventually(lambda: not client.check(["alive/1"]), what="the held key's deletion")
    assert client.get("plain") == b"stays"


def test_a_set_makes_a_held_key_ordinary(server, client):
    holder = StoreClient(*server.address, SECRET)
    holder.hold("taken-over")
    client.set("taken-over", b"mine now")
    holder.close()
    # (the server drops a connection's held keys before it forgets the connection)
    eventually(lambda: len(server._connections) == 1, what="the holder's connection ending")
    assert client.get("taken-over") == b"mine now"


CHILD_HOLDS = """
import sys
from ringsync.store import StoreClient, load_secret
client = StoreClient("127.0.0.1", int(sys.argv[1]), load_secret(), connect_timeout=30)
client.hold(sys.argv[2], b"alive")
if sys.argv[3] == "waiting":
    client.set_timeout(300)
    client.get("never")  # (killed while the server waits for it)
sys.stdin.read()  # (until killed)
"""


@pytest.mark.parametrize("doing", ["idle", "waiting"])
def test_held_key_goes_when_its_process_is_killed(server, client, doing):
    child = subprocess.Popen([sys.executable, "-c", CHILD_HOLDS, str(server.address[1]),
                              "alive/child", doing], stdin=subprocess.PIPE,
                             env=child_env(RINGSYNC_SECRET=SECRET_TEXT), cwd=ROOT)
    try:
        client.wait(["alive/child"], timeout=30)
        if doing == "waiting":
            eventually(lambda: server._table.waiting >= 1, seconds=30,
                       what="the child's get waiting on the server")
        child.send_signal(signal.SIGKILL)
        child.wait(DEADLINE_S)
        eventually(lambda: not client.check(["alive/child"]), what="the killed child's key going")
    finally:
        child.kill()
        child.wait(DEADLINE_S)


def test_server_sockets_keep_alive_so_a_vanished_host_is_noticed(server, client):
    (connection,) = server._connections.values()
    sock = connection._sock
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    for name, seconds in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            assert sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name)) == seconds


def test_closing_the_server_mid_get_fails_the_get_at_once(server, client):
    getter, outcome = in_thread(lambda: client.get("never"))  # (would wait 10 s)
    eventually(lambda: server._table.waiting >= 1, what="the get waiting on the server")
    start = time.monotonic()
    server.close()
    getter.join(DEADLINE_S)
    assert time.monotonic() - start < 5
    error = outcome["error"]
    assert type(error) is StoreLostError and "lost the store at tcp://" in str(error)
    assert "the test" in str(error)  # (served_by, from the hello)
    with pytest.raises(CommunicationError, match="lost the store"):
        client.set("after", b"x")


def test_a_closed_client_refuses_requests(client):
    client.close()
    with pytest.raises(UsageError, match="closed"):
        client.get("anything")


def test_client_retries_until_the_server_listens():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    connecting, outcome = in_thread(
        lambda: StoreClient("127.0.0.1", port, SECRET, connect_timeout=DEADLINE_S))
    with StoreServer(SECRET, port=port) as srv:
        connecting.join(DEADLINE_S + 5)
        c = outcome["value"]
        c.set("k", b"v")
        assert c.get("k") == b"v" and c.url == srv.url
        c.close()


def test_client_gives_up_at_its_connect_timeout():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(CommunicationTimeout, match=f"127.0.0.1:{port}"):
        StoreClient("127.0.0.1", port, SECRET, connect_timeout=0.3)


def test_limits_refuse_a_set_and_leave_the_store_as_it_was():
    with StoreServer(SECRET, max_value_bytes=50, max_total_bytes=100, max_keys=3) as srv, \
            StoreClient(*srv.address, SECRET) as c:
        with pytest.raises(UsageError, match="max_value_bytes=50"):
            c.set("v", b"x" * 51)
        c.set("a", b"1" * 40)  # 41 bytes with its key
        c.set("b", b"2" * 40)  # 82
        with pytest.raises(UsageError, match="max_total_bytes=100"):
            c.set("c", b"3" * 40)  # 123
        assert not c.check(["c"]) and c.get("a") == b"1" * 40
        c.set("a", b"4" * 50)  # a replacement counts the difference: 92
        c.set("c", b"")
        with pytest.raises(UsageError, match="max_keys=3"):
            c.set("d", b"")
        with pytest.raises(UsageError, match="max_keys=3"):
            c.add("counter", 1)
        assert not c.check(["d"]) and not c.check(["counter"])
        assert c.delete_key("c") and c.add("counter", 2) == 2  # room again


def test_excess_connections_are_closed_at_once():
    with StoreServer(SECRET, max_connections=2) as srv:
        first, second = (StoreClient(*srv.address, SECRET) for _ in range(2))
        with pytest.raises(CommunicationError, match="connection limit"):
            StoreClient(*srv.address, SECRET, connect_timeout=1)
        first.close()

        def third_connects():
            try:
                return StoreClient(*srv.address, SECRET, connect_timeout=1)
            except CommunicationError:
                return None

        box = []
        eventually(lambda: box.append(third_connects()) or box[-1] is not None,
                   what="a connection after one closed")
        box[-1].set("k", b"v")
        assert second.get("k") == b"v"
        box[-1].close()
        second.close()


def test_the_secret_shows_in_no_repr_or_message(server, client, tmp_path):
    texts = [repr(server), repr(client), server.url, client.url,
             repr(FileStore(str(tmp_path / "f"), SECRET))]
    for attempt in (lambda: client.wait(["x"], timeout=0.05),
                    lambda: StoreClient(*server.address, b"another secret entirely"),
                    lambda: client.set("k" * 2000, b"")):
        with pytest.raises(Exception) as info:
            attempt()
        texts.append(str(info.value))
    assert not [t for t in texts if SECRET_TEXT in t or SECRET.hex() in t]


def test_connect_refuses_urls_it_does_not_serve(tmp_path):
    for url in ("http://host:1", "tcp://hostonly", "tcp://host:notaport", "file://rel/dir",
                "file://otherhost/dir", "nonsense"):
        with pytest.raises(UsageError, match="url"):
            connect(url, SECRET)
        with pytest.raises(UsageError) as info:
            connect(url, SECRET)
        assert repr(url) in str(info.value)
    assert isinstance(connect(f"file://{tmp_path}/s", SECRET), FileStore)


# --- rogue clients and servers (the protocol written out again) -----------------------

def mac(key, *parts):
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def recv_exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def field_key(key):
    raw = key.encode() if isinstance(key, str) else key
    return struct.pack(">H", len(raw)) + raw


def field_value(value):
    return struct.pack(">I", len(value)) + value


class RawClient:
    """A client that does the handshake by hand and then sends frames as told."""

    def __init__(self, address, secret=SECRET):
        self.sock = socket.create_connection(address, timeout=DEADLINE_S)
        server_nonce = recv_exactly(self.sock, 32)
        client_nonce = os.urandom(32)
        self.sock.sendall(client_nonce + mac(secret, b"ringsync-store client", server_nonce,
                                             client_nonce))
        self.session = mac(secret, b"ringsync-store session", server_nonce, client_nonce)
        self.sent = self.received = 0
        self.proof = self.sock.recv(32)  # (b"" where the server refused us)
        if len(self.proof) == 32:
            assert self.recv()[0] == 3  # the hello

    def frame(self, payload, seq=None, flip_tag=False):
        seq = struct.pack(">Q", self.sent if seq is None else seq)
        tag = bytearray(mac(self.session, b"\x01", seq, payload))
        if flip_tag:
            tag[0] ^= 1
        return struct.pack(">I", len(payload)) + seq + payload + bytes(tag)

    def send(self, payload, **how):
        data = self.frame(payload, **how)
        self.sock.sendall(data)
        self.sent += 1
        return data

    def recv(self):
        length, seq = struct.unpack(">IQ", recv_exactly(self.sock, 12))
        assert seq == self.received and length < 1 << 20
        body = recv_exactly(self.sock, length + 32)
        assert hmac.compare_digest(body[length:], mac(self.session, b"\x02",
                                                      struct.pack(">Q", seq), body[:length]))
        self.received += 1
        return body[:length]

    def dropped(self, within=DEADLINE_S):
        """Whether the server closes this connection within the deadline (reading and
        discarding anything it still sends)."""
        self.sock.settimeout(within)
        try:
            while self.sock.recv(4096):
                pass
            return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


SEEDED = {"seed/a": b"alpha", "seed/n": b"5", "seed/held": b"beta"}


@pytest.fixture
def seeded(server, client):
    for key, value in SEEDED.items():
        client.set(key, value)
    yield
    # every rogue left the store as it was, and the server still serves a good client
    with StoreClient(*server.address, SECRET) as good:
        assert {key: good.get(key) for key in SEEDED} == SEEDED
        assert not good.check(["rogue"])
        good.set("after", b"fine")
        assert good.get("after") == b"fine"


def test_rogue_with_a_wrong_secret_is_dropped(server, seeded):
    rogue = RawClient(server.address, secret=b"not the secret at all")
    assert rogue.proof == b""
    with pytest.raises(CommunicationError, match="another secret"):
        StoreClient(*server.address, b"not the secret at all")


def test_rogue_that_says_nothing_is_dropped_after_the_handshake_time(server, seeded):
    sock = socket.create_connection(server.address, timeout=DEADLINE_S)
    start = time.monotonic()
    assert len(recv_exactly(sock, 32)) == 32  # the nonce, then silence from us
    sock.settimeout(DEADLINE_S)
    assert sock.recv(1) == b""
    assert 0.25 <= time.monotonic() - start < 5
    sock.close()


def test_rogue_frame_with_a_bad_tag_is_dropped_unacted(server, seeded):
    rogue = RawClient(server.address)
    rogue.send(bytes([OP_SET]) + field_key("rogue") + field_value(b"evil"), flip_tag=True)
    assert rogue.dropped()


def test_replayed_frame_is_dropped_unacted(server, seeded, client):
    rogue = RawClient(server.address)
    frame = rogue.send(bytes([OP_ADD]) + field_key("replayed") + struct.pack(">q", 1))
    assert rogue.recv() == bytes([0]) + struct.pack(">q", 1)
    rogue.sock.sendall(frame)  # the same bytes again: an old sequence number
    assert rogue.dropped()
    assert client.get("replayed") == b"1"


def test_frame_from_the_future_is_dropped_unacted(server, seeded):
    rogue = RawClient(server.address)
    rogue.send(bytes([OP_SET]) + field_key("rogue") + field_value(b"x"), seq=5)
    assert rogue.dropped()


@pytest.mark.parametrize("length", [2 ** 31, 2 ** 32 - 1, MAX_VALUE_BYTES + MAX_KEY_BYTES + 65])
def test_oversized_length_is_dropped_without_reading_it(server, seeded, length):
    rogue = RawClient(server.address)
    # only the header: a server that believed the length would wait for the rest
    rogue.sock.sendall(struct.pack(">IQ", length, 0))
    assert rogue.dropped(within=5)


MALFORMED = {
    "empty": b"",
    "unknown op": b"\xff" + field_key("rogue"),
    "key cut short": bytes([OP_SET]) + struct.pack(">H", 10) + b"rog",
    "value cut short": bytes([OP_SET]) + field_key("rogue") + struct.pack(">I", 100) + b"v",
    "bytes left over": bytes([OP_SET]) + field_key("rogue") + field_value(b"v") + b"extra",
    "key too long": bytes([OP_SET]) + field_key("r" * (MAX_KEY_BYTES + 1)) + field_value(b""),
    "key not utf-8": bytes([OP_SET]) + field_key(b"\xff\xfe") + field_value(b"v"),
    "huge key count": bytes([OP_CHECK]) + struct.pack(">I", 2 ** 32 - 1) + field_key("rogue"),
    "delete of a seeded key, with a tail": bytes([OP_DELETE]) + field_key("seed/a") + b"\0",
    "get without its timeout": bytes([OP_GET]) + field_key("seed/a"),
    "add cut short": bytes([OP_ADD]) + field_key("seed/n") + b"\0\0\0",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_payload_is_dropped_unacted(server, seeded, name):
    rogue = RawClient(server.address)
    rogue.send(MALFORMED[name])
    assert rogue.dropped()


def test_a_well_formed_raw_request_is_served(server, seeded):
    # (the rogue tests' protocol is the real one: the same client, well-behaved, works)
    rogue = RawClient(server.address)
    rogue.send(bytes([OP_GET]) + field_key("seed/a") + struct.pack(">Q", 1000))
    assert rogue.recv() == b"\0alpha"
    rogue.send(bytes([OP_DELETE]) + field_key("rogue"))
    assert rogue.recv() == b"\0\0"


def rogue_server(respond):
    """A listener that runs respond(sock) on its first connection; its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(DEADLINE_S)

    def serve():
        with listener:
            sock, _ = listener.accept()
            with sock:
                sock.settimeout(DEADLINE_S)
                respond(sock)

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()


def test_client_refuses_a_server_that_does_not_know_the_secret():
    def impostor(sock):
        sock.sendall(os.urandom(32))
        recv_exactly(sock, 64)
        sock.sendall(os.urandom(32))  # a guessed proof
        sock.recv(1)  # (until the client hangs up)

    with pytest.raises(CommunicationError, match="does not know this job's secret"):
        StoreClient(*rogue_server(impostor), SECRET, connect_timeout=5)


def test_client_does_not_read_an_oversized_frame_from_its_server():
    def liar(sock):
        server_nonce = os.urandom(32)
        sock.sendall(server_nonce)
        answer = recv_exactly(sock, 64)
        sock.sendall(mac(SECRET, b"ringsync-store server", answer[:32], server_nonce))
        sock.sendall(struct.pack(">IQ", 2 ** 31, 0))  # a hello "of 2 GiB", then nothing
        sock.recv(1)

    start = time.monotonic()
    with pytest.raises(CommunicationError, match="handshake"):
        StoreClient(*rogue_server(liar), SECRET, connect_timeout=5)
    assert time.monotonic() - start < 5


# --- load_secret ----------------------------------------------------------------------

def test_load_secret_from_the_environment():
    assert load_secret({"RINGSYNC_SECRET": SECRET_TEXT}) == SECRET
    assert load_secret({}) is None
    with pytest.raises(UsageError, match="too short") as info:
        load_secret({"RINGSYNC_SECRET": "hunter2"})
    assert "hunter2" not in str(info.value)


def test_load_secret_from_a_private_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    assert load_secret({"RINGSYNC_SECRET_FILE": str(path)}) == SECRET
    # the variable wins over the file
    other = "another-secret-of-enough-length"
    assert load_secret({"RINGSYNC_SECRET": other,
                        "RINGSYNC_SECRET_FILE": str(path)}) == other.encode()


def test_load_secret_refuses_a_file_others_can_read(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o644)
    with pytest.raises(UsageError) as info:
        load_secret({"RINGSYNC_SECRET_FILE": str(path)})
    message = str(info.value)
    assert str(path) in message and "0644" in message and SECRET_TEXT not in message


def test_load_secret_names_an_unreadable_or_short_file(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(UsageError, match="missing"):
        load_secret({"RINGSYNC_SECRET_FILE": str(missing)})
    short = tmp_path / "short"
    short.write_bytes(b"tiny\n")
    short.chmod(0o600)
    with pytest.raises(UsageError, match="too short") as info:
        load_secret({"RINGSYNC_SECRET_FILE": str(short)})
    assert "tiny" not in str(info.value).replace(str(short), "")


# --- the file store -------------------------------------------------------------------

def the_file_of(store, key):
    """The file a key's set() wrote (found by writing it, not by knowing the naming)."""
    before = set(os.listdir(store.path))
    store.set(key, b"probe")
    (name,) = {n for n in os.listdir(store.path) if not n.startswith(".")} - before
    return os.path.join(store.path, name)


def test_file_store_creates_a_private_directory(tmp_path):
    store = FileStore(str(tmp_path / "new" / "dir"), SECRET)
    assert os.stat(store.path).st_mode & 0o777 == 0o700
    assert store.url == "file://" + store.path


def test_file_store_ignores_files_it_did_not_write(tmp_path):
    store = FileStore(str(tmp_path / "s"), SECRET, timeout=0.2)
    tampered = the_file_of(store, "tampered")
    with open(tampered, "r+b") as f:  # the tag kept, the value changed
        f.seek(32)
        f.write(b"PROBE")
    forged = the_file_of(store, "forged")
    value = b"forged value"
    with open(forged, "wb") as f:  # a tag made with another secret
        f.write(mac(b"another secret entirely", b"forged", value) + value)
    for key in ("tampered", "forged"):
        assert not store.check([key])
        with pytest.raises(CommunicationTimeout, match=key):
            store.get(key)
        with pytest.raises(UsageError, match="not written by this job"):
            store.add(key, 1)
        with pytest.raises(UsageError, match="not written by this job"):
            store.compare_set(key, b"", b"x")
    assert FileStore(store.path, b"another secret entirely").check(["forged"])


def test_file_store_cannot_hold(tmp_path):
    with pytest.raises(NotImplementedError, match="tcp://"):
        FileStore(str(tmp_path), SECRET).hold("alive/0")


def test_file_store_adds_from_threads_are_atomic(tmp_path):
    store = FileStore(str(tmp_path / "s"), SECRET)
    threads = [in_thread(lambda: [store.add("n", 1) for _ in range(50)]) for _ in range(4)]
    for thread, _ in threads:
        thread.join(DEADLINE_S * 3)
    assert sorted(n for _, o in threads for n in o["value"]) == list(range(1, 201))
    assert store.get("n") == b"200"


CHILD_ADDS = """
import sys
from ringsync.store import FileStore
store = FileStore(sys.argv[1], sys.argv[2].encode())
for _ in range(100):
    store.add("n", 1)
"""


def test_file_store_adds_from_processes_are_atomic(tmp_path):
    path = str(tmp_path / "s")
    children = [subprocess.Popen([sys.executable, "-c", CHILD_ADDS, path, SECRET_TEXT],
                                 env=child_env(), cwd=ROOT) for _ in range(2)]
    try:
        assert [c.wait(DEADLINE_S * 3) for c in children] == [0, 0]
    finally:
        for c in children:
            c.kill()
            c.wait(DEADLINE_S)
    assert FileStore(path, SECRET).get("n") == b"200"


# --- python -m ringsync.store serve ---------------------------------------------------

def read_line(stream, seconds=DEADLINE_S * 3):
    ready, _, _ = select.select([stream], [], [], seconds)
    assert ready, f"no line within {seconds} s"
    return stream.readline()


def test_serve_prints_its_url_and_serves_until_terminated():
    server = subprocess.Popen([sys.executable, "-m", "ringsync.store", "serve"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env(RINGSYNC_SECRET=SECRET_TEXT), cwd=ROOT)
    try:
        url = read_line(server.stdout).strip()
        assert url.startswith("tcp://127.0.0.1:")
        with connect(url, SECRET, connect_timeout=DEADLINE_S) as c:
            c.set("k", b"served")
            assert c.get("k") == b"served"
            assert "ringsync.store serve" in c.served_by
        server.terminate()
        assert server.wait(DEADLINE_S) == 0
    finally:
        server.kill()
        server.wait(DEADLINE_S)


def test_serve_refuses_to_start_without_a_secret():
    env = child_env()
    env.pop("RINGSYNC_SECRET", None)
    env.pop("RINGSYNC_SECRET_FILE", None)
    done = subprocess.run([sys.executable, "-m", "ringsync.store", "serve"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=DEADLINE_S * 3)
    assert done.returncode == 2 and "RINGSYNC_SECRET" in done.stderr and not done.stdout
