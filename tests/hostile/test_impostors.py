"""Servers that are not what the URI says: a "Redis" or "sentinel" that answers nonsense.

redis-py trusts the protocol: its parsers and handshake raise ValueError, TypeError,
AttributeError or RecursionError on replies Redis never sends. Whatever such a server
answers, lockrun says so in one line and exits 69, never 70 with a traceback.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from typing import TYPE_CHECKING, Final

import pytest

from tests.support.cli import lockrun, one_line

if TYPE_CHECKING:
    from collections.abc import Iterator

_HELLO: Final = b"%1\r\n$5\r\nproto\r\n:3\r\n"  # RESP3 accepted, and nothing else said
# What the impostor answers to everything after HELLO (and, for "ok", to HELLO too).
REPLIES: Final = {
    "ok": b"+OK\r\n",
    "garbage": b"%\xff\xfe garbage\r\n",
    "integer": b":42\r\n",
    "error": b"-ERR boom\r\n",
    "deep": b"*1\r\n" * 100_000 + b":1\r\n",
    "map-of-junk": b"%1\r\n:1\r\n*1\r\n$-1\r\n",
}


# A plausible impostor answers the set-up as Redis would, and only our scripts with junk.
_PLAUSIBLE: Final = {
    b"HELLO": _HELLO,
    b"CONFIG": b"%0\r\n",
    b"CLIENT": b":1\r\n",
    b"SCRIPT": b"$40\r\n" + b"0" * 40 + b"\r\n",
}
_COMMAND: Final = re.compile(rb"\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n")


class Impostor:
    """A TCP server on loopback that reads commands and answers each with one reply."""

    def __init__(self, mode: str, *, plausible: bool = False) -> None:
        """Listen on a free port and serve in daemon threads."""
        self.mode = mode
        self.plausible = plausible
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                peer, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(peer,), daemon=True).start()

    def _serve(self, peer: socket.socket) -> None:
        with peer, contextlib.suppress(OSError):
            while data := peer.recv(65536):
                # One reply per command in the packet (a pipeline sends several at once).
                peer.sendall(b"".join(self._reply(name.upper()) for name in _COMMAND.findall(data)))

    def _reply(self, command: bytes) -> bytes:
        if self.plausible and command in _PLAUSIBLE:
            return _PLAUSIBLE[command]
        if command == b"HELLO" and self.mode != "ok":
            return _HELLO
        return REPLIES[self.mode]

    def close(self) -> None:
        """Stop listening."""
        self.listener.close()


@pytest.fixture(params=sorted(REPLIES))
def impostor(request: pytest.FixtureRequest) -> Iterator[Impostor]:
    """Return an impostor for each kind of reply, closed at teardown."""
    server = Impostor(request.param)
    yield server
    server.close()


@pytest.mark.parametrize("scheme", ["redis", "redis+sentinel"])
def test_a_server_that_answers_nonsense_is_69_in_one_line(
    impostor: Impostor, scheme: str, name: str
) -> None:
    """Run, status and the sentinels' view: one line naming the URI, status 69."""
    where = f"127.0.0.1:{impostor.port}"
    uri = f"redis://{where}/0" if scheme == "redis" else f"redis+sentinel://{where}/mymaster"
    for args in (
        ("--uri", uri, "-n", name, "--ttl", "3", "--", "true"),
        ("status", "--uri", uri, name),
    ):
        result = lockrun(*args)
        assert result.returncode == 69, result.stderr
        assert "Traceback" not in result.stderr
        assert where in one_line(result.stderr)


@pytest.mark.parametrize("mode", sorted(REPLIES))
def test_a_server_that_answers_our_scripts_with_nonsense_is_69_in_one_line(
    mode: str, name: str
) -> None:
    """Set-up answered as Redis would, then junk to the acquire script: 69, one line."""
    impostor = Impostor(mode, plausible=True)
    try:
        where = f"127.0.0.1:{impostor.port}"
        result = lockrun("--uri", f"redis://{where}/0", "-n", name, "--ttl", "3", "--", "true")
    finally:
        impostor.close()
    assert result.returncode == 69, result.stderr
    assert "Traceback" not in result.stderr
    assert where in one_line(result.stderr)
