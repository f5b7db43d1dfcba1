"""Authentication, tenant isolation and the control socket's peer check, on a real daemon with
CURVE on (tcp clients need an allowed key; ipc clients are the tenant "uid:<uid>")."""
import json
import os
import stat
import time

import msgpack
import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from mcpd.client import Client, CurveKeys
from mcpd.config import ConfigError, from_dict
from mcpd.daemon.frontend.gate import Gate
from mcpd.protocol import codes, wire
from mcpd.protocol import delta as codec
from mcpd.protocol.codes import MCPDError
from mcpd.security import keys
from mcpd.security.peer import PeerCred, is_admin, parse_peer_address
from mcpd.testing import Daemon, run_as

ADMIN_GROUP = "daemon"
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
REFUSED_WAIT_S = 30   # bounds the wait for a handshake's outcome, which the monitor shows in milliseconds


@pytest.fixture(scope="module")
def secure(module_daemon):
    return module_daemon(security={"curve": "on", "admin_group": ADMIN_GROUP},
                         limits={"max_message_bytes": 1 << 20, "max_header_bytes": 8192, "max_new_tokens": 4})


@pytest.fixture(scope="module")
def alice(secure):
    with secure.client(curve=secure.curve_keys("alice")) as client:
        yield client


@pytest.fixture(scope="module")
def bob(secure):
    with secure.client(curve=secure.curve_keys("bob")) as client:
        yield client


def refused(endpoint: str, curve: CurveKeys | None, context: zmq.Context | None = None) -> bool:
    """Whether a client with these keys (None: plaintext) is refused: its first handshake fails
    and the ping it sent is not answered. The handshake is watched on the socket's monitor, so a
    refusal is seen when it happens, not waited out (a refused handshake never answers)."""
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(endpoint)
        sock.send(wire.encode_request("ping", 1, {}))
        if not monitor.poll(REFUSED_WAIT_S * 1000):
            return False
        return bool(recv_monitor_message(monitor)["event"] & HANDSHAKE_FAILED) and not sock.poll(0)
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


# -- CURVE --------------------------------------------------------------------------------------

def test_allowed_key_is_served_and_its_name_is_the_tenant(alice):
    alice.call("context.open", {"id": "whoami"})
    assert [c["id"] for c in alice.call("context.list", {})["contexts"]] == ["whoami"]


def test_unknown_key_is_refused(secure, tmp_path):
    public, secret = keys.generate(tmp_path, "stranger")   # never allowed
    server = keys.read_public(secure.root / "state/keys/server.key")
    assert refused(secure.endpoint, CurveKeys(server, public, secret))


def test_plaintext_client_is_refused(secure):
    assert refused(secure.endpoint, None)


def test_revoked_key_is_refused_after_reload(secure):
    keys_of_carol = secure.curve_keys("carol")
    assert not refused(secure.endpoint, keys_of_carol)   # the check sees a handshake succeed, too
    with secure.client(curve=keys_of_carol) as carol:
        assert carol.ping()["pong"]
        assert secure.mcpctl("keys", "revoke", "carol").returncode == 0
        # The open connection is refused from its next request on, once the front-end re-reads.
        deadline = time.monotonic() + 30
        while True:
            try:
                carol.ping()
            except MCPDError as e:
                assert e.code == codes.UNAUTHORIZED
                break
            assert time.monotonic() < deadline, "a revoked key was still served after 30 s"
            time.sleep(0.1)
    assert refused(secure.endpoint, keys_of_carol)   # and a new connection cannot handshake


def new_key_for(secure, name: str, directory) -> CurveKeys:
    """A fresh key pair allowed as NAME, replacing whatever key NAME had."""
    public, secret = keys.generate(directory, name)
    done = secure.mcpctl("keys", "allow", "--", name, public)
    assert done.returncode == 0, done.stderr
    return CurveKeys(keys.read_public(secure.root / "state/keys/server.key"), public, secret)


def unauthorized(client: Client) -> bool:
    with pytest.raises(MCPDError) as raised:
        client.ping()
    return raised.value.code == codes.UNAUTHORIZED


def test_a_names_new_key_shuts_out_the_old_keys_connection(secure, tmp_path):
    with secure.client(curve=new_key_for(secure, "frank", tmp_path / "old")) as old:
        assert old.ping()["pong"]
        with secure.client(curve=new_key_for(secure, "frank", tmp_path / "new")) as new:
            # Its handshake succeeding shows the front-end has read the new key set.
            assert new.call("context.open", {"id": "franks"})["created"] is True
            assert unauthorized(old)
            assert [c["id"] for c in new.call("context.list", {})["contexts"]] == ["franks"]


