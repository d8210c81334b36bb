"""Linux abstract-namespace UNIX sockets: locks with no files, gone the instant a holder dies.

A slot is a listening socket bound to an abstract name; bind(2) is exclusive and the kernel
frees the name when the last descriptor closes, SIGKILL included (docs/design.md A3).
Waiters connect to the holder and sit in its accept backlog, which is FIFO. On release the
holder accepts the oldest waiter and hands it the listening socket itself with SCM_RIGHTS,
so the name never becomes free for a latecomer to take. With N slots every waiter first
queues the same way on a gate name; only the gate's holder (the head) waits on the slots.
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import re
import select
import socket
import stat
import struct
import sys
import time
from typing import TYPE_CHECKING, Final

from lockrun.backends import (
    Holder,
    LockState,
    Request,
    describe_pid,
    next_fence,
    slots_mismatch,
)
from lockrun.errors import ConfigError
from lockrun.names import escape, unescape
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from lockrun.uri import LockURI

_BACKLOG: Final = 4096  # capped by net.core.somaxconn; a full backlog looks like a transition
_RECHECK: Final = 5.0  # every wait re-reads the truth this often (docs/design.md D2)
TRANSITION: Final = 0.005  # a name bound but not yet listening: look again this soon
GATE_GRACE: Final = 0.25  # a one-shot try waits this long for a head that is only sweeping
_UCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid (unix(7))
_MAX_BASE: Final = 70  # 107-byte sun_path minus the longest suffix we append


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,  # noqa: ARG001 - local locks are no leases
    warn: Callable[[str], None] | None = None,  # noqa: ARG001 - and have nothing to warn of
    note: Callable[[str], None] | None = None,  # noqa: ARG001 - or to note
) -> AbstractBackend:
    """Return the abstract-socket backend; refuse where abstract sockets don't exist."""
    if not sys.platform.startswith("linux"):
        msg = f"abstract: needs Linux abstract UNIX sockets; this is {sys.platform}; use file:"
        raise ConfigError(msg)
    return AbstractBackend(uri.path)


# -- socket helpers, shared with the file backend's wake-ups --------------------------------


def bind_listener(name: str) -> socket.socket | None:
    """Listen on abstract *name*; None if another socket has it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            return None
        raise  # pragma: no cover - our names are short and valid: a bug worth a traceback
    sock.listen(_BACKLOG)
    return sock


def bind_marker(name: str) -> socket.socket | None:
    """Bind an unconnected socket to *name* so that /proc/net/unix shows it; best effort."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind("\0" + name)
    except OSError:  # pragma: no cover - pid and microsecond make the name unique
        sock.close()
        return None
    return sock


