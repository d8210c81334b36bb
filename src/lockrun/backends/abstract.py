"""Linux abstract-namespace UNIX sockets: locks with no files, gone the instant a holder dies.

A slot is a listening socket bound to an abstract name; bind(2) is exclusive and the kernel
frees the name when the last descriptor closes, SIGKILL included (docs/design.md A3).
Waiters connect to the holder and sit in its accept backlog, which is FIFO. On release the
holder accepts the oldest waiter and hands it the listening socket itself with SCM_RIGHTS,
so the name never becomes free for a latecomer to take. With N slots every waiter first
queues the same way on a gate name; only the gate's holder (the head) waits on the slots.
Of the fleet modes it offers --shared only: with no storage, a --hold-at-least window would
need a process of its own and a --take-over a bell on every holder (docs/design.md A3), so
the registry declines them (`lockrun.uri.SCHEMES`).
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
from lockrun.errors import BackendUnavailable, ConfigError
from lockrun.names import escape, unescape
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from lockrun.uri import LockURI

_BACKLOG: Final = 4096  # capped by net.core.somaxconn; a full backlog looks like a transition
RECHECK: Final = 5.0  # every wait re-reads the truth this often (docs/design.md D2)
# Queued on every name, a waiter has no truth to re-read: the kernel wakes its connection
# when the holder hands over or the name's last descriptor closes (docs/design.md A3). It
# looks once a minute all the same, so that a wait stays bounded (D2).
QUEUED_RECHECK: Final = 60.0
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
        raise  # our names are short and valid: a bug worth a traceback
    sock.listen(_BACKLOG)
    return sock


def bind_marker(name: str) -> socket.socket | None:
    """Bind an unconnected socket to *name* so that /proc/net/unix shows it; best effort."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind("\0" + name)
    except OSError:  # taken: pid and time make our names unique, so a squatter's
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
        raise  # our names are short and valid: a bug worth a traceback
    return sock


def remaining(deadline: float | None, cap: float = RECHECK) -> float:
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
            _connect_all(names, conns)
            if len(conns) < len(names):  # a name in transition: look again soon
                wait = min(wait, TRANSITION)
            else:
                wait = remaining(deadline, QUEUED_RECHECK)
            if (got := _await_hand_over(conns, names, wait)) is not None:
                return got
    finally:
        for conn in conns.values():
            conn.close()


def _connect_all(names: list[str], conns: dict[int, socket.socket]) -> None:
    """Queue on each of *names* we are not queued on yet (those listening)."""
    for index, name in enumerate(names):
        if index not in conns and (conn := connect_to(name)) is not None:
            conns[index] = conn


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


def accept_all(listener: socket.socket) -> list[socket.socket]:
    """Accept every connection waiting on the non-blocking *listener*."""
    accepted: list[socket.socket] = []
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:  # EAGAIN: none left; EMFILE: they stay queued until the next look
            return accepted
        accepted.append(conn)


# -- the backend ---------------------------------------------------------------------------


def _base(prefix: str, namespace: str, name: str) -> str:
    readable = f"lockrun/{escape(prefix)}/{escape(namespace)}/{escape(name)}"
    if len(readable.encode()) <= _MAX_BASE:
        return readable
    import hashlib  # noqa: PLC0415 - only long names pay for OpenSSL's load

    digest = hashlib.sha256(f"{prefix}\0{namespace}\0{name}".encode()).hexdigest()[:40]
    return f"lockrun/#{digest}"


_SHARED_FLAG: Final = b" r"  # in a hand-over's payload: readers may hold the lock too
_NAME_TRIES: Final = 1000  # µs to try for a name of our own before calling them squatted


def _counter(payload: bytes) -> bytes:
    """Return the fence counter a hand-over's *payload* carries (b"" for none)."""
    return payload.split(b" ", 1)[0]


def _bind_own(prefix: str) -> socket.socket:
    """Listen on ``PREFIX/US/PID``, a name of our own (US: now in µs, or a little later)."""
    us = time.time_ns() // 1000
    for tried in range(_NAME_TRIES):  # two of one process in one µs: the next µs
        if (sock := bind_listener(f"{prefix}/{us + tried}/{os.getpid()}")) is not None:
            sock.setblocking(False)  # noqa: FBT003 - the socket API
            return sock
    msg = f"every abstract name {prefix}/… of this process is taken (squatted?)"
    raise BackendUnavailable(msg)