def test_a_revoked_key_is_not_served_again_when_its_name_returns_with_another_key(secure, tmp_path):
    with secure.client(curve=new_key_for(secure, "grace", tmp_path / "old")) as old:
        old.call("context.open", {"id": "graces"})
        assert secure.mcpctl("keys", "revoke", "grace").returncode == 0
        with secure.client(curve=new_key_for(secure, "grace", tmp_path / "new")) as new:
            assert new.ping()["pong"]
            assert unauthorized(old)
            assert [c["id"] for c in new.call("context.list", {})["contexts"]] == ["graces"]


def test_one_key_is_one_tenant(secure, tmp_path):
    public, _ = keys.generate(tmp_path, "heidi")
    assert secure.mcpctl("keys", "allow", "heidi", str(tmp_path / "heidi.key")).returncode == 0
    assert secure.mcpctl("keys", "allow", "heidi", str(tmp_path / "heidi.key")).returncode == 0   # same: fine
    taken = control_op(secure, "keys.allow", {"name": "ivan", "public_key": public})
    assert taken["code"] == codes.CONFLICT and "already allowed as 'heidi'" in taken["message"]


UNDECODABLE = "#" * 40   # Z85 characters, but 84 * (85^4 + ... + 1) >= 2^32: no 32 bytes


def test_an_undecodable_key_is_refused_with_its_reason(secure):
    done = secure.mcpctl("keys", "allow", "x", UNDECODABLE)
    assert done.returncode == 1 and "does not decode to 32 bytes" in done.stderr
    refused = control_op(secure, "keys.allow", {"name": "x", "public_key": UNDECODABLE})
    assert refused["code"] == codes.BAD_REQUEST and "does not decode to 32 bytes" in refused["message"]
    assert "x" not in [entry["name"] for entry in json.loads(secure.mcpctl("keys", "list", "--json").stdout)["allowed"]]


def test_bad_entries_on_disk_are_skipped_and_break_nobody(secure, alice, tmp_path):
    allowed = secure.root / "state/keys/allowed"
    planted = {"hash.key": lambda p: p.write_text(f'curve\n    public-key = "{UNDECODABLE}"\n'),
               "fifo.key": os.mkfifo,   # reading it would block the front-end forever
               "huge.key": lambda p: p.write_bytes(b"x" * (1 << 20)),
               "latin.key": lambda p: p.write_bytes(b"\xff\xfe" * 20),
               "link.key": lambda p: p.symlink_to(secure.root / "state/keys/server.key")}
    try:
        for name, make in planted.items():
            make(allowed / name)
        with secure.client(curve=new_key_for(secure, "judy", tmp_path)) as judy:   # read after the bad ones
            assert judy.ping()["pong"]
        assert alice.ping()["pong"]
        for name in planted:
            assert f"allowed key file {allowed / name} skipped" in secure.log(), name
        listed = json.loads(secure.mcpctl("keys", "list", "--json").stdout)["allowed"]
        assert not {entry["name"] for entry in listed} & {"hash", "fifo", "huge", "latin", "link"}
    finally:
        for name in planted:
            (allowed / name).unlink()