def connect_to(name: str) -> socket.socket | None:
    """Connect to the listener on *name*; None when nobody listens there (yet)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)  # noqa: FBT003 - a full backlog would block connect(2): EAGAIN
    try:
        sock.connect("\0" + name)
    except OSError as err:
        sock.close()
        if err.errno in {errno.ECONNREFUSED, errno.ENOENT, errno.EAGAIN}:
            return None
        raise  # pragma: no cover - our names are short and valid: a bug worth a traceback
    return sock


def remaining(deadline: float | None, cap: float = _RECHECK) -> float:
    """Seconds to the deadline (0 when past), at most *cap*."""
    return cap if deadline is None else max(0.0, min(cap, deadline - now()))


def wait_readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """Return the sockets of *socks* readable (or hung up) within *timeout* seconds."""
    poller = select.poll()
    by_fd = {sock.fileno(): sock for sock in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(timeout * 1000)]


def _receive(conn: socket.socket, name: str) -> tuple[socket.socket, bytes] | None:
    """Take a handed-over listener of *name* from *conn* if one is queued there; never blocks.

    Anyone in this network namespace can listen on a name and send us anything: only a
    listening socket bound to *name* itself is the slot (the kernel binds a name to one
    socket only); anything else is closed and counts as a hang-up.
    """
    # Not socket.recv_fds: Python 3.11's ignores its flags, so MSG_DONTWAIT would block.
    fds = array.array("i")
    flags = socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
    try:
        message, ancillary, _, _ = conn.recvmsg(64, socket.CMSG_SPACE(fds.itemsize), flags)
    except (BlockingIOError, ConnectionResetError):
        return None
    for level, kind, data in ancillary:  # room for one fd: the kernel truncates the rest
        if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
            fds.frombytes(data[: fds.itemsize] if len(data) >= fds.itemsize else b"")
    if not fds:
        return None
    if not _is_listener_of(fds[0], name):
        os.close(fds[0])
        return None
    listener = socket.socket(fileno=fds[0])
    listener.listen(_BACKLOG)  # so that SO_PEERCRED names us, its holder now (`_markers`)
    return listener, message


def _is_listener_of(fd: int, name: str) -> bool:
    """Whether *fd* is a listening UNIX stream socket bound to abstract *name*."""
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        return False
    probe = socket.socket(fileno=os.dup(fd))
    try:
        return (
            probe.family == socket.AF_UNIX
            and probe.type == socket.SOCK_STREAM
            and probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            and probe.getsockname() in {"\0" + name, b"\0" + name.encode()}
        )
    except OSError:
        return False
    finally:
        probe.close()


def hand_over(listener: socket.socket, payload: bytes) -> None:
    """Pass *listener* to the oldest waiter still connected, or close it (freeing the name)."""
    listener.setblocking(False)  # noqa: FBT003 - the socket API
    with listener:
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return
            with conn:
                try:
                    socket.send_fds(conn, [payload], [listener.fileno()])
                except OSError:  # that waiter gave up; ask the next one
                    continue
                return


def take(names: list[str], deadline: float | None) -> tuple[int, socket.socket, bytes] | None:
    """Hold one of *names*: bind a free one, else wait for a holder to hand theirs over.

    A connection, once made, is kept until its holder hangs up or hands over: making it
    again would move us to the back of that holder's queue.
    """
    conns: dict[int, socket.socket] = {}
    try:
        while True:
            for index, name in enumerate(names):
                if index not in conns and (listener := bind_listener(name)) is not None:
                    return index, listener, b""
            wait = remaining(deadline)
            if wait == 0:
                return None
            for index, name in enumerate(names):
                if index not in conns and (conn := connect_to(name)) is not None:
                    conns[index] = conn
            if len(conns) < len(names):  # a name in transition: look again soon
                wait = min(wait, TRANSITION)
            if (got := _await_hand_over(conns, names, wait)) is not None:
                return got
    finally:
        for conn in conns.values():
            conn.close()


def _await_hand_over(
    conns: dict[int, socket.socket], names: list[str], wait: float
) -> tuple[int, socket.socket, bytes] | None:
    """Wait for a holder among *conns* to hand over; drop those that hung up instead."""
    ready = wait_readable(list(conns.values()), wait)
    for index, conn in list(conns.items()):
        if conn in ready:
            if (got := _receive(conn, names[index])) is not None:
                return index, *got
            del conns[index]  # hung up without a hand-over: the name may be free now
            conn.close()
            time.sleep(TRANSITION)  # a squatter that answers at once must not spin us
    return None


# -- the backend ---------------------------------------------------------------------------


def _base(prefix: str, namespace: str, name: str) -> str:
    readable = f"lockrun/{escape(prefix)}/{escape(namespace)}/{escape(name)}"
    if len(readable.encode()) <= _MAX_BASE:
        return readable
    import hashlib  # noqa: PLC0415 - only long names pay for OpenSSL's load

    digest = hashlib.sha256(f"{prefix}\0{namespace}\0{name}".encode()).hexdigest()[:40]
    return f"lockrun/#{digest}"


class AbstractLease:
    """A held abstract slot: the listening socket plus a marker that names the holder."""

    ttl: float | None = None  # the slot lives exactly as long as the listening socket
    sessions: tuple[int, ...] = ()
    bells: tuple[int, ...] = ()  # take-over bells (backends.Lease)

    def __init__(
        self, slot: int, fence: int, listener: socket.socket, marker: socket.socket | None
    ) -> None:
        """Hold slot *slot* through *listener*."""
        self.slot, self.fence = slot, fence
        self.confirmed = now()  # no lease: for the record only
        self._listener: socket.socket | None = listener
        self._marker = marker

    @property
    def fds(self) -> tuple[int, ...]:
        """Return the listening socket: the slot is held while any process has it open."""
        return () if self._listener is None else (self._listener.fileno(),)

    def refresh(self) -> None:
        """Do nothing: the slot lives exactly as long as this process."""

    def release(self, hold: float = 0.0) -> None:
        """Hand the slot to the oldest waiter, or free the name."""
        if self._listener is not None:
            hand_over(self._listener, str(self.fence).encode())
            self._listener = None
        if self._marker is not None:
            self._marker.close()
            self._marker = None


class AbstractBackend:
    """Locks in the abstract UNIX-socket namespace of this network namespace."""

    def __init__(self, prefix: str) -> None:
        """Keep our names under *prefix*."""
        self.prefix = prefix

    def acquire(self, request: Request, deadline: float | None) -> AbstractLease | None:
        """Queue FIFO for one of *request.slots* slots until *deadline*."""
        base = _base(self.prefix, request.namespace, request.name)
        slots = [f"{base}/{slot}" for slot in range(request.slots)]
        for holder, their_slots in _holders(base):
            if their_slots != request.slots:
                raise slots_mismatch(request, their_slots, holder)
        if request.slots == 1 and (listener := bind_listener(slots[0])) is not None:
            return self._grant(base, 1, (0, listener, b""))  # free: no waiter marker needed
        with self._waiting(base, request):
            if request.slots == 1:
                return self._grant(base, request.slots, take(slots, deadline))
            gate_deadline = None if deadline is None else max(deadline, now() + GATE_GRACE)
            gate = take([f"{base}/g"], gate_deadline)
            if gate is None:
                return None
            _, gate_listener, counter = gate
            lease = None
            try:
                lease = self._grant(base, request.slots, take(slots, deadline), counter)
            finally:
                fence = b"" if lease is None else str(lease.fence).encode()
                hand_over(gate_listener, fence or counter)
            return lease

    @staticmethod
    @contextlib.contextmanager
    def _waiting(base: str, request: Request) -> Iterator[None]:
        since = request.holder.since or time.time()
        marker = bind_marker(f"{base}/w/{int(since * 1e6)}/{os.getpid()}")
        try:
            yield
        finally:
            if marker is not None:
                marker.close()

    @staticmethod
    def _grant(
        base: str,
        slots: int,
        taken: tuple[int, socket.socket, bytes] | None,
        counter: bytes = b"",
    ) -> AbstractLease | None:
        if taken is None:
            return None
        slot, listener, payload = taken
        fence = next_fence(counter or payload)
        marker = bind_marker(f"{base}/h{slot}.{slots}/{int(time.time() * 1000)}/{os.getpid()}")
        return AbstractLease(slot, fence, listener, marker)

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """List the locks of this prefix and *namespace* that have holders or waiters."""
        wanted = None if name is None else _base(self.prefix, namespace, name)
        found: dict[str, tuple[list[Holder], list[Holder]]] = {}
        for marker in _markers(wanted):
            holders, waiters = found.setdefault(marker["base"], ([], []))
            if marker["slot"] is not None:
                holder = describe_pid(int(marker["pid"]))
                holders.append(_with(holder, int(marker["ms"]) / 1e3, int(marker["slot"])))
            else:
                waiters.append(_with(describe_pid(int(marker["wpid"])), int(marker["us"]) / 1e6))
        states = []
        for base, (holders, waiters) in sorted(found.items()):
            parts = _READABLE.fullmatch(base)
            if parts is not None:
                if (unescape(parts["prefix"]), unescape(parts["ns"])) != (self.prefix, namespace):
                    continue
                lock_name = unescape(parts["name"])
            elif name is None:
                continue  # a hashed name we can't attribute to this namespace
            else:
                lock_name = name
            holders.sort(key=lambda holder: holder.slot or 0)
            waiters.sort(key=lambda waiter: waiter.since or 0.0)
            states.append(
                LockState(namespace, lock_name, "@" + base, None, tuple(holders), tuple(waiters))
            )
        if wanted is not None and not states:
            states.append(LockState(namespace, name or "", "@" + wanted))  # free
        return states

    def close(self) -> None:
        """Nothing to close: there is no connection."""


_MARKER: Final = re.compile(
    r"(?P<base>lockrun/(?:#[0-9a-f]+|[^/]*/[^/]*/[^/]*))/"
    r"(?:h(?P<slot>\d+)\.(?P<slots>\d+)/(?P<ms>\d+)/(?P<pid>\d+)|w/(?P<us>\d+)/(?P<wpid>\d+))",
    re.ASCII,
)
_READABLE: Final = re.compile(r"lockrun/(?P<prefix>[^/#]*)/(?P<ns>[^/]*)/(?P<name>[^/]*)")


def _holders(base: str) -> Iterator[tuple[Holder, int]]:
    """Yield each live holder of *base* with the --slots it uses."""
    for marker in _markers(base):
        if marker["slot"] is not None:
            holder = _with(
                describe_pid(int(marker["pid"])), int(marker["ms"]) / 1e3, int(marker["slot"])
            )
            yield holder, int(marker["slots"])


def _markers(base: str | None = None) -> Iterator[re.Match[str]]:
    """Yield the holder and waiter markers (of *base* only, if given) that the kernel backs.

    Anyone can bind any abstract name, and a name may hold a line break that forges a line
    of /proc/net/unix. A holder marker is believed only if the kernel says that the process
    it names listens on the slot it names: SO_PEERCRED of a connection to the slot gives the
    PID of the last process to call listen(2) on it, which a taker does (`_receive`). A
    waiter marker, an unconnected socket, only if the process it names has that very socket
    open, where /proc lets us look (our own processes, or all of them as root).
    """
    for path, inode in _abstract_names(base):
        marker = _MARKER.fullmatch(path)
        if marker is None or (base is not None and marker["base"] != base):
            continue
        if marker["slot"] is None:
            believed = _has_socket(int(marker["wpid"]), inode)
        else:
            slot = int(marker["slot"])
            believed = slot < int(marker["slots"]) and _listener_pid(
                f"{marker['base']}/{slot}"
            ) == int(marker["pid"])
        if believed:
            yield marker


def _listener_pid(name: str) -> int | None:
    """Return the PID that the kernel gives for the listener on *name*; None if nobody listens.

    0 for a process outside our PID namespace.
    """
    probe = connect_to(name)
    if probe is None:
        return None
    with probe:
        ucred = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, _, _ = _UCRED.unpack(ucred)
    return int(pid)


def _has_socket(pid: int, inode: str) -> bool:
    """Whether process *pid* lives and has socket *inode* open (True if we may not look)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except PermissionError:  # another user's process: alive, and all we can tell
        return True
    except OSError:  # gone
        return False
    wanted = f"socket:[{inode}]"
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(f"/proc/{pid}/fd/{fd}") == wanted:
                return True
    return False


def _with(holder: Holder, since: float, slot: int | None = None) -> Holder:
    return holder._replace(since=since, slot=slot)


def _abstract_names(base: str | None = None) -> Iterator[tuple[str, str]]:
    """Yield our abstract socket names (under *base*, if given) in this network namespace.

    With their inodes, from /proc/net/unix: Num RefCount Protocol Flags Type St Inode Path.
    It lists every UNIX socket of the namespace, often thousands: only the lines that name
    one of ours are split, found by a regular expression over the whole table at once.
    """
    table = os.open("/proc/net/unix", os.O_RDONLY | os.O_CLOEXEC)  # open() adds 4 syscalls
    try:
        text = b"".join(iter(lambda: os.read(table, 1 << 16), b""))
    finally:
        os.close(table)
    ours = re.escape(f"@{base}/" if base is not None else "@lockrun/").encode()
    for line in re.finditer(rb"^[^\n]*" + ours + rb"[^\n]*$", text, re.MULTILINE):
        fields = line[0].decode(errors="replace").split()
        if len(fields) == 8 and fields[7].startswith("@lockrun/"):  # noqa: PLR2004
            yield fields[7][1:], fields[6]
