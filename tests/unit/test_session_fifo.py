"""The session-lock semaphore's order of things, over a fake server in memory.

`SessionLocks` (docs/design.md A6) given ports on a `FakeServer`: named locks, each with a
first-in first-out queue, held by sessions until they end; a wait's answer is a byte on
the session's socket, so the head's wait on every slot runs through a real selector. No
server, no subprocess: each test takes milliseconds.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import TYPE_CHECKING

import pytest

from lockrun.backends import Holder, Request
from lockrun.backends.sessionlock import (
    GATE,
    Attempt,
    Holding,
    Idle,
    Outage,
    SessionLease,
    SessionLocks,
    quiet,
)
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    Interrupted,
    LeaseLost,
    LockrunError,
)
from lockrun.timing import RECONNECT_INTERVAL, now

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

HOLDER = Holder("box", 42, "alice", ("true",))
TTL = 3.0
_GRANTED, _RAN_OUT, _GONE = b"1", b"0", b"x"  # what a wait's answer says
ENDED, REFUSED = "the session ended", "connection refused"
ANOTHER_N, NO_WINDOWS = "another N", "no windows"

Try = Attempt["FakeSession", str, None]


class FakeError(Exception):
    """The fake driver's error: *lost* when the connection went (a waiter may ride it out)."""

    def __init__(self, text: str, *, lost: bool = True) -> None:
        """Say *text*."""
        super().__init__(text)
        self.lost = lost


class Waiter:
    """One session's place in a lock's queue."""

    def __init__(self, session: FakeSession, name: str, *, asked: bool) -> None:
        """Queue *session* for *name*; an *asked* wait answers on the session's socket."""
        self.session = session
        self.name = name
        self.asked = asked
        self.granted = False
        self.event = threading.Event()
        self.timer: threading.Timer | None = None


class FakeSession:
    """A session of the fake server: it holds its locks until it ends."""

    def __init__(self, server: FakeServer) -> None:
        """Open a session on *server*, with a socket its waits answer on."""
        self.server = server
        self.ours, self.theirs = socket.socketpair()
        self.ended = False

    def fileno(self) -> int:
        """Return the socket's descriptor, readable when a wait has answered."""
        return self.ours.fileno()

    def hang_up(self) -> None:
        """Cut the connection: the server frees its locks and drops its waits."""
        self.server.end(self)

    def abandon(self) -> None:
        """Hang up and close the socket."""
        self.server.end(self)
        self.ours.close()
        self.theirs.close()

    close = abandon  # a goodbye frees the same


