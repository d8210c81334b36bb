"""How every front end holds a lock (lockrun.hold), in-process: no server, no command.

The backend and the lease are fakes here because they are what `lockrun.hold` is tried
against: what it asks of them, and what it makes of their answers. Signals go to this very
process: each test puts back every handler and the signal mask it found.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import hold
from lockrun.backends import Holder, LockState, Request, parse_uri
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    Interrupted,
    LeaseLost,
    LockBusy,
    TakenOver,
)
from lockrun.hold import (
    INTERRUPTS,
    acquired,
    deferred,
    interruptible,
    make_request,
    release,
    report_for,
    take,
    unheard,
)
from lockrun.progress import WaitReport
from lockrun.runner import Options
from lockrun.sigmask import pthread_sigmask, valid_signals
from lockrun.supervise import FORWARDED
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

NAME = "unit-hold"


class Clock:
    """A `timing.now` that moves only when told."""

    def __init__(self) -> None:
        self.time = 1000.0

    def __call__(self) -> float:
        return self.time


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(hold, "now", fake)
    monkeypatch.setattr("lockrun.lock.now", fake)
    return fake


@pytest.fixture
def handlers() -> Iterator[None]:
    """Start from the default handlers; put back the handlers and the mask found."""
    saved = {signo: signal.getsignal(signo) for signo in FORWARDED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    for signo in FORWARDED:
        signal.signal(signo, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for signo, handler in saved.items():
            signal.signal(signo, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class FakeLease:
    """A held slot whose release the service hears, or not."""

    def __init__(self, *, heard: bool = True, slot: int = 0, fence: int | None = None) -> None:
        self.heard = heard
        self.slot = slot
        self.fence = fence
        self.released: list[float] = []  # the hold of each release

    def release(self, hold: float = 0.0) -> bool:
        self.released.append(hold)
        return self.heard


class FakeBackend:
    """A backend whose acquire gives *lease*, None (busy) or raises *error*."""

    def __init__(self, lease: FakeLease | None = None, error: Exception | None = None) -> None:
        self.lease = lease
        self.error = error
        self.deadlines: list[float | None] = []
        self.states: list[LockState] | Exception = []
        self.status_asked = 0

    def acquire(self, _request: Request, deadline: float | None) -> FakeLease | None:
        self.deadlines.append(deadline)
        if self.error is not None:
            raise self.error
        return self.lease

    def status(self, _namespace: str, _name: str | None) -> list[LockState]:
        self.status_asked += 1
        if isinstance(self.states, Exception):
            raise self.states
        return self.states

    def close(self) -> None:
        pass


class FakeReport:
    """A -v report that notes when it was started (with what) and stopped."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def start(self, states: Sequence[LockState]) -> None:
        self.calls.append(("start", list(states)))

    def stop(self) -> None:
        self.calls.append(("stop", None))


def request(*, slots: int = 1) -> Request:
    return Request("default", NAME, slots, 30.0, Holder.me(["true"]))


# -- the request ----------------------------------------------------------------------------


def test_make_request_carries_every_option_it_asks_with() -> None:
    """Slots, ttl, --shared, --take-over, --hold-at-least and the lease id reach the service."""
    options = Options(name=NAME, slots=3, ttl=12.5, shared=True, take_over=True, hold_at_least=7.0)
    made = make_request(options, "ns", NAME, ["make", "all"], lease_id="lease-1")
    assert (made.namespace, made.name, made.slots, made.ttl) == ("ns", NAME, 3, 12.5)
    assert (made.shared, made.take_over, made.hold, made.lease_id) == (True, True, 7.0, "lease-1")


def test_make_request_describes_this_process_as_the_holder() -> None:
    """Our pid and host, the command line given, and --shared in the record too."""
    made = make_request(Options(shared=True), "ns", NAME, ["make", "all"])
    assert made.holder.pid == os.getpid()
    assert made.holder.host == os.uname().nodename
    assert made.holder.argv == ("make", "all")
    assert made.holder.shared is True
    assert made.holder.since is not None


def test_make_request_of_the_defaults_asks_for_an_exclusive_slot_for_now() -> None:
    """Nothing asked for: one exclusive slot, no take-over, no window, no detached lease."""
    made = make_request(Options(), "default", NAME, ["true"])
    assert (made.slots, made.shared, made.take_over, made.hold, made.lease_id) == (
        1,
        False,
        False,
        0.0,
        "",
    )
    assert made.holder.shared is False


def test_make_request_cuts_a_long_command_line_for_the_record() -> None:
    """A command line too long for a record is cut, with a marker: the run goes on."""
    made = make_request(Options(), "default", NAME, ["x" * 5000])
    assert made.holder.argv[-1].endswith("more characters not recorded]")


