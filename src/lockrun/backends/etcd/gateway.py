"""etcd's gRPC gateway, spoken as JSON over HTTP/1.1 (`wire`; docs/design.md A13).

Every call is one ``POST /v3/…`` on a kept connection to one member; a member that does
not answer, or says it has no leader, is left for the next one in the URI. A watch is a
streaming answer on a connection of its own. Whatever comes back is read within one
deadline per call and one size (`MAX_REPLY`, `MAX_LINE`): a slow or hostile server cannot
hold lockrun past its timeout nor fill its memory (docs/security.md).
"""

from __future__ import annotations

import base64
import json
import time
from typing import TYPE_CHECKING, Any, Final, Literal

from lockrun.backends.etcd.wire import Link
from lockrun.errors import BackendUnavailable
from lockrun.uri import scrub

if TYPE_CHECKING:
    from collections.abc import Mapping

    from lockrun.backends.etcd.uri import Settings

# What a watch saw (`Watch.moved`): a deletion, something else that calls for a look, nothing.
Moved = Literal["deleted", "changed", ""]
MAX_REPLY: Final = 4 << 20  # bytes of one answer: a status of 1000 waiters' records fits
MAX_LINE: Final = 1 << 20  # bytes of one message of a watch's stream
# gRPC's status codes the gateway passes on (google.golang.org/grpc/codes).
_UNAVAILABLE: Final = 14  # "no leader", "request timed out", a member stopping: ask another
_UNAUTHENTICATED: Final = 16  # the token expired (or the member restarted): log in again
_AUTH_OFF: Final = "authentication is not enabled"
_PACE: Final = 0.1  # seconds between two watches of a stream that ended by itself


class Refused(Exception):
    """The server answered with an error: gRPC's *code* and its *message*."""

    def __init__(self, code: int, message: str) -> None:
        """Keep gRPC's *code* and the server's *message* (already scrubbed of secrets)."""
        super().__init__(message)
        self.code = code
        self.message = message


class Outage(BackendUnavailable):
    """No member of the cluster answered (69): a waiter in the queue may ride it out."""


class Unreachable(Exception):
    """A member did not answer in time, hung up, or said it cannot serve now."""

    def __init__(self, words: str, *, closed: bool = False) -> None:
        """Keep the line to show; *closed*: the connection was closed or reset, not silent."""
        super().__init__(words)
        self.closed = closed


def b64(text: str | bytes) -> str:
    """Return *text* as the gateway's bytes fields are written: base64."""
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def unb64(value: object) -> bytes:
    """Decode a bytes field of an answer; b"" where it is missing or not base64."""
    if not isinstance(value, str):
        return b""
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        return b""


def number(message: object, field: str) -> int:
    """Return an int64 field of *message*: a string of digits in JSON, left out when 0."""
    value = message.get(field) if isinstance(message, dict) else None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit() and len(value) <= 20:  # noqa: PLR2004
        return int(value)
    return 0