class FakeServer:
    """Named locks with first-in first-out queues, and the sessions that hold them."""

    def __init__(self) -> None:
        """Start with every lock free and the server up."""
        self.mutex = threading.Lock()
        self.holders: dict[str, FakeSession] = {}
        self.queues: dict[str, list[Waiter]] = {}
        self.sessions: list[FakeSession] = []
        self.down = False
        self.fence = 0

    def open(self) -> FakeSession:
        """Open a session, unless the server is down."""
        if self.down:
            raise FakeError(REFUSED)
        session = FakeSession(self)
        self.sessions.append(session)
        return session

    def queued(self, name: str) -> int:
        """Return how many wait in *name*'s queue."""
        with self.mutex:
            return len(self.queues.get(name, []))

    def lock(self, session: FakeSession, name: str, seconds: float | None) -> bool:
        """Take *name*, or wait in its queue up to *seconds* (None: for ever; 0: one try)."""
        with self.mutex:
            if session.ended:
                raise FakeError(ENDED)
            if self._take(session, name) or seconds == 0:
                return self.holders.get(name) is session
            waiter = Waiter(session, name, asked=False)
            self.queues.setdefault(name, []).append(waiter)
        waiter.event.wait(seconds)
        with self.mutex:
            if waiter.granted:
                return True
            if session.ended:
                raise FakeError(ENDED)
            self.queues[name].remove(waiter)
            return False

    def ask(self, session: FakeSession, name: str, seconds: float) -> None:
        """Start a wait for *name* whose answer comes on *session*'s socket."""
        with self.mutex:
            if session.ended:
                raise FakeError(ENDED)
            if self._take(session, name):
                session.theirs.send(_GRANTED)
                return
            waiter = Waiter(session, name, asked=True)
            self.queues.setdefault(name, []).append(waiter)
            waiter.timer = threading.Timer(seconds, self._ran_out, (waiter,))
            waiter.timer.start()

    def take_first(self, session: FakeSession, names: Sequence[str]) -> int:
        """Take the first free of *names* at once; its index, or -1."""
        with self.mutex:
            if session.ended:
                raise FakeError(ENDED)
            for index, name in enumerate(names):
                if self._take(session, name):
                    return index
            return -1

    def cancel(self, session: FakeSession) -> None:
        """Cancel *session*'s waits (what it got meanwhile it keeps)."""
        with self.mutex:
            for queue in self.queues.values():
                for waiter in [w for w in queue if w.session is session]:
                    queue.remove(waiter)
                    if waiter.timer is not None:
                        waiter.timer.cancel()

    def release(self, session: FakeSession, name: str) -> bool:
        """Let *name* go: the next in its queue has it at once."""
        with self.mutex:
            if self.holders.get(name) is not session:
                return False
            self._hand_on(name)
            return True

    def end(self, session: FakeSession) -> None:
        """End *session*: free its locks, drop its waits (which answer that it is gone)."""
        with self.mutex:
            self._end(session)

    def restart(self, *, down: bool = False) -> None:
        """End every session at once, as a restart does; *down* keeps the server down after."""
        with self.mutex:
            self.holders.clear()  # nothing is handed on to a session about to end too
            for session in self.sessions:
                self._end(session)
            self.down = down

    def _end(self, session: FakeSession) -> None:
        if not session.ended:
            session.ended = True
            for name in [name for name, held in self.holders.items() if held is session]:
                self._hand_on(name)
            for queue in self.queues.values():
                for waiter in [w for w in queue if w.session is session]:
                    queue.remove(waiter)
                    if waiter.timer is not None:
                        waiter.timer.cancel()
                    waiter.event.set()
            with contextlib.suppress(OSError):  # a goodbye to read, if the socket is open
                session.theirs.send(_GONE)

    def _take(self, session: FakeSession, name: str) -> bool:
        holder = self.holders.get(name)
        if holder is None and not self.queues.get(name):
            self.holders[name] = session
            return True
        return holder is session

    def _hand_on(self, name: str) -> None:
        del self.holders[name]
        queue = self.queues.get(name, [])
        if queue:
            waiter = queue.pop(0)
            self.holders[name] = waiter.session
            waiter.granted = True
            if waiter.timer is not None:
                waiter.timer.cancel()
            if waiter.asked:
                waiter.session.theirs.send(_GRANTED)
            waiter.event.set()

    def _ran_out(self, waiter: Waiter) -> None:
        with self.mutex:
            queue = self.queues.get(waiter.name, [])
            if waiter in queue:
                queue.remove(waiter)
                with contextlib.suppress(OSError):
                    waiter.session.theirs.send(_RAN_OUT)