# -- -v's report ----------------------------------------------------------------------------


def test_no_report_without_verbose() -> None:
    """A run without -v draws nothing."""
    uri = parse_uri("file:///tmp")
    assert report_for(Options(wait=60.0), request(), uri, print, None) is None


def test_no_report_of_a_single_try() -> None:
    """-v with no wait: one try, nothing to report while waiting."""
    uri = parse_uri("file:///tmp")
    assert report_for(Options(verbose=True, wait=0.0), request(), uri, print, None) is None


@pytest.mark.parametrize("wait", [60.0, None])
def test_a_report_of_a_wait_that_may_last(wait: float | None) -> None:
    """-v with a wait, or forever: a report of this request at this URI."""
    uri = parse_uri("file:///tmp")
    made = request()
    report = report_for(Options(verbose=True, wait=wait), made, uri, print, None)
    assert isinstance(report, WaitReport)
    assert (report.request, report.uri) == (made, uri)


# -- take -----------------------------------------------------------------------------------


def test_take_returns_the_backends_lease_by_the_deadline_asked(clock: Clock) -> None:
    """A wait of 5 s is a deadline 5 s from now on the backend's clock."""
    lease = FakeLease(slot=2)
    backend = FakeBackend(lease)
    got: object = take(backend, request(), 5.0, None)  # type: ignore[arg-type]
    assert got is lease
    assert backend.deadlines == [clock.time + 5.0]


@pytest.mark.usefixtures("clock")
def test_take_with_no_wait_limit_waits_forever() -> None:
    """No limit to the wait (None): no deadline at all."""
    backend = FakeBackend(FakeLease())
    take(backend, request(), None, None)  # type: ignore[arg-type]
    assert backend.deadlines == [None]


@pytest.mark.usefixtures("clock")
def test_take_of_a_busy_lock_is_lock_busy_naming_it_once() -> None:
    """Busy: 75, its message begins with the lock's name, not with it twice."""
    backend = FakeBackend(None)
    with pytest.raises(LockBusy) as raised:
        take(backend, request(), 0.0, None)  # type: ignore[arg-type]
    assert str(raised.value) == f"{NAME} busy"


@pytest.mark.parametrize(
    "error",
    [BackendUnavailable("connection refused"), ConfigError("no such database"), TakenOver("x")],
)
@pytest.mark.usefixtures("clock")
def test_take_names_the_lock_in_what_the_backend_raised(error: Exception) -> None:
    """69, 78 and 79 from the backend come out naming the lock (docs/semantics.md)."""
    backend = FakeBackend(error=error)
    with pytest.raises(type(error)) as raised:
        take(backend, request(), 0.0, None)  # type: ignore[arg-type]
    assert raised.value is error
    assert str(raised.value).startswith(f"{NAME}: ")


@pytest.mark.usefixtures("clock")
def test_take_names_the_lock_only_once() -> None:
    """An error the backend named already keeps the backend's name."""
    backend = FakeBackend(error=BackendUnavailable("refused").about("other"))
    with pytest.raises(BackendUnavailable, match=r"^other: refused$"):
        take(backend, request(), 0.0, None)  # type: ignore[arg-type]


@pytest.mark.usefixtures("clock")
def test_take_leaves_a_lost_lease_unnamed() -> None:
    """Only the three outcomes of asking are named here; a lost lease says its own words."""
    backend = FakeBackend(error=LeaseLost("gone"))
    with pytest.raises(LeaseLost, match=r"^gone$"):
        take(backend, request(), 0.0, None)  # type: ignore[arg-type]


@pytest.mark.usefixtures("clock")
def test_take_starts_the_report_with_what_status_read() -> None:
    """-v: the report starts from the holders read before queueing; take leaves it running."""
    state = LockState("default", NAME, "here", 1, (Holder.me(["other"]),))
    backend = FakeBackend(FakeLease())
    backend.states = [state]
    report = FakeReport()
    take(backend, request(), 5.0, report)  # type: ignore[arg-type]
    assert report.calls == [("start", [state])]  # the caller stops it, where no signal lands


def test_take_starts_the_report_bare_when_status_is_unavailable(clock: Clock) -> None:
    """A status that fails is only the report's loss: acquire() judges the outage itself."""
    backend = FakeBackend(FakeLease())
    backend.states = BackendUnavailable("down")
    report = FakeReport()
    take(backend, request(), 5.0, report)  # type: ignore[arg-type]
    assert report.calls == [("start", [])]
    assert backend.deadlines == [clock.time + 5.0]


