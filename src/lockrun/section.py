"""Who owns a lock `acquire` took, and the section of a script that holds it after its shell.

docs/semantics.md "Holding a lock across steps": `acquire` belongs to its owner, the shell
that ran it (`default_owner`), and the lock lives while the owner lives, or, once the owner
is gone, while a process of its section does (`Section`). The keeper watches both.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun.errors import ConfigError, UsageError
from lockrun.processes import Stat, stat_of
from lockrun.supervise import readable

if TYPE_CHECKING:
    from lockrun.runner import Options

_PID: Final = re.compile(r"[0-9]{1,10}", re.ASCII)
# The shells that fork subshells for `$(…)`, by executable (busybox: its ash).
_SHELL: Final = re.compile(r"(ba|da|z|k|mk|pdk|a|y|po)?sh[0-9.]*|ksh93|busybox", re.ASCII)
PID_MAX: Final = 2**22  # the kernel's PID_MAX_LIMIT
_PF_KTHREAD: Final = 0x00200000  # include/linux/sched.h: a kernel thread
KEEPER_NAME: Final = b"lockrun-keeper"  # its comm, for ps(1) and so sections skip keepers


def default_owner() -> int:
    """Return the process `acquire` belongs to: its parent, unless that is a subshell.

    A subshell is a shell's forked copy of itself, the same program with the same command
    line and environment: bash forks one for ``$(lockrun acquire … 2>/dev/null)``, dash
    and zsh for a pipeline or a function's ``$(…)``. It exits as soon as `acquire` does,
    so the owner is the shell it was forked from. Only a shell's copy is skipped: a
    worker forked by a Python master (multiprocessing, gunicorn) is a copy too, and owns
    its lock, which must end with it.
    """
    owner = os.getppid()
    while owner > 1 and (parent := _parent(owner)) > 1:
        image = _image(owner)
        if (
            image is None
            or image != _image(parent)
            or not _SHELL.fullmatch(os.path.basename(image[0]))
        ):
            break
        owner = parent
    return owner


def _parent(pid: int) -> int:
    """Return the parent of *pid* (0 if it cannot be read)."""
    info = stat_of(pid)
    return 0 if info is None else info.parent


def _image(pid: int) -> tuple[str, bytes, bytes] | None:
    """Return what *pid* runs: its executable, command line and environment at its start.

    A fork keeps all three; a shell started by a shell of the same command line (``bash``
    typed in ``bash``) was given an environment of its own (bash's SHLVL, at least).
    None if any cannot be read.
    """
    try:
        with (
            open(f"/proc/{pid}/cmdline", "rb") as cmdline,
            open(f"/proc/{pid}/environ", "rb") as environ,
        ):
            return os.readlink(f"/proc/{pid}/exe"), cmdline.read(), environ.read()
    except OSError:
        return None


def parse_owner(text: str) -> int | None:
    """Return the owner pid of ``--owner TEXT`` (None for ``none``), checked to be a pid."""
    if text == "none":
        return None
    if not _PID.fullmatch(text) or not 1 <= int(text) <= PID_MAX:
        msg = f"--owner takes a process id (1 to {PID_MAX}) or 'none', not {text!r}"
        raise UsageError(msg)
    return int(text)


def watch_owner(owner: int | None, options: Options) -> int | None:
    """Return a pidfd of the *owner* process (None for none), checking the time bound.

    Opened now, in the process that the owner started: a pidfd names that process, never
    a later one that reuses its pid. An owner that never exits bounds nothing: as
    ``--owner none``, it needs --max-time.
    """
    if owner is None:
        if options.max_time is None:
            who = "--owner none"
            raise _unbounded(who)
        return None
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        msg = f"--owner {owner}: no such process"
        raise UsageError(msg) from None
    except OSError as err:  # pragma: no cover - ENOSYS: Linux before 5.3
        msg = f"--owner {owner}: cannot watch it: {err.strerror}"
        raise ConfigError(msg) from None
    never = _never_exits(owner)  # read after the pidfd: still that process if it lives
    if readable([pidfd]):  # it exited already
        os.close(pidfd)
        msg = f"--owner {owner}: that process has exited"
        raise UsageError(msg)
    if never is not None and options.max_time is None:
        os.close(pidfd)
        raise _unbounded(f"the owner, pid {owner}, {never}: it")
    return pidfd


def _unbounded(who: str) -> UsageError:
    """Return the error of an acquire that only `release` would end: *who* holds it."""
    return UsageError(
        f"{who} holds the lock until it is released; give --max-time too, so that "
        "a lost token cannot hold it forever"
    )


def _never_exits(pid: int) -> str | None:
    """Say why *pid* never exits in practice (init, a kernel thread, a namespace's init).

    proc(5): a kernel thread has PF_KTHREAD in its flags and kthreadd (pid 2) or no
    parent; the last NSpid of a process is its pid in its own namespace, 1 for an init.
    """
    if pid == 1:
        return "init, which never exits"
    info = stat_of(pid)
    try:
        with open(f"/proc/{pid}/status", "rb") as status_file:
            nspids = [line.split()[1:] for line in status_file if line.startswith(b"NSpid:")]
    except OSError:
        return None  # gone: pidfd_open says so
    if info is None:
        return None
    if info.flags & _PF_KTHREAD or info.parent in {0, 2}:
        return "a kernel thread, which never exits"
    if nspids and nspids[0][-1:] == [b"1"]:
        return "the init of a pid namespace, which never exits before the namespace ends"
    return None


class Section(NamedTuple):
    """The processes a script runs under its lock, told apart once its shell is gone.

    docs/semantics.md "Holding a lock across steps": as flock(1)'s inherited descriptor, the
    lock lives while a process of the section lives. Those are the live processes started
    after the acquire (in a later clock tick) that (a) are in the owner's process group,
    where a non-interactive shell runs its foreground and ``&`` steps and subshells: if the
    owner leads that group, any of them; if the group is its starter's (a CI runner's), only
    those that init adopted, since the starter's other children may wait for this very
    lock; or (b) are our user's and carry the token in their environment, as every program
    the script ran after ``eval`` does, wherever its group. Other keepers are none of them.
    """

    group: int
    leader: bool  # whether the owner leads its group: the script's own, not its starter's
    since: int  # clock ticks after boot: when acquire started
    token: bytes  # b"=" + the token, as an environment entry ends

    @classmethod
    def of(cls, owner: int) -> Section | None:
        """Return the section of *owner* (None if it cannot be read), from acquire's process."""
        me = stat_of(os.getpid())
        try:
            group = os.getpgid(owner)
        except OSError:
            return None
        return None if me is None else cls(group, group == owner, me.start, b"")

    def members(self) -> dict[int, int]:
        """Return the live processes of the section: pid and start."""
        processes: dict[int, Stat] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (info := stat_of(int(entry))) is not None:
                processes[int(entry)] = info
        me = os.getpid()
        return {
            pid: info.start
            for pid, info in processes.items()
            if pid != me and self._candidate(info) and self._belongs(pid, info, processes)
        }

    def _candidate(self, info: Stat) -> bool:
        """Whether *info* is a live process, not a keeper, started after the acquire.

        After acquire's tick: /proc counts starts in ticks (10 ms), and a step forked just
        before acquire often began in the same one; none of the section can, as it starts
        only once acquire has printed its token and exited.
        """
        return (
            info.start > self.since
            and info.state not in {b"Z", b"X"}  # exited, not yet reaped
            and info.name != KEEPER_NAME
        )

    def _belongs(self, pid: int, info: Stat, processes: dict[int, Stat]) -> bool:
        """Whether the candidate *pid* is of the section: by its group, or by the token."""
        if info.group == self.group and (self.leader or self._orphaned(info, processes)):
            return True
        return self._carries_token(pid)

    def _orphaned(self, info: Stat, processes: dict[int, Stat]) -> bool:
        """Whether *info*, or its oldest ancestor started since the acquire, init adopted."""
        for _ in range(len(processes)):
            parent = processes.get(info.parent)
            if parent is None or parent.start <= self.since:
                return info.parent == 1
            info = parent
        return False

    def _carries_token(self, pid: int) -> bool:
        """Whether *pid*, ours, has the token in its environment."""
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
                return False
            with open(f"/proc/{pid}/environ", "rb") as environ:
                return any(entry.endswith(self.token) for entry in environ.read().split(b"\0"))
        except OSError:
            return False


__all__ = ["KEEPER_NAME", "PID_MAX", "Section", "default_owner", "parse_owner", "watch_owner"]