class Statements:
    """The fake server's `SessionPort`, logging what it is asked in order."""

    def __init__(self, server: FakeServer, holding: Holding[FakeSession]) -> None:
        """Work on *server*; a grant's lease holds with *holding*."""
        self.server = server
        self.holding = holding
        self.log: list[str] = []
        self.opened = 0

    def open(self, attempt: Try) -> FakeSession:  # noqa: ARG002 - all alike
        """Open a session."""
        self.opened += 1
        return self.server.open()

    def revive(self, session: FakeSession, attempt: Try) -> bool:  # noqa: ARG002 - all alike
        """Whether a kept session heard no goodbye."""
        return quiet(session)

    def lock(
        self, session: FakeSession, part: int | str, seconds: float | None, attempt: Try
    ) -> bool:
        """Take or wait for *part*."""
        self.log.append(f"lock {part} {'try' if seconds == 0 else 'wait'}")
        return self.server.lock(session, f"{attempt.key}:{part}", seconds)

    def first_free(self, session: FakeSession, attempt: Try) -> int:
        """Take the first free slot."""
        self.log.append("first_free")
        return self.server.take_first(session, [f"{attempt.key}:{n}" for n in range(attempt.slots)])

    def refuse_mismatch(self, session: FakeSession, attempt: Try) -> None:  # noqa: ARG002
        """Refuse a request for 7 slots, as if another N held the name."""
        self.log.append("refuse_mismatch")
        if attempt.slots == 7:
            raise ConfigError(ANOTHER_N)

    def ask(self, session: FakeSession, slot: int, seconds: float, attempt: Try) -> None:
        """Start a wait for *slot*."""
        self.log.append(f"ask {slot}")
        self.server.ask(session, f"{attempt.key}:{slot}", seconds)

    def answer(self, session: FakeSession, slot: int) -> bool | None:  # noqa: ARG002
        """Read a wait's answer."""
        said = session.ours.recv(1)
        if said == _GONE:
            raise FakeError(ENDED)
        return said == _GRANTED

    def cancel(self, winner: FakeSession, sessions: Sequence[FakeSession]) -> None:
        """End the helpers, cancel the first session's wait."""
        self.log.append("cancel")
        first, *helpers = sessions
        for loser in helpers:
            if loser is not winner:
                loser.abandon()
        if first is not winner:
            self.server.cancel(first)

    def grant(self, session: FakeSession, attempt: Try, slot: int) -> SessionLease[FakeSession]:
        """Draw a fence."""
        self.log.append(f"grant {slot}")
        self.server.fence += 1
        key = f"{attempt.key}:{slot}"
        return SessionLease(self.holding, session, key, slot, self.server.fence)

    def release_gate(self, session: FakeSession, attempt: Try) -> None:
        """Let the gate go."""
        self.log.append("release_gate")
        self.server.release(session, f"{attempt.key}:{GATE}")

    def end(self, sessions: Sequence[FakeSession]) -> None:
        """End what we hung up on."""
        self.log.append(f"end {len(sessions)}")


class Requests:
    """Plain requests: a name's key, and nothing to register."""

    def names(self, request: Request, token: str) -> tuple[str, str]:
        """Name the lock by the request's name."""
        return f"k:{request.name}", f"/* {token} */"

    def begin(self, session: FakeSession, attempt: Try) -> bool:  # noqa: ARG002
        """Register nothing."""
        return True

    def reusable(self, session: FakeSession, attempt: Try) -> bool:  # noqa: ARG002
        """Every session may be kept."""
        return True


class Faults:
    """The fake driver's errors."""

    errors: tuple[type[Exception], ...] = (FakeError,)
    where = "fake://server"
    waits = "LOCK"

    def failure(self, err: Exception) -> LockrunError:
        """Say *err* as the server's."""
        return BackendUnavailable(f"{self.where}: {err}")

    def passing(self, err: BaseException) -> bool:
        """Let a queued waiter ride out a lost connection."""
        return getattr(err, "lost", False) or "cancelled on the server" in str(err)

    def was_cancelled(self, err: Exception) -> bool:  # noqa: ARG002
        """Nothing is cancelled here."""
        return False

    def said(self, err: Exception) -> str:
        """Say *err*."""
        return str(err)


class Leases:
    """The statements on a lease's session."""

    def __init__(self, server: FakeServer) -> None:
        """Work on *server*."""
        self.server = server

    def holds(self, lease: SessionLease[FakeSession]) -> bool:
        """Whether the server still gives the lease's session its lock."""
        if lease.session.ended:
            raise FakeError(ENDED)
        return self.server.holders.get(str(lease.key)) is lease.session

    def give_back(self, lease: SessionLease[FakeSession]) -> None:
        """Release the slot."""
        if lease.session.ended:
            raise FakeError(ENDED)
        self.server.release(lease.session, str(lease.key))

    def hold_over(self, lease: SessionLease[FakeSession], hold: float) -> None:  # noqa: ARG002
        """No windows here."""
        self.give_back(lease)
        raise ConfigError(NO_WINDOWS)

    def cut(self, lease: SessionLease[FakeSession]) -> bool:
        """Hang up."""
        lease.session.abandon()
        return False


