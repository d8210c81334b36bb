"""One contender of the Python API benchmarks in this process: ``python -m bench.api``.

bench/measure.py starts one process per contender: lockrun.Lock or a peer library, or the
bare primitive under them (a floor). Each keeps its lock object, and its connection, across
cycles, as a program that locks in a loop would; a cycle is acquire, an empty block, release.
``--cycles WARMUP N`` prints N cycles' times in µs as JSON; ``--until READY GO`` says READY,
waits for GO (which holds the deadline, a time.monotonic()), then cycles until the deadline
and prints how many cycles completed before it.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from bench.core import poll_until

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Sequence

# A setup: (the target's URI, lock name, directory) -> one cycle, ready to repeat.
Setup = Callable[[str, str, Path], Callable[[], None]]

# GET_LOCK's wait, as lockrun's longest: MariaDB returns NULL at once on a negative one
# (docs/design.md P20). Also portalocker's: it gives up after 5 s by default.
FOREVER: Final = 31_536_000
LEASE: Final = 30  # seconds: the Redis keys and etcd leases end as a lockrun lease would
GO_TIMEOUT: Final = 120.0


def held(lock: contextlib.AbstractContextManager[Any]) -> Callable[[], None]:
    """Return a cycle that enters and leaves *lock*."""

    def cycle() -> None:
        with lock:
            pass

    return cycle


def lockrun_lock(uri: str, name: str, _: Path) -> Callable[[], None]:
    import lockrun  # noqa: PLC0415 - each contender imports only its own library

    return held(lockrun.Lock(name, uri=uri, wait=None))


def portalocker_lock(_: str, name: str, directory: Path) -> Callable[[], None]:
    import portalocker  # noqa: PLC0415 - the bench extra

    return held(portalocker.Lock(directory / f"{name}.portalocker", timeout=FOREVER))


def filelock_lock(_: str, name: str, directory: Path) -> Callable[[], None]:
    import filelock  # noqa: PLC0415 - the bench extra

    return held(filelock.FileLock(directory / f"{name}.filelock"))


def flock_floor(_: str, name: str, directory: Path) -> Callable[[], None]:
    """Return a cycle of open, flock(2) and close: closing the last fd releases the lock."""
    path = directory / f"{name}.flock"

    def cycle() -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.close(fd)

    return cycle


def redis_lock(uri: str, name: str, _: Path) -> Callable[[], None]:
    import redis  # noqa: PLC0415 - each contender imports only its own library

    return held(redis.Redis.from_url(uri).lock(name, timeout=LEASE))


def set_nx_floor(uri: str, name: str, _: Path) -> Callable[[], None]:
    """Return a cycle of SET NX PX and DEL on one kept connection (it cannot wait)."""
    import redis  # noqa: PLC0415 - each contender imports only its own library

    client = redis.Redis.from_url(uri)

    def cycle() -> None:
        if not client.set(name, "1", nx=True, px=LEASE * 1000):
            msg = f"{name} is taken"
            raise RuntimeError(msg)
        client.delete(name)

    return cycle


def get_lock(uri: str, name: str, _: Path) -> Callable[[], None]:
    """Return a cycle of GET_LOCK and RELEASE_LOCK on one kept PyMySQL connection."""
    import pymysql  # noqa: PLC0415 - each contender imports only its own library

    parts = urlsplit(uri)
    connection = pymysql.connect(
        host=parts.hostname,
        port=parts.port or 3306,
        user=parts.username,
        database=parts.path.lstrip("/"),
        autocommit=True,
    )
    cursor = connection.cursor()

    def cycle() -> None:
        cursor.execute("SELECT GET_LOCK(%s, %s)", (name, FOREVER))
        if cursor.fetchone() != (1,):
            msg = f"GET_LOCK({name!r}) failed"
            raise RuntimeError(msg)
        cursor.execute("SELECT RELEASE_LOCK(%s)", (name,))
        cursor.fetchone()

    return cycle


def advisory_lock(uri: str, name: str, _: Path) -> Callable[[], None]:
    """Return a cycle of pg_advisory_lock and pg_advisory_unlock on one kept psycopg connection."""
    import psycopg  # noqa: PLC0415 - the postgres extra

    cursor = psycopg.connect(uri, autocommit=True).cursor()
    key = zlib.crc32(name.encode())

    def cycle() -> None:
        cursor.execute("SELECT pg_advisory_lock(%s)", (key,))
        cursor.execute("SELECT pg_advisory_unlock(%s)", (key,))

    return cycle


def etcd3gw_lock(uri: str, name: str, _: Path) -> Callable[[], None]:
    """Return a cycle of etcd3gw's Lock: acquire (a lease, a put if absent), release (a delete).

    Its acquire does not wait (False when taken, which `with` would pass over): checked.
    """
    from etcd3gw.client import Etcd3Client  # noqa: PLC0415 - the bench extra

    parts = urlsplit(uri)
    lock = Etcd3Client(host=parts.hostname or "", port=parts.port or 2379).lock(name, ttl=LEASE)

    def cycle() -> None:
        if not lock.acquire():
            msg = f"{name} is taken"
            raise RuntimeError(msg)
        lock.release()

    return cycle


def v3lock(uri: str, name: str, _: Path) -> Callable[[], None]:
    """Return a cycle of lease grant, Lock and revoke on etcd's lock service, one kept connection.

    etcd's v3lock runs clientv3's Mutex in the server (`etcdctl lock`'s queue): Lock waits
    there, and the revoke deletes the lock's key with the lease. A lease per cycle, as a
    lockrun acquire and an `etcdctl lock` run make, the lease that frees a dead holder's lock.
    """
    import http.client  # noqa: PLC0415 - each contender imports only its own library
    import socket  # noqa: PLC0415

    parts = urlsplit(uri)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port or 2379)
    connection.connect()
    # As lockrun's: http.client writes a body apart from its headers, which Nagle would hold.
    connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    key = base64.b64encode(name.encode()).decode()

    def call(path: str, body: dict[str, object]) -> dict[str, Any]:
        connection.request("POST", path, json.dumps(body).encode())
        answer = connection.getresponse()
        found: dict[str, Any] = json.loads(answer.read())
        if answer.status != http.client.OK:
            raise RuntimeError(found)
        return found

    def cycle() -> None:
        lease = call("/v3/lease/grant", {"TTL": LEASE})["ID"]
        call("/v3/lock/lock", {"name": key, "lease": lease})
        call("/v3/lease/revoke", {"ID": lease})

    return cycle


@dataclass(frozen=True)
class Contender:
    """A way to take a lock from Python: its name here, its label, what it needs."""

    name: str  # as `python -m bench.api` takes it
    label: str
    setup: Setup
    module: str  # must be importable
    floor: bool = False  # the primitive under the libraries, not a peer
    waits: bool = True  # can wait for a held lock (SET NX cannot: no contention round)


LOCKRUN: Final = Contender("lockrun", "lockrun.Lock", lockrun_lock, "lockrun")
PORTALOCKER: Final = Contender("portalocker", "portalocker.Lock", portalocker_lock, "portalocker")
FILELOCK: Final = Contender("filelock", "filelock.FileLock", filelock_lock, "filelock")
FLOCK: Final = Contender("flock", "floor: open+flock+close", flock_floor, "fcntl", floor=True)
REDIS_LOCK: Final = Contender("redis-py", "redis-py Redis.lock", redis_lock, "redis")
SET_NX: Final = Contender(
    "set-nx", "floor: SET NX PX + DEL", set_nx_floor, "redis", floor=True, waits=False
)
GET_LOCK: Final = Contender("get-lock", "raw GET_LOCK/RELEASE_LOCK", get_lock, "pymysql")
ADVISORY: Final = Contender("advisory", "raw pg_advisory_(un)lock", advisory_lock, "psycopg")
ETCD3GW: Final = Contender("etcd3gw", "etcd3gw Lock", etcd3gw_lock, "etcd3gw", waits=False)
V3LOCK: Final = Contender("v3lock", "raw lease + v3lock Lock + revoke", v3lock, "http.client")
# Each backend's peers, the one its target names first (bench/measure.py).
PEERS: Final = {
    "file": (PORTALOCKER, FILELOCK, FLOCK),
    "abstract": (PORTALOCKER, FILELOCK, FLOCK),
    "redis": (REDIS_LOCK, SET_NX),
    "mysql": (GET_LOCK,),
    "postgres": (ADVISORY,),
    "etcd": (ETCD3GW, V3LOCK),
}
CONTENDERS: Final = {c.name: c for c in (LOCKRUN, *(p for ps in PEERS.values() for p in ps))}


def latencies(cycle: Callable[[], None], warmup: int, cycles: int) -> list[float]:
    """Run *warmup* cycles, then time *cycles* more one by one; return their times in µs."""
    for _ in range(warmup):
        cycle()
    times = []
    for _ in range(cycles):
        began = time.perf_counter_ns()
        cycle()
        times.append((time.perf_counter_ns() - began) / 1000)
    return times


def contend(cycle: Callable[[], None], ready: Path, go: Path) -> int:
    """Say *ready*, wait for *go*, cycle until its deadline; return the cycles done by then."""
    ready.touch()
    if not poll_until(go.exists, GO_TIMEOUT, 0.001):
        msg = f"no {go} after {GO_TIMEOUT:.0f} s"
        raise SystemExit(msg)
    deadline = float(go.read_text())
    count = 0
    while True:
        cycle()
        if time.monotonic() >= deadline:
            return count
        count += 1


def main(argv: Sequence[str] | None = None) -> int:
    """Set the contender up, then time its cycles or contend."""
    parser = argparse.ArgumentParser(prog="python -m bench.api", description=__doc__.split("\n")[0])
    parser.add_argument("contender", choices=CONTENDERS)
    parser.add_argument("uri", help="the lockrun URI of the target (its server's, for a peer)")
    parser.add_argument("name", help="the lock name")
    parser.add_argument("directory", type=Path, help="where the file locks go")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cycles", nargs=2, type=int, metavar=("WARMUP", "N"))
    mode.add_argument("--until", nargs=2, type=Path, metavar=("READY", "GO"))
    args = parser.parse_args(argv)
    cycle = CONTENDERS[args.contender].setup(args.uri, args.name, args.directory)
    if args.cycles:
        print(json.dumps(latencies(cycle, *args.cycles)))
    else:
        print(contend(cycle, *args.until))
    return 0


if __name__ == "__main__":
    sys.exit(main())
