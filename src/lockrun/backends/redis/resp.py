"""Redis's replies, read within bounds: a deadline per reply, and caps on its size.

redis-py reads a reply until it is whole, however long the server takes and however much
it says: its socket timeout bounds each recv, which a trickle of bytes resets, and a length
of ``$999999999999`` is believed. A server that is not Redis (or a link that is not the
server's) could hold lockrun for ever, deaf to TERM's clean-up, and fill its memory
(docs/semantics.md "What bounds a call"). So every connection lockrun makes reads through
`Parser`: each reply must be whole within the call's timeout, counted from when lockrun
starts to read it; and it may announce or bring at most `MAX_BYTES` bytes, `MAX_ITEMS`
elements and `MAX_DEPTH` levels of nesting. Beyond, redis-py's TimeoutError or
`TooLarge` (its InvalidResponse): the backend says so in one line, 69.

`bound` is given to redis-py as ``redis_connect_func``, which every connection it makes
(plain, TLS, unix, Sentinel's and a cluster node's) calls once its socket is open: the
handshake (HELLO, AUTH) is read within the bounds too.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Final

from redis._parsers import _RESP3Parser
from redis._parsers.socket import SocketBuffer
from redis.exceptions import InvalidResponse
from redis.utils import SENTINEL

from lockrun.timing import now

if TYPE_CHECKING:
    import socket
    from collections.abc import Iterator

# lockrun's largest replies are a lock's state (about 7 elements and 500 bytes a waiter)
# and a SCAN page of 1000 keys: these leave room for some 30000 waiters.
MAX_BYTES: Final = 16 << 20
MAX_ITEMS: Final = 1 << 18  # an element is ~60 bytes in Python: 16 MiB at most
MAX_DEPTH: Final = 16  # HELLO's and CLUSTER SLOTS's replies nest 3 deep
_BULK: Final = frozenset(b"$=!")  # a header's first byte: a length of bytes follows
_AGGREGATE: Final = frozenset(b"*~%>|")  # …: a number of elements (pairs for % and |)


_CALL = threading.local()  # .end: when every reply of the block under way must be whole


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Make every reply this thread reads in the block whole within *seconds*, all in all.

    For a clean-up of several calls (a release after TERM) that must end in one timeout.
    """
    outer: float | None = getattr(_CALL, "end", None)
    end = now() + seconds
    _CALL.end = end if outer is None else min(outer, end)
    try:
        yield
    finally:
        _CALL.end = outer


class TooLarge(InvalidResponse):
    """A reply beyond `MAX_BYTES`, `MAX_ITEMS` or `MAX_DEPTH`: no Redis answers lockrun so."""


class _Deadline:
    """A socket's reading side that stops at a deadline and after `MAX_BYTES`, while armed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline: float | None = None
        self.left: int | None = None  # None: not armed (between replies: a poll, can_read)

    def arm(self, seconds: float | None) -> None:
        """Start a reply: it must be whole within *seconds* (None: no deadline)."""
        self.deadline = None if seconds is None else now() + seconds
        self.left = MAX_BYTES

    def disarm(self) -> None:
        """End a reply."""
        self.deadline = self.left = None

    def settimeout(self, value: float | None) -> None:
        """Set the socket's own timeout (redis-py's, for a read or between them)."""
        self.sock.settimeout(value)

    def recv(self, size: int) -> bytes:
        """Read up to *size* bytes, within the deadline and what is left of the cap."""
        if self.left is None:
            return self.sock.recv(size)
        saved = self.sock.gettimeout()
        if self.deadline is not None:
            left = self.deadline - now()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left if not saved else min(left, saved))
        try:
            data = self.sock.recv(size)
        finally:
            self.sock.settimeout(saved)
        self.left -= len(data)
        if self.left < 0:
            msg = f"Protocol error: a reply of more than {MAX_BYTES} bytes"
            raise TooLarge(msg)
        return data


class _Buffer(SocketBuffer):
    """redis-py's buffer, refusing a header that announces more than the caps allow."""

    def readline(self, timeout: Any = SENTINEL) -> bytes:  # noqa: ANN401 - redis-py's SENTINEL or seconds
        """Return the next line: a simple value, or the header of a bulk or an aggregate."""
        line: bytes = super().readline(timeout)
        kind, number = line[:1], line[1:]
        if kind and kind[0] in _BULK | _AGGREGATE and number.isdigit():  # "-1": a null
            cap = MAX_BYTES if kind[0] in _BULK else MAX_ITEMS
            if int(number) > cap:
                unit = "bytes" if cap == MAX_BYTES else "elements"
                msg = f"Protocol error: a reply announces {int(number)} {unit}"
                raise TooLarge(msg)
        return line