class Fixture:
    """A fake server and the semaphore over it."""

    def __init__(self, ttl: float = TTL) -> None:
        """Compose `SessionLocks` of the fake ports, for leases of *ttl*."""
        self.server = FakeServer()
        faults = Faults()
        self.holding = Holding(
            Leases(self.server), faults, Idle[FakeSession](ttl, faults.errors), ttl
        )
        self.port = Statements(self.server, self.holding)
        self.locks = SessionLocks[FakeSession, str, None](self.port, Requests(), self.holding, 0.5)

    def acquire(
        self, slots: int = 1, wait: float | None = None, name: str = "jobs"
    ) -> SessionLease[FakeSession] | None:
        """Acquire one of *slots* of *name*, waiting up to *wait* seconds (None: for ever)."""
        request = Request("default", name, slots, TTL, HOLDER)
        return self.locks.acquire(request, None if wait is None else now() + wait)

    def waiting(self, slots: int = 1, **kwargs: float | None) -> Waiting:
        """Start an acquisition in a thread."""
        return Waiting(self, slots, **kwargs)

    def until(self, condition: str, check: Callable[[], bool]) -> None:
        """Wait (up to 5 s) until *check*() is true."""
        deadline = now() + 5
        while not check():
            assert now() < deadline, condition
            threading.Event().wait(0.002)


class Waiting(threading.Thread):
    """An acquisition in a thread, and what it got."""

    def __init__(self, fixture: Fixture, slots: int, wait: float | None = None) -> None:
        """Acquire one of *slots* in a thread, waiting up to *wait* seconds."""
        super().__init__(daemon=True)
        self.fixture = fixture
        self.slots = slots
        self.wait = wait
        self.lease: SessionLease[FakeSession] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        """Acquire, keeping the lease or the error."""
        try:
            self.lease = self.fixture.acquire(self.slots, self.wait)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            self.error = err

    def result(self) -> SessionLease[FakeSession] | None:
        """Wait for the acquisition to end; its lease, or raise its error."""
        self.join(5)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error
        return self.lease


@pytest.fixture
def fake() -> Iterator[Fixture]:
    """Return a fake server and the semaphore over it; close every session after."""
    fixture = Fixture()
    yield fixture
    fixture.locks.idle.close()
    for session in fixture.server.sessions:
        session.abandon()


def test_one_slot_is_granted_at_once_in_one_try(fake: Fixture) -> None:
    """A free slot: one try, the grant, and a lease that proves itself and is given back."""
    lease = fake.acquire()
    assert lease is not None
    assert (lease.slot, lease.fence, fake.port.log) == (0, 1, ["lock 0 try", "grant 0"])
    lease.refresh()
    assert lease.release()
    assert "k:jobs:0" not in fake.server.holders


def test_one_slot_busy_queues_and_is_handed_on_in_arrival_order(fake: Fixture) -> None:
    """Held: a waiter checks N then queues; the release hands the slot to the first waiter."""
    holder = fake.acquire()
    assert holder is not None
    first = fake.waiting()
    fake.until("first queued", lambda: fake.server.queued("k:jobs:0") == 1)
    second = fake.waiting()
    fake.until("second queued", lambda: fake.server.queued("k:jobs:0") == 2)
    assert holder.release()
    lease = first.result()
    assert lease is not None
    assert second.is_alive()
    assert fake.port.log[2:5] == ["lock 0 try", "refuse_mismatch", "lock 0 wait"]
    assert lease.release()
    assert second.result() is not None


