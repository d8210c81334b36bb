"""The process table, read from /proc: a process's state, a group's members, stopping them."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import NamedTuple


def kill_the_others(group: int = 0, spare: int = 0) -> None:
    """SIGKILL every process of *group* but *spare*; return once none of them is alive.

    By default the guardian's own group, sparing itself. Not killpg, which would take us
    along: the kernel might end us before a command that is slow to die, and our copies
    of the lock's descriptors with us, freeing the lock while the command still ran. A
    process killed while it forks may leave a child: look again until the group is empty.
    """
    me = spare or os.getpid()
    group = group or me
    pause = 0.001
    try:
        while others := [pid for pid in members(group) if pid != me]:
            for pid in others:
                # One we may not signal (sudo's) keeps the lock held until it ends by itself.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)  # one stuck in the kernel (D state) is not spun on
    except OSError:  # no /proc to read: kill what we can, the guardian included, at least
        os.killpg(group, signal.SIGKILL)


class Stat(NamedTuple):
    """What proc(5)'s /proc/PID/stat says of a process: a group's members, a section's."""

    name: bytes  # comm
    state: bytes
    parent: int
    group: int
    flags: int
    start: int  # clock ticks after boot


def stat_of(pid: int) -> Stat | None:
    """Return /proc/*pid*/stat, None if it cannot be read (the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            head, _, tail = stat_file.read().rpartition(b")")
        fields = tail.split()
        return Stat(
            head.partition(b"(")[2], fields[0], int(fields[1]), int(fields[2]),
            int(fields[6]), int(fields[19]),
        )  # fmt: skip
    except (OSError, ValueError, IndexError):
        return None


def members(group: int) -> list[int]:
    """Return the live (not zombie) processes of process *group*, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        info = stat_of(int(entry)) if entry.isdigit() else None  # None: it ended meanwhile
        if (
            info is not None
            and info.group == group
            and (info.state not in {b"Z", b"X"} or threads_left(entry))
        ):
            found.append(int(entry))
    return found


def threads_left(pid: str) -> bool:
    """Return whether a zombie *pid* still has threads running (its leader exited first)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


__all__ = ["Stat", "kill_the_others", "members", "stat_of"]
