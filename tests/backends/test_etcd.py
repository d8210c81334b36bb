"""etcd's own: what its keys and leases look like on the server, and the gateway's hostility.

What every server backend shares runs in tests/contract; here is what only a lock made of
etcd keys on leases has: the queue keys and leases a run leaves (none), the create
revision as the fence, a lease revoked under a holder, several members in one URI, a login,
and a gateway that answers what etcd never would. Every test talks to a real etcd 3.4
started for the module (tests/support/servers.py); the oracle is the server's own keys
and the commands' own interval log, never lockrun's word.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from typing import TYPE_CHECKING, Any, Final

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun import AsyncLock
from lockrun.backends.etcd import EtcdBackend, lock_prefix
from lockrun.backends.etcd.gateway import number, unb64
from lockrun.backends.etcd.queue import kvs_of
from tests.support.cli import Held, finish, interval_log, lockrun, one_line, start, wait_for
from tests.support.net import make_certificates
from tests.support.servers import EtcdServer, free_port

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = [pytest.mark.server, pytest.mark.timeout(60)]

PASSWORD: Final = "Sesame-8e1f"  # noqa: S105 - a test server's


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    """Return an etcd of this module's own (one member)."""
    server = EtcdServer(port=free_port(), peer_port=free_port())
    yield server
    server.close()


def uri_of(server: EtcdServer) -> str:
    return "etcd://" + server.uri.removeprefix("http://")


