"""An independent witness of who runs under the lock: the kernel tells it, not lockrun.

Each command under test is a bash script whose first act is to connect to `Oracle` over
loopback TCP and say who it is (pid, parent, fence, slot, tag). Its socket stays open until
the process is gone, however it ends, TERM or SIGKILL included, because the kernel closes
it then. The oracle's thread records a start at each connection and an end at each
hang-up, so how many commands run at once is known without asking lockrun or its backend.

Counting is exact, not merely likely: each round of events reads every socket with
something to say to its end (a line and a hang-up may come together) first, then accepts
one connection only. The connection accepted is the oldest waiting, which was waiting
already when the round's `select` returned, so every hang-up that happened before it
connected has been counted. One that happened after is a real overlap. What it cannot see
is a command's first milliseconds, before it connects: the commands connect first thing.
"""

from __future__ import annotations

import contextlib
import selectors
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable
    from pathlib import Path

import pytest


@dataclass
class Run:
    """One command's life as the oracle saw it (times from `time.monotonic`)."""

    start: float
    tag: str = ""
    pid: int = 0  # 0: killed before it said who it is
    ppid: int = 0  # its lockrun
    fence: int = 0
    slot: int = -1
    end: float | None = None
    running_at_start: int = 0  # commands running once this one started, itself included
    sock: socket.socket | None = field(default=None, repr=False)

    @property
    def length(self) -> float:
        """How long it ran (so far)."""
        return (time.monotonic() if self.end is None else self.end) - self.start


