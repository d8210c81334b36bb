"""Hold one lock across several steps: `lockrun acquire`, `release` and `renew`.

`acquire` forks a keeper before anything is opened. The keeper takes the lock as a run
would (the same wait, progress lines and statuses), so the holder record and `lockrun
status` name the keeper's own pid. It hands its token to the parent over a socket pair
and, once the parent has written it, detaches and holds the lock: it renews the lease every
ttl/3, hears take-over bells, and watches its owner's pidfd. `release` and `renew` reach it
through its door, a Linux abstract socket named by the token, which answers only the
acquiring user or root, and only with the token's secret (docs/security.md).
docs/semantics.md "Holding a lock across steps" is the contract.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import select
import signal
import socket
import time
from typing import TYPE_CHECKING, Final, NamedTuple, Self

from lockrun.backends import Request, open_backend, parse_uri
from lockrun.door import (
    ACK,
    BUSY,
    HELD,
    MAX_REPLY,
    MAX_REQUEST,
    NACK,
    Grant,
    Token,
    answer,
    grant_message,
    peer_uid,
    read_grant,
    read_request,
)
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    ExitCode,
    Interrupted,
    LeaseLost,
    LockrunError,
    OutputError,
    TakenOver,
    TimedOut,
)
from lockrun.hold import (
    INTERRUPTS,
    acquired,
    interruptible,
    make_request,
    quiet,
    release,
    report_for,
    take,
    unheard,
)
from lockrun.lock import Lease as Held
from lockrun.names import check_name
from lockrun.processes import stat_of
from lockrun.runner import check_options
from lockrun.section import KEEPER_NAME, Section, watch_owner
from lockrun.sigmask import pthread_sigmask
from lockrun.supervise import FORWARDED, hung_up, readable
from lockrun.timing import clock_time, format_duration, now

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from collections.abc import Set as AbstractSet

    from lockrun.backends import Lease
    from lockrun.runner import Options
    from lockrun.uri import LockURI

PATIENCE: Final = 2.0  # how long the keeper waits for a client's request
CLIENTS: Final = 8  # connections served at once; more are hung up on
LINGER: Final = 3600.0  # how long a keeper whose lock ended waits to tell why
_PR_SET_PDEATHSIG: Final = 1  # prctl(2)
_PR_SET_NAME: Final = 15  # prctl(2)
RESCAN: Final = 1.0  # how often a keeper whose owner is gone looks for new section processes


# -- acquire: the parent ----------------------------------------------------------------------


def acquire(
    options: Options,
    owner: int | None,
    deliver: Callable[[Grant], None],
    *,
    log: Callable[[str], None],
    live: Callable[[str], None] | None = None,
    private: Sequence[int] = (),
) -> int:
    """Take the lock of *options* in a keeper process; return the status to exit with.

    *deliver* writes the token (stdout, an env file), in this process; an `OutputError`
    from it releases the lock. *private* are descriptors of ours that the keeper closes.
    This forks: in the keeper it returns only once the keeper ends. What it raises maps to
    an exit status (docs/semantics.md "Exit status").
    """
    uri = parse_uri(options.uri)
    check_options(options, uri)
    name = check_name(options.name or "")
    check_name(options.namespace, "namespace")
    pidfd = watch_owner(owner, options)
    section = None if owner is None else Section.of(owner)  # while the owner surely lives
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    # No handler of ours may run in the child before its own are set (_interruptible).
    saved = pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = os.fork()
    if child == 0:
        ours.close()
        for fd in private:
            os.close(fd)
        keeper = _Child(options, uri, _Parent(parent, theirs, saved), owner, pidfd, section)
        return keeper.run(log=log, live=live)
    theirs.close()
    if pidfd is not None:
        os.close(pidfd)
    return _relay(ours, child, name, deliver, saved)


def _relay(
    link: socket.socket,
    child: int,
    name: str,
    deliver: Callable[[Grant], None],
    saved: AbstractSet[int],
) -> int:
    """In the parent: pass signals on to the keeper while it waits, and its token on."""
    relaying = [True]

    def forward(signo: int, _frame: object) -> None:
        if relaying[0]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signo)

    for signo in INTERRUPTS:
        if signal.getsignal(signo) is not signal.SIG_IGN:  # nohup's HUP stays ignored
            signal.signal(signo, forward)
    for signo in FORWARDED - INTERRUPTS:  # USR1, USR2: dropped while waiting, as by a run
        signal.signal(signo, signal.SIG_IGN)
    pthread_sigmask(signal.SIG_SETMASK, saved)
    with link:
        grant = read_grant(link.recv(MAX_REPLY))
        if grant is None:  # the keeper ended without the lock, and said why on stderr
            return _child_status(child, name)
        try:
            deliver(grant)
        except OutputError as err:
            with contextlib.suppress(OSError):
                link.send(NACK)
            with contextlib.suppress(LockrunError):
                _child_status(child, name)  # it has released the lock
            raise OutputError(f"{name}: {err}; released the lock") from None
        try:
            link.send(ACK)
            kept = link.recv(16) == HELD
        except OSError:
            kept = False
        relaying[0] = False
        if not kept:  # a signal or its owner's end stopped it first: it released
            return _child_status(child, name)
    return 0


def _child_status(child: int, name: str) -> int:
    """Reap the keeper that ended and return its status; `Interrupted` if a signal killed it."""
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        what = signal.Signals(-code).name
        msg = f"{name}: the keeper was killed by {what}; nothing is held"
        raise Interrupted(msg, signo=-code)
    # Ended without handing a token over, and said why on stderr: busy (-E, which may be 0),
    # or any other status of a run that never held the lock.
    return code


# -- acquire: the keeper ----------------------------------------------------------------------


class _Parent(NamedTuple):
    """The process that forked the keeper: who, the socket to it, its signal mask."""

    pid: int
    link: socket.socket
    mask: AbstractSet[int]


class _Child:
    """The forked keeper: wait for the lock, hand the token over, detach and hold it."""

    def __init__(
        self,
        options: Options,
        uri: LockURI,
        parent: _Parent,
        owner: int | None,
        pidfd: int | None,
        section: Section | None,
    ) -> None:
        self.options = options
        self.uri = uri
        self.parent = parent
        self.owner = owner  # the pid, for the record
        self.pidfd = pidfd
        self.section = section

    def run(self, *, log: Callable[[str], None], live: Callable[[str], None] | None) -> int:
        """Take the lock, then keep it until something ends the keeper; return its status."""
        options = self.options
        name = options.name or ""
        verbose = log if options.verbose else quiet
        os.setpgid(0, 0)  # our own group: a Ctrl-C reaches the parent, which passes it on once
        _die_with(self.parent.pid)
        _prctl(_PR_SET_NAME, KEEPER_NAME)
        _close_inherited({self.parent.link.fileno(), *([self.pidfd] if self.pidfd else [])})
        owner = "none" if self.owner is None else str(self.owner)
        holder = ("lockrun", "acquire", "--owner", owner, name)
        request = make_request(options, options.namespace, name, holder)
        report = None
        with interruptible(name, verbose):
            pthread_sigmask(signal.SIG_SETMASK, self.parent.mask)  # a TERM ends the wait
            backend = open_backend(self.uri, ttl=options.ttl, warn=log, note=verbose)
            try:
                report = report_for(options, request, self.uri, log, live)
                started = now()
                lease = take(backend, request, options.wait, report)
            except BaseException:
                backend.close()
                raise
            pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # ours from here on
        try:
            if report is not None:
                report.stop()
            verbose(acquired(request, lease, started))
            try:
                keeper = _Keeper(options, request, lease, self.pidfd, verbose, self.section)
            except BaseException:  # no door: nobody could release it
                release(lease, request, now(), 0.0, verbose)
                raise
            try:
                with _Signals() as keeper.signals:
                    self._hand_over(keeper)
                    if not keeper.finished:
                        keeper.run()
            finally:
                keeper.close()
            return keeper.status
        finally:
            backend.close()

    def _hand_over(self, keeper: _Keeper) -> None:
        """Give the parent the token; detach once it says it wrote it, else release."""
        link = self.parent.link
        link.send(grant_message(Grant(keeper.token, keeper.lease.fence)))
        self._await_answer(keeper)
        if link.recv(16) != ACK:  # the parent could not write it (and says so), or died
            keeper.finish()
            return
        # Our group of its own (made at the fork) keeps the signals of the script's group
        # (Ctrl-C, timeout(1), a CI runner's cancel) from us: its owner's end ends us.
        _die_with(None)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the parent's stdout may be a $(…) that waits for its end
            os.dup2(null, fd)
        os.close(null)
        with contextlib.suppress(OSError):
            link.send(HELD)
        link.close()

    def _await_answer(self, keeper: _Keeper) -> None:
        """Wait for the parent's answer; release and raise if the owner or a signal ends us."""
        poll = select.poll()
        for fd in (self.parent.link.fileno(), keeper.signals.fd, self.pidfd):
            if fd is not None:
                poll.register(fd, select.POLLIN)
        ready: set[int] = set()
        while self.parent.link.fileno() not in ready:  # the owner's end and signals first
            ready = {fd for fd, _ in poll.poll()}
            if self.pidfd in ready:
                keeper.finish()
                msg = f"{keeper.name}: its owner (pid {self.owner}) exited; released the lock"
                raise LeaseLost(msg)
            if keeper.signals.fd in ready and (signo := keeper.end_on_signals()):
                what = signal.Signals(signo).name
                msg = f"{what} before the token of {keeper.name} was handed over; released it"
                raise Interrupted(msg, signo=signo)


