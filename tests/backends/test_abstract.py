"""The abstract: backend: a name bound but not listening, Linux only, the socket table, modes."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import ConfigError
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends import abstract as abstract_backend
from lockrun.timing import now
from tests.support.cli import RING_TTL, lock_state, lockrun, take_over_ring, wait_for

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


def test_a_window_is_kept_by_a_detached_keeper_until_it_ends(name: str) -> None:
    """The keeper: its own session, nothing of lockrun's caller open; status names the run."""
    uri = f"abstract:modes-{os.getpid()}"
    base = abstract_backend._base(f"modes-{os.getpid()}", "default", name)
    asked = time.time()
    ran = lockrun("--uri", uri, "-n", name, "--hold-at-least", "30", "--", "sh", "-c", "echo $PPID")
    assert ran.returncode == 0, ran.stderr
    run = int(ran.stdout)
    keeper = abstract_backend._listener_pid(f"{base}/0")
    assert keeper is not None
    assert keeper != run
    assert os.getsid(keeper) != os.getsid(0)  # a session of its own: no terminal, no job control
    for fd in ("0", "1", "2"):
        assert os.readlink(f"/proc/{keeper}/fd/{fd}") == os.devnull
    others = [fd for fd in os.listdir(f"/proc/{keeper}/fd") if fd not in {"0", "1", "2"}]
    kinds = {fd: os.readlink(f"/proc/{keeper}/fd/{fd}") for fd in others}
    assert all(kind.startswith("socket:") for kind in kinds.values()), kinds
    (holder,) = lock_state(uri, name)["holders"]
    assert holder["pid"] == run
    assert asked + 30 - 0.05 <= holder["until"] <= time.time() + 30  # granted in between
    os.kill(keeper, signal.SIGTERM)  # ends the window early, as documented
    wait_for(lambda: lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0)


def test_a_windows_marker_fits_the_longest_readable_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A base of 70 bytes, the largest pid and the longest window: within 107 bytes."""
    base = "lockrun/prefix/default/" + "x" * 47
    assert len(base) == abstract_backend._MAX_BASE
    monkeypatch.setattr(os, "getpid", lambda: 4194304)  # pid_max's largest
    with socket.socket(socket.AF_UNIX) as unused:
        lease = abstract_backend.AbstractLease(
            0, 1, unused, None, base=base, since_ms=int(time.time() * 1000)
        )
        name = lease._window_name(366 * 86400.0)
    monkeypatch.undo()
    assert len(name.encode()) <= 107
    marker = abstract_backend._MARKER.fullmatch(name)
    assert marker is not None
    assert marker["pid"] == "4194304"
    assert int(marker["until"], 36) >= 366 * 86400 * 1000


@pytest.mark.parametrize("options", [(), ("--shared",)])
def test_a_holder_hears_a_taker_at_once(
    name: str, tmp_path: Path, options: tuple[str, ...]
) -> None:
    """The taker rings the holder's marker (a reader's socket): TERM well under ttl/3."""
    uri = f"abstract:modes-{os.getpid()}"
    assert take_over_ring(uri, tmp_path, name, *options) < RING_TTL / 3  # the bell, no renewal