def gateway(server: EtcdServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST *body* to the server's gateway, as an operator with curl would."""
    request = urllib.request.Request(  # noqa: S310 - our own server on loopback
        server.uri + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
        decoded: dict[str, Any] = json.load(answer)
        return decoded


def keys_of(server: EtcdServer, name: str) -> dict[str, dict[str, Any]]:
    """Return every key of lock *name* with its create revision, lease and value (the server's)."""
    prefix = lock_prefix("default", name).encode()
    end = prefix[:-1] + b"0"
    answer = gateway(
        server,
        "/v3/kv/range",
        {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()},
    )
    return {
        base64.b64decode(kv["key"]).decode()[len(prefix) :]: {
            "created": int(kv["create_revision"]),
            "lease": int(kv.get("lease", 0)),
            "value": base64.b64decode(kv.get("value", "")),
        }
        for kv in answer.get("kvs", [])
    }


def queue_of(server: EtcdServer, name: str) -> dict[str, dict[str, Any]]:
    """Return lock *name*'s queue keys (``q/LEASE``), as `keys_of` does."""
    return {key: kv for key, kv in keys_of(server, name).items() if key.startswith("q/")}


def leases(server: EtcdServer) -> set[int]:
    """Return the IDs of every lease the server has."""
    return {int(lease["ID"]) for lease in gateway(server, "/v3/lease/leases", {}).get("leases", [])}


def test_a_waiter_runs_after_the_holder_with_a_higher_fence(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name, "--ttl", "10")
    (queue,) = queue_of(etcd, name).values()
    assert held.fence == queue["created"]  # the fence is the queue key's create revision
    fence = tmp_path / "fence"
    waiter = start(
        "--uri", uri, "--name", name, "--ttl", "10", "-w", "30",
        "--", "sh", "-c", f"echo $LOCKRUN_FENCE > {fence}",
    )  # fmt: skip
    wait_for(lambda: len(queue_of(etcd, name)) == 2, what="the waiter's key")
    assert held.finish() == 0
    assert finish(waiter) == 0
    assert int(fence.read_text()) > held.fence
    wait_for(lambda: not keys_of(etcd, name), what="no key left")


def test_a_busy_try_and_a_run_leave_no_key_and_no_lease(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    uri = uri_of(etcd)
    before = leases(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name)
    busy = lockrun("--uri", uri, "--name", name, "--wait", "0", "--", "true")
    assert busy.returncode == 75, busy.stderr
    assert f"{name} busy" in one_line(busy.stderr)
    assert len(queue_of(etcd, name)) == 1  # the holder's alone
    assert len(leases(etcd) - before) == 1
    assert held.finish() == 0
    assert keys_of(etcd, name) == {}
    assert leases(etcd) - before == set()


def test_n_slots_run_at_most_n_at_once_each_in_its_own_slot(
    etcd: EtcdServer, tmp_path: Path, name: str
) -> None:
    runs, slots, most = interval_log(
        tmp_path,
        ["--uri", uri_of(etcd), "--name", name, "--ttl", "10"],
        slots=3,
        rounds=3,
        workers=5,
    )
    assert runs == 15
    assert most == 3  # never more than N; all N in use at once
    assert slots == {0, 1, 2}
    assert keys_of(etcd, name) == {}


def test_another_n_is_refused_and_leaves_nothing(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name, "--slots", "2")
    before = set(keys_of(etcd, name))
    other = lockrun("--uri", uri, "--name", name, "--slots", "3", "--wait", "5", "--", "true")
    assert other.returncode == 78, other.stderr
    assert "in use with 2 slots" in one_line(other.stderr)
    assert set(keys_of(etcd, name)) == before
    assert held.finish() == 0


def test_a_killed_lockrun_frees_its_slot_long_before_its_ttl(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """SIGKILL to lockrun: its guardian ends the command and revokes the lease (G2, G5)."""
    uri = uri_of(etcd)
    log = tmp_path / "intervals"
    body = f'echo "start $(date +%s%N)" >> {log}; trap "" TERM; sleep 600'
    holder = start("--uri", uri, "--name", name, "--ttl", "60", "--", "sh", "-c", body)
    wait_for(log.exists, what="the holder's command")
    waiter = start(
        "--uri",
        uri,
        "--name",
        name,
        "--ttl",
        "60",
        "-w",
        "50",
        "--",
        "sh",
        "-c",
        f'echo "next $(date +%s%N)" >> {log}',
    )
    wait_for(lambda: len(queue_of(etcd, name)) == 2, what="the waiter's key")
    killed = time.monotonic()
    holder.send_signal(signal.SIGKILL)
    assert finish(waiter) == 0
    assert time.monotonic() - killed < 30  # far below the 60 s lease: the guardian revoked it
    holder.communicate(timeout=10)
    # the holder's command (it ignores TERM) was killed before the next command started
    shells = subprocess.run(
        ["pgrep", "-f", f"echo .start.*{log}"], capture_output=True, text=True, check=False
    )
    assert shells.stdout.strip() == ""


def test_a_lease_revoked_under_a_holder_stops_its_command_with_76(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name, "--ttl", "3", "--kill-after", "1")
    ((_, queue),) = queue_of(etcd, name).items()
    gateway(etcd, "/v3/lease/revoke", {"ID": str(queue["lease"])})
    held.process.communicate(timeout=30)
    assert held.process.returncode == 76
    assert keys_of(etcd, name) == {}


def test_a_member_that_does_not_answer_is_passed_over(etcd: EtcdServer, name: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    uri = f"etcd://{dead},{etcd.uri.removeprefix('http://')}"
    ran = lockrun("--uri", uri, "--name", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert ran.returncode == 0, ran.stderr
    assert int(ran.stdout) > 0


def test_no_member_answering_is_69_in_one_line(name: str) -> None:
    uri = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    ran = lockrun("--uri", uri, "--name", name, "--", "true")
    assert ran.returncode == 69
    assert "Traceback" not in ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def guarded() -> Iterator[EtcdServer]:
    """Return an etcd with auth on: user lockrun (PASSWORD) may read and write lockrun/."""
    server = EtcdServer(port=free_port(), peer_port=free_port())
    ctl = ("etcdctl", f"--endpoints={server.uri}")
    for command in (
        ("user", "add", "root:root-pw"),
        ("user", "add", f"lockrun:{PASSWORD}"),
        ("role", "add", "locks"),
        ("role", "grant-permission", "locks", "--prefix=true", "readwrite", "lockrun/"),
        ("user", "grant-role", "lockrun", "locks"),
        ("auth", "enable"),
    ):
        subprocess.run(
            [*ctl, *command],
            check=True,
            capture_output=True,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
    yield server
    server.close()


def test_a_login_runs_and_a_wrong_password_is_69_never_shown(
    guarded: EtcdServer, name: str
) -> None:
    where = guarded.uri.removeprefix("http://")
    ran = lockrun(
        "--uri",
        f"etcd://lockrun:{PASSWORD}@{where}",
        "--name",
        name,
        "--",
        "sh",
        "-c",
        "echo $LOCKRUN_FENCE",
    )
    assert ran.returncode == 0, ran.stderr
    wrong = "Wrong-pw-5b7a"
    refused = lockrun(
        "--uri", f"etcd://lockrun:{wrong}@{where}", "--name", name, "-v", "--", "true"
    )
    assert refused.returncode == 69
    assert "authentication failed" in one_line(refused.stderr)
    assert wrong not in refused.stderr + refused.stdout
    assert wrong[:4] not in refused.stderr


def test_a_quiet_watch_stays_open_and_still_hears_the_deletion(etcd: EtcdServer) -> None:
    """A wait that ends with nothing leaves the watch streaming: no new one per keep-alive.

    Every waiter waits ttl/3 at a time, then keeps its lease alive: a watch closed at each
    such end cost a connection, a request and a watch on the server per waiter and cycle.
    """
    from lockrun.backends import parse_uri
    from lockrun.backends.etcd import connect

    backend = connect(parse_uri(uri_of(etcd)))
    key = b"quiet/watched"
    put = gateway(etcd, "/v3/kv/put", {"key": base64.b64encode(key).decode(), "value": ""})
    watch = backend.gateway.watch()
    watch.start(key, b"", int(put["header"]["revision"]) + 1)
    try:
        connections = watch.link.sock
        for _ in range(3):
            assert watch.moved(0.2) == ""
            assert watch.open
        assert watch.link.sock is connections  # the same stream, never made again
        gateway(etcd, "/v3/kv/deleterange", {"key": base64.b64encode(key).decode()})
        assert watch.moved(30) == "deleted"
    finally:
        watch.close()
        backend.close()


# -- a gateway that answers what etcd never would ---------------------------------------------

HOSTILE: Final = {
    "garbage": b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!",
    "a list": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]",
    "endless": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"100000\r\n" + b"{" * 0x100000 + b"\r\n",
    "huge length": b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n{}",
    "not http": b"+OK\r\n",
    "error without words": b'HTTP/1.1 500 Oops\r\nContent-Length: 11\r\n\r\n{"code": 2}',
    "wrong types": b"HTTP/1.1 200 OK\r\nContent-Length: 69\r\n\r\n"
    b'{"ID": [1], "TTL": {"a": 1}, "header": "x", "responses": 7, "kvs": 1}',
    "trickle": b"",  # one byte a second, forever: the call's deadline ends it
}


class Impostor:
    """A TCP server that answers every request with *reply* (or a byte a second)."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.done = threading.Event()
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self.done.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed
                return
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                if self.reply:
                    conn.sendall(self.reply)
                    self.done.wait(30)
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
                while not self.done.wait(1):
                    conn.sendall(b" ")
            except OSError:
                return

    def close(self) -> None:
        self.done.set()
        self.listener.close()


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_gateway_is_69_in_one_line_within_the_timeout(kind: str, name: str) -> None:
    impostor = Impostor(HOSTILE[kind])
    try:
        began = time.monotonic()
        ran = lockrun(
            "--uri",
            f"etcd://127.0.0.1:{impostor.port}",
            "--name",
            name,
            "--ttl",
            "20",
            "--",
            "true",
            timeout=45,
        )
        took = time.monotonic() - began
    finally:
        impostor.close()
    assert ran.returncode == 69, ran.stderr
    assert "Traceback" not in ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1
    assert took < 30  # a timeout of 1 s per call, a few calls: never the trickle's forever


JSON: Final = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@given(message=JSON, field=st.sampled_from(["TTL", "revision", "create_revision", "x"]))
def test_decoding_any_json_never_raises(message: object, field: str) -> None:
    assert isinstance(number(message, field), int)
    assert isinstance(unb64(message), bytes)
    kvs = kvs_of(message)
    assert kvs is None or all(isinstance(kv, dict) for kv in kvs)


def test_status_lists_holder_and_waiter_in_order(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name)
    waiter = start("--uri", uri, "--name", name, "-w", "30", "--", "true")
    wait_for(lambda: len(queue_of(etcd, name)) == 2, what="the waiter's key")
    shown = lockrun("status", "--uri", uri, "--json", name)
    assert shown.returncode == 0, shown.stderr
    (state,) = json.loads(shown.stdout)
    assert [h["pid"] for h in state["holders"]] == [held.process.pid]
    assert [w["pid"] for w in state["waiters"]] == [waiter.pid]
    assert state["holders"][0]["expires"] > time.time()
    assert held.finish() == 0
    assert finish(waiter) == 0


def test_backend_settings_never_show_the_password() -> None:
    from lockrun.backends import parse_uri
    from lockrun.backends.etcd import connect

    backend: EtcdBackend = connect(parse_uri(f"etcd://u:{PASSWORD}@127.0.0.1:1"))
    assert PASSWORD not in repr(backend.settings)
    assert PASSWORD not in repr(backend.__dict__)


def test_status_shows_each_holder_of_n_in_the_slot_its_command_was_told(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    uri = uri_of(etcd)
    held = [Held(tmp_path, "--uri", uri, "--name", name, "--slots", "3") for _ in range(3)]
    assert sorted(h.slot for h in held) == [0, 1, 2]
    held[0].finish()  # its slot goes free; the next holder takes it
    held[0] = Held(tmp_path, "--uri", uri, "--name", name, "--slots", "3")
    shown = lockrun("status", "--uri", uri, "--json", name)
    (state,) = json.loads(shown.stdout)
    told = {h.process.pid: h.slot for h in held}
    assert {h["pid"]: h["slot"] for h in state["holders"]} == told
    assert sorted(told.values()) == [0, 1, 2]
    assert all(h.finish() == 0 for h in held)


def test_a_queued_waiter_rides_out_a_restart_of_the_only_member(name: str, tmp_path: Path) -> None:
    """Etcd keeps leases and keys across a restart; the waiter asks again, it is not 69."""
    server = EtcdServer(port=free_port(), peer_port=free_port())
    try:
        uri = uri_of(server)
        held = Held(tmp_path, "--uri", uri, "--name", name, "--ttl", "10")
        fence = tmp_path / "fence"
        waiter = start(
            "--uri", uri, "--name", name, "--ttl", "10", "-w", "60",
            "--", "sh", "-c", f"echo $LOCKRUN_FENCE > {fence}",
        )  # fmt: skip
        wait_for(lambda: len(queue_of(server, name)) == 2, what="the waiter's key")
        server.restart()
        assert held.finish() == 0
        _, said = waiter.communicate(timeout=30)
        assert waiter.returncode == 0, said
        assert int(fence.read_text()) > held.fence
    finally:
        server.close()


def test_a_waiter_whose_watch_was_compacted_away_still_gets_its_turn(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """A compaction past the revision a waiter watches from: etcd cancels the watch.

    The waiter watches again from its last look's revision at every keep-alive (ttl/3), so
    that watch starts before the compaction; it looks again and keeps its place.
    """
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name, "--ttl", "3")
    fence = tmp_path / "fence"
    waiter = start(
        "--uri", uri, "--name", name, "--ttl", "3", "-w", "60",
        "--", "sh", "-c", f"echo $LOCKRUN_FENCE > {fence}",
    )  # fmt: skip
    wait_for(lambda: len(queue_of(etcd, name)) == 2, what="the waiter's key")
    for _ in range(20):  # revisions to compact away
        gateway(etcd, "/v3/kv/put", {"key": base64.b64encode(b"other/x").decode(), "value": ""})
    revision = int(gateway(etcd, "/v3/kv/range", {"key": "eA=="})["header"]["revision"])
    gateway(etcd, "/v3/kv/compaction", {"revision": str(revision), "physical": True})
    time.sleep(2.5)  # past a keep-alive: the waiter has watched again from before the compaction
    assert held.finish() == 0
    _, said = waiter.communicate(timeout=30)
    assert waiter.returncode == 0, said
    assert int(fence.read_text()) > held.fence


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """Return an etcd that speaks TLS alone and asks for a client certificate, and its certs."""
    certs = tmp_path_factory.mktemp("certs")
    make_certificates(certs)
    port, peer = free_port(), free_port()
    data = tmp_path_factory.mktemp("tls-etcd")
    url = f"https://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            *("etcd", "--data-dir", str(data / "data"), "--name", "tls"),
            *("--listen-client-urls", url, "--advertise-client-urls", url),
            *("--listen-peer-urls", f"http://127.0.0.1:{peer}"),
            *("--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"),
            *("--initial-cluster", f"tls=http://127.0.0.1:{peer}"),
            *("--cert-file", str(certs / "server.crt"), "--key-file", str(certs / "server.key")),
            *("--client-cert-auth", "--trusted-ca-file", str(certs / "ca.crt")),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ca = f"ssl_ca_certs={certs / 'ca.crt'}"
        client = f"ssl_certfile={certs / 'client.crt'}&ssl_keyfile={certs / 'client.key'}"
        uri = f"etcds://127.0.0.1:{port}?{ca}&{client}"
        wait_for(
            lambda: lockrun("status", "--uri", uri).returncode == 0, timeout=30, what="TLS etcd"
        )
        yield f"127.0.0.1:{port}", certs
    finally:
        server.kill()
        server.wait(10)


def test_etcds_checks_the_member_and_shows_our_certificate(
    tls_etcd: tuple[str, Path], name: str
) -> None:
    where, certs = tls_etcd
    client = f"ssl_certfile={certs / 'client.crt'}&ssl_keyfile={certs / 'client.key'}"
    good = f"etcds://{where}?ssl_ca_certs={certs / 'ca.crt'}&{client}"
    ran = lockrun("--uri", good, "--name", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert ran.returncode == 0, ran.stderr
    assert int(ran.stdout) > 0
    impostor = f"etcds://{where}?ssl_ca_certs={certs / 'other-ca.crt'}&{client}"
    nobody = f"etcds://{where}?ssl_ca_certs={certs / 'ca.crt'}"
    plain = f"etcd://{where}"
    for uri, says in (
        (impostor, "certificate verify failed"),
        (nobody, ""),  # the server refuses a client without a certificate
        (plain, ""),  # HTTP to a TLS port
    ):
        refused = lockrun("--uri", uri, "--name", name, "--", "true")
        assert refused.returncode == 69, (uri, refused.stderr)
        assert says in one_line(refused.stderr)
        assert "Traceback" not in refused.stderr


def test_a_cancelled_async_wait_leaves_the_queue_at_once(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """AsyncLock's cancel interrupts the watch the wait sleeps on: its key goes, not at ttl."""
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name)

    async def main() -> None:
        waiter = asyncio.create_task(AsyncLock(name, uri=uri, wait=None, ttl=3600).acquire())
        queued = lambda: len(queue_of(etcd, name)) == 2  # noqa: E731
        await asyncio.to_thread(wait_for, queued, what="the waiter's key")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # long before its hour's lease would end: the wait was cut, its lease revoked
        left = lambda: len(queue_of(etcd, name)) == 1  # noqa: E731
        await asyncio.to_thread(wait_for, left, what="the waiter's key gone")

    asyncio.run(main())
    assert held.finish() == 0


def test_status_dates_a_waiter_that_was_granted_from_its_grant(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name)
    queued = start("--uri", uri, "--name", name, "--ttl", "3", "-w", "60", "--", "sleep", "30")
    wait_for(lambda: len(queue_of(etcd, name)) == 2, what="the waiter's key")
    time.sleep(1.5)  # a wait long enough to tell its start from the grant
    released = time.time()
    assert held.finish() == 0

    def dated() -> bool:
        holders = json.loads(lockrun("status", "--uri", uri, "--json", name).stdout)[0]["holders"]
        return (
            bool(holders)
            and holders[0]["pid"] == queued.pid
            and holders[0]["since"] >= released - 0.5
        )

    wait_for(dated, what="the record rewritten at the first refresh (ttl/3)")
    queued.terminate()
    queued.communicate(timeout=30)


def handled(server: EtcdServer, *methods: str) -> int:
    """Return how many requests of *methods* the server answered (its /metrics), all codes."""
    with urllib.request.urlopen(f"{server.uri}/metrics", timeout=10) as answer:  # noqa: S310
        text = answer.read().decode()
    total = 0
    for line in text.splitlines():
        if line.startswith("grpc_server_handled_total{") and any(
            f'grpc_method="{method}"' in line for method in methods
        ):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def test_the_next_in_line_starts_on_the_holders_deletion_without_asking_again(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """One slot: the waiter right behind the holder is the head once the holder's key goes."""
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name, "--ttl", "60")
    ran = tmp_path / "ran"
    waiter = start(
        "--uri", uri, "--name", name, "--ttl", "60", "-w", "60",
        "--", "sh", "-c", f": > {ran}; sleep 30",
    )  # fmt: skip
    wait_for(lambda: len(queue_of(etcd, name)) == 2, what="the waiter's key")
    time.sleep(0.5)  # its watch is made after its look
    asked = handled(etcd, "Txn", "Range")
    held.go.touch()
    wait_for(ran.exists, what="the waiter's command")
    assert handled(etcd, "Txn", "Range") == asked  # the holder revokes; the waiter asks nothing
    held.process.communicate(timeout=30)
    assert held.process.returncode == 0
    waiter.terminate()
    waiter.communicate(timeout=30)


def test_a_waiter_behind_one_that_left_asks_before_it_runs(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """Holder A, waiters B then C: B gives up; C (watching B) must see A still there."""
    uri = uri_of(etcd)
    held = Held(tmp_path, "--uri", uri, "--name", name, "--ttl", "60")
    second = start("--uri", uri, "--name", name, "-w", "2", "--", "true")
    wait_for(lambda: len(queue_of(etcd, name)) == 2, what="B's key")
    ran = tmp_path / "ran"
    third = start("--uri", uri, "--name", name, "-w", "60", "--", "sh", "-c", f": > {ran}")
    wait_for(lambda: len(queue_of(etcd, name)) == 3, what="C's key")
    assert finish(second) == 75  # B gave up: its key went, and C's watch fired
    wait_for(lambda: len(queue_of(etcd, name)) == 2, what="B's key gone")
    time.sleep(1)  # C had its chance to run wrongly
    assert not ran.exists()
    assert held.finish() == 0
    assert finish(third) == 0
    assert ran.exists()
