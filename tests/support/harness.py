"""One harness per backend: where a lock lives, and how the tests break what holds it.

The contract suites (tests/contract) run each scenario once per backend of the scheme
registry (`lockrun.uri.BACKENDS`) through a `Harness`: a URI (and, for a server, the same
server through a `Proxy`), the registry's `Scheme` as `kind` (what the backend holds a lock
with: `inherits_fds`, `leased`, `session`, `local`), and the faults the tests inject — a
server restart, the end of the session (or lease) that holds a lock, a silent partition, a
paused lockrun. What the registry cannot know is a harness capability (`can_restart`,
`can_partition`, `can_end_session`) or a small expectation (`early_share`, `gave_up`,
`hangup_delay`, `after_restart`, `check_granted`); a test asks for those, never for a
backend's name. The server's own view comes through it too: who holds a slot, on what a
waiter waits, when the server would free a silent holder's slot (`holder`, `waits`,
`expiry`).

Loaded by tests/conftest.py as a plugin (`pytest_plugins`), so that its fixtures reach every
test without a second module called ``conftest``: `harness` (each backend, a server of the
test's own), `server_harness` (the server backends only), `shared_harness` and
`shared_server_harness` (on the session's servers: cheap, but nothing that would disturb
other tests; a test marked `on_valkey_too` gets Valkey, a Valkey cluster and an etcd
cluster as well), and
the chaos suite's `rig`, `target`, `oracle` and `record`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import math
import os
import re
import select
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

import pytest

from lockrun.uri import BACKENDS, SCHEMES, Scheme
from tests.support.cli import gone, one_line, states, wait_for
from tests.support.oracle import Oracle
from tests.support.proxy import Proxy
from tests.support.servers import (
    EtcdServer,
    MariaServer,
    PostgresServer,
    RedisServer,
    free_port,
    gateway,
)

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterable, Iterator
    from pathlib import Path

SERVERS: Final = tuple(backend for backend in BACKENDS if not SCHEMES[backend].local)
# The backends whose lock is a server session: a waiter there is sessions waiting too.
SESSION_BACKENDS: Final = tuple(backend for backend in SERVERS if SCHEMES[backend].session)
LOCAL: Final = tuple(backend for backend in BACKENDS if SCHEMES[backend].local)

# Room for 200 waiters and their helpers, the scale test's crowd.
_ROOMY: Final = {
    "redis": ("--maxclients", "2000"),
    "mysql": ("--max-connections=1000",),
    "postgres": ("max_connections=600",),
    "etcd": (),  # no limit on clients by default
}
# How to count a server's client connections, leaving out the one that asks.
_MYSQL_SESSIONS: Final = (
    "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
    " WHERE ID <> CONNECTION_ID() AND COMMAND <> 'Daemon' AND USER <> 'system user'"
)
_POSTGRES_SESSIONS: Final = (
    "SELECT count(*) FROM pg_stat_activity"
    " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
)
NAMESPACE: Final = "default"

# The fault tests' timing: leases short enough to lose within a test, long enough that a
# loaded machine renews them in time.
TTL: Final = 3.0  # seconds: renewals or ownership checks every second
KILL_AFTER: Final = 1.0
LEASE: Final = ("--ttl", f"{TTL:g}", "--kill-after", f"{KILL_AFTER:g}")
CALM: Final = ("--ttl", "10")  # where the lease length does not matter
SLACK: Final = 3.0  # generous: a shared 2-core machine, and Python start-ups on the way


# -- processes and the evidence they leave ------------------------------------------------------


def stopped(pid: int) -> bool:
    """Return whether *pid* is stopped (SIGSTOP took effect)."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rsplit(b")", 1)[1].split()[0] == b"T"


def pause(process: subprocess.Popen[str] | int) -> None:
    """SIGSTOP *process* (a lockrun, or any pid) and wait until the kernel has stopped it."""
    pid = process if isinstance(process, int) else process.pid
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: stopped(pid), what=f"{pid} to stop")


def resume(process: subprocess.Popen[str] | int) -> None:
    """SIGCONT *process*."""
    os.kill(process if isinstance(process, int) else process.pid, signal.SIGCONT)


@contextlib.contextmanager
def paused(process: subprocess.Popen[str] | int) -> Iterator[None]:
    """Keep *process* stopped for the block; it resumes however the block ends."""
    pause(process)
    try:
        yield
    finally:
        resume(process)


def wait_for_death(pidfd: int, deadline: float) -> float | None:
    """Sleep until the process of *pidfd* exits; return the Unix time we woke to see it.

    None means it still ran when the kernel last looked, at or after *deadline* (Unix time).
    An exit wakes us at once (no polling interval), so the time returned is late only by
    our own scheduling delay.
    """
    while True:
        ready, _, _ = select.select([pidfd], [], [], max(0.0, deadline - time.time()))
        if ready:
            return time.time()
        if time.time() >= deadline:
            return None


def check_lost(status: int | None, err: str, name: str, reason: str | None = None) -> str:
    """Assert lockrun exited 76 with one line naming the lock (and *reason*); return the line.

    An internal error (70) fails with its traceback, not as a wrong status.
    """
    assert not (status == 70 and "internal error" in err), err.strip()
    assert status == 76, err
    line = one_line(err)
    assert line.startswith(f"lockrun: {name}: "), line
    assert reason is None or reason in line, line
    return line


class Victim:
    """A `sh` command that publishes its pid and fence, logs TERM, and loops until killed."""

    def __init__(self, directory: Path, *, exit_on_term: bool = True) -> None:
        """Describe the script; *exit_on_term* False makes it survive TERM (only KILL ends it)."""
        self.pid_file = directory / "victim.pid"
        self.term_file = directory / "victim.term"
        # Written whole, then renamed: a reader never sees the file empty (as the pid file).
        on_term = f"date +%s%N > {self.term_file}.tmp; mv {self.term_file}.tmp {self.term_file}"
        on_term += "; exit 0" if exit_on_term else ""
        # The shell reports its TERMed `sleep` ("Terminated") on stderr: keep that out of
        # lockrun's, which must hold exactly one line.
        self.script = (
            f"exec 2>>{directory / 'victim.err'}; trap '{on_term}' TERM; "
            f'echo "$$ $LOCKRUN_FENCE" > {self.pid_file}.tmp; '
            f"mv {self.pid_file}.tmp {self.pid_file}; "
            "while :; do sleep 0.05; done"
        )
        self.pid = 0
        self.fence = 0

    def start(
        self, spawn: Callable[..., subprocess.Popen[str]], *options: str
    ) -> subprocess.Popen[str]:
        """Start ``lockrun OPTIONS -- sh -c SCRIPT`` and wait until the command runs.

        With ttl 3 every server call may take 0.3 s; a machine busy with other test runs can
        miss that while lockrun acquires, before anything under test happens. Such a 69 is
        tried again (twice); any other early exit fails the test with lockrun's stderr.
        """
        for _ in range(3):
            process = spawn(*options, "--", "sh", "-c", self.script)
            wait_for(functools.partial(self._started, process), what="the command")
            if self.pid_file.exists():
                pid, fence = self.pid_file.read_text().split()
                self.pid, self.fence = int(pid), int(fence)
                return process
            _, err = process.communicate(timeout=10)
            if process.returncode != 69:
                break
            print(f"lockrun could not acquire, trying again: {err}")
        pytest.fail(f"the command did not start (status {process.returncode}): {err}")

    def _started(self, process: subprocess.Popen[str]) -> bool:
        return self.pid_file.exists() or process.poll() is not None

    def term_time(self) -> float:
        """Return the Unix time the command's TERM trap ran."""
        return int(self.term_file.read_text()) / 1e9

    def check_stopped(self) -> None:
        """Assert the command was sent TERM and is gone."""
        assert self.term_file.exists(), "the command was not sent TERM"
        assert gone(self.pid)


