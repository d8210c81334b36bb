"""Hold a lock with no process of ours: `lockrun acquire --no-keeper`, `renew` and `release`.

`acquire --no-keeper` takes the lock as a run would, prints a token and exits, leaving the
lease to the service: it ends one ttl after the acquire or the last `renew`, on the
service's clock, unless `release` ends it first. Any process that has the token and the
lock URI renews or releases it, on this host or another. Only a service whose locks are
leases can keep one with no process (Redis, etcd); the others are refused before anything is
opened. docs/semantics.md "Holding a lock across steps" is the contract.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets
import signal
import threading
import time
from typing import TYPE_CHECKING, Final, NamedTuple, Self, TypeVar

from lockrun.backends import Detachable, Holder, Request, open_backend, parse_uri
from lockrun.bounds import MAX_SLOTS, MAX_TTL, MAX_WAIT, MIN_TTL, check_modes
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    Interrupted,
    LeaseLost,
    OutputError,
    TakenOver,
    UsageError,
)
from lockrun.hold import INTERRUPTS, acquired, make_request, quiet, report_for, take
from lockrun.names import check_name
from lockrun.runner import check_options
from lockrun.supervise import FORWARDED
from lockrun.timing import clock_time, format_duration, now
from lockrun.uri import SCHEMES

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends import Backend, Detached, Lease
    from lockrun.runner import Options
    from lockrun.uri import LockURI

VERSION: Final = "lrl1"  # a keeper's token is lr1.…
# lrl1.SERVICE.ID.MODE SLOTS.TTL_MS.HOLD_MS.NAMESPACE.NAME: the service is a hash of where
# the lease is (no URI, no password), the id the lease's, the mode x (exclusive) or s
# (shared), the names base64url without padding. Letters, digits, `.`, `_` and `-` only.
_TOKEN: Final = re.compile(
    r"lrl1\.([0-9a-f]{8})\.([0-9a-f]{20})\.([xs])([1-9][0-9]{0,3})\.([1-9][0-9]{0,7})"
    r"\.(0|[1-9][0-9]{0,10})\.([A-Za-z0-9_-]{2,340})\.([A-Za-z0-9_-]{2,340})",
    re.ASCII,
)
LEASED: Final = tuple(scheme for scheme, kind in SCHEMES.items() if kind.detachable)
# The services, as their URIs start (`redis://`, `etcd://`), for the line of a wrong URI.
_KEPT_BY: Final = " or ".join(f"{name}://" for name in LEASED if SCHEMES[name].backend == name)
_T = TypeVar("_T")


class LeaseToken(NamedTuple):
    """What `acquire --no-keeper` prints: which lease, of which lock, on which service."""

    service: str  # 8 hex digits: a hash of `Detachable.place`
    lease_id: str  # 20 hex digits, chosen at random by the acquire
    shared: bool
    slots: int
    ttl_ms: int
    hold_ms: int  # --hold-at-least, left as a window by `release`
    namespace: str
    name: str

    def __str__(self) -> str:
        """Return the token as printed."""
        mode = "s" if self.shared else "x"
        return (
            f"{VERSION}.{self.service}.{self.lease_id}.{mode}{self.slots}.{self.ttl_ms}."
            f"{self.hold_ms}.{_encode(self.namespace)}.{_encode(self.name)}"
        )

    def request(self) -> Request:
        """Return the request the lease was granted for, as far as a renewal needs it."""
        return Request(
            self.namespace,
            self.name,
            self.slots,
            self.ttl_ms / 1000,
            Holder("", 0, "", ()),
            shared=self.shared,
            lease_id=self.lease_id,
        )


def is_lease_token(text: str) -> bool:
    """Whether *text* claims to be a token of ours (a keeper's is another kind)."""
    return text.startswith(f"{VERSION}.")


def parse_token(text: object) -> LeaseToken:
    """Return the token *text*; `UsageError` (64) for anything `acquire` did not print."""
    match = _TOKEN.fullmatch(text) if isinstance(text, str) else None
    token = None if match is None else _read(match)
    if token is None:
        msg = f"malformed token: expected {VERSION}.… as printed by `lockrun acquire --no-keeper`"
        raise UsageError(msg)
    return token


def _read(match: re.Match[str]) -> LeaseToken | None:
    """Return the token *match* spells, if its numbers and names are ones acquire prints."""
    service, lease_id, mode, slots, ttl_ms, hold_ms, namespace, name = match.groups()
    token = LeaseToken(
        service,
        lease_id,
        mode == "s",
        int(slots),
        int(ttl_ms),
        int(hold_ms),
        _decode(namespace) or "",
        _decode(name) or "",
    )
    try:
        check_name(token.namespace, "namespace")
        check_name(token.name)
        check_modes(token.slots, shared=token.shared, hold=token.hold_ms / 1000)
    except UsageError:
        return None
    ttl_ok = MIN_TTL * 1000 <= token.ttl_ms <= MAX_TTL * 1000
    ok = ttl_ok and token.slots <= MAX_SLOTS and token.hold_ms <= MAX_WAIT * 1000
    return token if ok else None


def _encode(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).rstrip(b"=").decode()


def _decode(text: str) -> str | None:
    """Return the name base64url *text* encodes; None unless *text* is its one spelling."""
    try:
        decoded = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded if _encode(decoded) == text else None


def _detachable(backend: Backend) -> Detachable:
    """Return *backend*, a `Detachable` as its scheme's row says (`check_leased`)."""
    if not isinstance(backend, Detachable):  # pragma: no cover - the registry's promise broken
        backend.close()
        msg = "this lock service cannot hold a lock with no process"
        raise ConfigError(msg)
    return backend


def _service(backend: Detachable) -> str:
    return hashlib.sha256(backend.place().encode()).hexdigest()[:8]


def check_leased(uri: LockURI) -> None:
    """Raise `UsageError` (64) unless *uri*'s service can keep a lock with no process."""
    if not uri.kind.detachable:
        schemes = ", ".join(f"{scheme}:" for scheme in LEASED)
        msg = (
            f"--no-keeper needs a lock service that keeps a lease with no process ({schemes}); "
            f"a {uri.scheme}: lock ends with its holder: drop --no-keeper, and a keeper holds it"
        )
        raise UsageError(msg)


# -- acquire ------------------------------------------------------------------------------------


def acquire(
    options: Options,
    deliver: Callable[[str], None],
    *,
    log: Callable[[str], None],
    live: Callable[[str], None] | None = None,
) -> int:
    """Take the lock of *options*, hand its token to *deliver*, and leave it to the service.

    An `OutputError` from *deliver* (the token could not be written) releases it, and so
    does a signal that comes before the token was written. What it raises maps to an
    exit status (docs/semantics.md "Exit status").
    """
    uri = parse_uri(options.uri)
    check_leased(uri)
    check_options(options, uri)
    name = check_name(options.name or "")
    namespace = check_name(options.namespace, "namespace")
    verbose = log if options.verbose else quiet
    holder = ("lockrun", "acquire", "--no-keeper", name)
    request = make_request(options, namespace, name, holder, secrets.token_hex(10))
    with _Interrupts(verbose, name) as interrupts:
        backend = open_backend(uri, ttl=options.ttl, warn=log, note=verbose)
        try:
            detachable = _detachable(backend)
            interrupts.watch(detachable)
            report = report_for(options, request, uri, log, live)
            started = now()
            lease = interrupts.wait(lambda: take(backend, request, options.wait, report))
            if report is not None:
                report.stop()
            verbose(acquired(request, lease, started))
            token = _token(detachable, request, options)
            _hand_over(lease, token, deliver, interrupts)
        finally:
            backend.close()
    ends = clock_time(time.time() + lease.confirmed + options.ttl - now())
    verbose(f"left {name} held with no process, until {ends} unless renewed (lockrun renew)")
    return 0


def _token(backend: Detachable, request: Request, options: Options) -> LeaseToken:
    return LeaseToken(
        _service(backend),
        request.lease_id,
        request.shared,
        request.slots,
        max(1, round(request.ttl * 1000)),
        round(options.hold_at_least * 1000),
        request.namespace,
        request.name,
    )


def _hand_over(
    lease: Lease, token: LeaseToken, deliver: Callable[[str], None], interrupts: _Interrupts
) -> None:
    """Write the token; release unless it was written before any signal came."""
    name = token.name
    if interrupts.signo:
        lease.release()
        what = signal.Signals(interrupts.signo).name
        msg = f"{what} before the token of {name} was written; released it"
        raise Interrupted(msg, signo=interrupts.signo)
    try:
        deliver(str(token))
    except OutputError as err:
        lease.release()
        raise OutputError(f"{name}: {err}; released the lock") from None


class _Interrupts:
    """INT, TERM, HUP and QUIT while acquire waits, taken by a thread, not a handler.

    A handler could raise between the grant and the hand-over, leaving a lease nobody has
    a token for to run out its ttl (an hour, maybe). Blocked, and taken by `sigwait`
    in a thread, a signal ends the wait through the backend's `interrupt`, or is seen by
    `_hand_over` after the grant, which releases.
    """

    def __init__(self, verbose: Callable[[str], None], name: str) -> None:
        self.verbose = verbose
        self.name = name
        self.signo = 0
        self.backend: Detachable | None = None
        self.closing = False
        # nohup's HUP stays ignored; USR1 and USR2 are noted and dropped, as while a run waits
        ignored = {each for each in FORWARDED if signal.getsignal(each) is signal.SIG_IGN}
        self.watched = FORWARDED - ignored
        self.saved: set[int | signal.Signals] = set()
        self.thread = threading.Thread(target=self._listen, name="lockrun-signals", daemon=True)

    def __enter__(self) -> Self:
        self.saved = signal.pthread_sigmask(signal.SIG_BLOCK, self.watched)
        if self.watched:  # pragma: no branch - all six ignored: nothing to wait for
            self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.closing = True
        if self.thread.ident is not None:  # pragma: no branch - it started (__enter__)
            signal.pthread_kill(self.thread.ident, min(self.watched))  # ends its sigwait
            self.thread.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, self.saved)

    def _listen(self) -> None:
        while True:
            signo = signal.sigwait(self.watched)
            if self.closing:
                return
            if signo not in INTERRUPTS:
                what = signal.Signals(signo).name
                self.verbose(
                    f"{what} while waiting for {self.name}: no command to pass it to; dropped"
                )
                continue
            self.signo = self.signo or signo
            self._interrupt()

    def watch(self, backend: Detachable) -> None:
        """Interrupt *backend*'s wait on a signal, at once if one came already."""
        self.backend = backend
        if self.signo:
            self._interrupt()

    def _interrupt(self) -> None:
        if self.backend is not None:  # else `watch` will, once it has one
            self.backend.interrupt()

    def wait(self, acquiring: Callable[[], Lease]) -> Lease:
        """Return what *acquiring* returns; a signal that ended it is `Interrupted` (128+N)."""
        try:
            return acquiring()
        except Interrupted:
            signo = self.signo or signal.SIGINT
            what = signal.Signals(signo).name
            msg = f"{what} while waiting for {self.name}; nothing is held"
            raise Interrupted(msg, signo=signo) from None