def control_op(daemon: Daemon, op: str, args: dict) -> dict:
    """One control op sent as it is (mcpctl checks some arguments before sending); its reply."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{daemon.runtime_dir}/control.ipc")
    sock.send(msgpack.packb({"v": 1, "op": op, "id": 1, "args": args}))
    assert sock.poll(20000)
    reply = msgpack.unpackb(sock.recv(), raw=False)
    sock.close()
    return reply


def test_no_zap_handler_means_refusal(secure, tmp_path):
    """Fail closed: the socket set up as the front-end does, with its handler gone, admits no one."""
    context = zmq.Context()
    config = from_dict({"server": {"tcp": "tcp://127.0.0.1:0", "runtime_dir": str(tmp_path),
                                   "state_dir": str(secure.root / "state")}, "security": {"curve": "on"}})
    gate = Gate(config, context)
    gate.authenticator.socket.close(0)   # no handler bound any more
    server = context.socket(zmq.ROUTER)
    gate.bind(server)
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    assert refused(endpoint, secure.curve_keys("dave"), context)   # a key the daemon allows
    assert not server.poll(0)
    server.close(0)
    context.term()


# -- tenants ------------------------------------------------------------------------------------

def test_tenants_cannot_reach_each_others_contexts(alice, bob):
    alice.call("context.open", {"id": "secret"})
    entries, frames = codec.to_wire([codec.diff("w", None, np.arange(8, dtype=np.int64))])
    alice.call_with_payload("context.update", {"id": "secret", "base": 0, "changes": entries}, frames)
    for op, args in [("context.open", {"id": "secret", "create": False}), ("context.get", {"id": "secret"}),
                     ("context.update", {"id": "secret", "base": 1, "changes": []}),
                     ("generate", {"context": "secret", "prompt": "x", "max_tokens": 1})]:
        with pytest.raises(MCPDError) as raised:
            bob.call(op, args)
        assert raised.value.code == codes.NOT_FOUND, op
    assert bob.call("context.drop", {"id": "secret"}) == {"dropped": False}
    assert "secret" not in [c["id"] for c in bob.call("context.list", {})["contexts"]]
    assert bob.call("context.open", {"id": "secret"})["created"] is True   # bob's own, separate one
    assert alice.call("context.get", {"id": "secret"})["version"] == 1


def test_header_tenant_cannot_claim_another_identity(bob):
    with pytest.raises(MCPDError) as raised:
        bob.call("context.list", {}, tenant="alice")
    assert raised.value.code == codes.UNAUTHORIZED
    assert bob.call("context.list", {}, tenant="bob")["contexts"] is not None   # its own name is fine


def test_ipc_clients_are_their_uid(secure, alice):
    with Client(f"ipc://{secure.runtime_dir}/client.ipc") as local:
        local.call("context.open", {"id": "mine"})
        assert [c["id"] for c in local.call("context.list", {})["contexts"]] == ["mine"]
    assert "mine" not in [c["id"] for c in alice.call("context.list", {})["contexts"]]


# -- the control socket -------------------------------------------------------------------------

def control_as(daemon: Daemon, uid: int, gid: int) -> dict:
    """The answers to control ops status and keys.list, asked from a process with this uid and gid
    (it drops its privileges before it touches zmq, in a zmq context of its own)."""
    return run_as(uid, gid, lambda: _control_answers(daemon.runtime_dir / "control.ipc"))


def _control_answers(path) -> dict:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20000)
    sock.connect(f"ipc://{path}")
    answers = {}
    for op in ("status", "keys.list"):
        sock.send(msgpack.packb({"v": 1, "op": op, "id": 1}))
        reply = msgpack.unpackb(sock.recv(), raw=False)
        answers[op] = reply.get("code", reply["kind"])
    return answers


@pytest.fixture
def reachable_by_others(secure):
    """Let other users reach the runtime dir (mkdtemp made it 0700)."""
    os.chmod(secure.root, 0o711)
    yield
    os.chmod(secure.root, 0o700)
    os.chmod(secure.runtime_dir / "control.ipc", 0o660)


@pytest.mark.skipif(os.getuid() != 0, reason="switching uid needs root")
def test_control_ops_refused_for_another_uid(secure, reachable_by_others):
    import grp
    admins = grp.getgrnam(ADMIN_GROUP).gr_gid
    assert oct(os.stat(secure.runtime_dir / "control.ipc").st_mode & 0o777) == oct(0o660)
    assert control_as(secure, 65534, admins) == {"status": "ok", "keys.list": "ok"}   # admin group
    # Loosen the socket file as a careless operator might: the peer check still holds.
    os.chmod(secure.runtime_dir / "control.ipc", 0o666)
    assert control_as(secure, 65534, 65534) == {"status": "ok", "keys.list": codes.UNAUTHORIZED}


def test_own_uid_may_use_privileged_control_ops(secure):
    assert secure.mcpctl("keys", "list", "--json").returncode == 0


@pytest.mark.parametrize("peer, admin", [
    (PeerCred(os.getuid(), 1234, 1), True), (PeerCred(0, 0, 1), True),
    (PeerCred(54321, 4242, 1), True),          # primary group is the admin group
    (PeerCred(54321, 54321, 1), False), (None, False)])
def test_admin_rule(peer, admin):
    assert is_admin(peer, os.getuid(), 4242) is admin


def test_peer_address_parsing():
    assert parse_peer_address("localhost:1000:100:4242") == PeerCred(1000, 100, 4242)
    assert parse_peer_address("127.0.0.1") is None and parse_peer_address("fe80::1:2:3") is None


# -- configuration and key files ----------------------------------------------------------------

@pytest.mark.parametrize("tcp, curve, allowed", [
    ("tcp://0.0.0.0:7070", "off", False), ("tcp://10.1.2.3:7070", "off", False),
    ("tcp://eth0:7070", "off", False), ("tcp://127.0.0.1:7070", "off", True),
    ("tcp://[::1]:7070", "off", True), ("tcp://0.0.0.0:7070", "auto", True)])
def test_plaintext_beyond_loopback_refuses_to_start(tcp, curve, allowed):
    raw = {"server": {"tcp": tcp}, "security": {"curve": curve}}
    if allowed:
        from_dict(raw)
    else:
        with pytest.raises(ConfigError, match="not a loopback address"):
            from_dict(raw)
    assert from_dict({**raw, "security": {"curve": curve, "allow_plaintext_non_loopback": True}})


def test_auto_means_curve_exactly_off_loopback():
    assert from_dict({"server": {"tcp": "tcp://0.0.0.0:1"}}).curve
    assert not from_dict({"server": {"tcp": "tcp://127.0.0.1:1"}}).curve


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o777])
def test_secret_key_files_are_0600_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        keys.generate(tmp_path, "k")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "k.key_secret").st_mode & 0o777 == 0o600


def test_bad_key_names_and_keys_are_refused(secure):
    for args in (["keys", "allow", "../evil", "x" * 40], ["keys", "allow", "uid:0", "x" * 40],
                 ["keys", "allow", "ok", "tooshort"]):
        done = secure.mcpctl(*args)
        assert done.returncode != 0 and done.stderr, args


def test_a_key_under_two_names_on_disk_allows_neither(tmp_path):
    store = keys.KeyStore(tmp_path)
    store.ensure_server_keys()
    public, _ = keys.generate(tmp_path / "clients", "kim")
    other, _ = keys.generate(tmp_path / "clients", "lee")
    store.allow("kim", public)
    store.allow("lee", other)
    (store.allowed_dir / "kim2.key").write_text(f'curve\n    public-key = "{public}"\n')   # by hand
    assert store.allowed() == {other: "lee"}


@pytest.mark.parametrize("umask", [0o000, 0o777])
def test_key_files_get_their_modes_whatever_the_umask(tmp_path, umask):
    public, _ = keys.generate(tmp_path / "clients", "kim")
    old = os.umask(umask)
    try:
        store = keys.KeyStore(tmp_path / "keys")
        store.ensure_server_keys()
        store.allow("kim", public)
    finally:
        os.umask(old)
    modes = {path.relative_to(tmp_path / "keys").as_posix(): stat.S_IMODE(path.stat().st_mode)
             for path in [tmp_path / "keys", *(tmp_path / "keys").rglob("*")]}
    assert modes == {".": 0o700, "allowed": 0o700, "allowed/kim.key": 0o600,
                     "server.key": 0o644, "server.key_secret": 0o600}


def test_a_raw_header_claiming_another_tenant_is_refused(secure, bob):
    """A header naming another tenant, sent from a bare socket (no client library in the way), is
    refused UNAUTHORIZED rather than served as that tenant."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20000)
    secure_keys = secure.curve_keys("erin")
    secure_keys.apply(sock)
    sock.connect(secure.endpoint)
    sock.send(msgpack.packb({"v": 1, "op": "context.list", "id": 1, "tenant": "bob"}))
    reply = msgpack.unpackb(sock.recv(), raw=False)
    sock.close()
    assert reply["code"] == codes.UNAUTHORIZED


