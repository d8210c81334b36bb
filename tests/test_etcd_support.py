"""The etcd servers and harness the tests use, checked before any lockrun runs on them.

The etcd backend's tests (tests/contract on `EtcdHarness`) read the server's own view of a
lock: its queue keys by create revision, the leases they are attached to, and each lease's
time to live. Here that reading is checked on keys put by hand in docs/design.md A13's
layout, and the servers themselves: a restart keeps the data, auth keeps lockrun's user to
its prefix, a cluster of three elects another leader when its leader dies.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from lockrun.backends.redis.scripts import key_prefix
from tests.support.cli import wait_for
from tests.support.harness import NAMESPACE, EtcdHarness, etcd_prefix
from tests.support.servers import (
    ETCD_PASSWORD,
    ETCD_USER,
    EtcdError,
    EtcdServer,
    etcdctl,
    gateway,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.support.servers import EtcdCluster

pytestmark = [pytest.mark.server, pytest.mark.timeout(60)]

TTL: Final = 3


@pytest.fixture
def own() -> Iterator[EtcdHarness]:
    """Return an `EtcdHarness` with an etcd and a proxy of its own."""
    made = EtcdHarness("etcd")
    yield made
    made.close()


def b64(text: str) -> str:
    """Return *text* as the gateway wants a key or value: base64."""
    return base64.b64encode(text.encode()).decode()


def enqueue(harness: EtcdHarness, name: str, pid: int, slots: int = 1) -> int:
    """Queue an acquirer as the backend does: a lease of its own, q/LEASE with its record."""
    lease = int.from_bytes(os.urandom(8), "big") >> 1  # 63 random bits, as lockrun draws
    harness.call("/v3/lease/grant", {"TTL": TTL, "ID": str(lease)})
    record = {
        "token": f"{lease:016x}",
        "namespace": NAMESPACE,
        "name": name,
        "slots": slots,
        "holder": {"host": "h", "pid": pid, "user": "u", "argv": ["true"], "since": 0},
    }
    key = f"{etcd_prefix(NAMESPACE, name)}q/{lease:016x}"
    harness.call(
        "/v3/kv/put", {"key": b64(key), "value": b64(json.dumps(record)), "lease": str(lease)}
    )
    return lease


def take_slot(harness: EtcdHarness, name: str, lease: int, slot: int) -> None:
    """Put s/SLOT attached to *lease*, as a holder of N > 1 does."""
    key = f"{etcd_prefix(NAMESPACE, name)}s/{slot}"
    harness.call("/v3/kv/put", {"key": b64(key), "value": b64(""), "lease": str(lease)})


def test_the_prefix_escapes_as_the_redis_keys_do() -> None:
    """NS and NAME are escaped by the Redis backend's rule: "/" joins nothing."""
    assert etcd_prefix("default", "a/b%c{d} e*") == "lockrun/default/a%2Fb%25c%7Bd%7D%20e%2A/"
    for text in ("x/y", "50%", "[a]?", "tab\there", "ünï", "\x7f\\"):
        parts = etcd_prefix("n/s", text).removeprefix("lockrun/").removesuffix("/")
        assert key_prefix("n/s", text) == f"lockrun:{{{parts}}}"


def test_the_queue_is_read_in_create_order_holders_first(own: EtcdHarness) -> None:
    """The first key by create revision holds; the others wait, known by their leases."""
    first, second, third = (enqueue(own, "q", pid) for pid in (101, 102, 102))
    assert [entry.lease for entry in own.queue("q")] == [first, second, third]
    assert own.holder("q") == first
    assert own.holder("q", 1) is None
    assert own.holder("q", "gate") is None
    assert own.waits("q", 101) == {}
    assert own.waits("q", 102) == {second: "queue", third: "queue"}
    assert own.session_ids() == {first, second, third}
    assert own.sessions() == 3
    own.check_granted("q", first, 0, 1)