# A command that logs its pid, fence, slot and start (Unix ns), then a heartbeat every 2 ms
# until its go file exists, and a last stamp. With a third argument, another command's pid
# file or log: it also notes whether that command was still alive when this one started.
COMMAND: Final = """
import os, sys, time
log, go = sys.argv[1], sys.argv[2]
started = time.time_ns()
verdict = "-"
if len(sys.argv) > 3:
    try:
        pid = int(open(sys.argv[3]).read().split()[0])
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # the other never started, or has gone
        state = "gone"
    verdict = "overlap" if state not in {"Z", "X", "gone"} else "alone"
fence, slot = os.environ["LOCKRUN_FENCE"], os.environ["LOCKRUN_SLOT"]
with open(log + ".tmp", "w") as head:
    head.write(f"{os.getpid()} {fence} {slot} {started} {verdict}\\n")
os.rename(log + ".tmp", log)
with open(log, "a", buffering=1) as out:
    while not os.path.exists(go):
        out.write(f"{time.time_ns()}\\n")
        time.sleep(0.002)
    out.write(f"{time.time_ns()}\\n")
"""


class Run(NamedTuple):
    """What a `COMMAND` wrote: pid, fence, slot, start, verdict and its last sign of life."""

    pid: int
    fence: int
    slot: int
    begun: float  # Unix time: the command's first moment (date(1), before Python starts)
    start: float  # Unix time: when Python looked for the other command
    verdict: str  # "alone", "overlap" or "-"
    last: float  # Unix time of its last heartbeat


def check_resumed_head(
    harness: Harness,
    name: str,
    head: subprocess.Popen[str],
    head_log: Path,
    next_log: Path,
    *,
    alone: bool = True,
) -> None:
    """Check that a frozen head waiter, resumed behind a second one, gave up or ran after.

    It exits with one of `harness.gave_up` in one line naming the lock and never ran its
    command; or it queued again and ran after the second's command ended (*alone*: with
    nobody else running), with a larger fence. Never an internal error.
    """
    _, err = head.communicate(timeout=SLACK + 10)
    print(f"the resumed head waiter exited {head.returncode}: {err.strip()}")
    assert "internal error" not in err
    if head.returncode == 0:  # it queued again and ran after the second
        first_run, second_run = read_run(head_log), read_run(next_log)
        if alone:
            assert first_run.verdict == "alone"
        assert first_run.begun > second_run.last
        assert first_run.fence > second_run.fence
    else:
        assert head.returncode in harness.gave_up, err
        assert name in one_line(err)
        assert not head_log.exists()


def read_run(log: Path) -> Run:
    """Parse a `COMMAND`'s log (a SIGKILL may have cut it short after any whole line)."""
    head, *beats = log.read_text().splitlines()
    pid, fence, slot, started, verdict = head.split()
    stamps = [int(beat) for beat in beats if beat.isdigit()]
    last = max(stamps, default=int(started))
    begun = int(log.with_suffix(".begun").read_text()) / 1e9
    return Run(int(pid), int(fence), int(slot), begun, int(started) / 1e9, verdict, last / 1e9)


def command(
    tmp_path: Path, label: str, *, other: Path | None = None
) -> tuple[list[str], Path, Path]:
    """Return the argv of a `COMMAND` labelled *label*, its log and its go file.

    A shell notes the first moment (Unix ns) in LABEL.begun and execs Python in its place
    (the same pid), so start-up time does not widen the margins measured.
    """
    script = tmp_path / "command.py"
    if not script.exists():
        script.write_text(COMMAND)
    log, go = tmp_path / f"{label}.log", tmp_path / f"{label}.go"
    begun = log.with_suffix(".begun")
    stamp = f'date +%s%N > {begun}.tmp; mv {begun}.tmp {begun}; exec "$@"'
    argv = ["sh", "-c", stamp, "sh", sys.executable, str(script), str(log), str(go)]
    if other is not None:
        argv.append(str(other))
    return argv, log, go


def most_at_once(runs: Iterable[Run]) -> int:
    """Return how many of *runs* ran at once at most ([begun, last] intervals)."""
    events = sorted(event for run in runs for event in ((run.begun, 1), (run.last, -1)))
    running = peak = 0
    for _, change in events:  # at one instant an end comes before a start
        running += change
        peak = max(peak, running)
    return peak


# A command that publishes its slot in a ready file and runs until its go file exists.
HOLD: Final = (
    "echo $LOCKRUN_SLOT > {ready}.tmp; mv {ready}.tmp {ready}; "
    "while [ ! -e {go} ]; do sleep 0.05; done"
)


# -- the protocol and its implementations ---------------------------------------------------------