@pytest.mark.usefixtures("clock")
def test_take_stops_the_report_when_the_wait_fails() -> None:
    """Busy, or an error: the report stops before the error leaves, the lock named."""
    backend = FakeBackend(error=BackendUnavailable("down"))
    report = FakeReport()
    with pytest.raises(BackendUnavailable, match=rf"^{NAME}: down$"):
        take(backend, request(), 5.0, report)  # type: ignore[arg-type]
    assert report.calls == [("start", []), ("stop", None)]


@pytest.mark.usefixtures("clock")
def test_take_without_a_report_reads_no_status() -> None:
    """No -v: no status read on the way (a busy lock reads it for its message only)."""
    backend = FakeBackend(FakeLease())
    take(backend, request(), 5.0, None)  # type: ignore[arg-type]
    assert backend.status_asked == 0


# -- what was got, and its release ----------------------------------------------------------


def test_acquired_says_slot_time_and_fence(clock: Clock) -> None:
    """-v's line: which slot of how many, how long the wait took, and the fence."""
    started = clock.time
    clock.time += 2.5
    line = acquired(request(slots=3), FakeLease(slot=1, fence=42), started)  # type: ignore[arg-type]
    assert line == f"acquired {NAME} slot 1 of 3 after 2.50s, fence 42"


def test_acquired_without_a_fence_says_none() -> None:
    """A backend with no fence: no ", fence" at all (not "fence None")."""
    line = acquired(request(), FakeLease(fence=None), now())  # type: ignore[arg-type]
    assert line.startswith(f"acquired {NAME} slot 0 of 1 after ")
    assert "fence" not in line


def test_acquired_shows_fence_zero() -> None:
    """Fence 0 is a fence: shown, not taken for none."""
    line = acquired(request(), FakeLease(fence=0), now())  # type: ignore[arg-type]
    assert line.endswith(", fence 0")


def test_release_heard_says_how_long_it_was_held(clock: Clock) -> None:
    """Heard: True, released at once (no window), and -v says after how long."""
    lease, lines = FakeLease(), list[str]()
    held_since = clock.time
    clock.time += 4.0
    assert release(lease, request(), held_since, 0.0, lines.append)  # type: ignore[arg-type]
    assert lease.released == [0.0]
    assert lines == [f"released {NAME} after 4s"]


def test_release_leaves_the_rest_of_the_hold_at_least_window(clock: Clock) -> None:
    """Held 4 s of --hold-at-least 10 s: the slot stays taken 6 s more, and -v says so."""
    lease, lines = FakeLease(), list[str]()
    held_since = clock.time
    clock.time += 4.0
    assert release(lease, request(), held_since, 10.0, lines.append)  # type: ignore[arg-type]
    assert lease.released == [6.0]
    assert lines == [
        f"left {NAME} taken for 6s more (--hold-at-least)",
        f"released {NAME} after 4s",
    ]


def test_release_after_the_window_passed_leaves_nothing(clock: Clock) -> None:
    """Held longer than --hold-at-least: released at once, never a negative hold."""
    lease, lines = FakeLease(), list[str]()
    held_since = clock.time
    clock.time += 12.0
    assert release(lease, request(), held_since, 10.0, lines.append)  # type: ignore[arg-type]
    assert lease.released == [0.0]
    assert lines == [f"released {NAME} after 12s"]


def test_release_unheard_says_the_lock_frees_by_itself(clock: Clock) -> None:
    """Not heard: False, and the one line saying it frees by itself, no "released"."""
    lease, lines = FakeLease(heard=False), list[str]()
    held_since = clock.time
    clock.time += 3.0
    assert not release(lease, request(), held_since, 10.0, lines.append)  # type: ignore[arg-type]
    assert lines == [unheard(NAME, 3.0)]
    assert lines[0] == (
        f"could not tell the server to release {NAME} after 3s; "
        'it frees by itself (docs/semantics.md "A killed holder")'
    )


# -- signals while waiting ------------------------------------------------------------------


def _interrupt(signo: int) -> None:
    """Send *signo* to this process, and let the main thread run its handler."""
    os.kill(os.getpid(), signo)
    deadline = time.monotonic() + 30  # a loaded machine: the outcome, not the time, counts
    while time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize(
    ("signo", "status"),
    [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129), (signal.SIGQUIT, 131)],
)
@pytest.mark.usefixtures("handlers")
def test_an_interrupt_while_waiting_raises_interrupted(signo: int, status: int) -> None:
    """INT, TERM, HUP, QUIT: `Interrupted`, 128+N, saying nothing is held."""
    lines: list[str] = []
    with pytest.raises(Interrupted) as raised, interruptible(NAME, lines.append):
        _interrupt(signo)
    name = signal.Signals(signo).name
    assert raised.value.exit_code == status
    assert str(raised.value) == f"{name} while waiting for {NAME}; nothing is held"
    assert lines == []


