"""A loopback TCP proxy whose link can be cut silently, like a network partition.

`Proxy` accepts on 127.0.0.1 (a port of its own) and pipes bytes both ways to a target
address, in one thread. `blackhole()` stops forwarding without closing anything: clients
keep connected sockets (and new connections are still accepted by the kernel) but nothing
reaches the server or comes back, which is what a dropped link looks like from either end
until TCP gives up.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time

_TAIL = 6  # bytes of PostgreSQL's ReadyForQuery message: 'Z', length 5, status


class Proxy:
    """Forward 127.0.0.1:`port` to *target* until `blackhole` or `close`."""

    def __init__(self, target: tuple[str, int], *, late_tail: float = 0.0) -> None:
        """Listen on a free loopback port and start forwarding to *target*.

        With *late_tail*, the last 6 bytes of each chunk from the server come that many
        seconds after the rest: PostgreSQL's ReadyForQuery, after the result it ends.
        """
        self.target = target
        self.late_tail = late_tail
        self._upstreams: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)  # noqa: FBT003 - the socket API
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket | None] = {}
        self._blackholed = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="proxy", daemon=True)
        self._thread.start()

    @property
    def uri(self) -> str:
        """The redis:// URI that reaches the target through this proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def blackhole(self) -> None:
        """Silently drop every byte from now on, both ways, keeping every socket open."""
        self._blackholed.set()

    def close(self) -> None:
        """Stop the thread and close every socket."""
        self._stopping.set()
        self._thread.join(10)
        for sock in [self._listener, *self._peers]:
            sock.close()
        self._selector.close()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            for key, _ in self._selector.select(timeout=0.02):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                else:
                    self._forward(sock)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        client.setblocking(True)  # noqa: FBT003 - the socket API
        upstream = None
        if not self._blackholed.is_set():
            upstream = socket.create_connection(self.target, timeout=5)
            self._peers[upstream] = client
            self._upstreams.add(upstream)
            self._selector.register(upstream, selectors.EVENT_READ)
        self._peers[client] = upstream
        self._selector.register(client, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        if sock not in self._peers:  # closed with its peer earlier in this round of events
            return
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        peer = self._peers[sock]
        if self._blackholed.is_set():
            if not data:  # stop watching a closed end, but tell the other end nothing
                self._selector.unregister(sock)
            return
        if not data:  # a clean close: pass it on, as a working link would
            for end in (sock, peer):
                if end is not None:
                    self._selector.unregister(end)
                    self._peers.pop(end)
                    end.close()
            return
        if peer is not None:
            with contextlib.suppress(OSError):
                if self.late_tail and sock in self._upstreams and len(data) > _TAIL:
                    peer.sendall(data[:-_TAIL])
                    time.sleep(self.late_tail)  # the whole proxy waits: it is for tests
                    data = data[-_TAIL:]
                peer.sendall(data)