# -- renew and release ----------------------------------------------------------------------


def renew(text: str, uri: str) -> str:
    """Extend the lease of the token *text* by its ttl; return what to say with -v.

    `LeaseLost` (76) if it is gone, `TakenOver` (79) if a taker waited (it is released).
    """
    token, lease, backend = _find(text, uri)
    try:
        _ask(token, backend, lease.renew)
    finally:
        backend.close()
    ends = clock_time(time.time() + token.ttl_ms / 1000)
    return f"{token.name} is held, until {ends} unless renewed"


def release(text: str, uri: str) -> str:
    """Release the lease of the token *text*; return what to say with -v.

    0 means it was held until the release. `LeaseLost` (76) if it was gone already.
    """
    token, lease, backend = _find(text, uri)
    try:
        taker, window = _ask(token, backend, lease.release)
    finally:
        backend.close()
    said = f"released {token.name}"
    if window > 0:
        said += f" (taken {format_duration(window)} more: --hold-at-least)"
    return said if taker is None else f"{said}; a take-over waited, and runs next"


def _find(text: str, uri_text: str) -> tuple[LeaseToken, Detached, Detachable]:
    """Parse the token and the URI, and return the lease the token names there."""
    token = parse_token(text)
    uri = parse_uri(uri_text)
    if not uri.kind.detachable:
        default = " (the default: no --uri, --uri-file or LOCKRUN_URI)" * (uri_text == "file:")
        msg = (
            f"this token's lease is kept by a lock service ({_KEPT_BY}), but the lock URI "
            f"is {uri.redacted}{default}: give the URI `acquire --no-keeper` used"
        )
        raise ConfigError(msg)
    backend = _detachable(open_backend(uri, ttl=token.ttl_ms / 1000))
    return token, backend.detached(token.request(), token.hold_ms / 1000), backend


def _ask(token: LeaseToken, backend: Detachable, asking: Callable[[], _T]) -> _T:
    """Return what *asking* returns; name the lock in what it raises.

    A lease not found through a URI other than the acquire's may be on another service:
    that is said (78) rather than that it is gone.
    """
    try:
        return asking()
    except LeaseLost as err:
        if _service(backend) != token.service:
            msg = (
                f"{token.name}: no lease for this token at {backend.where}, which is not where "
                "`acquire --no-keeper` took it (another service, or another spelling of its "
                "address): give the URI it used"
            )
            raise ConfigError(msg) from None
        raise LeaseLost(f"{token.name}: {err}") from None
    except (TakenOver, BackendUnavailable, ConfigError) as err:
        err.about(token.name)
        raise


__all__ = ["LeaseToken", "acquire", "is_lease_token", "parse_token", "release", "renew"]