def test_ending_the_holders_session_revokes_its_lease_and_the_next_holds(
    own: EtcdHarness,
) -> None:
    """end_session revokes the holder's lease: its key goes, the waiter behind it holds."""
    first, second = enqueue(own, "e", 201), enqueue(own, "e", 202)
    assert own.alive("e", first)
    own.end_session("e")
    assert not own.alive("e", first)
    assert own.holder("e") == second
    assert own.waits("e", 202) == {}
    assert own.session_ids() == {second}


def test_with_n_slots_a_slot_is_the_lease_of_its_slot_key(own: EtcdHarness) -> None:
    """N = 2: the first two keys hold, slot I is s/I's lease; the third waits."""
    a, b, c = (enqueue(own, "s", pid, slots=2) for pid in (301, 302, 303))
    take_slot(own, "s", a, 0)
    take_slot(own, "s", b, 1)
    assert [own.holder("s", slot) for slot in range(3)] == [a, b, None]
    assert own.waits("s", 303) == {c: "queue"}
    assert own.waits("s", 302) == {}
    own.check_granted("s", b, 1, 2)
    with pytest.raises(AssertionError):
        own.check_granted("s", c, 1, 2)  # it holds no slot key
    own.end_session("s", 1)
    assert own.holder("s", 1) is None
    assert own.waits("s", 303) == {}  # now among the first two


def test_expiry_of_a_lease_nobody_renews_is_found_to_a_few_ms(own: EtcdHarness) -> None:
    """Etcd says whole seconds; the tick to the next one gives the lease's end."""
    granted = time.time()
    enqueue(own, "x", 401)
    enqueued = time.time()  # the grant came in between, however loaded the machine
    expiry = own.expiry("x", TTL)
    assert expiry is not None
    assert granted + TTL - 0.05 < expiry < enqueued + TTL + 0.05
    assert own.free_after(TTL) == TTL
    assert own.free_after(0.5) == 2  # etcd's least TTL


def keepalive(port: int, lease: int) -> dict[str, Any]:
    """Renew *lease* through the gateway on *port*, as lockrun does: one round trip."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("POST", "/v3/lease/keepalive", json.dumps({"ID": str(lease)}))
        answer = json.loads(connection.getresponse().read())
    finally:
        connection.close()
    result: dict[str, Any] = answer["result"]
    return result


def test_keepalives_through_the_proxy_set_the_expiry(own: EtcdHarness) -> None:
    """A keep-alive the proxy passed is the holder's last word: the expiry is a TTL later."""
    assert own.proxy is not None
    lease = enqueue(own, "k", 501)
    time.sleep(0.3)
    renewed = time.time()
    assert keepalive(own.proxy.port, lease)["TTL"] == str(TTL)
    answered = time.time()
    assert own.tap is not None
    # The proxy's thread may hand the answer on before it notes it (found by a loaded CI
    # run: the server's whole seconds answered instead, 2 ms off): wait for the note.
    wait_for(lambda: own.tap is not None and own.tap.expiry(lease) is not None)
    expiry = own.expiry("k", TTL)
    assert expiry is not None
    assert renewed <= expiry - TTL <= answered
    own.partition()  # a keep-alive lost on the way says nothing: back to the server's word
    assert own.tap is not None
    call = f'POST /v3/lease/keepalive HTTP/1.1\r\nHost: x\r\n\r\n{{"ID":"{lease}"}}'
    own.tap(0, False, call.encode())  # noqa: FBT003 - the tap's signature
    assert own.tap.expiry(lease) is None
    ticked = own.expiry("k", TTL)
    assert ticked is not None
    assert abs(ticked - expiry) < 0.05