class AbstractLease:
    """A held abstract slot: the listening socket plus a marker that names the holder.

    A shared (reader) lease holds its own listening socket at ``BASE/r/US/PID`` instead; the
    slot's socket went on to the next waiter (docs/design.md A3).
    """

    ttl: float | None = None  # the slot lives exactly as long as the listening socket
    sessions: tuple[int, ...] = ()
    orphan: bytes | None = None  # the name ends with its last socket

    def __init__(
        self,
        slot: int,
        fence: int | None,
        listener: socket.socket,
        marker: socket.socket | None,
    ) -> None:
        """Hold slot *slot* through *listener*, named by *marker*; *fence* None: a reader."""
        self.slot, self.fence = slot, fence
        self.confirmed = now()  # no lease: for the record only
        self._listener: socket.socket | None = listener
        self._marker = marker
        self._waiting_writers: list[
            socket.socket
        ] = []  # a reader's: writers waiting for it to leave

    @property
    def fds(self) -> tuple[int, ...]:
        """Return the listening socket: the slot is held while any process has it open."""
        return () if self._listener is None else (self._listener.fileno(),)

    @property
    def bells(self) -> tuple[int, ...]:
        """Return a reader's own listening socket: who connects to it gets accepted (`refresh`)."""
        listener = self._listener
        return (listener.fileno(),) if self.fence is None and listener is not None else ()

    def refresh(self) -> None:
        """Accept what connected to a reader's socket; the slot lives as long as we do.

        Writers wait on a connection to each reader, and `status` probes it: accepted, the
        probes cannot fill its backlog, which would tell a writer that the reader left.
        """
        listener = self._listener  # a release may run meanwhile
        if self.fence is None and listener is not None:
            # Keep what writers connected: a connection closed would tell them we left.
            self._waiting_writers = [conn for conn in self._waiting_writers if not _hung_up(conn)]
            self._waiting_writers += accept_all(listener)

    def release(self, hold: float = 0.0) -> bool:  # noqa: ARG002 - no windows here (uri.SCHEMES)
        """Hand the slot to the oldest waiter, or free the name."""
        if self._marker is not None:
            self._marker.close()
            self._marker = None
        if self._listener is not None:
            if self.fence is None:
                self._listener.close()  # a reader: the writer waiting for it sees it go
            else:
                hand_over(self._listener, str(self.fence).encode())
            self._listener = None
        for conn in self._waiting_writers:
            conn.close()
        self._waiting_writers = []
        return True


def _hung_up(conn: socket.socket) -> bool:
    """Whether the far end of *conn* closed (it never sends: anything readable is the end)."""
    if conn.fileno() >= 0 and not wait_readable([conn], 0):
        return False
    conn.close()
    return True


