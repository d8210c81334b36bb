"""A holder's take-over bell on etcd: a watch on the lock's stop keys, rung by a thread (A13).

The watch's socket cannot be the bell itself: the supervisor watches a bell from the
grant to the release, and a watch is made again after a member goes or a compaction. A
thread of the lease reads the watch and writes an eventfd, as the Redis backend's bell
does (docs/design.md A4); the lease's refresh reads the stop keys and decides.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import TYPE_CHECKING, Final

from lockrun.backends.etcd.gateway import Refused, Unreachable
from lockrun.errors import BackendUnavailable
from lockrun.timing import RECONNECT_INTERVAL

if TYPE_CHECKING:
    from lockrun.backends.etcd.gateway import Gateway, Watch

# A watch with nothing to say for this long is made again (the same revision on): a member
# gone silent without a hang-up is left within it. The renewals read the stop keys meanwhile.
_QUIET: Final = 300.0
_CUT_AGAIN: Final = 0.05  # seconds between two cuts of the watch while the thread ends
# How long a run goes before its bell's watch is made: a connection and a request to etcd
# that a run shorter than this never pays (as file:'s bell, `supervise.LOCAL_BELL_AFTER`).
# Nothing is missed: the watch starts from the grant's revision, and hears what came since.
WATCH_AFTER: Final = 0.1


class Bell:
    """An eventfd that turns readable when a take-over request may have been put."""

    def __init__(self, gateway: Gateway, prefix: bytes, revision: int) -> None:
        """Watch ``PREFIX t…`` (``t/`` and ``tr/``) from *revision* + 1 on, in a thread."""
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._gateway = gateway
        self._range = (prefix + b"t", prefix + b"u")
        self._next = revision + 1
        self._quit = threading.Event()
        self._watch: Watch | None = None
        self._thread = threading.Thread(target=self._run, name="lockrun-etcd-bell", daemon=True)
        # The supervisor takes its signals with them blocked (sigtimedwait): a thread that
        # left one unblocked could be handed it.
        saved = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            self._thread.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, saved)

    def heard(self) -> None:
        """Take the ring back: the refresh under way answers it."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def _run(self) -> None:
        """Watch, ring for each put, and watch again from after the last event read."""
        if self._quit.wait(WATCH_AFTER):
            return
        while not self._quit.is_set():
            watch = self._gateway.watch()
            self._watch = watch
            if self._quit.is_set():
                break
            try:
                watch.start(*self._range, self._next)
            except (Unreachable, Refused, BackendUnavailable):
                watch.close()
                self._quit.wait(RECONNECT_INTERVAL)
                continue
            while watch.open and not self._quit.is_set():
                moved = watch.moved(_QUIET)
                if moved == "changed":
                    os.eventfd_write(self.fd, 1)
                elif not moved:  # quiet for long: made again, past a member gone silent
                    watch.close()
            self._next = max(self._next, watch.seen + 1, watch.compacted)
            watch.close()

    def close(self) -> None:
        """Stop the thread and close the eventfd."""
        self._quit.set()
        while self._thread.is_alive():  # a watch made as we cut the last one is cut too
            watch = self._watch
            if watch is not None:
                watch.cut()
            self._thread.join(_CUT_AGAIN)
        os.close(self.fd)
