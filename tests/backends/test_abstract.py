"""The abstract: backend: a name bound but not listening, Linux only, the socket table."""

from __future__ import annotations

import socket
import sys

import pytest

from lockrun import ConfigError
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends import abstract as abstract_backend
from lockrun.timing import now


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
