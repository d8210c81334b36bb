"""The files of a lock and what a slot file holds: the fence counter, a holder's record, a window.

Names: slot 0 of a lock is ``<base>.lock``, slot i of a semaphore ``<base>~<i>.lock``; its
waiters queue on ``<base>.gate`` and a semaphore keeps its fence in ``<base>.fence``. A slot
file's first line is the fence counter; a holder's JSON record follows it while the slot is
held, or a --hold-at-least window's once it is let go (docs/design.md A1). A record counts
only from a file no user but us, root and our groups could write (`stranger`).
"""

from __future__ import annotations

import functools
import os
import pwd
import stat
import time
from typing import Final, NamedTuple

from lockrun.backends import Holder, read_json
from lockrun.backends.directories import describe_uid
from lockrun.bounds import MAX_SLOTS, MAX_WAIT
from lockrun.names import escape, unescape
from lockrun.timing import now

DEFAULT_NAMESPACE: Final = "default"
_MAX_BASE: Final = 200  # leaves room for "~NNN.lock" within NAME_MAX (255)
LOCK_FILE: Final = r"(?P<base>[^.~]+(?:\.[^.~]+)?)(?:~(?P<slot>\d+))?\.lock"  # status only
_UNTIL: Final = b'"until": '  # a --hold-at-least window's end, in a record left behind
# A window read back that ends further away than any --hold-at-least could make it was
# never written by lockrun (a forged record, a clock stepped back by a year): no window.
_LONGEST_WINDOW: Final = MAX_WAIT + 86400.0
_WINDOW_NAP: Final = 1.0  # a window's wait looks at the wall clock again this often


@functools.lru_cache(maxsize=1024)  # every acquisition names its file: a loop, the same
def lock_base(namespace: str, name: str) -> str:
    """Return the file-name stem of a lock: ``name``, or ``namespace.name`` outside default."""
    key = escape(name) if namespace == DEFAULT_NAMESPACE else f"{escape(namespace)}.{escape(name)}"
    if len(key) <= _MAX_BASE:
        return key
    digest = sha256(f"{namespace}\0{name}")[:32]
    return f"{key[:150]}%%{digest}"  # "%%" never comes out of escape(): no collisions


def sha256(text: str) -> str:
    """Return the hex SHA-256 of *text*."""
    import hashlib  # noqa: PLC0415 - only long names and semaphores pay for OpenSSL's load

    return hashlib.sha256(text.encode()).hexdigest()


def slot_file(base: str, slot: int) -> str:
    """Name the file of *slot* of the lock *base*."""
    return f"{base}.lock" if slot == 0 else f"{base}~{slot}.lock"


def namespace_of(base: str) -> str:
    """Return the namespace of the lock whose file-name stem is *base*."""
    return unescape(base.split(".", 1)[0]) if "." in base else DEFAULT_NAMESPACE


def name_of(base: str) -> str:
    """Return the name of the lock whose file-name stem is *base*."""
    return unescape(base.split(".", 1)[-1])


def split(content: bytes) -> tuple[bytes, bytes]:
    """Split a slot file into its fence counter line (b"" if none) and its holder record."""
    first, newline, rest = content.partition(b"\n")
    if newline and first.isdigit():
        return first, rest
    return b"", content  # written by an older lockrun, or by someone else


def counter_line(content: bytes) -> bytes:
    """Return the fence counter line of a slot file alone (b"" if it has none)."""
    counter = split(content)[0]
    return counter + b"\n" if counter else b""


def overwrite(fd: int, data: bytes) -> None:
    """Make *data* all that the file open as *fd* holds."""
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


class Record(NamedTuple):
    """A holder's record, read back from a slot file of its lock."""

    holder: Holder
    name: str
    slots: int


def read_record(content: bytes, base: str) -> Record | None:
    """Parse the holder record of a slot file of *base*; None for anything else.

    A flock(1) user's pid, or whatever another user of a shared directory wrote: a record
    counts only if it is well formed and names the lock whose file it is in.
    """
    data = read_json(split(content)[1])
    if not isinstance(data, dict):
        return None
    name, namespace, slots = data.get("name"), data.get("namespace"), data.get("slots")
    if not isinstance(name, str) or not isinstance(namespace, str):
        return None
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        return None
    try:
        if lock_base(namespace, name) != base:
            return None
        return Record(Holder.from_dict(data), name, slots)
    except (ValueError, UnicodeError):
        return None


def window_end(content: bytes, base: str) -> float | None:
    """Return when the --hold-at-least window left in a slot file of *base* ends, if it is open.

    Anyone who may write the file may write a record: an end further away than any window
    lockrun makes (a forged one, a clock stepped back by a year) is none, and a negative or
    non-numeric one is none (docs/security.md). So a forged window can hold the lock for as
    long as a lockrun could, never for ever.
    """
    if _UNTIL not in content:  # the usual file: a counter line and nothing else
        return None
    record = read_record(content, base)
    until = None if record is None else record.holder.until
    if until is None or not 0 < until - time.time() <= _LONGEST_WINDOW:
        return None
    return until


def window_marker(data: bytes, until: float) -> bytes:
    """Return the slot file's *data* (counter line and record) with the record ending *until*."""
    counter, _, line = data.partition(b"\n")
    import json  # noqa: PLC0415 - --hold-at-least only (write_json)

    record = json.loads(line)
    record["until"] = until
    return b"%s\n%s\n" % (counter, json.dumps(record).encode())


def wait_out(until: float | None, deadline: float | None) -> bool:
    """Sleep, holding the lock, until the window ending *until* (Unix time) is over.

    False at once if *deadline* comes first: busy. Holding the lock keeps our place; the
    waiters behind us stay queued in the kernel (docs/design.md A1).
    """
    if until is None:
        return True
    if deadline is not None and deadline - now() < until - time.time():
        return False
    while (left := until - time.time()) > 0:  # the wall clock, as the window was written
        if deadline is not None and now() >= deadline:  # the clock stepped back
            return False
        time.sleep(min(left, _WINDOW_NAP))
    return True


def stranger(info: os.stat_result) -> str | None:
    """Name who other than us, root and our groups could have written the file *info* is of.

    None if nobody else could: the file is ours or root's, or belongs to one of our groups
    and its owner is a member (a set-group-ID directory gives every file made in it its
    group, whoever makes it), and not every user may write it. A group we are in is one
    whose members we share locks with (docs/security.md).
    """
    if info.st_uid not in {0, os.geteuid()} and not (
        info.st_gid in _our_groups() and _member(info.st_uid, info.st_gid)
    ):
        return describe_uid(info.st_uid)
    return "every user" if info.st_mode & stat.S_IWOTH else None


def _our_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def _member(uid: int, gid: int) -> bool:
    """Whether user *uid* is in group *gid*, as the user and group databases say."""
    try:
        entry = pwd.getpwuid(uid)
        return gid in os.getgrouplist(entry.pw_name, entry.pw_gid)
    except (KeyError, OSError):  # a uid with no name: a member of nothing we can tell
        return False