class Parser(_RESP3Parser):
    """redis-py's RESP3 parser, reading each reply within a deadline and the caps."""

    def __init__(self, socket_read_size: int) -> None:
        """Make a parser that reads *socket_read_size* bytes at a time."""
        super().__init__(socket_read_size)  # type: ignore[no-untyped-call]
        self._reading: _Deadline | None = None
        self._items = self._depth = 0

    def on_connect(self, connection: Any) -> None:  # noqa: ANN401 - redis-py's Connection
        """Read *connection*'s socket through `_Deadline` and `_Buffer`."""
        super().on_connect(connection)  # type: ignore[no-untyped-call]
        if self._buffer is not None:
            self._buffer.close()
        self._reading = _Deadline(connection._sock)  # noqa: SLF001 - redis-py has no accessor
        self._buffer = _Buffer(
            self._reading,  # type: ignore[arg-type]  # reads, and sets its timeout
            self.socket_read_size,
            connection.socket_timeout,
        )

    def read_response(
        self,
        disable_decoding: bool = False,  # redis-py's signature
        push_request: bool = False,
        timeout: Any = SENTINEL,  # noqa: ANN401 - redis-py's SENTINEL or seconds
    ) -> Any:  # noqa: ANN401 - a reply
        """Read one reply, whole within *timeout* (default: the socket's) and the caps."""
        reading = self._reading
        if reading is not None and self._buffer is not None:
            seconds = self._buffer.socket_timeout if timeout is SENTINEL else timeout
            end: float | None = getattr(_CALL, "end", None)
            if end is not None:  # `within` a block's time
                seconds = end - now() if seconds is None else min(seconds, end - now())
            reading.arm(seconds)
        self._items = self._depth = 0
        try:
            return super().read_response(
                disable_decoding=disable_decoding, push_request=push_request, timeout=timeout
            )
        finally:
            if reading is not None:
                reading.disarm()

    def _read_response(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - redis-py's
        """Read one element (aggregates recurse here), counting elements and depth."""
        self._items += 1
        self._depth += 1
        try:
            if self._items > MAX_ITEMS or self._depth > MAX_DEPTH:
                msg = f"Protocol error: a reply over {MAX_ITEMS} elements or {MAX_DEPTH} deep"
                raise TooLarge(msg)
            return super()._read_response(*args, **kwargs)
        finally:
            self._depth -= 1


def bound(connection: Any) -> None:  # noqa: ANN401 - redis-py's Connection
    """Read every reply of *connection* through `Parser`, then shake hands (redis-py's own).

    redis-py's ``redis_connect_func``: called once the socket is open, in place of
    ``on_connect``. The parser redis-py made is replaced (hiredis's too: its C reader knows
    no caps), keeping the handlers set on it for pushed messages.
    """
    made = connection._parser  # noqa: SLF001 - redis-py has no accessor
    if type(made) is not Parser:
        connection.set_parser(Parser)
        parser = connection._parser  # noqa: SLF001
        for name, value in vars(made).items():
            if name.endswith("_push_handler_func") and not name.startswith("pubsub"):
                setattr(parser, name, value)
    connection.on_connect()
