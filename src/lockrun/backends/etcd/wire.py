"""HTTP/1.1 as etcd's gateway speaks it: one POST at a time on a kept connection (A13).

What the gateway sends is small and plain: a status line, a few headers, and a body with a
Content-Length (a call) or chunked (a watch's stream of JSON lines). `http.client` reads
the same, through `email.parser`, and costs each lockrun that imports it 3 MiB of private
memory and a few ms of start-up (measured: docs/design.md A13), which every waiting
lockrun pays: this reads what the gateway sends, and refuses anything else in one line.
Every read ends by the call's deadline (`within`), and every answer is bounded in size.
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from lockrun.backends.etcd.uri import TLS

_READ: Final = 65536  # bytes asked of the socket at a time
_MAX_HEAD: Final = 16384  # bytes of a status line and its headers
_MAX_HEADERS: Final = 64


class BadHTTP(ConnectionError):
    """An answer that is not HTTP/1.1 as the gateway speaks it: the connection is useless."""


def _bounded(sock: Any, buffer: Any, nbytes: int, flags: int, read: Any) -> int:  # noqa: ANN401
    """Read into *buffer* with *read* (a socket class's own), never past *sock*'s deadline."""
    if sock.deadline is not None:
        left = sock.deadline - time.monotonic()
        if left <= 0:
            msg = "no whole answer in time"
            raise TimeoutError(msg)
        sock.settimeout(left)
    return int(read(sock, buffer, nbytes, flags))


def _plain(host: str) -> str | bytes:
    """Return *host* as getaddrinfo(3) takes it: bytes when ASCII, else text to encode.

    A text host is encoded with the "idna" codec, whose import (encodings.idna, stringprep,
    unicodedata) took 1 ms of every start and, made after the guardian's fork, cost each
    waiting lockrun 0.7 MiB of pages the two processes no longer shared (issue #33).
    """
    return host.encode() if host.isascii() else host


class _Socket(socket.socket):
    """A socket whose reads all end by the deadline of the call under way."""

    deadline: float | None = None  # time.monotonic(); None: each read as long as it takes

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:  # noqa: ANN401
        """Read as `socket.recv_into`, but never past `deadline`."""
        return _bounded(self, buffer, nbytes, flags, socket.socket.recv_into)


class Link:
    """One HTTP/1.1 connection to a member, on a `_Socket` (TLS where the URI says so).

    Made at the first request; closed after an error, an answer that says so, or a close.
    """

    def __init__(self, host: str, port: int, timeout: float, tls: TLS | None) -> None:
        """Aim at *host*:*port*; nothing is sent until the first request."""
        self.host, self.port = host, port
        self.timeout = timeout
        self.tls = tls
        self.sock: Any = None
        self.deadline: float | None = None
        self._buffer = bytearray()  # read from the socket, not yet taken
        self._view = memoryview(bytearray(_READ))
        self._chunked = False  # the answer under way comes in chunks (`line`, `body`)
        self._left = -1  # the body's length, as its Content-Length says; -1: none said
        self._close = False  # the server closes after this answer
        self._stream = bytearray()  # a stream's bytes not yet read as a line (`line`)

    def within(self, seconds: float | None) -> None:
        """Make every read until the next call end within *seconds* from now (None: no end)."""
        self.deadline = None if seconds is None else time.monotonic() + seconds
        if self.sock is not None:
            self.sock.deadline = self.deadline

    def connect(self) -> None:
        """Connect within the timeout, with TCP_NODELAY: every request is one small write."""
        error: OSError = OSError(f"{self.host}: no address")
        for family, kind, proto, _, address in socket.getaddrinfo(
            _plain(self.host), self.port, 0, socket.SOCK_STREAM
        ):
            sock = _Socket(family, kind, proto)
            try:
                sock.settimeout(self.timeout)
                sock.connect(address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                bounded: Any = sock if self.tls is None else _wrap(sock, self.host, self.tls)
            except OSError as err:
                sock.close()
                error = err
                continue
            bounded.deadline = self.deadline
            self.sock = bounded
            self._buffer.clear()
            return
        raise error

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        """Send one POST with *body*, in one write; read its status line and headers.

        Return the status. The body is then `body` (or `line` by line, for a stream).
        """
        if self.sock is None:
            self.connect()
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        self.sock.sendall("\r\n".join(head).encode() + body)
        return self._head()

    def _head(self) -> int:
        """Read a status line and its headers; return the status."""
        status = self._line(_MAX_HEAD).split(None, 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():  # noqa: PLR2004
            msg = "an answer that is not HTTP/1.1"
            raise BadHTTP(msg)
        self._chunked, self._left, self._close = False, -1, status[0] == b"HTTP/1.0"
        self._stream.clear()
        for _ in range(_MAX_HEADERS):
            line = self._line(_MAX_HEAD)
            if not line:
                return int(status[1])
            name, _, value = line.partition(b":")
            self._header(name.strip().lower(), value.strip().lower())
        msg = "an answer with too many headers"
        raise BadHTTP(msg)

    def _header(self, name: bytes, value: bytes) -> None:
        if name == b"content-length":
            if not value.isdigit() or len(value) > 18:  # noqa: PLR2004 - more than any int64
                msg = "an answer with a bad Content-Length"
                raise BadHTTP(msg)
            self._left = int(value)
        elif name == b"transfer-encoding":
            self._chunked = value == b"chunked"
        elif name == b"connection":
            self._close = value == b"close"

    def body(self, most: int) -> bytes:
        """Read the rest of the answer's body; at most *most* + 1 bytes (more is cut there)."""
        if self._chunked:
            data = bytearray()
            while len(data) <= most and (chunk := self._chunk(most + 1 - len(data))):
                data += chunk
        elif self._left >= 0:
            data = self._take(min(self._left, most + 1))
        else:  # neither: the body runs to the connection's end
            data = bytearray(self._rest(most + 1))
            self._close = True
        if self._close or len(data) > most:
            self.close()
        return bytes(data)

    def ready(self, seconds: float) -> bool:
        """Wait up to *seconds* for a stream's next bytes, reading none; whether any came.

        A wait that ends with nothing leaves the stream whole (a read that timed out could
        stop mid-message, and the stream would be lost): a watch then stays open.
        """
        if self.sock is None:
            msg = "the connection was closed"
            raise BadHTTP(msg)
        if b"\n" in self._stream or self._buffer:
            return True
        if self.tls is not None and self.sock.pending():  # decrypted, not yet taken
            return True
        poller = select.poll()  # not select(2): a descriptor past 1023 is a run's right
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(seconds * 1000))

    def line(self, most: int) -> bytes:
        """Read one line of a chunked stream (with its newline); b"" at the stream's end.

        A line longer than *most* comes back cut at *most* + 1 bytes.
        """
        while True:
            end = self._stream.find(b"\n")
            if end >= 0 or len(self._stream) > most:
                cut = min(end + 1 if end >= 0 else len(self._stream), most + 1)
                line = bytes(self._stream[:cut])
                del self._stream[:cut]
                return line
            chunk = self._chunk(most + 1) if self._chunked else self._rest(most + 1)
            if not chunk:
                line = bytes(self._stream)
                self._stream.clear()
                return line
            self._stream += chunk

    def _chunk(self, most: int) -> bytes:
        """Read the next chunk of a chunked body (b"" at its end); more than *most* is refused."""
        size = self._line(_MAX_HEAD).split(b";", 1)[0].strip()
        try:
            length = int(size, 16)
        except ValueError:
            msg = "a chunk whose size is not hexadecimal"
            raise BadHTTP(msg) from None
        if length == 0:
            while self._line(_MAX_HEAD):  # trailers, to the blank line
                pass
            self._chunked = False
            return b""
        if length > most:
            raise BadHTTP(f"a chunk of {length} bytes, more than {most}")
        data = self._take(length)
        if self._line(2):
            msg = "a chunk longer than it said"
            raise BadHTTP(msg)
        return bytes(data)

    def _line(self, most: int) -> bytes:
        """Return the next line of the answer without its CRLF; `BadHTTP` past *most* bytes."""
        start = 0
        while (end := self._buffer.find(b"\n", start)) < 0:
            if len(self._buffer) > most:
                raise BadHTTP(f"a line longer than {most} bytes")
            start = len(self._buffer)
            self._fill()
        line = bytes(self._buffer[:end]).rstrip(b"\r")
        del self._buffer[: end + 1]
        return line

    def _take(self, count: int) -> bytearray:
        """Return the next *count* bytes of the answer."""
        while len(self._buffer) < count:
            self._fill()
        data = self._buffer[:count]
        del self._buffer[:count]
        return data

    def _rest(self, most: int) -> bytes:
        """Read to the connection's end, at most *most* bytes."""
        try:
            while len(self._buffer) < most:
                self._fill()
        except BadHTTP:  # the end
            pass
        data = bytes(self._buffer[:most])
        del self._buffer[:most]
        return data

    def _fill(self) -> None:
        """Read what the socket has; `BadHTTP` when the server hung up."""
        count = self.sock.recv_into(self._view, _READ)
        if not count:
            msg = "the connection was closed"
            raise BadHTTP(msg)
        self._buffer += self._view[:count]

    def cut(self) -> None:
        """From another thread: end a read under way (a shutdown, not a close)."""
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection; the next request makes another."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self._buffer.clear()


def _wrap(sock: socket.socket, host: str, tls: TLS) -> Any:  # noqa: ANN401 - ssl's, loaded here
    """Speak TLS on *sock*, checking the member as *tls* says (the options of rediss://)."""
    import ssl  # noqa: PLC0415 - etcds:// alone: a tenth of a plain run's start-up

    class TLSSocket(ssl.SSLSocket):
        """An `ssl.SSLSocket` whose reads end by the call's deadline, as `_Socket`'s."""

        deadline: float | None = None

        def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:  # noqa: ANN401
            return _bounded(self, buffer, nbytes or 0, flags, ssl.SSLSocket.recv_into)

    context = ssl.create_default_context(cafile=tls.ca_certs)
    context.check_hostname = tls.check_hostname and tls.cert_reqs != "none"
    context.verify_mode = {
        "none": ssl.CERT_NONE,
        "optional": ssl.CERT_OPTIONAL,
        "required": ssl.CERT_REQUIRED,
    }[tls.cert_reqs]
    if tls.certfile:
        context.load_cert_chain(tls.certfile, tls.keyfile)
    context.sslsocket_class = TLSSocket
    return context.wrap_socket(sock, server_hostname=host)