def _die_with(parent: int | None) -> None:
    """Have the kernel TERM us when *parent* dies (None: no longer): prctl(2) PDEATHSIG.

    While the keeper waits, a parent killed with SIGKILL must not leave it waiting, or
    holding a lock whose token nobody received.
    """
    _prctl(_PR_SET_PDEATHSIG, 0 if parent is None else signal.SIGTERM)
    if parent is not None and os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _prctl(option: int, argument: int | bytes) -> None:
    """Call prctl(2) with one argument (bytes: a C string)."""
    import ctypes  # noqa: PLC0415 - only keepers pay for it

    ctypes.CDLL(None, use_errno=True).prctl(option, argument, 0, 0, 0)


def _close_inherited(keep: set[int]) -> None:
    """Close what we inherited from the shell (a `flock 9`'s fd 9, a pipe's end) but *keep*.

    Inherited descriptors are the inheritable ones: Python opens its own close-on-exec.
    """
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd > 2 and fd not in keep:  # noqa: PLR2004 - past stdin, stdout and stderr
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    os.close(fd)


class _Signals:
    """INT, TERM, HUP and QUIT as bytes on a pipe the keeper polls (signal.set_wakeup_fd)."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wakeup = -1

    def __enter__(self) -> Self:
        for signo in INTERRUPTS:
            if signal.getsignal(signo) is not signal.SIG_IGN:  # nohup's HUP stays ignored
                signal.signal(signo, _noted)
        for signo in FORWARDED - INTERRUPTS:  # USR1, USR2: there is no command to pass them
            signal.signal(signo, signal.SIG_IGN)
        self._wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # pending ones arrive now
        return self

    def __exit__(self, *_: object) -> None:
        pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        signal.set_wakeup_fd(self._wakeup)
        os.close(self.fd)
        os.close(self._write)

    def received(self) -> set[int]:
        """Return the signals of INTERRUPTS that arrived since the last call."""
        got: set[int] = set()
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self.fd, 64):
                got.update(data)
        return got & set(INTERRUPTS)


def _noted(_signo: int, _frame: object) -> None:
    """Do nothing: set_wakeup_fd has written the signal's number for the keeper's loop."""


class _Client(NamedTuple):
    connection: socket.socket
    deadline: float  # `now` by which it must have asked, or be hung up on


class _Keeper:
    """The detached keeper: its lease, door, owner and time limit, and why it ended."""

    signals: _Signals

    def __init__(
        self,
        options: Options,
        request: Request,
        lease: Lease,
        pidfd: int | None,
        verbose: Callable[[str], None],
        section: Section | None,
    ) -> None:
        self.options = options
        self.request = request
        self.name = request.name
        self.lease = lease
        self.held_since = now()
        # The Python API's lease: its renew() and check() keep the lease arithmetic.
        self.held: Held | None = Held(lease, ("", request.namespace, request.name))
        self.pidfd = pidfd
        self.verbose = verbose
        self.deadline = None if options.max_time is None else self.held_since + options.max_time
        self.every = options.ttl / 3  # as a run's supervisor: local locks too (their file)
        self.renew_at = lease.confirmed + self.every
        self.ended: LockrunError | None = None  # why the lock is no longer held, if it is not
        self.linger = 0.0  # when a keeper whose lock ended stops waiting to say why
        self.finished = False
        self.status = 0
        self.clients: dict[int, _Client] = {}
        self.watched: dict[int, str] = {}  # fd: what it is
        self.epoll = select.epoll()
        self.token, self.door = _open_door()
        token = f"={self.token}".encode()
        self.section = None if section is None else section._replace(token=token)
        self.steps: dict[int, int] = {}  # pidfd: pid, of the section once the owner is gone
        self.rescan_at: float | None = None  # when to look for more of them

    def run(self) -> None:
        """Hold the lock and serve the door until something ends the keeper."""
        self._watch(self.door.fileno(), "door", select.EPOLLIN)
        self._watch(self.signals.fd, "signals", select.EPOLLIN)
        if self.pidfd is not None:
            self._watch(self.pidfd, "owner", select.EPOLLIN)
        for fd in self.lease.sessions:  # the server hung up: the lock is gone at once
            self._watch(fd, "session", select.EPOLLRDHUP)
        for fd in self.lease.bells:  # a take-over may have been asked: renew now
            self._watch(fd, "bell", select.EPOLLIN | select.EPOLLET)
        while not self.finished:
            for fd, _ in self.epoll.poll(self._timeout()):
                if self._on(self.watched.get(fd, "client"), fd):
                    return
            self._tick()

    def _watch(self, fd: int, what: str, events: int) -> None:
        if fd not in self.watched:
            self.epoll.register(fd, events)
            self.watched[fd] = what

    def _unwatch(self, *kinds: str) -> None:
        for fd, kind in list(self.watched.items()):
            if kind in kinds:
                del self.watched[fd]
                with contextlib.suppress(OSError):  # a lost session's socket is closed already
                    self.epoll.unregister(fd)

    def _timeout(self) -> float:
        timers = [client.deadline for client in self.clients.values()]
        if self.rescan_at is not None:
            timers.append(self.rescan_at)
        if self.held is not None:
            timers.append(self.renew_at)
            if self.deadline is not None:
                timers.append(self.deadline)
        else:
            timers.append(self.linger)
        return max(0.0, min(timers) - now())

    def _on(self, what: str, fd: int) -> bool:
        """Act on *fd*, which is *what*, turning ready; return whether the keeper is done."""
        if what == "door":
            self._accept()
        elif what == "client":
            self._serve(fd)
        elif what == "signals":
            self.end_on_signals()
        elif what == "owner":
            self._unwatch("owner")
            self._follow_section()  # the script's shell is gone: its steps may not be
        elif what == "step":
            self._unwatch_step(fd)
            if not self.steps:
                self._follow_section()
        elif what == "session" and hung_up(self.lease.sessions):
            lost = "the session holding the lock ended (the server hung up); its locks are gone"
            self._lost(LeaseLost(lost))
        elif what == "bell":
            self._check(renew=False)  # check() renews if the bell is still readable
        return self.finished

    def _follow_section(self) -> None:
        """Hold, or linger once the lock ended, while the section lives (docs/semantics.md).

        Watched through pidfds; looked for again when the last one ends (its children are
        in /proc by then) and every `RESCAN` seconds.
        """
        if self.section is None:
            self.finish()  # nobody is left to ask why
            return
        for fd in [fd for fd in self.steps if readable([fd])]:  # ended, event or not
            self._unwatch_step(fd)
        known = set(self.steps.values())
        for pid, start in self.section.members().items():
            pidfd = None if pid in known else _pidfd_of(pid, start)
            if pidfd is not None:
                self.steps[pidfd] = pid
                self.watched.pop(pidfd, None)  # a number a closed session had: not it now
                self._watch(pidfd, "step", select.EPOLLIN)
        if self.steps:
            self.rescan_at = now() + RESCAN
        else:
            self.rescan_at = None
            self.finish()

    def _unwatch_step(self, fd: int) -> None:
        del self.steps[fd]
        del self.watched[fd]
        with contextlib.suppress(OSError):
            self.epoll.unregister(fd)
        os.close(fd)

    def _tick(self) -> None:
        """Do what is due: look for the section, hang up on the slow, renew, time out."""
        current = now()
        if self.rescan_at is not None and current >= self.rescan_at and not self.finished:
            self._follow_section()
        for fd in [fd for fd, client in self.clients.items() if current >= client.deadline]:
            self._hang_up(fd)
        if self.held is None:
            self.finished = current >= self.linger
        elif self._check(renew=current >= self.renew_at):
            self._time_out()

    def _time_out(self) -> None:
        """End the hold once --max-time (counted again by each `renew`) is up."""
        if self.deadline is not None and now() >= self.deadline:
            limit = format_duration(self.options.max_time or 0.0)
            self._lost(TimedOut(f"--max-time {limit} expired; the lock was released"))

    def _check(self, *, renew: bool) -> bool:
        """Renew if *renew*, and end the hold if the lease is gone; return whether held."""
        held = self.held
        if held is None:
            return False
        try:
            if renew:
                every = held.renew()
                due = self.every if held.ttl is None or every is None else every
                self.renew_at = now() + due
            held.check()
        except (LeaseLost, TakenOver) as err:
            self._lost(err)
            return False
        return True

    def _confirm(self) -> BackendUnavailable | None:
        """Renew with a round trip to the service; return why it is unconfirmed (None: it is).

        As `Held.renew`, but a doubt is told rather than kept: the renewals every ttl/3
        decide, as before, when an unconfirmed lease is lost.
        """
        held = self.held
        if held is None:
            return None
        err = held.confirm()  # bounded by the backend's timeouts, which fit the ttl
        if err is not None:
            return BackendUnavailable(
                f"{self.name}: the lock service did not confirm the lease now ({err}); the "
                "keeper holds on and renews, and gives the lock up if that fails for a ttl"
            )
        if held.lost is None:
            self.renew_at = held.clock.confirmed + self.every
        return None

    def _lost(self, why: LeaseLost | TakenOver | TimedOut) -> None:
        """Release what is left of the lock; stay a while to tell `release` *why*."""
        with contextlib.suppress(LockrunError):
            # A taker runs next and a lost lock is no one's: only --max-time keeps a window.
            self._give_back(leave_window=isinstance(why, TimedOut))
        self.ended = why.about(self.name)
        self.linger = now() + LINGER

    def _give_back(self, *, leave_window: bool) -> tuple[int, str]:
        """Release the lease (leaving the --hold-at-least window if *leave_window*).

        Return the status and line for `lockrun release`: 69 if the service never heard it
        (the lock then frees by itself).
        """
        if self.held is None:
            return 0, ""
        self.held = None
        self._unwatch("bell", "session")
        took = now() - self.held_since
        hold = self.options.hold_at_least if leave_window else 0.0
        if not release(self.lease, self.request, self.held_since, hold, self.verbose):
            return BackendUnavailable.exit_code, f"{self.name}: {unheard(self.name, took)}"
        left = f" (taken {format_duration(hold - took)} more: --hold-at-least)" * (hold > took)
        return 0, f"released {self.name} after {format_duration(took)}{left}"

    def finish(self) -> None:
        """Release (its window stays) and end: the owner exited, or the parent gave up."""
        self.finished = True
        with contextlib.suppress(LockrunError):
            self._give_back(leave_window=True)

    def end_on_signals(self) -> int:
        """End on INT, TERM, HUP or QUIT, releasing; return the signal (0: none came)."""
        got = self.signals.received()
        if not got:
            return 0
        signo = min(got)
        self.status = 128 + signo
        self.finish()
        return signo

    def _accept(self) -> None:
        """Take every waiting connection; hang up at once on other users and on a crowd."""
        allowed = {0, os.geteuid()}
        while True:
            try:
                connection, _ = self.door.accept()
            except OSError:  # none left (EAGAIN), the client gave up, or no fds left
                return
            connection.setblocking(False)  # noqa: FBT003 - the socket API
            if peer_uid(connection) not in allowed:
                answer(connection, ExitCode.NOPERM, "this keeper is another user's: not yours")
                connection.close()
            elif len(self.clients) >= CLIENTS:
                answer(connection, ExitCode.UNAVAILABLE, BUSY)
                connection.close()
            else:
                fd = connection.fileno()
                self.watched.pop(fd, None)  # a number a closed session had: not it any more
                self.clients[fd] = _Client(connection, now() + PATIENCE)
                self.epoll.register(fd, select.EPOLLIN)

    def _hang_up(self, fd: int) -> None:
        client = self.clients.pop(fd)
        with contextlib.suppress(OSError):
            self.epoll.unregister(fd)
        client.connection.close()

    def _serve(self, fd: int) -> None:
        """Answer one request of a client of ours, then hang up; never wait for it."""
        client = self.clients.get(fd)
        if client is None:
            return
        try:
            data = client.connection.recv(MAX_REQUEST + 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        request = read_request(data)
        if request is None:
            answer(client.connection, ExitCode.USAGE, "not a request a keeper answers")
        elif not hmac.compare_digest(request[1].encode(), self.token.secret.encode()):
            answer(client.connection, ExitCode.NOPERM, "the token's secret is wrong: not yours")
        else:
            answer(
                client.connection, *(self._release() if request[0] == "release" else self._renew())
            )
        self._hang_up(fd)

    def _release(self) -> tuple[int, str]:
        """Release for `lockrun release`, proving the lock was still ours; the keeper ends.

        A lease that a renewal has not yet found gone (a Redis key deleted a moment ago)
        would otherwise be reported as released: 0 means held until the release.
        """
        self.finished = True
        self._check(renew=True)
        if self.ended is not None:
            return self.ended.exit_code, str(self.ended)
        try:
            return self._give_back(leave_window=True)
        except LockrunError as err:
            return err.exit_code, f"{self.name}: {err}"

    def _renew(self) -> tuple[int, str]:
        """Prove the lock ours now and count --max-time from now, for `lockrun renew`.

        A renewal on the service, now (docs/semantics.md): 0 only once it answered; 69 if
        it did not (unreachable, partitioned, slow), while the keeper holds on and renews.
        """
        doubt = self._confirm() if self.ended is None else None
        if doubt is not None:
            return doubt.exit_code, str(doubt)
        if self.ended is None and self._check(renew=False):
            if self.options.max_time is None:
                return 0, f"{self.name} is held"
            self.deadline = now() + self.options.max_time
            return 0, f"{self.name} is held, until {_clock(self.deadline)} unless renewed"
        ended = self.ended or LeaseLost(f"{self.name}: not held")
        return ended.exit_code, str(ended)

    def close(self) -> None:
        """Let go of everything: the lease if still held, the door, its clients."""
        with contextlib.suppress(LockrunError):
            self._give_back(leave_window=True)
        for fd in list(self.clients):
            self._hang_up(fd)
        for fd in list(self.steps):
            self._unwatch_step(fd)
        self.door.close()
        self.epoll.close()


def _pidfd_of(pid: int, start: int) -> int | None:
    """Return a pidfd of the live process *pid* that started at *start* (None: not it)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # gone already
        return None
    info = stat_of(pid)  # read after the pidfd: still that process if it lives
    if info is None or info.start != start or readable([pidfd]):
        os.close(pidfd)
        return None
    return pidfd


def _open_door() -> tuple[Token, socket.socket]:
    """Listen on a fresh token's abstract name (a new one if that one is taken)."""
    for _ in range(8):
        token = Token.new()
        door = socket.socket(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        try:
            door.bind(token.door)
        except OSError as err:
            door.close()
            if err.errno == errno.EADDRINUSE:  # someone squats it: 64 random bits were guessed?
                continue
            raise ConfigError(f"cannot open the keeper's door: {err.strerror}") from None
        door.listen(CLIENTS)
        return token, door
    msg = "cannot open the keeper's door: every name tried was taken"
    raise ConfigError(msg)


def _clock(deadline: float) -> str:
    """Render a `now` deadline as the wall-clock time it falls on."""
    return clock_time(time.time() + deadline - now())


__all__ = ["acquire"]
