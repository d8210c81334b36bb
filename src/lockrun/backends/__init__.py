"""The backend interface every lock service implements, and the way to open one.

A backend is an adapter: it blocks natively until one of N slots is ours or a deadline
passes, and hands back a `Lease`. Deadlines, lease cadence, exit statuses and process
supervision live in `lockrun.runner`, `lockrun.lock` and `lockrun.supervise`, written once for
all backends.
"""

from __future__ import annotations

import importlib
import math
import os
import pwd
import re
import sys
import time
import zipimport
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol, runtime_checkable

from lockrun.bounds import MAX_FENCE, MAX_SLOTS
from lockrun.errors import ConfigError
from lockrun.names import MAX_NAME_BYTES
from lockrun.uri import LockURI, URIError
from lockrun.uri import host_port as _host_port
from lockrun.uri import parse_uri as _parse_uri

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


# Records are NamedTuples, not dataclasses: creating a frozen dataclass costs ~0.8 ms of
# start-up each, and lockrun starts once per cron run (`python -m bench`, section a).


class Holder(NamedTuple):
    """Who holds or waits for a slot; what `lockrun status` shows."""

    host: str
    pid: int
    user: str
    argv: tuple[str, ...]
    since: float | None = None  # Unix time the slot was granted (or the wait began)
    slot: int | None = None
    expires: float | None = None  # Unix time a lease ends unless refreshed
    shared: bool = False  # a shared (reader) holder or waiter; exclusive otherwise
    # Unix time a slot whose command has ended stays taken (--hold-at-least); None: running
    until: float | None = None
    # A lease kept by the service with no process (acquire --no-keeper): pid and host are
    # those of the acquire, long gone; `expires` is when it ends unless renewed. Never
    # read from a record (`from_dict`), which anyone who may write it could forge.
    detached: bool = False

    @classmethod
    def me(cls, argv: Sequence[str]) -> Holder:
        """Describe this process as the holder of *argv* (its command line cut to a record)."""
        return cls(
            os.uname().nodename, os.getpid(), user_name(os.geteuid()), cut(argv), time.time()
        )

    @classmethod
    def from_dict(cls, data: object) -> Holder:
        """Rebuild a holder from `to_dict` output, written by anyone; ValueError if it is none.

        Records come from servers and files that other users can write: every field is
        checked, a bad optional one is dropped, and long text is cut (`cut`).
        """
        if not isinstance(data, dict):
            msg = "a holder record is a JSON object"
            raise ValueError(msg)  # noqa: TRY004 - callers catch one kind for any bad record
        host, pid, user = data.get("host"), data.get("pid"), data.get("user")
        if not isinstance(host, str) or not isinstance(user, str) or not _whole(pid, _MAX_PID):
            msg = "a holder record names a host, a pid and a user"
            raise ValueError(msg)
        argv = data.get("argv")
        return cls(
            host=_short(host),
            pid=int(pid),  # type: ignore[arg-type]  # _whole checked it
            user=_short(user),
            argv=cut(argv)
            if isinstance(argv, list) and all(isinstance(a, str) for a in argv)
            else (),
            since=_stamp(data.get("since")),
            slot=int(data["slot"]) if _whole(data.get("slot"), MAX_SLOTS - 1) else None,
            expires=_stamp(data.get("expires")),
            shared=data.get("shared") is True,
            until=_stamp(data.get("until")),
        )  # never `detached`: the backend knows that from its own keys, not from a record

    def to_dict(self) -> dict[str, object]:
        """Return a JSON-ready dict; ``detached`` only where it is true.

        The backends store this dict as the holder's record: one of a process (every
        record) stays as it was before detached leases existed.
        """
        record: dict[str, object] = self._asdict()
        record["argv"] = list(self.argv)
        if not self.detached:
            del record["detached"]
        return record


_MAX_PID: Final = 2**31 - 1
_MAX_STAMP: Final = 2.0**40  # Unix time in the year 36812: anything later is made up
_SHORT: Final = 255  # longest host or user name kept from a record
RECORD_ARGV: Final = 1000  # a recorded command line is cut to about this many bytes of JSON
MAX_RECORD: Final = 65536  # a record (or a comment) longer than this is none of ours