def test_a_wait_that_runs_out_is_busy_and_leaves_the_queue(fake: Fixture) -> None:
    """The deadline ends the wait: None, nothing queued, the session kept for next time."""
    holder = fake.acquire()
    assert holder is not None
    started = now()
    assert fake.acquire(wait=0.05) is None
    assert 0.05 <= now() - started < 1
    assert fake.server.queued("k:jobs:0") == 0
    assert fake.acquire(wait=0) is None  # one try, no queue
    assert fake.port.log[-1] == "lock 0 try"


def test_another_n_is_refused_before_queueing(fake: Fixture) -> None:
    """A live holder of another N: `ConfigError` before any wait at the gate."""
    assert fake.acquire(slots=2) is not None
    with pytest.raises(ConfigError, match="another N"):
        fake.acquire(slots=7)
    assert fake.server.queued(f"k:jobs:{GATE}") == 0


def test_n_slots_take_the_first_free_then_queue_at_the_gate(fake: Fixture) -> None:
    """Free slots are taken in one statement; then the gate's head waits on every slot."""
    leases = [fake.acquire(slots=2), fake.acquire(slots=2)]
    assert [lease.slot for lease in leases if lease is not None] == [0, 1]
    assert fake.port.log[:4] == ["refuse_mismatch", "lock gate wait", "first_free", "grant 0"]
    assert fake.port.log[4] == "release_gate"
    head = fake.waiting(2)
    fake.until("asked every slot", lambda: fake.server.queued("k:jobs:1") == 1)
    behind = fake.waiting(2)
    fake.until("behind at the gate", lambda: fake.server.queued(f"k:jobs:{GATE}") == 1)
    assert leases[1] is not None
    leases[1].release()
    got = head.result()
    assert got is not None
    assert got.slot == 1
    log = fake.port.log[fake.port.log.index("ask 0") :]
    assert log.index("ask 1") < log.index("cancel") < log.index("grant 1")
    assert behind.is_alive()  # now the head, waiting on every slot
    got.release()
    assert behind.result() is not None


def test_the_gate_s_head_waits_in_pieces_until_its_deadline(fake: Fixture) -> None:
    """Every slot held: the head asks each slot until the deadline, then is busy."""
    assert fake.acquire(slots=2) is not None
    assert fake.acquire(slots=2) is not None
    assert fake.acquire(slots=2, wait=0.05) is None
    assert fake.port.log.count("ask 0") >= 1
    assert fake.server.queued("k:jobs:0") == fake.server.queued("k:jobs:1") == 0
    assert fake.acquire(slots=2, wait=0) is None  # --wait 0: no gate, one look
    assert fake.port.log[-1] == "first_free"


def test_a_lost_connection_while_queued_is_ridden_out(fake: Fixture) -> None:
    """A restart under a queued waiter: it connects, queues again and gets the slot."""
    assert fake.acquire() is not None
    waiter = fake.waiting()
    fake.until("queued", lambda: fake.server.queued("k:jobs:0") == 1)
    opened = fake.port.opened
    fake.server.restart()  # the holder's session goes too: the slot is free after
    lease = waiter.result()
    assert lease is not None
    assert fake.port.opened == opened + 1


def test_a_server_that_stays_away_is_reported_after_a_ttl() -> None:
    """Queued, then the server goes for good: reported once a ttl has passed, not before."""
    fake = Fixture(ttl=0.3)
    try:
        assert fake.acquire() is not None
        waiter = fake.waiting()
        fake.until("queued", lambda: fake.server.queued("k:jobs:0") == 1)
        lost = now()
        fake.server.restart(down=True)
        with pytest.raises(BackendUnavailable, match="connection refused"):
            waiter.result()
        assert now() - lost >= 0.3
    finally:
        for session in fake.server.sessions:
            session.abandon()


def test_a_server_out_of_reach_at_first_is_reported_at_once(fake: Fixture) -> None:
    """Never queued: no ride-out, the failure is said at once."""
    fake.server.down = True
    with pytest.raises(BackendUnavailable, match="fake://server: connection refused"):
        fake.acquire()