def test_a_restart_keeps_the_keys_and_the_revision(etcd_server: EtcdServer) -> None:
    """Data on tmpfs survives a SIGKILL and a start: etcd's store, and so every fence."""
    etcd_server.etcdctl("put", "lockrun/kept", "1")
    before = etcd_server.call("/v3/kv/range", {"key": b64("lockrun/kept")})
    etcd_server.restart()
    after = etcd_server.call("/v3/kv/range", {"key": b64("lockrun/kept")})
    assert after["kvs"] == before["kvs"]
    assert int(after["header"]["revision"]) >= int(before["header"]["revision"])
    assert etcd_server.etcdctl("get", "--print-value-only", "lockrun/kept").stdout == "1\n"


def test_closing_a_server_leaves_no_process_and_no_directory() -> None:
    """close: the member is gone and its tmpfs directory with it."""
    server = EtcdServer()
    process, directory = server.process, server.directory
    assert process is not None
    assert directory.startswith("/dev/shm/")
    server.close()
    assert process.poll() is not None
    assert not os.path.exists(directory)


def test_auth_keeps_lockruns_user_to_its_prefix_and_refuses_a_wrong_password(
    etcd_server: EtcdServer,
) -> None:
    """After enable_auth: lockrun's user writes under lockrun/ only; a wrong password fails."""
    etcd_server.enable_auth()
    assert (
        etcd_server.lock_uri == f"etcd://{ETCD_USER}:{ETCD_PASSWORD}@127.0.0.1:{etcd_server.port}/"
    )
    endpoint = [etcd_server.uri]
    user = ("--user", f"{ETCD_USER}:{ETCD_PASSWORD}")
    assert etcdctl(endpoint, *user, "put", "lockrun/mine", "1").returncode == 0
    refused = etcdctl(endpoint, *user, "put", "elsewhere", "1", check=False)
    assert refused.returncode != 0
    assert "permission denied" in refused.stderr
    etcd_server.add_user("nobody", "pw-nobody", prefix=None)  # as root, auth on
    nobody = ("--user", "nobody:pw-nobody")
    assert (
        "permission denied" in etcdctl(endpoint, *nobody, "get", "lockrun/mine", check=False).stderr
    )
    with pytest.raises(EtcdError, match="authentication failed"):
        gateway(etcd_server.uri, "/v3/auth/authenticate", {"name": ETCD_USER, "password": "wrong"})
    with pytest.raises(EtcdError):  # no token at all
        gateway(etcd_server.uri, "/v3/kv/range", {"key": b64("lockrun/mine")})
    assert etcd_server.call("/v3/kv/range", {"key": b64("lockrun/mine")})["count"] == "1"


def test_a_shared_harness_logs_in_with_the_uris_user(etcd_server: EtcdServer) -> None:
    """On a URI with a user, the harness reads as that user (its token asked on first use)."""
    etcd_server.enable_auth()
    harness = EtcdHarness("etcd", etcd_server.lock_uri)
    lease = enqueue(harness, "u", 601)
    assert harness.holder("u") == lease
    harness.end_session("u")
    assert harness.holder("u") is None


@pytest.mark.slow
def test_the_cluster_elects_another_leader_when_its_leader_dies(
    etcd_cluster: EtcdCluster,
) -> None:
    """Three members agree on a leader; killed, another leads; restarted, it rejoins with data."""
    assert etcd_cluster.uri.count(",") == 2
    leader = etcd_cluster.wait_leader()
    etcd_cluster.etcdctl("put", "lockrun/c", "1")
    etcd_cluster.kill(leader)
    successor = etcd_cluster.wait_leader(other_than=leader)
    assert successor is not leader
    etcd_cluster.etcdctl("put", "lockrun/c", "2")
    etcd_cluster.restart(leader)
    etcd_cluster.wait_leader()
    wait = time.monotonic() + 10
    while (
        leader.etcdctl("get", "--consistency=s", "--print-value-only", "lockrun/c").stdout != "2\n"
    ):
        assert time.monotonic() < wait, "the restarted member did not catch up"
        time.sleep(0.05)
