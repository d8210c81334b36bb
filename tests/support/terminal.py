"""A program on a pseudo-terminal, for tests of what a person at a terminal sees."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import termios
import time
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path
    from types import TracebackType


def _control_terminal() -> None:
    """In the child, after setsid: make stdin, the pty, our controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """Run *argv* with a pty as its controlling terminal; collect everything it writes."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None = None,
        columns: int = 100,
    ) -> None:
        """Start *argv* in its own session, the pty's slave as stdin, stdout and stderr."""
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        self.process = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**env, "TERM": "xterm"},
            cwd=cwd,
            start_new_session=True,  # setsid, then the pty becomes its controlling terminal
            preexec_fn=_control_terminal,  # noqa: PLW1509 - an ioctl, no lock taken
        )
        os.close(slave)
        self.output = b""

    def send(self, data: bytes) -> None:
        """Type *data*."""
        os.write(self.master, data)

    def read_until(self, wanted: bytes, timeout: float = 20.0, *, count: int = 1) -> bytes:
        """Read until *wanted* has appeared *count* times; return all output so far."""
        deadline = time.monotonic() + timeout
        while self.output.count(wanted) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"never saw {wanted!r}; the terminal shows {self.output!r}"
            assert self._read(left), f"the terminal closed before {wanted!r}: {self.output!r}"
        return self.output

    def read_to_end(self, timeout: float = 20.0) -> bytes:
        """Read until the program has exited and closed the terminal; return all output."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the program is still running; it showed {self.output!r}"
            if not self._read(left):
                self.process.wait(timeout=left)
                return self.output

    def _read(self, timeout: float) -> bool:
        """Add what the terminal shows within *timeout* to `output`; False once it closed."""
        if select.select([self.master], [], [], timeout)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every process closed the slave
                return False
            self.output += chunk
            return bool(chunk)
        return True

    def __enter__(self) -> Self:
        """Use the terminal in a ``with`` block."""
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Kill the program if it still runs and close the pty."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        os.close(self.master)


def press_tab(
    shell: Sequence[str], setup: str, typed: str, wanted: str, *, env: Mapping[str, str]
) -> bytes:
    """In an interactive *shell*, run *setup*, type *typed* and Tab; wait for *wanted*.

    *setup* must end by echoing ``ready-0``: that is how we know the shell is done with it.
    """
    with Terminal(shell, env=env) as term:
        term.send(f"{setup}\n".encode())
        term.read_until(b"ready-0")
        term.send(f"{typed}\t".encode())
        return term.read_until(wanted.encode())
