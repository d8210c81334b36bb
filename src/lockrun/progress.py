"""What ``-v`` says while lockrun waits: who holds the lock, how many are ahead, how long.

On a terminal it is one live line, redrawn every second; elsewhere (cron mails it) plain
lines, one when the wait begins and one whenever the holder changes. The backend's own
connection is busy waiting, so the holder and the queue are read over a second one.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Final

from lockrun.backends import Backend, Holder, LockState, Request, open_backend
from lockrun.sigmask import pthread_sigmask, valid_signals
from lockrun.timing import clock_time, format_duration, now

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from lockrun.uri import LockURI

TICK: Final = 1.0  # seconds between redraws of the live line
LIVE_STATUS: Final = 2.0  # seconds between status reads for the live line
PLAIN_STATUS: Final = 5.0  # … and for plain lines
SHOWN_HOLDERS: Final = 2  # a semaphore's line names this many holders, then "and N more"


def holders_text(holders: Sequence[Holder]) -> str:
    """Say who holds a lock, for people: ``vm:21883 since 12:03:04, vm:42 … and 1 more``."""
    named = [
        f"{holder.host}:{holder.pid}"
        + (" (shared)" if holder.shared else "")
        + (
            f" until {clock_time(holder.until)} (--hold-at-least)"
            if holder.until is not None
            else ("" if holder.since is None else f" since {clock_time(holder.since)}")
        )
        + (" (no process)" if holder.detached else "")
        for holder in holders[:SHOWN_HOLDERS]
    ]
    more = len(holders) - len(named)
    return ", ".join(named) + (f" and {more} more" if more else "")


def position_text(waiters: Sequence[Holder], me: Holder, *, queued: bool) -> str:
    """Say where *me* stands among *waiters* (all of them are ahead if not *queued* yet)."""
    mine = [i for i, waiter in enumerate(waiters) if (waiter.host, waiter.pid) == me[:2]]
    if queued and not mine:
        return ""  # the service does not show us (yet): say nothing rather than guess
    ahead = mine[0] if mine else len(waiters)
    return "next in line" if ahead == 0 else f"{ahead} ahead of you"


class WaitReport:
    """Report a wait until `stop`; *live* redraws one line (a terminal), else *log* lines."""

    def __init__(
        self,
        request: Request,
        uri: LockURI,
        *,
        log: Callable[[str], None],
        live: Callable[[str], None] | None,
    ) -> None:
        """Prepare to report *request*'s wait at *uri*; nothing runs before `start`."""
        self.request = request
        self.uri = uri
        self.log = log
        self.live = live
        self.started = now()
        self.holders = ""  # "vm:21883 since 12:03:04"
        self.position = ""  # "2 ahead of you"
        self._drawn = False  # whether the live line is on the screen
        self._stopped = threading.Event()
        self._drawing = threading.Lock()  # the last redraw cannot follow stop's erase
        self._thread = threading.Thread(target=self._run, name="lockrun-progress", daemon=True)

    def start(self, states: Sequence[LockState]) -> None:
        """Report a wait if *states*, read before queueing, show one: slots all held, or a queue."""
        holders = sum(len(state.holders) for state in states)
        if holders < self.request.slots and not any(state.waiters for state in states):
            return
        self._update(states, queued=False)
        if self.live is None:
            self.log(self._line(f"waiting for {self.request.name} ({self.uri.redacted})"))
        else:
            self._draw()
        # The thread starts with every signal blocked, so none is ever delivered to it: the
        # supervisor waits for SIGCHLD with sigwaitinfo, and a thread still finishing a
        # slow status read would take (and drop) a process-directed one.
        saved = pthread_sigmask(signal.SIG_BLOCK, valid_signals())
        try:
            self._thread.start()
        finally:
            pthread_sigmask(signal.SIG_SETMASK, saved)

    def stop(self) -> None:
        """Stop reporting and erase the live line; never waits for the thread.

        A status read in flight ends on its own, and the thread then closes its connection:
        the command must not wait for a report.
        """
        self._stopped.set()  # first: even if a signal cuts this short, nothing is drawn again
        with self._drawing:
            if self.live is not None and self._drawn:
                self.live("")

    def _run(self) -> None:
        backend: Backend | None = None
        interval = PLAIN_STATUS if self.live is None else LIVE_STATUS
        asked = now()
        try:
            while not self._stopped.wait(TICK if self.live else interval):
                if now() - asked >= interval - TICK / 2:
                    asked = now()
                    backend = backend or self._open()
                    before = self.holders
                    if backend is not None:
                        self._update(self._status(backend), queued=True)
                    if self.live is None and self.holders != before:
                        self._say(self._line(f"waiting for {self.request.name}"))
                self._draw()
        except Exception:  # noqa: BLE001 - only a report (a holder record we cannot read)
            return
        finally:
            if backend is not None:
                with contextlib.suppress(Exception):
                    backend.close()

    def _open(self) -> Backend | None:
        try:
            return open_backend(self.uri, ttl=self.request.ttl, warn=_ignore, note=_ignore)
        except Exception:  # noqa: BLE001 - only a report: the wait goes on without it
            return None

    def _status(self, backend: Backend) -> list[LockState]:
        try:
            return backend.status(self.request.namespace, self.request.name)
        except Exception:  # noqa: BLE001 - only a report: keep what we knew
            return []

    def _update(self, states: Sequence[LockState], *, queued: bool) -> None:
        if not states:  # the status read failed: keep what we knew
            return
        holders = [holder for state in states for holder in state.holders]
        waiters = [waiter for state in states for waiter in state.waiters]
        self.holders = holders_text(holders)
        self.position = position_text(waiters, self.request.holder, queued=queued)

    def _line(self, head: str) -> str:
        held = f"held by {self.holders}" if self.holders else ""
        return " — ".join(part for part in (head, held, self.position) if part)

    def _say(self, line: str) -> None:
        with self._drawing:
            if not self._stopped.is_set():  # never after the wait: the command has the stage
                self.log(line)

    def _draw(self) -> None:
        if self.live is None:
            return
        with self._drawing:
            if not self._stopped.is_set():
                elapsed = format_duration(int(now() - self.started))  # whole seconds tick
                self._drawn = True  # first: a signal may end the wait in the middle of live()
                self.live(self._line(f"waiting for {self.request.name}") + f" — {elapsed}")


def _ignore(_line: str) -> None:
    pass