class AbstractBackend:
    """Locks in the abstract UNIX-socket namespace of this network namespace."""

    def __init__(self, prefix: str) -> None:
        """Keep our names under *prefix*."""
        self.prefix = prefix

    def acquire(self, request: Request, deadline: float | None) -> AbstractLease | None:
        """Queue FIFO for one of *request.slots* slots until *deadline*."""
        base = _base(self.prefix, request.namespace, request.name)
        if request.slots == 1:
            return self._acquire_one(base, request, deadline)
        _agree(base, request)
        slots = [f"{base}/{slot}" for slot in range(request.slots)]
        with self._waiting(base, request):
            gate_deadline = None if deadline is None else max(deadline, now() + GATE_GRACE)
            gate = take([f"{base}/g"], gate_deadline)
            if gate is None:
                return None
            _, gate_listener, counter = gate
            lease = None
            try:
                taken = take(slots, deadline)
                if taken is None:
                    return None
                lease = self._grant(base, request.slots, taken, counter)
            finally:
                fence = b"" if lease is None else str(lease.fence).encode()
                hand_over(gate_listener, fence or counter)
            return lease

    def _acquire_one(
        self, base: str, request: Request, deadline: float | None
    ) -> AbstractLease | None:
        """Take a lock of one slot, exclusive or shared (docs/design.md A3)."""
        slot = f"{base}/0"
        taken = None
        if (listener := bind_listener(slot)) is not None:
            taken = (0, listener, b"")
        else:
            _agree(base, request)
            if request.shared and deadline is not None:
                # A one-shot reader waits briefly for a reader on its way in (A3).
                deadline = max(deadline, now() + GATE_GRACE)
            with self._waiting(base, request):
                taken = take([slot], deadline)
        if taken is None:
            return None
        return self._hold(base, request, deadline, taken[1], taken[2])

    def _hold(
        self,
        base: str,
        request: Request,
        deadline: float | None,
        listener: socket.socket,
        payload: bytes,
    ) -> AbstractLease | None:
        """Make the slot's *listener*, ours now, a lease; or give it back.

        A writer keeps it, waiting first until no reader is left; a reader lists itself and
        passes it on at once. On a name that was free, either first looks for holders of
        another --slots.
        """
        fresh = not payload
        counter = _counter(payload)
        try:
            if request.shared:
                reader = _bind_own(f"{base}/r")  # listed first, then looking: A3
                if fresh:
                    _check(base, request, reader.close, "h")
                hand_over(listener, counter + _SHARED_FLAG)
                return AbstractLease(0, None, reader, None)
            # What to look at: holders on a name that was free, readers on it or after a
            # reader's hand-over. Each is one read of /proc/net/unix, which a hand-over from
            # a writer never pays.
            kinds = "hr" if fresh else "r" if _SHARED_FLAG in payload else ""
            own = _mark(base, 0, 1)
            if kinds and (readers := _check(base, request, _closer(own), kinds)):
                _closer(own)()
                if not self._wait_for_readers(base, request, readers, deadline):
                    hand_over(listener, payload)
                    return None
                own = _mark(base, 0, 1)
            return AbstractLease(0, next_fence(counter), listener, own)
        except BaseException:
            if listener.fileno() >= 0:
                hand_over(listener, payload)
            raise

    def _wait_for_readers(
        self, base: str, request: Request, readers: list[str], deadline: float | None
    ) -> bool:
        """Keep the slot until the readers *readers* (their names) have all left.

        None can come meanwhile: a reader lists itself only while it holds the slot. A
        connection to each reader's socket hangs up when the reader leaves (docs/design.md A3).
        """
        conns: dict[str, socket.socket] = {}
        left = set(readers)
        with self._waiting(base, request):
            try:
                while True:
                    for name in list(left - conns.keys()):
                        conn = connect_to(name)
                        if conn is None:
                            left.discard(name)  # gone, or nobody listens there any more
                        else:
                            conns[name] = conn
                    if not left:
                        return True
                    wait = remaining(deadline)
                    if wait == 0:
                        return False
                    for conn in wait_readable(list(conns.values()), wait):
                        name = next(name for name, each in conns.items() if each is conn)
                        conns.pop(name).close()  # hung up: look whether it still listens
            finally:
                for conn in conns.values():
                    conn.close()

    @staticmethod
    @contextlib.contextmanager
    def _waiting(base: str, request: Request) -> Iterator[None]:
        since = request.holder.since or time.time()
        shared = "/s" if request.shared else ""
        marker = bind_marker(f"{base}/w/{int(since * 1e6)}/{os.getpid()}{shared}")
        try:
            yield
        finally:
            if marker is not None:
                marker.close()

    @staticmethod
    def _grant(
        base: str,
        slots: int,
        taken: tuple[int, socket.socket, bytes],
        counter: bytes = b"",
    ) -> AbstractLease:
        slot, listener, payload = taken
        return AbstractLease(
            slot, next_fence(counter or payload), listener, _mark(base, slot, slots)
        )

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """List the locks of this prefix and *namespace* that have holders or waiters."""
        wanted = None if name is None else _base(self.prefix, namespace, name)
        found: dict[str, tuple[list[Holder], list[Holder]]] = {}
        for marker, pid in _markers(wanted, "hwr"):
            holders, waiters = found.setdefault(marker["base"], ([], []))
            if marker["wpid"] is not None:
                waiters.append(_described(marker, pid))
            else:
                holders.append(_described(marker, pid))
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
            holders.sort(key=lambda holder: (holder.slot or 0, holder.since or 0.0))
            waiters.sort(key=lambda waiter: waiter.since or 0.0)
            states.append(
                LockState(namespace, lock_name, "@" + base, None, tuple(holders), tuple(waiters))
            )
        if wanted is not None and not states:
            states.append(LockState(namespace, name or "", "@" + wanted))  # free
        return states

    def close(self) -> None:
        """Nothing to close: there is no connection."""


def _mark(base: str, slot: int, slots: int) -> socket.socket | None:
    """Bind the marker that names us holder of *slot*, and since when (in ms)."""
    return bind_marker(f"{base}/h{slot}.{slots}/{int(time.time() * 1000)}/{os.getpid()}")


def _closer(sock: socket.socket | None) -> Callable[[], None]:
    return (lambda: None) if sock is None else sock.close


def _agree(base: str, request: Request) -> None:
    """Raise `ConfigError` if a live holder of *base* uses another --slots."""
    for marker, pid in _markers(base, "hr"):
        theirs = 1 if marker["rpid"] is not None else int(marker["slots"])
        if theirs != request.slots:
            raise slots_mismatch(request, theirs, _described(marker, pid))