class Gateway:
    """The members of one etcd cluster, asked one at a time, with a login if the URI has one."""

    def __init__(self, settings: Settings, timeout: float) -> None:
        """Remember where the members are; *timeout* bounds a connect and each whole answer."""
        self.settings = settings
        self.timeout = timeout
        self._at = 0  # the member asked first
        self._kept: Link | None = None
        self._token: str | None = None

    def call(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        """POST *body* to *path* (``/v3/kv/range``…); return the answer's JSON object.

        A member that does not answer, or says it cannot serve (no leader), is left for the
        next; when none answers, `Outage`. A kept connection the member closed or reset
        meanwhile (an idle timeout, a restart) is made again once before that. An error the
        server answers with is a `Refused`. Calls a retry could repeat are all safe to
        repeat (docs/design.md A13).
        """
        last: Unreachable | None = None
        for _ in self.settings.endpoints:
            kept = self._kept is not None
            try:
                return self._logged_in(path, body)
            except Unreachable as err:
                self.drop()
                last = err
            if kept and last.closed:
                try:
                    return self._logged_in(path, body)
                except Unreachable as err:
                    self.drop()
                    last = err
            self._at = (self._at + 1) % len(self.settings.endpoints)
        raise self.unavailable(last)

    def __del__(self) -> None:
        """Close the kept connection of a gateway nobody closed (a `Lock` dropped), quietly."""
        self.drop()

    def _logged_in(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        """Ask, logging in first where the URI has a user, and again once if the token expired."""
        if self.settings.user is not None and self._token is None:
            self._token = self._login()
        try:
            return self._ask(self.connection(), path, body)
        except Refused as refused:
            if refused.code != _UNAUTHENTICATED or self.settings.user is None:
                raise
        self._token = self._login()
        return self._ask(self.connection(), path, body)

    def _login(self) -> str | None:
        """Return a token for the URI's user (None where the server has auth off)."""
        login = {"name": self.settings.user, "password": self.settings.password}
        try:
            answer = self._ask(self.connection(), "/v3/auth/authenticate", login, token=False)
        except Refused as refused:
            if _AUTH_OFF in refused.message:
                return None
            raise
        token = answer.get("token")
        return token if isinstance(token, str) and token.isprintable() else None

    def connection(self) -> Link:
        """Return the kept connection to the member asked now (it connects at its first call)."""
        if self._kept is None:
            host, port = self.settings.endpoints[self._at]
            self._kept = Link(host, port, self.timeout, self.settings.tls)
        return self._kept

    def drop(self) -> None:
        """Close the kept connection (the next call makes another)."""
        if self._kept is not None:
            self._kept.close()
            self._kept = None

    def _ask(
        self, link: Link, path: str, body: Mapping[str, object], *, token: bool = True
    ) -> dict[str, Any]:
        """Send one request on *link* and read its whole answer within the timeout."""
        headers = {"Content-Type": "application/json"}
        if token and self._token is not None:
            headers["Authorization"] = self._token
        try:
            link.within(self.timeout)
            status = link.post(path, json.dumps(body).encode(), headers)
            data = link.body(MAX_REPLY)
        except OSError as err:  # TimeoutError, and BadHTTP, are OSErrors
            link.close()
            closed = not isinstance(err, TimeoutError)
            raise Unreachable(_words(err, self.timeout), closed=closed) from err
        finally:
            link.within(None)
        if len(data) > MAX_REPLY:
            raise Unreachable(f"an answer longer than {MAX_REPLY} bytes")
        return self._decode(status, data)

    def _decode(self, status: int, data: bytes) -> dict[str, Any]:
        """Return the JSON object of an answer; raise `Refused` for an error the server sent."""
        try:
            decoded = json.loads(data)
        except (ValueError, RecursionError):
            decoded = None
        if not isinstance(decoded, dict):
            raise Unreachable(f"HTTP {status} with an answer that is not etcd's")
        if status == 200 and "error" not in decoded:  # noqa: PLR2004
            return decoded
        message = decoded.get("message") or decoded.get("error")
        said = scrub(message, self.settings.secrets)[:200] if isinstance(message, str) else ""
        code = number(decoded, "code")
        if code == _UNAVAILABLE:
            raise Unreachable(said or "unavailable")
        raise Refused(code, said or f"HTTP {status}")

    def unavailable(self, err: Exception | None) -> Outage:
        """Return the one line for a cluster none of whose members answered."""
        why = str(err) if err is not None else "no member"
        return Outage(f"{self.settings.where}: {why}")

    def watch(self) -> Watch:
        """Return a watch, on a connection of its own to the member asked now."""
        host, port = self.settings.endpoints[self._at]
        return Watch(self, Link(host, port, self.timeout, self.settings.tls))

    def close(self) -> None:
        """Close every connection."""
        self.drop()


class Watch:
    """One watch of a key or a range, from a revision on, on its own connection."""

    def __init__(self, gateway: Gateway, link: Link) -> None:
        """Keep *link*; nothing is asked until `start`."""
        self.gateway = gateway
        self.link = link
        self.streaming = False
        self.cutting = False  # `cut` ends the read: no pause before the caller hears it
        self.seen = 0  # the newest revision of an event read (a watch made again starts after)
        self.compacted = 0  # the revision a compaction that cancelled the watch left, if one did

    def start(self, key: bytes, end: bytes, revision: int, *, puts: bool = True) -> None:
        """Watch *key* (up to *end*, if not empty) from *revision* on: deletions, and puts.

        Without *puts*, deletions only: a waiter for one of N slots, woken by nothing that
        cannot free one. The member must have a leader (``hasleader``): one cut off from the
        others cancels the watch rather than stay silent, and the waiter asks another member.
        """
        request: dict[str, object] = {"key": b64(key), "start_revision": str(revision)}
        if not puts:
            request["filters"] = ["NOPUT"]
        if end:
            request["range_end"] = b64(end)
        headers = {"Content-Type": "application/json", "Grpc-Metadata-hasleader": "true"}
        if self.gateway._token is not None:  # noqa: SLF001 - the same login as the calls
            headers["Authorization"] = self.gateway._token  # noqa: SLF001
        try:
            self.link.within(self.gateway.timeout)
            body = json.dumps({"create_request": request}).encode()
            status = self.link.post("/v3/watch", body, headers)
            data = b"" if status == 200 else self.link.body(MAX_REPLY)  # noqa: PLR2004
        except OSError as err:  # TimeoutError, and BadHTTP, are OSErrors
            self.close()
            raise Unreachable(_words(err, self.gateway.timeout)) from err
        finally:
            self.link.within(None)
        if status != 200:  # noqa: PLR2004
            self.close()
            self.gateway._decode(status, data)  # noqa: SLF001 - raises
            raise Unreachable(f"HTTP {status} to a watch")
        self.streaming = True

    def moved(self, seconds: float) -> Moved:
        """Wait up to *seconds* for a deletion or the watch's end; say which came.

        "deleted": a key of the range went. "changed": the watch ended (a compaction, the
        server's end, a broken stream, after a tenth of a second or *seconds* if less, never
        in a loop as fast as a broken server can hang up): look again. "": nothing within
        *seconds*, and the watch stays open: nothing of its stream was read (`Link.ready`),
        so a waiter's keep-alive every ttl/2 costs no new watch. A message begun must come
        whole within the timeout, else the watch is closed ("" too), and the caller
        watches again from the same revision.
        """
        until = time.monotonic() + max(seconds, 0.0)
        try:
            while self.link.ready(max(until - time.monotonic(), 0.0)):
                self.link.within(self.gateway.timeout)
                if said := self._said():
                    return said
                self.link.within(None)
        except TimeoutError:
            self.close()
            return ""
        except OSError:
            self.close()
            if not self.cutting:
                time.sleep(min(seconds, _PACE))
            return "changed"
        finally:
            self.link.within(None)
        return ""

    def _said(self) -> Moved:
        """Read one message: "deleted" for deletions alone, "changed" for a put or a cancel.

        "" for any other (created, progress). `ConnectionError` when the stream ended, sent
        an error, or a message longer than `MAX_LINE`.
        """
        line = self.link.line(MAX_LINE)
        message = _json(line) if 0 < len(line) <= MAX_LINE else None
        if not isinstance(message, dict) or "error" in message:
            msg = "the watch ended"
            raise ConnectionError(msg)
        result = message.get("result")
        if isinstance(result, dict):
            self.compacted = max(self.compacted, number(result, "compact_revision"))
            events = result.get("events")
            for event in events if isinstance(events, list) else ():
                if isinstance(event, dict):
                    self.seen = max(self.seen, number(event.get("kv"), "mod_revision"))
        return _what_moved(result)

    def cut(self) -> None:
        """From another thread: end the read `moved` is blocked in (a shutdown, not a close)."""
        self.cutting = True
        self.link.cut()

    @property
    def open(self) -> bool:
        """Whether the watch still streams (False after a timeout or its end)."""
        return self.streaming

    def close(self) -> None:
        """Close the watch's connection."""
        self.streaming = False
        self.link.close()


def _what_moved(result: object) -> Moved:
    """Classify one watch message's result: deletions alone, a put or a cancel, nothing.

    A put calls for a look: a key moved onto a window's lease, or put again by a holder
    that leaves for a taker (docs/design.md A13), even when its deletion follows at once.
    """
    if not isinstance(result, dict):
        return ""
    events = result.get("events")
    if (
        isinstance(events, list)
        and events
        and all(isinstance(event, dict) and event.get("type") == "DELETE" for event in events)
    ):
        return "deleted"
    return "changed" if events or result.get("canceled") else ""


def _json(line: bytes) -> object:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def _words(err: BaseException, timeout: float) -> str:
    """Return one line for a transport error (no secret can be in it: none was sent yet)."""
    if isinstance(err, TimeoutError):
        return f"no answer within {timeout:g}s"
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text[:200]