# -- 10,000 hostile frames at the live daemon ---------------------------------------------------

FUZZ_FRAMES = 10_000
MAX_RSS_GROWTH = 8 << 20


def hostile_messages(count: int, seed: int) -> list[list[bytes]]:
    """Random and mutated requests: valid headers of every op with bytes flipped, cut or
    inserted, random bytes, wrong types, and payload frames over the limits."""
    rng = np.random.default_rng(seed)
    seeds = [msgpack.packb(h) for h in (
        {"v": 1, "op": "ping", "id": 1},
        {"v": 1, "op": "generate", "id": 2, "args": {"prompt": "hi", "max_tokens": 2}},
        {"v": 1, "op": "context.open", "id": 3, "args": {"id": "x"}},
        {"v": 1, "op": "context.update", "id": 4, "args": {"id": "x", "base": 0, "changes": [
            {"name": "w", "kind": "set", "frame": 0,
             "meta": {"type": "array", "dtype": "<f4", "shape": [2], "codec": "raw", "nbytes": 8}}]}},
        {"v": 1, "op": "context.get", "id": 5, "args": {"id": "x"}},
        {"v": 1, "op": "context.drop", "id": 6, "args": {"id": "x"}},
        {"v": 1, "op": "cancel", "id": 7, "args": {"target": 2}})]
    messages = []
    for i in range(count):
        choice = rng.integers(4)
        if choice == 0:
            header = rng.bytes(int(rng.integers(0, 64)))
        else:
            header = bytearray(seeds[rng.integers(len(seeds))])
            for _ in range(int(rng.integers(1, 4))):
                header[rng.integers(len(header))] = rng.integers(256)
            header = bytes(header[: rng.integers(1, len(header) + 1)] if choice == 3 else header)
        extra = [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(0, 3)))]
        if i % 500 == 0:
            extra = [b"p"] * 20   # too many frames
        messages.append([header, *extra])
    return messages


