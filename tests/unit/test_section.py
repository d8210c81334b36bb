"""Who owns an acquired lock (lockrun.section) and the process table under it (lockrun.processes).

In-process, on this very process and its group: --owner's checks, the section's bounds, and
/proc/PID/stat read as proc(5) writes it. docs/semantics.md "Holding a lock across steps".
"""

from __future__ import annotations

import os
import select
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from lockrun.errors import UsageError
from lockrun.processes import members, stat_of
from lockrun.runner import Options
from lockrun.section import PID_MAX, Section, parse_owner, watch_owner

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.mark.parametrize(("text", "owner"), [("none", None), ("1", 1), (str(PID_MAX), PID_MAX)])
def test_an_owner_is_a_pid_or_none(text: str, owner: int | None) -> None:
    """1 … PID_MAX, or `none` for a lock that only --max-time bounds."""
    assert parse_owner(text) == owner


@pytest.mark.parametrize("text", ["0", str(PID_MAX + 1), "-1", "+5", " 5", "None", "٣", ""])
def test_an_owner_that_is_no_pid_is_a_usage_error(text: str) -> None:
    """Out of the kernel's range, signed, padded, or not ASCII digits: 64, quoting it."""
    with pytest.raises(UsageError, match=r"^--owner takes a process id \(1 to 4194304\)"):
        parse_owner(text)


def test_no_owner_needs_max_time() -> None:
    """--owner none without --max-time would hold until a release that may never come."""
    with pytest.raises(UsageError, match=r"^--owner none holds the lock until it is released"):
        watch_owner(None, Options())
    assert watch_owner(None, Options(max_time=60.0)) is None


def test_a_live_owner_is_watched_through_a_pidfd() -> None:
    """Our own process: a pidfd that is not readable while we live."""
    pidfd = watch_owner(os.getpid(), Options())
    assert pidfd is not None
    try:
        assert select.select([pidfd], [], [], 0)[0] == []
    finally:
        os.close(pidfd)


def test_an_owner_that_does_not_exist_is_a_usage_error() -> None:
    """No such process: 64, before anything is taken."""
    with pytest.raises(UsageError, match=f"^--owner {PID_MAX}: no such process$"):
        watch_owner(PID_MAX, Options())


def test_init_as_owner_needs_max_time() -> None:
    """Init (pid 1) never exits: it bounds nothing without --max-time (64), and is watched with."""
    with pytest.raises(UsageError, match=r"pid 1, init, which never exits: it holds"):
        watch_owner(1, Options())
    pidfd = watch_owner(1, Options(max_time=60.0))
    assert pidfd is not None
    os.close(pidfd)


# -- the section ----------------------------------------------------------------------------


def test_the_section_of_an_owner_is_its_group_from_now() -> None:
    """Its process group, whether it leads it, and acquire's start as the line drawn."""
    section = Section.of(os.getpid())
    me = stat_of(os.getpid())
    assert section is not None
    assert me is not None
    assert section.group == os.getpgrp()
    assert section.leader == (os.getpgrp() == os.getpid())
    assert section.since == me.start
    assert section.token == b""


def test_the_section_of_no_process_is_none() -> None:
    """An owner gone before it was read: no section, the owner's pidfd decides alone."""
    assert Section.of(PID_MAX) is None


def test_a_section_never_counts_its_keeper_itself() -> None:
    """The process that reads the section is never one of its members."""
    section = Section(os.getpgrp(), leader=True, since=0, token=b"")
    assert os.getpid() not in section.members()


def test_a_section_counts_nothing_started_before_it() -> None:
    """A line drawn after every process: none of them is the section's."""
    section = Section(os.getpgrp(), leader=True, since=2**62, token=b"")
    assert section.members() == {}


def test_a_section_counts_no_stranger_without_the_token() -> None:
    """No group of ours, a token no process carries: nothing, however early the line."""
    token = b"=lr1.0.00000000deadbeef.not-a-token-anyone-has"
    section = Section(PID_MAX, leader=False, since=0, token=token)
    assert section.members() == {}


# -- /proc ----------------------------------------------------------------------------------


def test_stat_of_reads_this_process() -> None:
    """Our parent, our group, a running or sleeping state, a start after boot."""
    info = stat_of(os.getpid())
    assert info is not None
    assert info.parent == os.getppid()
    assert info.group == os.getpgrp()
    assert info.state in {b"R", b"S"}
    assert info.start > 0


def test_stat_of_a_gone_process_is_none() -> None:
    """No /proc entry: None, not an OSError."""
    assert stat_of(PID_MAX) is None


@pytest.fixture
def comm() -> Iterator[Path]:
    path = Path(f"/proc/self/task/{os.getpid()}/comm")
    saved = path.read_bytes()
    try:
        yield path
    finally:
        path.write_bytes(saved)


def test_stat_of_reads_a_name_with_parentheses_and_blanks(comm: Path) -> None:
    """A process named `a) b (c` cannot shift the fields: the last `)` ends the name."""
    comm.write_bytes(b"a) 1 2 (c")
    info = stat_of(os.getpid())
    assert info is not None
    assert info.name == b"a) 1 2 (c"
    assert info.parent == os.getppid()
    assert info.group == os.getpgrp()


def test_members_of_our_group_include_us() -> None:
    """A group's members are read from /proc: ours has at least this process."""
    assert os.getpid() in members(os.getpgrp())


def test_members_of_no_group_are_none() -> None:
    """A group no process is in: empty."""
    assert members(PID_MAX) == []