@pytest.mark.parametrize("signo", [signal.SIGUSR1, signal.SIGUSR2])
@pytest.mark.usefixtures("handlers")
def test_usr_signals_while_waiting_are_logged_and_dropped(signo: int) -> None:
    """No command yet to pass USR1 or USR2 to: -v notes it, the wait goes on."""
    lines: list[str] = []
    with interruptible(NAME, lines.append):
        signal.pthread_kill(threading.get_ident(), signo)  # the handler runs right after
    name = signal.Signals(signo).name
    assert lines == [f"{name} while waiting for {NAME}: no command yet to pass it to; dropped"]


@pytest.mark.usefixtures("handlers")
def test_interruptible_puts_back_the_handlers_it_found() -> None:
    """A wait that ended without the lock leaves this process's signals as they were."""
    before = {signo: signal.getsignal(signo) for signo in FORWARDED}
    with interruptible(NAME, hold.quiet) as waiting:
        assert all(signal.getsignal(signo) is not before[signo] for signo in FORWARDED)
        assert not waiting.over
    assert {signo: signal.getsignal(signo) for signo in FORWARDED} == before


@pytest.mark.usefixtures("handlers")
def test_once_held_the_signals_are_left_ignored() -> None:
    """After the command ran, a late TERM cannot replace its status: ignored, not raised."""
    lines: list[str] = []
    with interruptible(NAME, lines.append) as waiting:
        waiting.over = True
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # nothing raised
    assert all(signal.getsignal(signo) is signal.SIG_IGN for signo in FORWARDED)
    assert lines == []


@pytest.mark.usefixtures("handlers")
def test_a_hangup_ignored_under_nohup_stays_ignored() -> None:
    """The HUP nohup ignores: neither an interrupt for us nor a signal for the command."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with interruptible(NAME, hold.quiet) as waiting:
        assert waiting.ignored == frozenset({signal.SIGHUP})
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.pthread_kill(threading.get_ident(), signal.SIGHUP)  # nothing raised
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN


@pytest.mark.usefixtures("handlers")
def test_nothing_ignored_means_nothing_kept_from_the_command() -> None:
    """With no signal ignored, none is noted as such."""
    with interruptible(NAME, hold.quiet) as waiting:
        assert waiting.ignored == frozenset()


def test_the_interrupts_are_int_term_hup_and_quit() -> None:
    """USR1 and USR2 are forwarded to a command but never end a wait."""
    assert frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}) == INTERRUPTS
    assert INTERRUPTS < FORWARDED


@pytest.mark.usefixtures("handlers")
def test_deferred_drops_the_signals_that_arrived() -> None:
    """USR1 sent inside is pending there, and never handled after: dropped, mask restored."""
    caught: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signo, _frame: caught.append(signo))
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    with deferred(frozenset({signal.SIGUSR1})):
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        assert signal.SIGUSR1 in signal.sigpending()
    assert caught == []
    assert signal.SIGUSR1 not in signal.sigpending()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before


@pytest.mark.usefixtures("handlers")
def test_deferred_blocks_only_the_signals_it_was_given() -> None:
    """USR2, not deferred, is handled inside as ever."""
    caught: list[int] = []
    signal.signal(signal.SIGUSR2, lambda signo, _frame: caught.append(signo))
    with deferred(frozenset({signal.SIGUSR1})):
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
        assert caught == [signal.SIGUSR2]


@pytest.mark.usefixtures("handlers")
def test_deferred_keeps_a_signal_blocked_before_it_blocked() -> None:
    """A signal the caller had blocked already stays blocked after the block."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    with deferred(frozenset({signal.SIGUSR1})):
        pass
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    assert signal.SIGUSR2 in mask
    assert signal.SIGUSR1 not in mask


def test_signal_masks_are_set_without_enum_conversions() -> None:
    """The hand-over path's masks come back as plain numbers, and go back in unchanged.

    ``signal.pthread_sigmask`` returns ``Signals`` members, an enum lookup each (issue 32).
    """
    blocked = {signal.SIGUSR1, signal.SIGUSR2}
    saved = pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        now_blocked = pthread_sigmask(signal.SIG_BLOCK, ())
        assert all(type(signo) is int for signo in now_blocked)
        assert {int(signo) for signo in blocked} <= now_blocked
    finally:
        pthread_sigmask(signal.SIG_SETMASK, saved)
    assert pthread_sigmask(signal.SIG_BLOCK, ()) == saved
    assert all(type(signo) is int for signo in valid_signals())
