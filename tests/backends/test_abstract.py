"""The abstract: backend: a name bound but not listening, Linux only, the socket table, modes.

Of the modes it offers --shared; --hold-at-least and --take-over are refused (`Scheme.modes`).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import ConfigError, ExitCode
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends import abstract as abstract_backend
from lockrun.timing import now
from tests.support.cli import Held, finish, lockrun, one_line, start, wait_for, waiter_pids

if TYPE_CHECKING:
    from pathlib import Path


def test_abstract_name_bound_but_not_listening_is_waited_out(name: str) -> None:
    """A holder caught between bind and listen makes waiters look again, not fail."""
    backend = open_backend(parse_uri("abstract:edge"))
    request = Request("default", name, 1, 30.0, Holder.me(["test"]))
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(f"\0lockrun/edge/default/{name}/0")
    assert backend.acquire(request, now() + 0.2) is None
    squatter.close()
    lease = backend.acquire(request, now() + 5)
    assert lease is not None
    lease.release()


def test_abstract_is_refused_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    """abstract: names the platform and the alternative where it cannot work."""
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ConfigError, match="needs Linux abstract UNIX sockets; this is darwin"):
        abstract_backend.connect(parse_uri("abstract:"))


def test_a_name_too_long_is_a_bug_said_as_such() -> None:
    """Our names fit sun_path (`_MAX_BASE`): one that does not raises, it is never "taken"."""
    with pytest.raises(OSError, match="too long"):
        abstract_backend.bind_listener("x" * 200)
    with pytest.raises(OSError, match="too long"):
        abstract_backend.connect_to("x" * 200)


def test_a_marker_whose_name_is_taken_is_left_out(name: str) -> None:
    """Markers are best effort: a name bound already (a squatter's) gives no marker."""
    first = abstract_backend.bind_marker(f"lockrun/edge/default/{name}/w/1/1")
    assert first is not None
    with first:
        assert abstract_backend.bind_marker(f"lockrun/edge/default/{name}/w/1/1") is None


def test_the_socket_table_is_read_for_one_lock_only(name: str) -> None:
    """Names of a lock are found among the others; a name it is a prefix of is not one."""
    base = f"lockrun/edge/default/{name}"
    ours, sibling = (socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(2))
    with ours, sibling:
        ours.bind(f"\0{base}/w/1/1")
        sibling.bind(f"\0{base}x/w/1/1")
        found = [path for path, _ in abstract_backend._abstract_names(base)]
        assert found == [f"{base}/w/1/1"]
        everything = [path for path, _ in abstract_backend._abstract_names()]
        assert {f"{base}/w/1/1", f"{base}x/w/1/1"} <= set(everything)


# -- the modes (docs/design.md A3) ------------------------------------------------------


def request(name: str, *, shared: bool = False) -> Request:
    """Ask for the one slot of *name*, shared or not."""
    return Request("default", name, 1, 30.0, Holder.me(["test"]), shared=shared)


def listening(name: str) -> bool:
    """Whether a socket listens on abstract *name*."""
    probe = abstract_backend.connect_to(name)
    if probe is None:
        return False
    probe.close()
    return True


def test_a_reader_lists_itself_and_passes_the_slot_on(name: str) -> None:
    """Readers hold sockets of their own, no fence; the slot's name is free between them."""
    backend = open_backend(parse_uri("abstract:modes"))
    base = abstract_backend._base("modes", "default", name)
    readers = [backend.acquire(request(name, shared=True), now()) for _ in range(2)]
    assert all(reader is not None and reader.fence is None for reader in readers)
    assert not listening(f"{base}/0")
    (state,) = backend.status("default", name)
    assert [(holder.pid, holder.shared) for holder in state.holders] == [(os.getpid(), True)] * 2
    assert backend.acquire(request(name), now()) is None  # a writer waits for them: busy
    assert not listening(f"{base}/0")  # and gave the slot back
    for reader in readers:
        assert reader is not None
        reader.release()
    writer = backend.acquire(request(name), now())
    assert writer is not None
    assert writer.fence is not None
    writer.release()


def test_a_readers_socket_accepts_what_connects_to_it(name: str) -> None:
    """A reader's bell is its socket: refresh accepts probes, so they never fill its backlog."""
    backend = open_backend(parse_uri("abstract:modes"))
    base = abstract_backend._base("modes", "default", name)
    reader = backend.acquire(request(name, shared=True), now())
    assert reader is not None
    (socket_name,) = [path for path, _ in abstract_backend._abstract_names(f"{base}/r")]
    for _ in range(3):
        assert listening(socket_name)  # status's probe: connects and hangs up
    (bell,) = reader.bells
    with socket.socket(fileno=os.dup(bell)) as listener:
        assert abstract_backend.wait_readable([listener], 0)
        reader.refresh()
        assert not abstract_backend.wait_readable([listener], 0)
    reader.release()
    assert reader.bells == ()


def test_a_writer_has_no_bell(name: str) -> None:
    """Nobody rings a writer on abstract: (no --take-over): its lease offers no bell."""
    backend = open_backend(parse_uri("abstract:modes"))
    writer = backend.acquire(request(name), now())
    assert writer is not None
    assert writer.bells == ()
    writer.refresh()  # the slot lives as long as we do: nothing to prove
    writer.release()


@pytest.mark.parametrize(
    "argv",
    [
        ("-u", "URI", "--take-over", "-w", "5", "-n", "NAME", "--", "true"),
        ("-u", "URI", "--hold-at-least", "1h", "-n", "NAME", "--", "true"),
        ("acquire", "-u", "URI", "--take-over", "-w", "5", "NAME"),
        ("acquire", "-u", "URI", "--hold-at-least", "1h", "NAME"),
        ("acquire", "-u", "URI", "--no-keeper", "--ttl", "1m", "--take-over", "-w", "5", "NAME"),
    ],
)
def test_the_modes_abstract_declines_are_refused_before_anything_is_opened(
    name: str, argv: tuple[str, ...]
) -> None:
    """--hold-at-least and --take-over on abstract: exit 64, one line, nothing left behind."""
    prefix = f"declined-{os.getpid()}"
    given = {"URI": f"abstract:{prefix}", "NAME": name}
    result = lockrun(*(given.get(word, word) for word in argv))
    assert result.returncode == ExitCode.USAGE, result.stderr
    said = one_line(result.stderr)
    assert "is not supported by abstract: (only --shared is)" in said or "--no-keeper" in said
    assert result.stdout == ""
    assert not list(abstract_backend._abstract_names(f"lockrun/{prefix}"))


def _switches(pid: int) -> int:
    """Return how often every thread of *pid* went to sleep and woke (voluntary switches)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def test_a_queued_waiter_sleeps_until_the_kernel_wakes_it(tmp_path: Path, name: str) -> None:
    """Queued on every name, a waiter has nothing to re-read: it does not wake every 5 s.

    Its connection wakes it when the holder hands over or the name's last descriptor closes
    (docs/design.md A3); the 5 s re-read (D2) is for names it could not queue on.
    """
    uri = "abstract:idle"
    held = Held(tmp_path, "--uri", uri, "--name", name)
    waiter = start("--uri", uri, "--name", name, "--wait", "forever", "--", "true")
    try:
        wait_for(lambda: waiter_pids(uri, name) == [waiter.pid], what="the waiter queued")
        before = _switches(waiter.pid)
        time.sleep(abstract_backend.RECHECK + 1)
        assert _switches(waiter.pid) == before
    finally:
        assert held.finish() == 0
    assert finish(waiter) == 0
