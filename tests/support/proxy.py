"""A loopback TCP proxy whose link can fail the ways networks do: silence, lag and resets.

`Proxy` accepts on 127.0.0.1 (a port of its own) and pipes bytes both ways to a target
address, in one thread. `blackhole()` stops forwarding without closing anything: clients
keep connected sockets (and new connections are still accepted by the kernel) but nothing
reaches the server or comes back, which is what a dropped link looks like from either end
until TCP gives up. `delay()` holds every byte for a while each way, like a slow server or
a congested link; `reset()` aborts every connection with an RST at both ends, as a
firewall or NAT that forgets its state does, and forwards new ones as before.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import selectors
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

_TAIL = 6  # bytes of PostgreSQL's ReadyForQuery message: 'Z', length 5, status


class Proxy:
    """Forward 127.0.0.1:`port` to *target* until `blackhole` or `close`."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        late_tail: float = 0.0,
        tap: Callable[[int, bool, bytes], None] | None = None,
    ) -> None:
        """Listen on a free loopback port and start forwarding to *target*.

        With *late_tail*, the last 6 bytes of each chunk from the server come that many
        seconds after the rest: PostgreSQL's ReadyForQuery, after the result it ends.
        *tap* sees every chunk as it is passed on (never one dropped): the connection (an
        id of its own), whether the server sent it, and the bytes; in the proxy's thread.
        """
        self.target = target
        self.late_tail = late_tail
        self.tap = tap
        self._upstreams: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)  # noqa: FBT003 - the socket API
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket | None] = {}
        self._blackholed = threading.Event()
        self._stopping = threading.Event()
        self._delay = 0.0
        self._due: list[tuple[float, int, socket.socket, bytes]] = []  # (when, order, to, data)
        self._order = itertools.count()
        self._resetting = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="proxy", daemon=True)
        self._thread.start()

    @property
    def uri(self) -> str:
        """The redis:// URI that reaches the target through this proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def blackhole(self) -> None:
        """Silently drop every byte from now on, both ways, keeping every socket open."""
        self._blackholed.set()

    def heal(self) -> None:
        """End a `blackhole`: connections made from now on are forwarded (old ones stay dead)."""
        self._blackholed.clear()

    def delay(self, seconds: float) -> None:
        """Hold every byte for *seconds* before passing it on, both ways (0: no more lag).

        Order is kept: the link is slow, not lossy.
        """
        self._delay = seconds

    def reset(self) -> None:
        """Abort every open connection with an RST to both ends; new ones are forwarded."""
        self._resetting.set()
        while self._resetting.is_set() and self._thread.is_alive():
            time.sleep(0.005)

    def close(self) -> None:
        """Stop the thread and close every socket."""
        self._stopping.set()
        self._thread.join(10)
        for sock in [self._listener, *self._peers]:
            sock.close()
        self._selector.close()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            if self._resetting.is_set():
                self._abort_all()
            self._deliver()
            wait = min([0.02, *(max(0.0, due[0] - time.monotonic()) for due in self._due[:1])])
            for key, _ in self._selector.select(timeout=wait):
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
        if self._blackholed.is_set():
            if not data:  # stop watching a closed end, but tell the other end nothing
                self._selector.unregister(sock)
            return
        if not self._delay and not self._due:  # nothing still on its way that this could pass
            self._pass(sock, data)
            return
        if not data:
            self._selector.unregister(sock)  # its close is passed on later, in order
        when = time.monotonic() + self._delay
        heapq.heappush(self._due, (when, next(self._order), sock, data))

    def _deliver(self) -> None:
        """Pass on the delayed bytes (and closes) whose time has come."""
        while self._due and self._due[0][0] <= time.monotonic():
            _, _, sock, data = heapq.heappop(self._due)
            self._pass(sock, data)

    def _pass(self, sock: socket.socket, data: bytes) -> None:
        """Send *data* from *sock* on to its peer; no data is a clean close, passed on too."""
        if sock not in self._peers:  # reset or closed meanwhile
            return
        peer = self._peers[sock]
        if not data:  # as a working link would
            for end in (sock, peer):
                if end is not None and end in self._peers:
                    with contextlib.suppress(KeyError):
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
            if self.tap is not None:
                client = peer if sock in self._upstreams else sock
                self.tap(id(client), sock in self._upstreams, data)

    def _abort_all(self) -> None:
        """Close every connection with SO_LINGER 0: the kernel sends an RST, not a FIN."""
        for sock in list(self._peers):
            with contextlib.suppress(KeyError):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        self._peers.clear()
        self._upstreams.clear()
        self._due.clear()
        self._resetting.clear()