@pytest.mark.parametrize("slots", [1, 2])
def test_interrupt_ends_a_wait_at_once(fake: Fixture, slots: int) -> None:
    """`interrupt` cuts the waiter's sessions: `Interrupted`, nothing queued, nothing kept."""
    for _ in range(slots):
        assert fake.acquire(slots) is not None
    waiter = fake.waiting(slots)
    queue = "k:jobs:0"
    fake.until("queued", lambda: fake.server.queued(queue) == 1)
    fake.locks.interrupt()
    with pytest.raises(Interrupted, match="the wait for jobs was interrupted; nothing is held"):
        waiter.result()
    assert fake.server.queued(queue) == 0
    assert fake.port.log[-1] == f"end {slots}"
    assert fake.locks.idle.reuse(lambda _session: True) is None


def test_a_released_session_is_kept_and_reused(fake: Fixture) -> None:
    """The next acquisition reuses the session of the last, without opening one."""
    lease = fake.acquire()
    assert lease is not None
    session = lease.session
    assert lease.release()
    again = fake.acquire()
    assert again is not None
    assert again.session is session
    assert fake.port.opened == 1


def test_a_kept_session_the_server_ended_is_replaced(fake: Fixture) -> None:
    """A kept session that heard goodbye is dropped; a new one serves at once."""
    lease = fake.acquire()
    assert lease is not None
    assert lease.release()
    fake.server.end(lease.session)  # its idle limit, say
    again = fake.acquire()
    assert again is not None
    assert again.session is not lease.session
    assert fake.port.opened == 2


def test_a_kept_session_found_dead_by_its_first_statement_is_replaced_once(fake: Fixture) -> None:
    """Revived, but its first try fails: a new session at once, with no ride-out pause."""
    lease = fake.acquire()
    assert lease is not None
    assert lease.release()
    lease.session.ended = True  # the server ended it and its goodbye is still on its way
    started = now()
    again = fake.acquire()
    assert again is not None
    assert now() - started < 0.5
    assert fake.port.opened == 2


def test_a_lease_whose_session_ended_is_lost(fake: Fixture) -> None:
    """The check on an ended session: `LeaseLost` naming the driver's words."""
    lease = fake.acquire()
    assert lease is not None
    fake.server.end(lease.session)
    with pytest.raises(LeaseLost, match="the session holding the lock ended"):
        lease.refresh()
    assert not lease.release()


def attempt(deadline: float | None = None, *, queued: bool = False) -> Try:
    """Return an attempt at one slot of jobs until *deadline*, queued or not."""
    tried = Try(Request("default", "jobs", 1, TTL, HOLDER), "k:jobs", "token", "", deadline)
    tried.queued = queued
    return tried


def test_an_outage_is_ridden_out_only_by_a_waiter_that_queued() -> None:
    """A refusal, or a connection lost before the queue, is said at once; a queued one waits."""
    outage = Outage(TTL)
    assert not outage.rides_out(attempt(queued=True), passing=False)
    assert not outage.rides_out(attempt(), passing=True)
    assert outage.pause == min(RECONNECT_INTERVAL, TTL / 10)
    assert outage.rides_out(attempt(queued=True), passing=True)
    assert outage.rides_out(attempt(), passing=True)  # not back in yet: still within a ttl


def test_an_outage_ends_a_ttl_after_the_waiter_was_last_queued_or_at_its_deadline() -> None:
    """Past a ttl since the last queued attempt, or past the deadline: said, not ridden out."""
    outage = Outage(TTL)
    assert outage.rides_out(attempt(queued=True), passing=True)
    assert outage.since is not None
    outage.since -= TTL + 0.1
    assert not outage.rides_out(attempt(), passing=True)
    assert outage.rides_out(attempt(queued=True), passing=True)  # queued again: a new ttl
    assert not outage.rides_out(attempt(now() - 1, queued=True), passing=True)
