"""Servers that are not what the URI says: a "Redis" or "sentinel" that answers nonsense.

redis-py trusts the protocol: its parsers and handshake raise ValueError, TypeError,
AttributeError or RecursionError on replies Redis never sends. Whatever such a server
answers, lockrun says so in one line and exits 69, never 70 with a traceback.

Nor may a reply hold lockrun: one that never ends (a huge length, then a trickle) is cut
at the call's deadline or its size cap (docs/semantics.md "What bounds a call"), and TERM
while it trickles ends lockrun at once, with 143.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import socket
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Final, NamedTuple

import pytest

from lockrun.backends.redis.scripts import SHA1
from tests.support.cli import LOCKRUN, lockrun, one_line, refused_in_process

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

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
# A command's name, and its next word: the SHA-1 of the script an EVALSHA names, say.
_COMMAND: Final = re.compile(rb"\*\d+\r\n\$\d+\r\n([A-Za-z]+)\r\n(?:\$\d+\r\n([0-9A-Za-z_]+)\r\n)?")
_SCRIPT_OF: Final = {sha.encode(): script for script, sha in SHA1.items()}


class Stream(NamedTuple):
    """A reply that never ends: *head*, then *chunk* again and again, *pause* s apart."""

    head: bytes
    chunk: bytes
    pause: float


# Replies that never end, fast (memory) or slowly (time): each resets a per-recv timeout.
STREAMS: Final = {
    "huge-bulk": Stream(b"$999999999999\r\n", b"x" * 65536, 0),
    "huge-bulk-trickle": Stream(b"$999999999999\r\n", b"x", 0.1),
    "bulk-trickle": Stream(b"$1000000\r\n", b"x", 0.1),
    "endless-line": Stream(b"+", b"a" * 65536, 0),
    "a-byte-at-a-time": Stream(b"+", b"a", 0.3),
    "huge-array": Stream(b"*999999999\r\n", b"~0\r\n" * 16384, 0),
    "huge-map": Stream(b"%999999999\r\n", b"$2\r\nab\r\n" * 8192, 0),
    "deep-trickle": Stream(b"", b"*1\r\n", 0.1),
}


class Late(NamedTuple):
    """A whole reply, sent *pause* seconds after the command came (a slow server)."""

    reply: bytes
    pause: float


# A grant, as the acquire script answers it: {1, slot 0, fence 1, 0, ""}.
_GRANT: Final = b"*5\r\n:1\r\n:0\r\n:1\r\n:0\r\n$0\r\n\r\n"


class _Loopback:
    """A TCP server on a free loopback port that serves each connection in a daemon thread."""

    def __init__(self) -> None:
        """Listen, and accept in a daemon thread: after the subclass has set itself up."""
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                peer, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(peer,), daemon=True).start()

    def _serve(self, peer: socket.socket) -> None:
        raise NotImplementedError


class Impostor(_Loopback):
    """A TCP server on loopback that reads commands and answers each with one reply.

    *scripts* maps our scripts (by name) to what an EVALSHA of each gets instead: a reply,
    or a `Stream`; `commands`, other commands (by name, or name and first argument, as
    ``b"CLIENT LIST"``) to what they get instead.
    `streaming` is set once a stream has begun.
    """

    def __init__(
        self,
        mode: str,
        *,
        plausible: bool = False,
        scripts: dict[str, bytes | Stream] | None = None,
    ) -> None:
        """Listen on a free port and serve in daemon threads."""
        self.mode = mode
        self.plausible = plausible
        self.scripts = scripts or {}
        self.commands: dict[bytes, bytes | Stream | Late] = {}
        self.asked: list[bytes] = []  # each command's name, and its next word
        self.streaming = threading.Event()
        super().__init__()

    def _serve(self, peer: socket.socket) -> None:
        with peer, contextlib.suppress(OSError):
            while data := peer.recv(65536):
                # One reply per command in the packet (a pipeline sends several at once).
                for name, word in _COMMAND.findall(data):
                    self.asked.append(b"%b %b" % (name.upper(), word.upper()))
                    answer: bytes | Stream | Late = self.scripts.get(_SCRIPT_OF.get(word, ""), b"")
                    answer = self.commands.get(self.asked[-1], answer)
                    if isinstance(answer, Stream):
                        self._stream(peer, answer)
                    elif isinstance(answer, Late):
                        time.sleep(answer.pause)
                        peer.sendall(answer.reply)
                    else:
                        peer.sendall(answer or self._reply(name.upper()))

    def _stream(self, peer: socket.socket, stream: Stream) -> None:
        """Send *stream* until the peer hangs up (OSError ends the connection's thread)."""
        peer.sendall(stream.head)
        self.streaming.set()
        while True:
            peer.sendall(stream.chunk)
            time.sleep(stream.pause)

    def _reply(self, command: bytes) -> bytes:
        answer = self.commands.get(command)
        if isinstance(answer, bytes):
            return answer
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
    impostor: Impostor, scheme: str, name: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Run, status and the sentinels' view: one line naming the URI, status 69.

    status meets the impostor in this process (what `lockrun status` does past its start-up:
    the replies only feed the parsers); a run is a process, for it forks its guardian first.
    """
    where = f"127.0.0.1:{impostor.port}"
    uri = f"redis://{where}/0" if scheme == "redis" else f"redis+sentinel://{where}/mymaster"
    for result in (
        lockrun("--uri", uri, "-n", name, "--ttl", "3", "--", "true"),
        refused_in_process(capfd, "status", "--uri", uri, name),
    ):
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


_RSS_CAP: Final = 150 << 20  # bytes: an interpreter with redis-py, plus a reply at its cap


class Watched(NamedTuple):
    """How a lockrun run under watch ended, and the most memory it held meanwhile."""

    status: int
    stderr: str
    peak_rss: int


def watch(*args: str, term_when: threading.Event | None = None) -> Watched:
    """Run lockrun ARGS, reading its RSS from /proc; TERM it once *term_when* is set.

    A hang guard (not a budget): a run that outlives it, or outgrows `_RSS_CAP`, fails.
    """
    process = subprocess.Popen([*LOCKRUN, *args], stderr=subprocess.PIPE, text=True)
    peak, guard = 0, time.monotonic() + 60
    try:
        while process.poll() is None:
            with contextlib.suppress(OSError), open(f"/proc/{process.pid}/statm") as statm:
                peak = max(peak, int(statm.read().split()[1]) * 4096)
            assert peak < _RSS_CAP, f"lockrun grew to {peak >> 20} MiB on a reply that never ends"
            assert time.monotonic() < guard, "lockrun hung on a reply that never ends"
            if term_when is not None and term_when.is_set():
                process.send_signal(signal.SIGTERM)
                term_when = None
            time.sleep(0.02)
    finally:
        process.kill()
        _, stderr = process.communicate()
    return Watched(process.returncode, stderr, peak)


def _release_args(impostor: Impostor, name: str) -> tuple[str, ...]:
    """Take *name* with --no-keeper from the impostor (it grants); return release's args."""
    uri = f"redis://127.0.0.1:{impostor.port}/0"
    taken = lockrun("acquire", "--no-keeper", "--ttl", "1m", "--uri", uri, name)
    assert taken.returncode == 0, taken.stderr
    return ("release", "--uri", uri, taken.stdout.split()[-1])


_CALLS: Final = {  # what lockrun is asked, and the script whose answer never ends
    "run --wait 0": ("acquire", ("--wait", "0", "--", "true")),
    "run --wait 5": ("acquire", ("--wait", "5", "--", "true")),
    "status": ("status", ()),
    "release": ("renew", ()),
}


@pytest.mark.parametrize("call", sorted(_CALLS))
@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_a_reply_that_never_ends_is_cut_with_69(stream: str, call: str, name: str) -> None:
    """Huge lengths, trickles, deep nesting: 69 in one line, with memory bounded."""
    script, options = _CALLS[call]
    impostor = Impostor("ok", plausible=True, scripts={"acquire": _GRANT})
    try:
        where = f"127.0.0.1:{impostor.port}"
        uri = f"redis://{where}/0"
        if call == "release":
            args = _release_args(impostor, name)
        elif call == "status":
            args = ("status", "--uri", uri, name)
        else:
            args = ("--uri", uri, "-n", name, *options)
        impostor.scripts[script] = STREAMS[stream]
        ended = watch(*args)
    finally:
        impostor.close()
    assert ended.status == 69, ended.stderr
    assert where in one_line(ended.stderr)


@pytest.mark.parametrize("wait", ["0", "5", "forever"])
@pytest.mark.parametrize("stream", ["bulk-trickle", "a-byte-at-a-time", "deep-trickle"])
def test_term_while_a_reply_trickles_ends_lockrun_with_143(
    stream: str, wait: str, name: str
) -> None:
    """TERM mid-trickle: 143 and its one line, though the release meets the trickle too."""
    impostor = Impostor(
        "ok", plausible=True, scripts={"acquire": STREAMS[stream], "release": STREAMS[stream]}
    )
    try:
        uri = f"redis://127.0.0.1:{impostor.port}/0"
        ended = watch(
            "--uri",
            uri,
            "-n",
            name,
            "--ttl",
            "100",
            "--wait",
            wait,
            "--",
            "true",
            term_when=impostor.streaming,
        )
    finally:
        impostor.close()
    assert ended.status == 143, ended.stderr
    assert "SIGTERM while waiting" in one_line(ended.stderr)


class Recorder:
    """A TCP listener on loopback that keeps whatever any connection sends it."""

    def __init__(self) -> None:
        """Listen on a free port and record in a daemon thread."""
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.heard = bytearray()
        self.connections = 0
        threading.Thread(target=self._record, daemon=True).start()

    def _record(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                peer, _ = self.listener.accept()
                self.connections += 1
                with peer:
                    peer.settimeout(5)
                    with contextlib.suppress(OSError):
                        while data := peer.recv(65536):
                            self.heard += data


@pytest.mark.parametrize("scheme", ["redis+cluster", "redis"])
def test_a_redirect_to_a_node_the_cluster_does_not_list_is_refused(scheme: str, name: str) -> None:
    """MOVED to an address CLUSTER SLOTS does not name: 69 in one line, no password sent."""
    stranger = Recorder()
    impostor = Impostor("ok", plausible=True)
    moved = f"-MOVED 1234 127.0.0.1:{stranger.port}\r\n".encode()
    itself = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % impostor.port
    impostor.scripts.update(dict.fromkeys(SHA1, moved))
    impostor.commands[b"CLUSTER"] = itself
    try:
        uri = f"{scheme}://:s3cret-pw@127.0.0.1:{impostor.port}"
        result = lockrun("--uri", uri, "-n", name, "--", "true")
    finally:
        impostor.close()
        stranger.listener.close()
    assert result.returncode == 69, result.stderr
    line = one_line(result.stderr)
    assert f"127.0.0.1:{stranger.port}, which the cluster does not list" in line
    assert "s3cret-pw" not in result.stderr
    assert stranger.connections == 0, bytes(stranger.heard)


@pytest.mark.parametrize("call", ["run", "status"])
def test_a_pushed_move_is_no_redirect_and_no_signal(call: str, name: str) -> None:
    """A RESP3 push "MOVING" (redis-py's maintenance notifications) moves nothing.

    redis-py would point later connections at the pushed address (the password with them)
    and start a timer thread that takes signals lockrun blocks (SIGIO: status -29).
    """
    stranger = Recorder()
    impostor = Impostor("ok", plausible=True)
    address = f"127.0.0.1:{stranger.port}".encode()
    moving = b">4\r\n$6\r\nMOVING\r\n:1\r\n:30\r\n$%d\r\n%b\r\n" % (len(address), address)
    impostor.commands[b"CLIENT MAINT_NOTIFICATIONS"] = b"+OK\r\n"
    impostor.scripts.update({"acquire": moving + _GRANT, "status": moving + b"*0\r\n"})
    uri = f"redis://:s3cret-pw@127.0.0.1:{impostor.port}/0"
    try:
        if call == "run":
            result = lockrun("--uri", uri, "-n", name, "--wait", "0", "--", "sleep", "2")
        else:
            result = lockrun("--uri", uri, "status", name)
    finally:
        impostor.close()
        stranger.listener.close()
    assert result.returncode >= 0, result.stderr  # not ended by a signal
    assert result.returncode != 70, result.stderr
    if result.returncode:
        one_line(result.stderr)
    assert "s3cret-pw" not in result.stderr
    assert stranger.connections == 0, bytes(stranger.heard)


def test_a_release_that_meets_a_slow_server_shares_one_timeout(name: str) -> None:
    """A release's replies all come within one call's timeout, as a wait's clean-up's do.

    They are: on the lease's own connection, again on the pool, CLIENT LIST and drops.

    The server grants, then answers the release with a woken waiter it never lists, and
    each CLIENT LIST late, within one call's timeout (1.5 s at the default ttl) but after
    most of it: before, lockrun asked 8 rounds of CLIENT LIST and drop, TERM unheeded.
    """
    woken = b"*2\r\n$5\r\ntoken\r\n$2\r\n42\r\n"
    impostor = Impostor(
        "ok",
        plausible=True,
        scripts={"acquire": _GRANT, "renew": b":1\r\n", "release": woken, "drop": woken},
    )
    impostor.commands[b"CLIENT LIST"] = Late(b"$0\r\n\r\n", 1.0)
    try:
        result = lockrun("--uri", f"redis://127.0.0.1:{impostor.port}/0", "-n", name, "--", "true")
    finally:
        impostor.close()
    assert result.returncode == 0, result.stderr
    assert 1 <= impostor.asked.count(b"CLIENT LIST") <= 2, impostor.asked


def _mysql_packets() -> Iterator[bytes]:
    """Send packets of 16 MiB - 1 bytes, each "to be continued": a reply without end."""
    for number in itertools.count():
        yield b"\xff\xff\xff" + bytes([number % 256]) + b"a" * 0xFFFFFF


def _mysql_trickle() -> Iterator[bytes]:
    """Send a greeting of 64 KiB, a byte at a time."""
    yield b"\xff\xff\x00\x00"
    while True:
        yield b"a"
        time.sleep(0.1)


# A MySQL greeting that never ends, slowly (time) or in full packets (memory).
MYSQL_STREAMS: Final = {"greeting-trickle": _mysql_trickle, "endless-packets": _mysql_packets}


class Trickler(_Loopback):
    """A TCP server on loopback that sends each connection *chunks*, whatever it says."""

    def __init__(self, chunks: Callable[[], Iterator[bytes]]) -> None:
        """Listen on a free port and send in daemon threads."""
        self.chunks = chunks
        super().__init__()

    def _serve(self, peer: socket.socket) -> None:
        with peer, contextlib.suppress(OSError):
            for chunk in self.chunks():
                peer.sendall(chunk)


@pytest.mark.parametrize("stream", sorted(MYSQL_STREAMS))
def test_a_mysql_greeting_that_never_ends_is_cut_with_69(stream: str, name: str) -> None:
    """A greeting that trickles, or packets that never end: 69 in one line, memory bounded."""
    server = Trickler(MYSQL_STREAMS[stream])
    try:
        where = f"127.0.0.1:{server.port}"
        ended = watch("--uri", f"mysql://root:pw@{where}/lockrun", "-n", name, "--", "true")
    finally:
        server.listener.close()
    assert ended.status == 69, ended.stderr
    assert where in one_line(ended.stderr)


def test_term_while_lockrun_passes_over_dead_waiters_is_not_swallowed(name: str) -> None:
    """TERM during the CLIENT LIST that follows a busy answer: 143, not 75.

    The best-effort calls after an answer (passing over dead waiters, leaving the queue)
    give up quietly when the server fails them, but never on an interrupt.
    """
    # Busy (code 0), with a waiter woken meanwhile, token "tok" on connection 77.
    busy = b"*7\r\n:0\r\n:1\r\n:0\r\n:0\r\n$0\r\n\r\n$3\r\ntok\r\n$2\r\n77\r\n"
    impostor = Impostor("ok", plausible=True, scripts={"acquire": busy})
    impostor.commands[b"CLIENT LIST"] = STREAMS["a-byte-at-a-time"]
    try:
        uri = f"redis://127.0.0.1:{impostor.port}/0"
        args = ("--uri", uri, "-n", name, "--ttl", "100", "--", "true")
        ended = watch(*args, term_when=impostor.streaming)
    finally:
        impostor.close()
    assert ended.status == 143, ended.stderr
    assert "SIGTERM while waiting" in one_line(ended.stderr)


@pytest.mark.parametrize("stream", ["huge-array", "a-byte-at-a-time", "deep-trickle"])
def test_a_sentinel_whose_answer_never_ends_is_69(stream: str, name: str) -> None:
    """A sentinel that trickles (or floods) its primary's address: 69, memory bounded."""
    impostor = Impostor("ok", plausible=True)
    for asked in (b"MASTERS", b"GET-MASTER-ADDR-BY-NAME"):  # redis-py's question, and ours
        impostor.commands[b"SENTINEL " + asked] = STREAMS[stream]
    try:
        where = f"127.0.0.1:{impostor.port}"
        ended = watch("--uri", f"redis+sentinel://{where}/mymaster", "-n", name, "--", "true")
    finally:
        impostor.close()
    assert ended.status == 69, ended.stderr
    assert where in one_line(ended.stderr)