class Harness:
    """Where a lock of one backend lives, and the faults a test can inject there.

    `uri` reaches the lock directly; `proxied` (None without a proxy) reaches the same
    server through `proxy`, so that lockrun processes can be put on either side of a
    partition. `kind` is the registry's `Scheme` of the backend. A fault the harness cannot
    inject has its capability False and raises `NotImplementedError` if asked anyway.

    A server's view of a lock is read through handles: what the server knows a holder or a
    waiter by (a MySQL connection id, a PostgreSQL backend pid; on Redis, which has no
    session per holder, the lockrun pid its lease record names).
    """

    backend: str  # the registry's backend name: "file", "redis", …
    uri: str
    proxied: str | None = None
    proxy: Proxy | None = None
    server: RedisServer | MariaServer | PostgresServer | EtcdServer | None = None
    can_restart = False  # restart() loses every session (and Redis its data)
    # Whether a restart takes the locks away: etcd keeps leases (and so locks) across one.
    restart_frees = True
    # Whether a release passes over a waiter that died (its session closed; Redis: CLIENT
    # LIST; etcd: its guardian revokes its lease, A13).
    passes_over_the_dead = True
    can_partition = False  # partition() silences the proxy
    can_end_session = False  # end_session() takes a lock from its holder
    # How much before its `expiry` a server may give a silent holder's slot away: a lease
    # ends at its own clock's millisecond; a session's idle timer fires a little early.
    early_share = 0.0
    # What a waiter that was granted a slot while frozen may exit with once resumed and
    # too late: 69 (it gave up), or 76 (it counted the lock it never used as lost).
    gave_up: frozenset[int] = frozenset({69})
    # How long the server may take to see that a waiting client hung up.
    hangup_delay = 0.0

    @property
    def kind(self) -> Scheme:
        """The registry's row for this backend: what it holds a lock with."""
        return SCHEMES[self.backend]

    def __repr__(self) -> str:
        """Name the backend and the URI (pytest shows it in failures)."""
        return f"<{type(self).__name__} {self.backend} {self.uri}>"

    @property
    def lost_reason(self) -> str | None:
        """What lockrun's one line says once `end_session` took its lock; None: no reason asked."""
        return "the session holding the lock ended" if self.kind.session else None

    @property
    def socket_uri(self) -> str:
        """The URI of a server of the test's own on its unix socket (else `uri`)."""
        return self.uri

    def restart(self, outage: float = 0.0) -> None:
        """Kill the server and start it again *outage* s later: every session is gone."""
        raise NotImplementedError(self.backend)

    def end_session(self, name: str, slot: int = 0) -> None:
        """Take *name*'s *slot* away from its holder, the backend's way."""
        raise NotImplementedError(self.backend)

    def partition(self) -> None:
        """Drop every byte between `proxied` clients and the server, keeping sockets open."""
        if self.proxy is None:
            raise NotImplementedError(self.backend)
        self.proxy.blackhole()

    def sessions(self) -> int:
        """Return how many client connections the server has now, not counting ours."""
        raise NotImplementedError(self.backend)

    def session_ids(self) -> set[int]:
        """Return the handles of every client session of the server but ours."""
        raise NotImplementedError(self.backend)

    def holder(self, name: str, slot: int | str = 0) -> int | None:
        """Return the handle holding *name*'s *slot* (or ``"gate"``), None if it is free.

        Here: the pid of the lockrun whose record `lockrun status` shows on that slot.
        """
        found = [entry["pid"] for entry in self._holders(name) if entry["slot"] == slot]
        return int(found[0]) if found else None

    def _holders(self, name: str) -> list[dict[str, Any]]:
        return [entry for state in states(self.uri, name) for entry in state["holders"]]

    def expected_waits(self, slots: int, *, head: bool = True) -> list[str]:
        """Return what `waits` shows of a waiter for a name of *slots* slots, sorted.

        The head of the queue waits on every slot (one session each); a waiter behind it
        waits on the gate, in front of which a mutex has none: it waits on slot 0 too.
        """
        if not head and slots > 1:
            return ["gate"]
        return [str(slot) for slot in range(slots if head else 1)]

    def alive(self, name: str, handle: int) -> bool:
        """Return whether the server still knows *handle* (its session, or its record)."""
        raise NotImplementedError(self.backend)

    def waits(self, name: str, pid: int) -> dict[int, str]:
        """Return the handles lockrun *pid* waits for *name* on, each with what it waits for."""
        raise NotImplementedError(self.backend)

    def free_after(self, ttl: float) -> float:
        """Return how long after the last word of a holder with *ttl* the server frees it."""
        return ttl

    def expiry(self, name: str, ttl: float, slot: int = 0) -> float | None:
        """Return when the server frees *name*'s *slot* unless it hears from its holder again.

        None while the holder's session runs a statement (its end sets the clock), or
        when nobody holds the slot.
        """
        raise NotImplementedError(self.backend)

    def expiry_of(
        self,
        name: str,
        ttl: float,
        slot: int = 0,
        handle: int | str | None = None,  # noqa: ARG002 - a server that can tell, below
    ) -> float | None:
        """Return `expiry`: when the holder of *slot* now (*handle*'s where one can tell) ends."""
        return self.expiry(name, ttl, slot)

    def grab(self, name: str, patience: float, slot: int = 0) -> float | None:
        """Wait up to *patience* s for *slot* on a session of our own, not lockrun's.

        Return the Unix time it was ours (it is let go at once), None if it never was.
        Only where the lock is a server session: a lease has no such lock to take.
        """
        raise NotImplementedError(self.backend)

    def settled_expiry(
        self, name: str, ttl: float, slot: int = 0, handle: int | str | None = None
    ) -> float:
        """Wait until the holder of *slot* is idle (a call may still run) and return `expiry`.

        With *handle*: the expiry of that holder's grant, even once another holds the slot
        (`expiry_of`).
        """
        deadline = time.monotonic() + 15
        while (expiry := self.expiry_of(name, ttl, slot, handle)) is None:
            if time.monotonic() > deadline:
                pytest.fail(f"{name}:{slot} was not held by an idle session for 15 s")
            time.sleep(0.01)
        return expiry

    def queue_two(
        self, spawn: Callable[..., subprocess.Popen[str]], tmp_path: Path, *options: str
    ) -> tuple[subprocess.Popen[str], subprocess.Popen[str], Path, Path, Path]:
        """Queue a head waiter and a second one (``OPTIONS -w forever``), each a `command`.

        The head's command notes whether the second's is alive when it starts. Returns both
        processes, the head's and the second's logs, and the second's go file.
        """
        next_argv, next_log, next_go = command(tmp_path, "next")
        head_argv, head_log, head_go = command(tmp_path, "head", other=next_log)
        head_go.touch()
        name = options[options.index("-n") + 1]
        head = spawn(*options, "-w", "forever", "--", *head_argv)
        wait_for(lambda: self.waits(name, head.pid), what="the head waiter")
        second = spawn(*options, "-w", "forever", "--", *next_argv)
        wait_for(lambda: self.waits(name, second.pid), what="the second waiter")
        return head, second, head_log, next_log, next_go

    def after_restart(self, name: str, fence: int) -> None:
        """Check what the server kept of *name* through a restart (the last *fence*)."""

    def check_granted(self, name: str, handle: int, slot: int, slots: int) -> None:
        """Check what the handle granted *slot* of *slots* holds beside it (nothing more)."""

    # Pausing a lockrun is the same on every backend; here so that a test needs one object.
    pause = staticmethod(pause)
    resume = staticmethod(resume)
    paused = staticmethod(paused)

    def close(self) -> None:
        """Let go of everything the harness started."""


class LocalHarness(Harness):
    """file: in a private directory, or abstract: under a private prefix: no server at all."""

    def __init__(self, backend: str, tmp_path: Path) -> None:
        """Describe a *backend* lock private to the test of *tmp_path*."""
        self.backend = backend
        if backend == "file":
            self.uri = f"file://{tmp_path}/locks"
        else:
            self.uri = f"{backend}:test-{uuid.uuid4().hex[:8]}"


