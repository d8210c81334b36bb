"""What lockrun writes: its ``lockrun: …`` lines, the live line, stdout, and no secret in any."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from typing import TYPE_CHECKING, Final

from lockrun.errors import OutputError
from lockrun.timing import clock_time
from lockrun.uri import HIDDEN, secrets_of

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lockrun.backends import Holder, LockState

# What a terminal would act on, or what would forge a line or a row: C0 and C1 controls
# (a line break in a name must not split the line cron mails), DEL, lone surrogates (not
# UTF-8: printing one would fail), bidirectional overrides and Unicode line separators.
_UNPRINTABLE: Final = (
    "[\x00-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]"
)
_SECRETS: Final[list[str]] = []  # the lock URI's, never to be printed (`hide`)


def printable(text: str) -> str:
    """Escape every character of *text* that a terminal would act on (an ESC, a line break)."""
    return re.compile(_UNPRINTABLE).sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code <= _LATIN1 else f"\\u{code:04x}"


_LATIN1: Final = 0xFF


def hide(text: str) -> str:
    """Replace each secret of the lock URI in use with ``***``: the last line of defence."""
    for secret in _SECRETS:
        text = text.replace(secret, HIDDEN)
    return text


def register_secret(uri: str) -> None:
    """Make `hide` hide the passwords of *uri* (those too short to hide anywhere excepted).

    User names are hidden from URIs (`redact`) and from what servers say (`scrub`); in
    lockrun's own words a user name like root or lockrun is no secret.
    """
    passwords = secrets_of(uri).passwords
    _SECRETS[:] = [secret for secret in passwords if len(secret) >= _SHORTEST_HIDDEN]


_SHORTEST_HIDDEN: Final = 4  # a shorter secret would hide letters of every word


def say(line: str) -> None:
    """Write one ``lockrun: …`` line to stderr; stdout belongs to the command."""
    with LIVE.lock:
        LIVE.write(f"\r\x1b[K{_text(line)}\n{LIVE.shown}" if LIVE.shown else f"{_text(line)}\n")


def _text(line: str) -> str:
    return f"lockrun: {printable(hide(line))}"


class _LiveLine:
    """One line of stderr on a terminal that is redrawn in place; `say` writes above it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.shown = ""

    def show(self, line: str) -> None:
        """Replace the live line with *line*, cut to the terminal's width ('' erases it).

        A line that wrapped could not be redrawn: a carriage return goes back to the
        start of its last row only.
        """
        with self.lock:
            try:
                width = os.get_terminal_size(sys.stderr.fileno()).columns or 80  # 0: unknown
            except (OSError, ValueError):
                width = 80
            self.shown = _text(line)[: width - 1] if line else ""
            self.write(f"\r\x1b[K{self.shown}")

    @staticmethod
    def write(text: str) -> None:
        if sys.stderr is None:  # started with fd 2 closed
            return
        with contextlib.suppress(OSError, ValueError):  # stderr closed: nobody is reading
            sys.stderr.write(text)
            sys.stderr.flush()


LIVE: Final = _LiveLine()


def on_terminal() -> bool:
    """Return whether stderr is a terminal that can redraw a line, and we are in front.

    A background job (`lockrun -v … &`) would redraw over the shell's prompt every second.
    """
    if not sys.stderr.isatty() or os.environ.get("TERM", "dumb") == "dumb":
        return False
    try:
        return os.tcgetpgrp(sys.stderr.fileno()) == os.getpgrp()
    except OSError:  # a terminal we are not attached to
        return False


def print_stdout(text: str) -> None:
    """Print *text* (escaped by the caller) on stdout, with no secret; `OutputError` if not."""
    if sys.stdout is None:  # started with fd 1 closed
        msg = "cannot write to stdout: it is closed"
        raise OutputError(msg)
    try:
        sys.stdout.write(hide(text) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError) as err:
        msg = f"cannot write to stdout: {getattr(err, 'strerror', None) or err}"
        raise OutputError(msg) from None


def _role(role: str, person: Holder) -> str:
    """Say what *person* does: ``holding``, ``waiting``, ``sharing``, ``held until 12:03:04``.

    A lease with no process (acquire --no-keeper): ``no process, until 12:03:04``.
    """
    if person.until is not None:
        return f"held until {clock_time(person.until)}"
    if person.detached:
        until = "" if person.expires is None else f", until {clock_time(person.expires)}"
        return f"{'sharing, ' * person.shared}no process{until}"
    if person.shared:
        return "sharing" if role == "holding" else "waiting (shared)"
    return role


def _table(states: Sequence[LockState]) -> str:
    rows = [("NAME", "SLOT", "STATE", "PID", "USER", "HOST", "SINCE", "COMMAND")]
    for state in states:
        if not state.holders and not state.waiters:
            rows.append((state.name, "-", "free", "", "", "", "", state.where))
        for role, people in (("holding", state.holders), ("waiting", state.waiters)):
            rows.extend(
                (
                    state.name,
                    "-" if person.slot is None else str(person.slot),
                    _role(role, person),
                    str(person.pid),
                    person.user,
                    person.host,
                    "" if person.since is None else clock_time(person.since),
                    " ".join(person.argv),
                )
                for person in people
            )
    # Escaped first, so that a cell's width is what the terminal shows.
    shown = [[printable(cell) for cell in row] for row in rows]
    widths = [max(len(row[column]) for row in shown) for column in range(len(shown[0]) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]])
        for row in shown
    )


def status_text(states: Sequence[LockState], *, as_json: bool, empty: str) -> str:
    """Return what `lockrun status` prints of *states*: JSON, a table, or that *empty* is."""
    if as_json:
        import json  # noqa: PLC0415 - kept off the start-up path of the run command

        return json.dumps([state.to_dict() for state in states], indent=2)
    if not states:
        return printable(f"no locks held or awaited in namespace {empty}")
    return _table(states)