def _check(
    base: str, request: Request, give_back: Callable[[], object], kinds: str = "hr"
) -> list[str]:
    """Look, as a new holder of *base*, at its other holders: markers of *kinds* (h, r).

    Raise `ConfigError` for one of another --slots, calling *give_back* first. Return the
    names of the readers' sockets: every one, believed or not, since a writer must never run
    beside a reader the kernel cannot name to us (another PID namespace); a forged one only
    holds the lock as a squatter could.
    """
    readers: list[str] = []
    for marker, pid in _markers(base, kinds, unchecked="r"):
        if marker["rpid"] is not None:
            readers.append(marker[0])
            if request.slots == 1 or pid != _listener_pid(marker[0]):
                continue
            theirs = 1
        elif (theirs := int(marker["slots"] or 1)) == request.slots:
            continue
        give_back()
        raise slots_mismatch(request, theirs, _described(marker, pid))
    return readers


_MARKER: Final = re.compile(
    r"(?P<base>lockrun/(?:#[0-9a-f]+|[^/]*/[^/]*/[^/]*))/"
    r"(?:h(?P<slot>\d+)\.(?P<slots>\d+)/(?P<ms>\d+)/(?P<pid>\d+)"
    r"|w/(?P<us>\d+)/(?P<wpid>\d+)(?P<wshared>/s)?"
    r"|r/(?P<rus>\d+)/(?P<rpid>\d+))",
    re.ASCII,
)
_READABLE: Final = re.compile(r"lockrun/(?P<prefix>[^/#]*)/(?P<ns>[^/]*)/(?P<name>[^/]*)")


def _kind(marker: re.Match[str]) -> str:
    """Return what *marker* marks: h(older), w(aiter) or r(eader)."""
    if marker["slot"] is not None:
        return "h"
    return "w" if marker["wpid"] is not None else "r"


def _described(marker: re.Match[str], pid: int) -> Holder:
    """Describe the holder or waiter *marker* names, the kernel naming process *pid* its own."""
    kind = _kind(marker)
    if kind == "w":
        holder = describe_pid(pid)._replace(since=int(marker["us"]) / 1e6)
        return holder._replace(shared=marker["wshared"] is not None)
    if kind == "r":
        return describe_pid(pid)._replace(since=int(marker["rus"]) / 1e6, slot=0, shared=True)
    return describe_pid(pid)._replace(since=int(marker["ms"]) / 1e3, slot=int(marker["slot"]))


def _markers(
    base: str | None = None, kinds: str = "hwr", unchecked: str = ""
) -> Iterator[tuple[re.Match[str], int]]:
    """Yield the markers of *kinds* (of *base* only, if given) the kernel backs, with their pid.

    Anyone can bind any abstract name, and a name may hold a line break that forges a line
    of /proc/net/unix. A holder marker is believed only if the kernel says that the process
    it names listens on the slot it names: SO_PEERCRED of a connection to the slot gives the
    PID of the last process to call listen(2) on it, which a taker does (`_receive`). A
    reader's socket (a listening socket) only if the process the name names listens on it.
    A waiter marker, an unconnected socket, only if the process it names has that very
    socket open, where /proc lets us look (our own processes, or all of them as root).
    Markers of the kinds in *unchecked* are yielded unchecked, with the pid they name.
    """
    seen = set()
    for path, inode in _abstract_names(base):
        marker = _MARKER.fullmatch(path)
        if marker is None or (base is not None and marker["base"] != base) or path in seen:
            continue  # the same path again: a connection accepted from a listener of that name
        seen.add(path)
        kind = _kind(marker)
        if kind not in kinds:
            continue
        if kind in unchecked:
            yield marker, int(marker[f"{kind}pid"])
        elif (pid := _believed(marker, kind, path, inode)) is not None:
            yield marker, pid


def _believed(marker: re.Match[str], kind: str, path: str, inode: str) -> int | None:
    """Return the process that the kernel says holds *marker*'s place; None if none does."""
    if kind == "w":
        pid = int(marker["wpid"])
        return pid if _has_socket(pid, inode) else None
    if kind == "r":
        pid = int(marker["rpid"])
        return pid if pid and _listener_pid(path) == pid else None
    slot = int(marker["slot"])
    if slot >= int(marker["slots"]):
        return None
    holder = _listener_pid(f"{marker['base']}/{slot}")
    return holder if holder and holder == int(marker["pid"]) else None


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