def rss_of(daemon: Daemon) -> dict[str, int]:
    import psutil
    return {role: psutil.Process(daemon.pid_of(role)).memory_info().rss for role in ("frontend", "scheduler")}


def flood(daemon: Daemon, curve: CurveKeys, messages: list[list[bytes]]) -> int:
    """Send all without waiting, then read replies until each message has one or none comes for
    REFUSED_WAIT_S; returns the count (each must get one: the wait is for a lost one)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    curve.apply(sock)
    sock.connect(daemon.endpoint)
    for frames in messages:
        sock.send_multipart(frames)
    replies = 0
    while replies < len(messages) and sock.poll(REFUSED_WAIT_S * 1000):
        sock.recv_multipart()
        replies += 1
    sock.close()
    return replies


def test_live_fuzz_leaves_the_daemon_serving_and_contexts_untouched(secure, alice):
    ctx = alice.context("precious")
    ctx["weights"] = np.arange(1000, dtype=np.float32)
    ctx.sync()
    before = alice.call("context.get", {"id": "precious"})
    mallory = secure.curve_keys("mallory")
    assert flood(secure, mallory, hostile_messages(1000, seed=1)) == 1000   # warm up: caches, allocator arenas
    rss_before = rss_of(secure)
    assert flood(secure, mallory, hostile_messages(FUZZ_FRAMES, seed=2)) == FUZZ_FRAMES   # every one answered
    rss_after = rss_of(secure)
    assert alice.ping()["pong"] is True
    assert alice.call("context.get", {"id": "precious"}) == before
    assert [c["id"] for c in alice.call("context.list", {})["contexts"]].count("precious") == 1
    for role in rss_before:
        assert rss_after[role] - rss_before[role] < MAX_RSS_GROWTH, (role, rss_before, rss_after)


def test_a_key_allowed_right_after_a_handshake_is_served_at_once(secure):
    """The allowed set was read for one client's handshake; a key allowed a moment later (within
    the re-read guard, or within the same timestamp tick) is served on its first handshake: a
    refused handshake is not retried by the client, it would wait until its timeout. A change in
    the read's tick leaves the directory's mtime as the read saw it: the test sets it back so."""
    first = secure.curve_keys("frank")
    time.sleep(1.5)   # the directory's mtime settles: the next read trusts it
    with secure.client(curve=first) as frank:
        frank.ping()   # a handshake: the allowed set is read now
        with secure.client(curve=secure.curve_keys("grace"), timeout=10) as grace:
            assert grace.ping() is not None
    allowed = secure.root / "state/keys/allowed"
    unsettled = time.time_ns() + 60 * 10**9   # an mtime no read here takes for settled, however slow the machine
    try:
        os.utime(allowed, ns=(unsettled, unsettled))
        with secure.client(curve=first) as frank:
            frank.ping()   # a handshake: the allowed set is read at that mtime
        heidi = secure.curve_keys("heidi")
        os.utime(allowed, ns=(unsettled, unsettled))   # allowed in the read's tick
        with secure.client(curve=heidi, timeout=10) as client:
            assert client.ping() is not None
    finally:
        os.utime(allowed)