class ServerHarness(Harness):
    """A server backend: either a server of the test's own (with a proxy) or a shared URI."""

    can_end_session = True

    def __init__(self, backend: str, uri: str | None = None, *options: str) -> None:
        """Start a *backend* server of our own (with *options*) and a proxy; or use *uri*.

        On a shared *uri* nothing may disturb the other tests: no restart, no partition.
        """
        self.backend = backend
        self._link: Any = None
        self._lock = threading.Lock()
        if uri is not None:
            self.uri = uri
            return
        port = free_port()
        self.server = _SERVER[backend](*options, port=port)
        self.proxy = Proxy(("127.0.0.1", port))
        self.uri = self.server.tcp_uri
        self.proxied = self.uri.replace(f":{port}/", f":{self.proxy.port}/")
        self.can_restart = self.can_partition = True  # only on a server of the test's own

    @property
    def socket_uri(self) -> str:
        """The own server's unix-socket URI (no TCP, no proxy); a shared server's `uri`."""
        return self.uri if self.server is None else self.server.uri

    def restart(self, outage: float = 0.0) -> None:
        """Kill the server and start it again (Redis comes back empty), *outage* s later."""
        if self.server is None:
            raise NotImplementedError(f"{self.backend}: a shared server")
        self._unlink()
        self.server.stop()
        time.sleep(outage)
        self.server.start()

    def connect(self) -> Any:
        """Open a connection of our own (not lockrun's) to the server."""
        raise NotImplementedError

    @contextlib.contextmanager
    def linked(self) -> Iterator[Any]:
        """Lend our one connection to the server (made on first use, and after a restart).

        One, kept: a connection of ours that just closed would still be listed among the
        server's sessions for a moment, and taken for lockrun's.
        """
        with self._lock:
            if self._link is None:
                self._link = self.connect()
            yield self._link

    def sessions(self) -> int:
        """Return how many client connections the server has now, not counting ours."""
        with self.linked() as link:
            return self._count(link)

    def alive(self, name: str, handle: int) -> bool:  # noqa: ARG002 - a session is server-wide
        """Return whether the session *handle* is still open."""
        return handle in self.session_ids()

    def close(self) -> None:
        """Stop the proxy and the server (a shared server is left alone)."""
        self._unlink()
        if self.proxy is not None:
            self.proxy.close()
        if self.server is not None:
            self.server.close()

    def _count(self, link: Any) -> int:
        raise NotImplementedError

    def _unlink(self) -> None:
        with self._lock:
            if self._link is not None:
                with contextlib.suppress(Exception):
                    self._link.close()
                self._link = None


class RedisHarness(ServerHarness):
    """Redis: the lock is a lease in keys, known by the lockrun pid its record names."""

    def client(self) -> Any:
        """Return a redis-py client of our own on the server (close it when done)."""
        import redis

        return redis.Redis.from_url(self.uri, decode_responses=True)

    connect = client

    def end_session(self, name: str, slot: int = 0) -> None:  # noqa: ARG002 - one lease key
        """Make the server forget *name*: FLUSHALL on our own server, else DEL its keys."""
        with self.linked() as client:
            if self.server is not None:
                client.flushall()
            elif keys := client.keys(f"lockrun:{{{NAMESPACE}/{name}}}:*"):
                client.delete(*keys)

    def session_ids(self) -> set[int]:
        """Return the CLIENT IDs of every connection but ours."""
        with self.linked() as client:
            mine = client.client_id()
            return {int(each["id"]) for each in client.client_list()} - {mine}

    def alive(self, name: str, handle: int) -> bool:
        """Return whether the server keeps a lease or a place in the queue for pid *handle*."""
        return any(
            int(entry["pid"]) == handle
            for state in states(self.uri, name)
            for entry in [*state["holders"], *state["waiters"]]
        )

    def waits(self, name: str, pid: int) -> dict[int, str]:
        """Return {pid: "queue"} while lockrun *pid* has a place in *name*'s queue."""
        waiting = {
            int(each["pid"]) for state in states(self.uri, name) for each in state["waiters"]
        }
        return {pid: "queue"} if pid in waiting else {}

    def expiry(self, name: str, ttl: float, slot: int = 0) -> float | None:  # noqa: ARG002
        """Return the server-side end of the lease on *slot*."""
        found = [entry["expires"] for entry in self._holders(name) if entry["slot"] == slot]
        return float(found[0]) if found and found[0] is not None else None

    def after_restart(self, name: str, fence: int) -> None:  # noqa: ARG002
        """Check the fence is gone: a Redis without persistence forgets it too."""
        with self.linked() as client:
            assert not client.exists(f"lockrun:{{{NAMESPACE}/{name}}}:fence")

    def expected_waits(self, slots: int, *, head: bool = True) -> list[str]:  # noqa: ARG002
        """Return ["queue"]: a waiter is a place in the queue, head or not."""
        return ["queue"]

    def _count(self, link: Any) -> int:
        return int(link.info("clients")["connected_clients"]) - 1


# Every client session on the server but ours: id, command, seconds in it, statement, clock.
_MYSQL_PROCESSLIST: Final = (
    "SELECT ID, COMMAND, TIME_MS / 1000, INFO, UNIX_TIMESTAMP(NOW(6)) "
    "FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID() AND DB = DATABASE() "
    "AND COMMAND NOT IN ('Daemon', 'Killed') AND USER <> 'system user'"
)
# A waiter's GET_LOCK carries a comment naming it; the first "pid" is the waiting lockrun's.
_MYSQL_WAITING: Final = re.compile(
    r"GET_LOCK\('(?P<lock>[^']+)'.*?\"pid\": (?P<pid>\d+)[,}]", re.DOTALL
)


class MysqlHarness(ServerHarness):
    """MySQL/MariaDB: the lock is a GET_LOCK of lockrun's session; ending it is a KILL."""

    early_share = 0.1  # wait_timeout fires on a timer with a granularity of its own
    hangup_delay = 1.0  # the server looks at a client waiting in GET_LOCK once a second

    def connect(self) -> Any:
        """Open a pymysql session of our own (not lockrun's) on the server."""
        import pymysql

        from lockrun.backends import parse_uri
        from lockrun.backends.mysql import parse

        settings = parse(parse_uri(self.uri))
        return pymysql.connect(
            **settings.kwargs, autocommit=True, connect_timeout=5, read_timeout=60
        )

    def query(self, sql: str, args: object = None) -> tuple[tuple[Any, ...], ...]:
        """Run *sql* on our session and return every row."""
        with self.linked() as connection, connection.cursor() as cursor:
            cursor.execute(sql, args)
            return tuple(cursor.fetchall())

    def lock(self, name: str, slot: int | str = 0) -> str:
        """Return the GET_LOCK name of *name*'s *slot* (or ``"gate"``)."""
        from lockrun.backends.mysql import lock_key

        return f"{lock_key(NAMESPACE, name)}:{slot}"

    def holder(self, name: str, slot: int | str = 0) -> int | None:
        """Return the connection id holding *name*'s *slot* (IS_USED_LOCK)."""
        ((holder,),) = self.query("SELECT IS_USED_LOCK(%s)", (self.lock(name, slot),))
        return None if holder is None else int(holder)

    def grab(self, name: str, patience: float, slot: int = 0) -> float | None:
        """GET_LOCK *slot* on a session of our own; return when it was ours."""
        with contextlib.closing(self.connect()) as connection, connection.cursor() as cursor:
            cursor.execute("SELECT GET_LOCK(%s, %s)", (self.lock(name, slot), patience))
            ((result,),) = cursor.fetchall()
            return time.time() if result == 1 else None

    def end_session(self, name: str, slot: int = 0) -> None:
        """KILL CONNECTION the session that holds *name*'s *slot*."""
        connection = self.holder(name, slot)
        assert connection is not None, f"nobody holds {name}:{slot}"
        self.query(f"KILL CONNECTION {connection:d}")

    def processlist(self) -> list[tuple[int, str, float, str, float]]:
        """Return (id, command, seconds in it, statement, server clock) of each session."""
        return [
            (int(row[0]), str(row[1]), float(row[2]), str(row[3] or ""), float(row[4]))
            for row in self.query(_MYSQL_PROCESSLIST)
        ]

    def session_ids(self) -> set[int]:
        """Return the ids of every client session in lockrun's database but ours."""
        return {row[0] for row in self.processlist()}

    def waits(self, name: str, pid: int) -> dict[int, str]:
        """Return the sessions of lockrun *pid* in GET_LOCK, and the slot (or gate) of each."""
        prefix = self.lock(name, "")
        found = {}
        for connection, _, _, info, _ in self.processlist():
            match = _MYSQL_WAITING.search(info)
            if match and int(match["pid"]) == pid and match["lock"].startswith(prefix):
                found[connection] = match["lock"].removeprefix(prefix)
        return found

    def free_after(self, ttl: float) -> float:
        """Return the session's wait_timeout, the lease in whole seconds."""
        return math.ceil(ttl)

    def expiry(self, name: str, ttl: float, slot: int = 0) -> float | None:
        """Return when wait_timeout ends the idle session holding *slot*."""
        holder = self.holder(name, slot)
        for connection, what, seconds, _, now in self.processlist():
            if connection == holder and what == "Sleep":
                return now - seconds + self.free_after(ttl)
        return None

    def after_restart(self, name: str, fence: int) -> None:  # noqa: ARG002
        """Check the fence is gone: it is in MEMORY, and the clock seeds the next (issue #32)."""
        key = self.lock(name).rpartition(":")[0]
        rows = self.query("SELECT fence FROM lockrun_fence WHERE lock_key = %s", (key,))
        assert rows == ()

    def _count(self, link: Any) -> int:
        with link.cursor() as cursor:
            cursor.execute(_MYSQL_SESSIONS)
            (found,) = cursor.fetchone() or (0,)
        return int(found)