def cut(argv: Sequence[str]) -> tuple[str, ...]:
    """Return *argv* cut to about `RECORD_ARGV` bytes of JSON, with a marker if it was cut.

    A holder record must fit where the backends keep it (a SQL comment of 1 kB, a TEXT
    column, one read of a lock file): a long command line degrades, it never blocks the run.
    """
    kept: list[str] = []
    room = RECORD_ARGV
    for arg in argv:
        cost = _json_bytes(arg) + 2  # and the ", " between
        if cost > room:
            kept.append(arg[: max(0, room // 6)])  # \uXXXX: six bytes for a character at most
            dropped = sum(map(len, argv)) - sum(map(len, kept))
            return (*kept, f"…[{dropped} more characters not recorded]")
        kept.append(arg)
        room -= cost
    return tuple(kept)


def _json_bytes(text: str) -> int:
    """Return how long *text* is as a JSON string, or a little more; without loading json.

    Exact for printable ASCII; six bytes a character (a u-escape) for anything else.
    """
    if text.isascii() and text.isprintable():
        return len(text) + 2 + text.count('"') + text.count("\\")
    return 6 * len(text) + 2


def write_json(value: object) -> str:
    """Return ``json.dumps(value)`` for a record: json's own once loaded, else `plain_json`'s.

    Where json is loaded already (etcd's gateway speaks it), its C encoder writes the same
    text in a tenth of the time: a waiter's record is written on the hand-over's path.
    """
    loaded = sys.modules.get("json")
    return plain_json(value) if loaded is None else str(loaded.dumps(value))


def plain_json(value: object) -> str:
    """Return ``json.dumps(value)`` for a record (dicts, lists, text, numbers, None, booleans).

    Without loading json where every text is printable ASCII with no quote or backslash, and
    every number finite: a run's own record, as a rule. json and its C accelerator are
    about 1.5 ms of start-up (issue #32); anything else goes through json itself.
    """
    text: str | None = None  # None: json's to write
    if isinstance(value, str):
        plain = value.isascii() and value.isprintable() and '"' not in value and "\\" not in value
        text = f'"{value}"' if plain else None
    elif value is None or isinstance(value, bool):
        text = {None: "null", True: "true", False: "false"}[value]
    elif isinstance(value, int):
        text = int.__repr__(value)
    elif isinstance(value, float):
        text = float.__repr__(value) if math.isfinite(value) else None
    elif isinstance(value, list | tuple):
        text = f"[{', '.join(map(plain_json, value))}]"
    elif isinstance(value, dict) and all(isinstance(key, str) for key in value):
        text = "{%s}" % ", ".join(f"{plain_json(k)}: {plain_json(v)}" for k, v in value.items())  # noqa: UP031
    return _dumps(value) if text is None else text


def _dumps(value: object) -> str:
    import json  # noqa: PLC0415 - see write_json

    return json.dumps(value)


def read_json(text: str | bytes) -> object:
    """Parse JSON that anyone could have written; None if it is too long, too deep or not JSON."""
    import json  # noqa: PLC0415 - 1.5 ms of start-up that a run without records never needs

    if len(text) > MAX_RECORD:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def taken_over_by(record: str) -> str:
    """Return the reason a take-over gives, naming the taker from its *record* (anyone's).

    Redis and etcd keep a taker's holder record where a holder finds it.
    """
    try:
        taker = Holder.from_dict(read_json(record))
    except ValueError:
        return "taken over by another lockrun, whose record is unreadable"
    return f"taken over by {taker.user}@{taker.host} pid {taker.pid}"


class Identity(NamedTuple):
    """Who waits or holds, as a record or a SQL comment of theirs says: for status and N."""

    token: str
    namespace: str
    name: str
    slots: int
    holder: Holder


def read_identity(text: str) -> Identity | None:
    """Decode an `Identity` written as JSON (by anyone); None if it is not a good one."""
    return identity_of(read_json(text))


def identity_of(data: object) -> Identity | None:
    """Return the `Identity` that *data* (a record's JSON, decoded) is; None if it is none."""
    if not isinstance(data, dict):
        return None
    token, namespace, name, slots = (
        data.get(key) for key in ("token", "namespace", "name", "slots")
    )
    if not (
        isinstance(token, str) and _name(namespace) and _name(name) and _whole(slots, MAX_SLOTS, 1)
    ):
        return None
    try:
        holder = Holder.from_dict(data.get("holder"))
    except ValueError:
        return None
    return Identity(_short(token), namespace, name, int(slots), holder)  # type: ignore[arg-type]


def _whole(value: object, high: int, low: int = 0) -> bool:
    """Whether *value* is an int (not a bool) in [*low*, *high*]."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _name(value: object) -> bool:
    """Whether *value* could be a lock name or namespace of ours (1 … 255 bytes of UTF-8)."""
    if not isinstance(value, str):
        return False
    try:
        return 0 < len(value.encode()) <= MAX_NAME_BYTES
    except UnicodeEncodeError:
        return False


def _short(text: str) -> str:
    return text if len(text) <= _SHORT else text[:_SHORT] + "…"


def _stamp(value: object) -> float | None:
    """Return a record's Unix time if it is a number a clock could show, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    stamp = float(value)
    return stamp if 0 <= stamp <= _MAX_STAMP else None


# uid → user name, looked up once per process: getpwuid reads the password database
# through NSS on every call (~10 µs, six system calls), and every acquire names its user.
# Keyed by uid, so a process that changes its effective uid (seteuid) names the new one.
_USER_NAMES: dict[int, str] = {}


def user_name(uid: int) -> str:
    """Name user *uid* as the user database does; the number if it has no name (cached)."""
    name = _USER_NAMES.get(uid)
    if name is None:
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        _USER_NAMES[uid] = name
    return name


def describe_pid(pid: int) -> Holder:
    """Describe a local process from /proc: user, command line and start time."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            raw = cmdline.read(MAX_RECORD)  # a command line may be 2 MB: a record is cut
        argv = tuple(arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1])
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return Holder(os.uname().nodename, pid, "?", ())
    return Holder(os.uname().nodename, pid, user_name(uid), cut(argv))


class Request(NamedTuple):
    """What an acquirer asks for: one of *slots* slots of (namespace, name).

    *shared* asks for the lock shared with other shared holders (a reader; one slot only),
    *take_over* asks the current holders to stop (docs/semantics.md "Take-over").
    """

    namespace: str
    name: str
    slots: int
    ttl: float
    holder: Holder
    shared: bool = False
    take_over: bool = False
    hold: float = 0.0  # --hold-at-least: a backend that could not keep the window refuses now
    # acquire --no-keeper: the id of a lease the service keeps with no process of ours, chosen
    # by the caller (a backend that keeps none is never asked); "": a lease that ends with us
    lease_id: str = ""
    # Told a waiter's lease (as `Lease.orphan` names one) as it starts to wait, by a backend
    # whose registry row says it does (`Scheme.tells_waiting`): the guardian is forked then,
    # and frees it should lockrun die waiting (etcd, docs/design.md A11, A13). None: nobody
    # to tell (the Python API has no guardian).
    waiting: Callable[[bytes], None] | None = None


class LockState(NamedTuple):
    """A lock as `lockrun status` reports it."""

    namespace: str
    name: str
    where: str  # the file, socket or key an operator would inspect
    slots: int | None = None
    holders: tuple[Holder, ...] = ()
    waiters: tuple[Holder, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """Return a JSON-ready dict."""
        return {
            "namespace": self.namespace,
            "name": self.name,
            "where": self.where,
            "slots": self.slots,
            # every holder says whether it is detached: JSON for machines keeps one shape
            "holders": [
                holder.to_dict() | {"detached": holder.detached} for holder in self.holders
            ],
            "waiters": [waiter.to_dict() for waiter in self.waiters],
        }


class Lease(Protocol):
    """One held slot; valid until `release`, or until `refresh` raises `LeaseLost`."""

    @property
    def slot(self) -> int:
        """The slot held, 0 … slots-1."""

    @property
    def fence(self) -> int | None:
        """A token larger than any earlier acquisition's of this name, if the backend has one."""

    @property
    def ttl(self) -> float | None:
        """Seconds the service keeps the slot without a refresh; None if it lives with us."""

    @property
    def confirmed(self) -> float:
        """When (`timing.now`) the request that last proved the slot ours was sent.

        A lease runs from there: a stall between the grant and its use is counted.
        """

    @property
    def fds(self) -> tuple[int, ...]:
        """File descriptors that keep the slot held while any process has them open."""

    @property
    def sessions(self) -> tuple[int, ...]:
        """Sockets of server sessions whose end frees the slot at once: watched for a hang-up."""

    @property
    def bells(self) -> tuple[int, ...]:
        """Descriptors that turn readable when a take-over may have been asked: refresh then."""

    def refresh(self) -> None:
        """Prove the slot is still ours (extend it).

        Raises `LeaseLost` or `BackendUnavailable`, or `TakenOver` if another acquirer asked
        for a take-over since the grant (the slot is still ours until `release`).
        """

    @property
    def orphan(self) -> bytes | None:
        """What another process needs to free this lease should we die (`Leased.abandon`).

        None where the slot ends with us anyway (a descriptor, a session).
        """

    def release(self, hold: float = 0.0) -> bool:
        """Give the slot back; idempotent and silent about a slot already lost.

        With *hold* > 0 the slot stays taken for *hold* more seconds with nothing of ours
        left running (--hold-at-least): later acquirers find it busy until then. Return
        whether the service heard it; if not, the slot frees by itself (a lease runs out,
        the server ends a session it lost).
        """


class Leased(Protocol):
    """A backend whose leases outlive their holder on the server (`Scheme.leased`)."""

    def abandon(self, orphan: bytes) -> None:
        """Free the lease *orphan* (`Lease.orphan`) of a holder that died, leaving no window."""


class Backend(Protocol):
    """A connection to one lock service."""

    def acquire(self, request: Request, deadline: float | None) -> Lease | None:
        """Block until a slot is ours (a `Lease`) or *deadline* (`timing.now`) passes (None).

        A deadline in the past means one attempt. None waits forever. Waiters are served
        first-in first-out and woken by the service, not by polling.
        """

    def status(self, namespace: str, name: str | None) -> list[LockState]:
        """List *name* (or every lock in *namespace* the service can enumerate)."""

    def close(self) -> None:
        """Drop connections; held leases are released by their own `release`."""


class Detached(Protocol):
    """A lease held by no process (`acquire --no-keeper`), as a later process finds it."""

    def renew(self) -> None:
        """Extend it by its ttl; `LeaseLost` if gone, `TakenOver` (released) if a taker waits."""

    def release(self) -> tuple[str | None, float]:
        """Release it; `LeaseLost` if gone. Return a waiting taker's record, and the window."""


@runtime_checkable
class Detachable(Protocol):
    """A backend that can leave a lock held with no process (`Scheme.detachable`)."""

    @property
    def where(self) -> str:
        """The service's URI, with no password: for messages."""

    def place(self) -> str:
        """Name the service, alike for every spelling of its URI, with no credentials."""

    def detached(self, request: Request, hold: float) -> Detached:
        """Return the lease *request*'s ``lease_id`` names (its holder is no one's)."""

    def interrupt(self) -> None:
        """From another thread: end a waiting `acquire` at once; it raises `Interrupted`."""

    def acquire(self, request: Request, deadline: float | None) -> Lease | None:
        """As `Backend.acquire`."""

    def close(self) -> None:
        """Drop the connections."""


class Connect(Protocol):
    """A backend module's ``connect``, the factory `open_backend` calls for a `Scheme`'s row."""

    def __call__(
        self,
        uri: LockURI,
        *,
        ttl: float | None = None,
        warn: Callable[[str], None] | None = None,
        note: Callable[[str], None] | None = None,
    ) -> Backend:
        """Return a backend for *uri*; a bad URI or a missing driver is a `ConfigError`."""


def slots_mismatch(
    request: Request, slots: int, holder: Holder | None = None, where: str = ""
) -> ConfigError:
    """Return the one error for a name in use with other *slots* than *request*'s.

    Said alike to CLI and API users; *holder* is who uses the other N, if known, and
    *where* the server's name for the lock, where that helps to find it.
    """
    by = f" by {holder.user}@{holder.host} pid {holder.pid}" if holder is not None else ""
    at = f" at {where}" if where else ""
    return ConfigError(
        f"in use with {_slots(slots)}{by}{at}, but this one asks for {_slots(request.slots)}; "
        "all users of a name must agree on its slots (--slots, or slots= in Python)"
    )


def _slots(count: int) -> str:
    return "1 slot" if count == 1 else f"{count} slots"


_FENCE_DIGITS: Final = len(str(MAX_FENCE))


def next_fence(previous: bytes) -> int:
    """Return a fence token above *previous* and above the microsecond wall clock.

    The local backends keep their counter in a file or pass it along with the lock; seeding
    with the clock keeps tokens increasing when that counter is lost (a name left free, a
    tmpfs emptied by a reboot), as the Redis fence is seeded with the server's TIME. A
    counter that is no whole number below `MAX_FENCE` is one lockrun never wrote (another
    user's): it counts as lost.
    """
    text = previous.strip()
    last = int(text) if text.isdigit() and len(text) <= _FENCE_DIGITS else 0
    if last >= MAX_FENCE:
        last = 0
    return max(last + 1, time.time_ns() // 1000)


def readable_file(path: str) -> bool:
    """Whether *path* is a regular file we may read.

    Not a FIFO or a device, whose open or read would block (a URI's TLS or option file).
    """
    return os.path.isfile(path) and os.access(path, os.R_OK)


# The least time a connect or an answer is given, on every server backend: a working
# server on a loaded machine answered a waiter in more than 0.25 s (load 40 on 2 cores,
# issue 29). Neither a short ttl nor --wait cuts it, so that 69 means "unreachable", not
# "slow" (docs/semantics.md "What bounds a call").
MIN_TIMEOUT: Final = 1.0
MAX_TIMEOUT: Final = 5.0


def timeout_for(ttl: float, *, durable: bool = False) -> float:
    """Return the timeout of a connect, and of an answer, for leases of *ttl* seconds.

    A twentieth of the lease, so that the supervisor can ask again several times before it
    must give a long lease up; a tenth where each grant commits to disk (*durable*: MySQL and
    PostgreSQL, whose busy servers take longer than Redis). Never less than `MIN_TIMEOUT` nor
    more than `MAX_TIMEOUT`. A check on an SQL holding session waits a whole lease instead
    (`SessionLease.refresh`).
    """
    return min(MAX_TIMEOUT, max(MIN_TIMEOUT, ttl / (10 if durable else 20)))


def open_backend(
    uri: LockURI,
    *,
    ttl: float | None = None,
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> Backend:
    """Return a backend for *uri*, importing its driver only now.

    A lease-based backend fits its timeouts to leases of *ttl* seconds (None: its default).
    *warn* gets one-line warnings about the service (Python's `warnings` by default), *note*
    what `-v` shows (nothing by default).
    """
    kind = uri.kind
    try:
        module = importlib.import_module(f"lockrun.backends.{kind.backend}")
    except ImportError as err:  # the driver, not our module: missing, or without libpq
        hint = _install_hint(kind.extra)
        what = (
            f"the {err.name} module"
            if isinstance(err, ModuleNotFoundError)
            else (str(err).strip() or "its driver").splitlines()[0].rstrip(".:")  # one line
        )
        msg = f"{uri.scheme}: needs {what}: {hint}"
        raise ConfigError(msg) from err
    connect: Connect = module.connect
    # Backends split hosts with `host_port` below, so a bad one is already a ConfigError.
    return connect(uri, ttl=ttl, warn=warn or _warn, note=note)


def _install_hint(extra: str | None) -> str:
    """Say how to add a backend's missing driver, for the way this lockrun was installed.

    pipx's venv (its `pipx_metadata.json` at the interpreter's prefix): `pipx inject`. A
    venv, or a Python of one's own: that interpreter's pip, so the driver lands where
    lockrun is. A system's Python (PEP 668's EXTERNALLY-MANAGED, outside a venv): its
    package. lockrun.pyz: the driver for the Python that runs it.
    """
    import shlex  # noqa: PLC0415 - the hint's alone: a good run never needs it

    loader: object = __spec__.loader  # typeshed's Loader is no zipimporter's base
    pyz = isinstance(loader, zipimport.zipimporter)
    see = ' (more: docs/install.md, "One file: lockrun.pyz")' if pyz else ""
    if extra is None:
        return f"lockrun.pyz leaves it out{see}" if pyz else "reinstall lockrun-cli"
    driver = _driver(extra)
    python = shlex.quote(sys.executable or "python3")
    left_out = "lockrun.pyz leaves it out; " if pyz else ""
    if _externally_managed():
        package = re.split(r"[^A-Za-z0-9._-]", driver)[0]
        system = f"install {package} for {python} from the system's packages"
        return f"{left_out}{system}, on Debian and Ubuntu: apt install python3-{package}{see}"
    if pyz:  # pragma: no cover - run from the zip: tests/test_install_hint.py
        return f"{left_out}{python} -m pip install {shlex.quote(driver)}{see}"
    if os.path.isfile(os.path.join(sys.prefix, "pipx_metadata.json")):
        return _pipx_inject(sys.prefix, driver)
    return f"{python} -m pip install {shlex.quote(f'lockrun-cli[{extra}]')}"


def _driver(extra: str) -> str:
    """Return what *extra* requires (``psycopg[binary]>=3.1``), from lockrun-cli's metadata."""
    import importlib.metadata  # noqa: PLC0415 - the hint's alone

    try:
        requires = importlib.metadata.requires("lockrun-cli") or []
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, a .pyz
        requires = []
    marker = re.compile(rf"""\bextra\s*==\s*(["']){re.escape(extra)}\1""")
    found = [line.partition(";")[0].strip() for line in requires if marker.search(line)]
    return found[0] if len(found) == 1 else _DRIVERS.get(extra, f"lockrun-cli[{extra}]")


_DRIVERS: Final = {"postgres": "psycopg[binary]"}  # where lockrun-cli's metadata is not


def _externally_managed() -> bool:
    """Whether this is a system's Python, whose packages pip leaves alone (PEP 668)."""
    import sysconfig  # noqa: PLC0415 - the hint's alone

    if sys.prefix != sys.base_prefix:  # a venv's: pip's to change
        return False
    return os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))


def _pipx_inject(prefix: str, driver: str) -> str:
    """Return the `pipx inject` line for pipx's venv at *prefix*, with PIPX_HOME if needed.

    pipx looks for its venvs under PIPX_HOME: the variable, else ~/.local/pipx if it is
    there (pipx < 1.3: always), else ~/.local/share/pipx. A venv elsewhere (a system-wide
    pipx's) needs the variable said.
    """
    import shlex  # noqa: PLC0415 - the hint's alone

    venv = os.path.realpath(prefix)
    home = os.path.dirname(os.path.dirname(venv))  # PIPX_HOME/venvs/NAME
    data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    usual = (os.environ.get("PIPX_HOME"), "~/.local/pipx", os.path.join(data, "pipx"))
    known = {os.path.realpath(os.path.expanduser(path)) for path in usual if path}
    said = "" if home in known else f"PIPX_HOME={shlex.quote(home)} "
    return f"{said}pipx inject {shlex.quote(os.path.basename(venv))} {shlex.quote(driver)}"


def parse_uri(text: object) -> LockURI:
    """Parse the lock URI *text*; a malformed, ambiguous or unknown one is a `ConfigError`."""
    try:
        return _parse_uri(text)
    except URIError as err:
        raise ConfigError(str(err)) from None


def host_port(uri: LockURI, text: str, default_port: int) -> tuple[str, int]:
    """Split ``HOST[:PORT]`` of *uri* as `lockrun.uri.host_port`; a bad one is a `ConfigError`."""
    try:
        return _host_port(uri, text, default_port)
    except URIError as err:
        raise ConfigError(str(err)) from None


def _warn(message: str) -> None:
    import warnings  # noqa: PLC0415 - only the Python API warns this way

    warnings.warn(message, RuntimeWarning, stacklevel=4)