class Oracle:
    """Count the commands running at once, from their connections' lives."""

    def __init__(self, listener: socket.socket | None = None) -> None:
        """Listen on *listener*, else on a free loopback port, and start the thread."""
        self._listener = listener or socket.create_server(("127.0.0.1", 0), backlog=512)
        self._listener.setblocking(False)  # noqa: FBT003 - the socket API
        inet = self._listener.family in {socket.AF_INET, socket.AF_INET6}
        self.port: int = self._listener.getsockname()[1] if inet else 0
        self.runs: list[Run] = []  # in the order they started
        self.running = 0
        self.peak = 0
        self._lines: dict[socket.socket, bytes] = {}
        self._by_sock: dict[socket.socket, Run] = {}
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="oracle", daemon=True)
        self._thread.start()

    def command(self, tag: str = "", *, hold: float | None = None) -> list[str]:
        """Return the argv of a command that reports to us, then holds.

        It holds until `release` or, with *hold*, for that many seconds at most.
        """
        timeout = "" if hold is None else f"-t {hold:g} "
        # {oracle}: bash opens the socket on a free descriptor of 10 or more. A fixed `3`
        # would replace the lock file that `file:` passes on when it happens to be fd 3,
        # and the command would run on without its share of the lock once lockrun died.
        script = (
            f"exec {{oracle}}<>/dev/tcp/127.0.0.1/{self.port} || exit 99; "
            f'echo "$$ $PPID ${{LOCKRUN_FENCE:-0}} ${{LOCKRUN_SLOT:--1}} {shlex.quote(tag)}"'
            ' >&"$oracle"; '
            f'read -r {timeout}-u "$oracle" _; exit 0'
        )
        return ["bash", "-c", script]

    def hold(
        self,
        spawn: Callable[..., subprocess.Popen[str]],
        tag: str,
        *options: str,
        wrap: Callable[[list[str]], list[str]] = list,
        log: Path | None = None,
        **kwargs: Any,
    ) -> tuple[subprocess.Popen[str], Run]:
        """Start ``lockrun OPTIONS -- <our command>`` (*wrap*ped) and wait until it runs.

        With a short lease every call may take only a fraction of it; a machine busy with
        other tests can miss that while lockrun acquires, before anything under test
        happens. Such a 69 is tried again, twice; any other early exit fails the test.
        With *log*, lockrun's stderr goes to the end of that file.
        """
        for attempt in range(3):
            label = f"{tag}{attempt or ''}"
            with contextlib.ExitStack() as stack:
                if log is not None:
                    kwargs["stderr"] = stack.enter_context(log.open("a"))
                process = spawn(*options, "--", *wrap(self.command(label)), **kwargs)
            if started := self.started_or_ended(label, process, 30):
                return process, started
            _, err = process.communicate(timeout=10)
            err = log.read_text() if log is not None else err or ""
            if process.returncode != 69:
                break
            print(f"lockrun could not acquire, trying again: {err}")
        pytest.fail(f"{tag} did not start (status {process.returncode}): {err}")

    def release(self, run: Run) -> None:
        """Tell a holding command to exit 0."""
        with contextlib.suppress(OSError):
            assert run.sock is not None
            run.sock.sendall(b"go\n")

    def wait(self, condition: object, timeout: float, what: str) -> None:
        """Poll *condition* (a callable) until true; fail the test after *timeout* seconds."""
        assert callable(condition)
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.005)

    def started(self, tag: str) -> list[Run]:
        """Return the runs that said *tag*."""
        with self._lock:
            return [run for run in self.runs if run.tag == tag]

    def wait_started(self, tag: str, timeout: float = 30) -> Run:
        """Wait until a command tagged *tag* has said who it is; return its run."""
        self.wait(lambda: any(run.pid for run in self.started(tag)), timeout, f"{tag} to start")
        return next(run for run in self.started(tag) if run.pid)

    def started_or_ended(
        self, tag: str, process: subprocess.Popen[str], timeout: float
    ) -> Run | None:
        """Wait until the command tagged *tag* runs (return it) or *process* exits (None)."""
        self.wait(
            lambda: any(run.pid for run in self.started(tag)) or process.poll() is not None,
            timeout,
            f"{tag} to start",
        )
        return next((run for run in self.started(tag) if run.pid), None)

    def wait_ended(self, run: Run, timeout: float = 30) -> float:
        """Wait until *run* ended; return when."""
        self.wait(lambda: run.end is not None, timeout, f"{run.tag or run.pid} to end")
        assert run.end is not None
        return run.end

    def overlaps(self) -> list[tuple[Run, Run]]:
        """Return every pair of runs that ran at the same time, earlier one first."""
        with self._lock:
            runs = sorted(self.runs, key=lambda run: run.start)
        pairs = []
        for i, first in enumerate(runs):
            for second in runs[i + 1 :]:
                if first.end is not None and second.start >= first.end:
                    continue
                pairs.append((first, second))
        return pairs

    def close(self) -> None:
        """Stop the thread and close every socket."""
        self._stopping.set()
        self._thread.join(10)
        for sock in [self._listener, *self._by_sock]:
            sock.close()
        self._selector.close()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            events = self._selector.select(timeout=0.05)
            listening = False
            for key, _ in events:
                if key.fileobj is self._listener:
                    listening = True
                else:
                    assert isinstance(key.fileobj, socket.socket)
                    self._read(key.fileobj)
            if listening:
                self._accept_one()

    def _accept_one(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            run = Run(start=time.monotonic(), running_at_start=self.running, sock=sock)
            self.runs.append(run)
        self._by_sock[sock] = run
        self._lines[sock] = b""
        sock.setblocking(False)  # noqa: FBT003 - the socket API
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, sock: socket.socket) -> None:
        """Take all the socket has: its line, and its hang-up if that came too."""
        run = self._by_sock[sock]
        while True:
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                break
            self._lines[sock] += data
            line = self._lines[sock]
            if b"\n" in line and not run.pid:
                pid, ppid, fence, slot, *tag = line.split(b"\n", 1)[0].decode().split(" ", 4)
                run.pid, run.ppid, run.fence, run.slot = int(pid), int(ppid), int(fence), int(slot)
                run.tag = tag[0] if tag else ""
        self._selector.unregister(sock)
        with self._lock:
            self.running -= 1
            run.end = time.monotonic()
        del self._by_sock[sock], self._lines[sock]
        run.sock = None
        sock.close()