_POSTGRES_ACTIVITY: Final = (
    "SELECT pid, coalesce(application_name, ''), coalesce(state, ''), "
    "coalesce(extract(epoch FROM state_change), 0)::float8 FROM pg_stat_activity "
    "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
    "AND datname = current_database()"
)
_POSTGRES_LOCKS: Final = (
    "SELECT l.pid, l.classid::bigint, l.objid::bigint, l.objsubid, l.granted, "
    "coalesce(a.query, '') FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.pid <> pg_backend_pid() AND l.database = "
    "(SELECT oid FROM pg_database WHERE datname = current_database())"
)
# Every statement of lockrun's carries /* lockrun {json} */ naming the lockrun process.
_POSTGRES_TAG: Final = re.compile(r"/\* lockrun (\{.*\}) \*/", re.DOTALL)


class Advisory(NamedTuple):
    """One advisory lock, granted or awaited, as pg_locks shows it."""

    pid: int  # the server process
    classid: int
    objid: int
    subid: int  # 1: a bigint key (slot or gate); 2: an int pair (the shared (name, N) lock)
    granted: bool
    owner: int | None  # the lockrun process its session's last statement names

    @property
    def key(self) -> int:
        """The signed bigint key (meaningful for subid 1)."""
        key = self.classid << 32 | self.objid
        return key - (1 << 64) if key >= 1 << 63 else key


def _statement_owner(statement: str) -> int | None:
    """Return the lockrun pid a statement's comment names, None if it names none."""
    match = _POSTGRES_TAG.search(statement)
    if match is None:
        return None
    try:
        return int(json.loads(match[1])["holder"]["pid"])
    except (ValueError, KeyError, TypeError):
        return None


class PostgresHarness(ServerHarness):
    """PostgreSQL: the lock is an advisory lock of lockrun's session; ending it terminates it."""

    early_share = 0.1  # idle_session_timeout fires on a timer
    gave_up = frozenset({69, 76})

    def connect(self) -> Any:
        """Open a psycopg session of our own (not lockrun's) on the server, autocommit."""
        import psycopg

        return psycopg.connect(self.uri, autocommit=True, connect_timeout=10)

    def query(self, sql: str, *params: object) -> list[tuple[Any, ...]]:
        """Run *sql* on our session and return every row."""
        with self.linked() as connection:
            rows: list[tuple[Any, ...]] = connection.execute(sql, params or None).fetchall()
            return rows

    def key(self, name: str, slot: int | str = 0) -> int:
        """Return the advisory-lock key of *name*'s *slot* (or ``"gate"``)."""
        from lockrun.backends.postgres import lock_key

        return lock_key(NAMESPACE, name, slot)

    def named(self, name: str) -> list[int]:
        """Return the server processes whose application_name says they hold a slot of *name*."""
        rows = self.query(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s ORDER BY pid",
            f"lockrun:{name}:%",
        )
        return [int(pid) for (pid,) in rows]

    def grab(self, name: str, patience: float, slot: int = 0) -> float | None:
        """pg_advisory_lock *slot*'s key on a session of our own; return when it was ours."""
        import psycopg

        with self.connect() as connection:
            connection.execute(f"SET lock_timeout = {int(patience * 1000):d}")
            try:
                connection.execute("SELECT pg_advisory_lock(%s)", (self.key(name, slot),))
            except psycopg.errors.LockNotAvailable:
                return None
            return time.time()

    def end_session(self, name: str, slot: int = 0) -> None:
        """pg_terminate_backend the session that holds *name*'s *slot*."""
        backend = self.holder(name, slot)
        assert backend is not None, f"nobody holds {name}:{slot}"
        assert self.query("SELECT pg_terminate_backend(%s::int)", backend) == [(True,)]

    def activity(self) -> dict[int, tuple[str, str, float]]:
        """Return each client session's (application_name, state, Unix time of its change)."""
        return {
            int(pid): (app, state, float(since))
            for pid, app, state, since in self.query(_POSTGRES_ACTIVITY)
        }

    def advisory(self) -> list[Advisory]:
        """Return every advisory lock in lockrun's database, granted or awaited."""
        return [
            Advisory(int(pid), int(classid), int(objid), int(subid), bool(granted), owner)
            for pid, classid, objid, subid, granted, text in self.query(_POSTGRES_LOCKS)
            for owner in [_statement_owner(text)]
        ]

    def session_ids(self) -> set[int]:
        """Return the backend pids of every client session in lockrun's database but ours."""
        return set(self.activity())

    def holder(self, name: str, slot: int | str = 0) -> int | None:
        """Return the backend pid holding *name*'s *slot* key."""
        key = self.key(name, slot)
        found = [lock.pid for lock in self.advisory() if _holds(lock, key)]
        return found[0] if found else None

    def waits(self, name: str, pid: int) -> dict[int, str]:
        """Return the sessions of lockrun *pid* waiting for a key of *name*, and its slot."""
        labels = {self.key(name, part): str(part) for part in [*range(16), "gate"]}
        return {
            lock.pid: labels.get(lock.key, "?")
            for lock in self.advisory()
            if lock.owner == pid and not lock.granted and lock.subid == 1
        }

    def expiry(self, name: str, ttl: float, slot: int = 0) -> float | None:
        """Return when idle_session_timeout ends the idle session holding *slot*."""
        holder = self.holder(name, slot)
        _, state, since = self.activity().get(holder or 0, ("", "", 0.0))
        return since + self.free_after(ttl) if state == "idle" else None

    def check_granted(self, name: str, handle: int, slot: int, slots: int) -> None:
        """Check the session is lockrun:NAME:SLOT, holding its key and (name, N) only."""
        from lockrun.backends.postgres import slots_key

        assert self.activity()[handle][0] == f"lockrun:{name}:{slot}"
        assert self.named(name) == sorted(self.holder(name, each) or 0 for each in range(slots))
        held = [lock for lock in self.advisory() if lock.pid == handle]
        assert all(lock.granted for lock in held), held
        pairs = sorted((lock.subid, lock.key if lock.subid == 1 else lock.objid) for lock in held)
        assert pairs == [(1, self.key(name, slot)), (2, slots)]
        (pair,) = [lock for lock in held if lock.subid == 2]
        assert pair.classid == slots_key(NAMESPACE, name) & 0xFFFF_FFFF

    def _count(self, link: Any) -> int:
        (found,) = link.execute(_POSTGRES_SESSIONS).fetchone() or (0,)
        return int(found)


def _holds(lock: Advisory, key: int) -> bool:
    return lock.subid == 1 and lock.granted and lock.key == key


# What etcd makes of a shorter TTL: 1.5 election timeouts (1 s by default), rounded up.
ETCD_LEAST_TTL: Final = 2
# A keep-alive or grant of lockrun's as it passes the proxy: its lease ID, in the JSON body.
_LEASE_CALL: Final = re.compile(
    rb"POST /v3/lease/(?:keepalive|grant) HTTP/1\.[01]\r\n.*?\r\n\r\n"  # its headers
    rb"[^{]*\{[^}]*?\"ID\"\s*:\s*\"?(\d+)",  # a chunk size maybe, then the body's "ID"
    re.DOTALL,
)
_ANSWERED_TTL: Final = re.compile(rb"\"TTL\"\s*:\s*\"?(-?\d+)")


def etcd_prefix(namespace: str, name: str) -> str:
    """Return the key prefix of the lock *name* in *namespace* (docs/design.md A13).

    NS and NAME are escaped as the Redis backend's keys are (`key_part`): "/" joins nothing.
    """
    from lockrun.names import key_part

    return f"lockrun/{key_part(namespace)}/{key_part(name)}/"


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    """Return the range end that covers every key starting with *prefix* (its last byte + 1)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class Queued(NamedTuple):
    """One queue key of a lock, as the server keeps it: an acquirer, in arrival order."""

    key: str  # the whole key: lockrun/NS/NAME/q/LEASE
    lease: int  # the lease the key is attached to (the server's word, not the key's name)
    created: int  # its create revision: the order, and the fence of its grant
    record: dict[str, Any]  # the acquirer's record (token, namespace, name, slots, holder)

    @property
    def pid(self) -> int | None:
        """The lockrun process the record names."""
        holder = self.record.get("holder")
        return int(holder["pid"]) if isinstance(holder, dict) and "pid" in holder else None


class LeaseTap:
    """The last keep-alive (or grant) of each lease that a `Proxy` passed on, and its answer.

    etcd tells a lease's time to live in whole seconds only (truncated), so the server
    cannot say when it last heard of a holder; the proxy between them can. Fed by the
    proxy's thread, read by the test's.
    """

    def __init__(self) -> None:
        """Start with nothing seen."""
        self._buffers: dict[int, bytes] = {}
        self._asked: dict[int, tuple[int, float]] = {}  # connection → (lease, when asked)
        self.answered: dict[int, tuple[float, float, int]] = {}  # lease → (asked, answered, TTL)
        self.pending: dict[int, float] = {}  # lease → when asked, while no answer came back
        self._lock = threading.Lock()

    def __call__(self, connection: int, from_server: bool, data: bytes) -> None:
        """Note a call that passed, or the answer to one."""
        now = time.time()
        with self._lock:
            if not from_server:
                buffer = (self._buffers.get(connection, b"") + data)[-8192:]
                for match in _LEASE_CALL.finditer(buffer):
                    lease = int(match[1])
                    self._asked[connection] = (lease, now)
                    self.pending[lease] = now
                    buffer = buffer[match.end() :]
                self._buffers[connection] = buffer
            elif connection in self._asked and (ttl := _ANSWERED_TTL.search(data)):
                lease, asked = self._asked.pop(connection)
                self.pending.pop(lease, None)
                self.answered[lease] = (asked, now, int(ttl[1]))

    def expiry(self, lease: int) -> float | None:
        """Return when the last answered call sets *lease* to end; None if unknown or unsure.

        Unsure: a call passed whose answer did not (the server may have renewed it).
        """
        with self._lock:
            if lease in self.pending or lease not in self.answered:
                return None
            asked, _, ttl = self.answered[lease]
            return asked + ttl if ttl > 0 else None


class EtcdHarness(ServerHarness):
    """etcd: a lease per acquirer, its queue key ordered by create revision (A13).

    A handle is a lease ID: the server knows a holder or a waiter by nothing else. The
    holders are the first N keys of the lock's queue by create revision (N: the first
    record's), the others wait. A proxy of our own watches lockrun's keep-alives through
    it (`LeaseTap`), for `expiry` to the millisecond where the server says whole seconds.
    """

    def __init__(self, backend: str, uri: str | None = None, *options: str) -> None:
        """Start an etcd of our own (with *options*) and a proxy; or use the shared *uri*."""
        self.backend = backend
        self._link = None
        self._lock = threading.Lock()
        self.tap: LeaseTap | None = None
        if uri is not None:
            self.uri = uri
            self.endpoints = _etcd_endpoints(uri)
            self._authorization: Callable[..., str | None] | None = _etcd_login(uri)
            return
        self.server = EtcdServer(*options, quick=True)  # a test's own: started, used, gone
        self.tap = LeaseTap()
        self.proxy = Proxy(("127.0.0.1", self.server.port), tap=self.tap)
        self.uri = self.server.lock_uri
        self.proxied = self.uri.replace(f":{self.server.port}/", f":{self.proxy.port}/")
        self.endpoints = [self.server.uri]
        self._authorization = None
        self.can_restart = self.can_partition = True
        self.restart_frees = False  # etcd keeps its leases (and their keys) across a restart

    @property
    def socket_uri(self) -> str:
        """The own server's URI, not through the proxy (etcd has no unix socket here)."""
        return self.uri

    def call(self, path: str, body: dict[str, object] | None = None) -> dict[str, Any]:
        """POST *body* to the gateway of the first member that answers; return its answer."""
        if isinstance(self.server, EtcdServer):
            return self.server.call(path, body)  # as root, once auth is on
        failure: Exception | None = None
        for endpoint in self.endpoints:
            try:
                return gateway(endpoint, path, body or {}, self._authorization)
            except OSError as err:
                failure = err
        raise AssertionError(f"no member of {self.uri} answers: {failure}")

    def queue(self, name: str) -> list[Queued]:
        """Return *name*'s queue keys in create-revision order: the holders, then the waiters."""
        prefix = etcd_prefix(NAMESPACE, name) + "q/"
        found = self.call(
            "/v3/kv/range",
            {
                "key": _b64(prefix),
                "range_end": _b64(_prefix_end(prefix)),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
            },
        )
        queue = []
        for kv in found.get("kvs", []):
            key = base64.b64decode(kv["key"]).decode()
            value = base64.b64decode(kv.get("value", "")).decode()
            lease = int(kv.get("lease", 0))  # the gateway leaves out a 0: no lease
            queue.append(Queued(key, lease, int(kv["create_revision"]), json.loads(value)))
        return queue

    def slot_keys(self, name: str) -> dict[int, int]:
        """Return *name*'s slot keys (N > 1): each slot taken, with the lease it is attached to."""
        prefix = etcd_prefix(NAMESPACE, name) + "s/"
        found = self.call(
            "/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        )
        return {
            int(base64.b64decode(kv["key"]).decode().removeprefix(prefix)): int(kv.get("lease", 0))
            for kv in found.get("kvs", [])
        }

    @staticmethod
    def slots(queue: list[Queued]) -> int:
        """Return N, as the first record of *queue* says it."""
        return int(queue[0].record.get("slots", 1)) if queue else 1

    def holder(self, name: str, slot: int | str = 0) -> int | None:
        """Return the lease holding *name*'s *slot*: the first key's (N = 1), or s/SLOT's.

        None for the gate: there is none on etcd.
        """
        if slot == "gate":
            return None
        queue = self.queue(name)
        if not queue:
            return None
        if self.slots(queue) == 1:
            return queue[0].lease if slot == 0 else None
        return self.slot_keys(name).get(int(slot))

    def _holders(self, name: str) -> list[dict[str, Any]]:
        queue = self.queue(name)
        return [entry.record for entry in queue[: self.slots(queue)]]

    def waits(self, name: str, pid: int) -> dict[int, str]:
        """Return {lease: "queue"} while lockrun *pid* has a key behind the holders' keys."""
        queue = self.queue(name)
        return {entry.lease: "queue" for entry in queue[self.slots(queue) :] if entry.pid == pid}

    def expected_waits(self, slots: int, *, head: bool = True) -> list[str]:  # noqa: ARG002
        """Return ["queue"]: a waiter is a key in the queue, head or not."""
        return ["queue"]

    def time_to_live(self, lease: int, *, keys: bool = False) -> dict[str, Any]:
        """Return the server's POST /v3/lease/timetolive answer for *lease* (TTL -1: gone)."""
        return self.call("/v3/lease/timetolive", {"ID": str(lease), "keys": keys})

    def alive(self, name: str, handle: int) -> bool:  # noqa: ARG002 - a lease is server-wide
        """Return whether the server still has the lease *handle*."""
        return int(self.time_to_live(handle).get("TTL", 0)) >= 0

    def session_ids(self) -> set[int]:
        """Return every lease the server has (the leased counterpart of a session)."""
        return {int(lease["ID"]) for lease in self.call("/v3/lease/leases").get("leases", [])}

    def sessions(self) -> int:
        """Return how many leases the server has: one per lockrun that holds or waits."""
        return len(self.session_ids())

    def end_session(self, name: str, slot: int = 0) -> None:
        """Revoke the lease that holds *name*'s *slot*: its keys go with it."""
        lease = self.holder(name, slot)
        assert lease is not None, f"nobody holds {name}:{slot}"
        self.call("/v3/lease/revoke", {"ID": str(lease)})

    def free_after(self, ttl: float) -> float:
        """Return the lease's TTL: --ttl rounded up, and no less than etcd's least."""
        return max(math.ceil(ttl), ETCD_LEAST_TTL)

    def expiry(self, name: str, ttl: float, slot: int = 0) -> float | None:  # noqa: ARG002
        """Return when the lease holding *name*'s *slot* runs out unless its holder renews it.

        From the last keep-alive our proxy passed, when one did (`LeaseTap`). Else from the
        server, which tells whole seconds: while nobody renews the lease, the moment its
        time to live ticks down to the next second gives the end to a few ms (a second's
        watch at most); a lease renewed meanwhile is reported as just renewed.
        """
        lease = self.holder(name, slot)
        if lease is None:
            return None
        tapped = self.tap.expiry(lease) if self.tap is not None else None
        if tapped is not None and self.alive(name, lease):
            return tapped
        return self._ticked(lease)

    def expiry_of(
        self, name: str, ttl: float, slot: int = 0, handle: int | str | None = None
    ) -> float | None:
        """Return when lease *handle* ends (else `expiry`), holding or no longer holding.

        From our proxy's last keep-alive of it: a frozen head whose lease ran out under load
        may be replaced by the next before this is asked, and the holder's then is not it.
        """
        if not isinstance(handle, int):
            return self.expiry(name, ttl, slot)
        tapped = self.tap.expiry(handle) if self.tap is not None else None
        return tapped if tapped is not None else self._ticked(handle)

    def _ticked(self, lease: int) -> float | None:
        """Watch *lease*'s whole seconds to live tick down once; return when it ends."""
        previous = time.time()
        left = int(self.time_to_live(lease).get("TTL", -1))
        deadline = time.monotonic() + 1.2
        while left >= 0 and time.monotonic() < deadline:
            asked = time.time()
            now = int(self.time_to_live(lease).get("TTL", -1))
            if now < 0:
                return None
            if now < left:  # it ticked between our last look (asked then) and this one
                return previous + now + 1
            left, previous = now, asked
            time.sleep(0.002)
        return None if left < 0 else time.time() + left + 1

    def check_granted(self, name: str, handle: int, slot: int, slots: int) -> None:
        """Check the lease holds its queue key and, for N > 1, the key of *slot*: nothing else."""
        prefix = etcd_prefix(NAMESPACE, name)
        keys = {
            base64.b64decode(key).decode()
            for key in self.time_to_live(handle, keys=True).get("keys", [])
        }
        expected = {f"{prefix}q/{handle:016x}"} | ({f"{prefix}s/{slot}"} if slots > 1 else set())
        assert keys == expected, keys

    def after_restart(self, name: str, fence: int) -> None:  # noqa: ARG002
        """Check the revision went on: etcd keeps its store (and so the fence) through a restart."""
        revision = int(self.call("/v3/kv/range", {"key": _b64("lockrun/")})["header"]["revision"])
        assert revision >= fence, (revision, fence)


def _etcd_endpoints(uri: str) -> list[str]:
    """Return the client URLs of an ``etcd://[USER:PASS@]HOST[:PORT][,…]`` URI."""
    scheme, _, rest = uri.partition("://")
    assert scheme == "etcd", f"{uri}: only plain etcd:// here"
    hosts = rest.rpartition("@")[2].split("/", 1)[0].split("?", 1)[0]
    return [
        f"http://{host}" if ":" in host.rsplit("]", 1)[-1] else f"http://{host}:2379"
        for host in hosts.split(",")
    ]


def _etcd_login(uri: str) -> Callable[..., str | None] | None:
    """Return how to get a token for the URI's user, None if it names none."""
    userinfo = uri.partition("://")[2].rpartition("@")[0]
    if not userinfo:
        return None
    user, _, password = (urllib.parse.unquote(part) for part in userinfo.partition(":"))
    endpoints = _etcd_endpoints(uri)
    token: list[str] = []

    def login(*, again: bool = False) -> str | None:
        if again or not token:
            answer = gateway(
                endpoints[0], "/v3/auth/authenticate", {"name": user, "password": password}
            )
            token[:] = [str(answer["token"])]
        return token[0]

    return login


_SERVER: Final[dict[str, type[RedisServer | MariaServer | PostgresServer]]] = {
    "redis": RedisServer,
    "mysql": MariaServer,
    "postgres": PostgresServer,
}
_HARNESS: Final[dict[str, type[ServerHarness]]] = {
    "redis": RedisHarness,
    "mysql": MysqlHarness,
    "postgres": PostgresHarness,
    "etcd": EtcdHarness,
}


def make_harness(backend: str, tmp_path: Path, *options: str) -> Harness:
    """Return a harness of *backend* with a server of its own (extra *options*) if it has one."""
    if SCHEMES[backend].local:
        return LocalHarness(backend, tmp_path)
    return _HARNESS[backend](backend, None, *(options or _ROOMY[backend]))


def shared_harness_for(backend: str, tmp_path: Path, uri: str | None = None) -> Harness:
    """Return a harness of *backend* on a shared server at *uri* (local backends need none)."""
    if SCHEMES[backend].local:
        return LocalHarness(backend, tmp_path)
    assert uri is not None
    return _HARNESS[backend](backend, uri)


@pytest.fixture(params=BACKENDS)
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return each backend, with a server (and proxy) of the test's own, closed at teardown."""
    made = make_harness(request.param, tmp_path)
    yield made
    made.close()


@pytest.fixture(params=SERVERS)
def server_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return each server backend, with a server (and proxy) of the test's own."""
    made = make_harness(request.param, tmp_path)
    yield made
    made.close()


@pytest.fixture(params=SERVERS)
def shared_server_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return each server backend on the session's servers: no restart, no partition."""
    made = shared_harness_for(
        request.param, tmp_path, request.getfixturevalue(f"{request.param}_uri")
    )
    yield made
    made.close()


# Valkey, the fork of Redis, runs the Redis backend: a few scenarios of the contract suite
# (@on_valkey_too) run on it too, alone and as a cluster, each the session's own (the
# `valkey` and `valkey_cluster` fixtures; tests/backends/test_valkey.py checks they are).
# `etcd-cluster` (a module's cluster of three etcd members, `etcd_cluster_uri`) runs them on
# etcd's cluster when asked for by name; CI leaves it out for its 12 minutes (issue #33).
VALKEY: Final = {"valkey": "valkey", "valkey-cluster": "valkey_cluster"}
ETCD_CLUSTER: Final = "etcd-cluster"
on_valkey_too: Final = pytest.mark.parametrize(
    "shared_harness", [*BACKENDS, *VALKEY], indirect=True
)


@pytest.fixture(params=BACKENDS)
def shared_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return each backend on the session's servers (redis_uri, …): no restart, no partition.

    A test marked `on_valkey_too` also runs on the session's Valkey and Valkey cluster, and
    on its cluster of three etcd members.
    """
    if request.param in VALKEY:
        server = request.getfixturevalue(VALKEY[request.param])
        made = shared_harness_for("redis", tmp_path, server.uri)
    elif request.param == ETCD_CLUSTER:
        made = shared_harness_for("etcd", tmp_path, request.getfixturevalue("etcd_cluster_uri"))
    else:
        local = SCHEMES[request.param].local
        uri = None if local else request.getfixturevalue(f"{request.param}_uri")
        made = shared_harness_for(request.param, tmp_path, uri)
    yield made
    made.close()


# -- the chaos suite's older names ----------------------------------------------------------------


class PeakSessions:
    """Sample a harness's connection count in a thread; `peak` is the most seen."""

    def __init__(self, rig: Harness, every: float = 0.05) -> None:
        """Start sampling *rig* every *every* seconds."""
        self.peak = self.samples = 0
        self._rig = rig
        self._every = every
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="sessions", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Stop sampling and return the peak."""
        self._stopping.set()
        self._thread.join(10)
        return self.peak

    def _sample(self) -> None:
        while not self._stopping.wait(self._every):
            self.peak = max(self.peak, self._rig.sessions())
            self.samples += 1


class Rig(Protocol):
    """What `rig` and `server_harness` give: a server of the test's own, a proxy in front."""

    backend: str
    uri: str
    proxied: str
    proxy: Proxy
    server: RedisServer | MariaServer | PostgresServer

    @property
    def kind(self) -> Scheme:
        """The registry's row for this backend."""
        ...  # pragma: no cover

    def restart(self) -> None:
        """Kill the server and start it again."""

    def end_session(self, name: str, slot: int = 0) -> None:
        """Take *name*'s *slot* away from its holder."""

    def partition(self) -> None:
        """Silence the proxy."""

    def sessions(self) -> int:
        """Return how many client connections the server has."""
        ...  # pragma: no cover


# etcd's faults run in tests/chaos/test_etcd_cluster.py and the contract suite; the chaos
# rigs leave it out to keep CI within its 12 minutes (issue 33's closing note).
@pytest.fixture(params=[backend for backend in SERVERS if backend != "etcd"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Return a fresh server of each kind with a proxy in front (same as `server_harness`)."""
    made = make_harness(request.param, tmp_path)
    yield made
    made.close()


class Target:
    """Where a lock lives, for tests that run on every backend: a URI, and a rig if any."""

    def __init__(self, kind: str, uri: str, rig: Harness | None = None) -> None:
        """Describe the backend *kind* at *uri*."""
        self.kind = kind
        self.uri = uri
        self.rig = rig


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """Return each backend: a private file: directory or abstract namespace, or a rig."""
    made = make_harness(request.param, tmp_path)
    yield Target(made.backend, made.uri, None if made.kind.local else made)
    made.close()


@pytest.fixture
def oracle() -> Iterator[Oracle]:
    """Return an `Oracle`, closed at teardown."""
    witness = Oracle()
    yield witness
    witness.close()


# -- results: each test's numbers, printed together at the end of the run -----------------------

_RESULTS: Final = "PYTEST_LOCKRUN_CHAOS_RESULTS"  # the file the workers append to


def pytest_configure(config: pytest.Config) -> None:
    """In the controlling process, name a fresh file for the workers' results."""
    if not hasattr(config, "workerinput") and _RESULTS not in os.environ:
        handle, path = tempfile.mkstemp(prefix="lockrun-chaos-", suffix=".jsonl")
        os.close(handle)
        os.environ[_RESULTS] = path  # inherited by the xdist workers, started after this
        config.add_cleanup(lambda: os.unlink(path))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print what the chaos and scale tests measured (margins, peaks, tau)."""
    path = os.environ.get(_RESULTS)
    if not path or not os.path.getsize(path):
        return
    terminalreporter.section("chaos and scale: what was measured")
    with open(path) as results:
        for line in sorted(results):
            entry = json.loads(line)
            numbers = "  ".join(f"{key} {value}" for key, value in entry["numbers"].items())
            terminalreporter.write_line(f"{entry['test']}: {entry['what']}: {numbers}")


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Return a function that keeps a test's measured numbers for the run's summary."""

    def write(what: str, **numbers: object) -> None:
        shown = {
            key: f"{value:.3f}" if isinstance(value, float) else value
            for key, value in numbers.items()
        }
        print(what, shown)
        path = os.environ.get(_RESULTS)
        if path:
            line = json.dumps({"test": request.node.nodeid, "what": what, "numbers": shown})
            with open(path, "a") as results:
                results.write(line + "\n")

    return write
