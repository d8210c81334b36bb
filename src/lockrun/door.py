"""The keeper's wire: its token, the door `release` and `renew` knock on, and the messages.

Two conversations, each defined once here with both of its sides:

- A client (`lockrun release`, `renew`) and a keeper's **door**, an abstract socket named by
  the token: ``VERB SECRET`` asked, ``STATUS MESSAGE`` answered, one each per connection
  (`ask`, `read_request`, `answer`, `read_reply`).
- The parent that ran `acquire` and the **keeper** it forked, over a socket pair: the keeper
  says ``granted TOKEN FENCE`` (`grant_message`, `read_grant`), the parent `ACK` once it
  wrote the token (`NACK` if it could not), the keeper `HELD` once it detached.

docs/security.md says who may ask what.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import socket
import struct
import time
from typing import Final, NamedTuple

from lockrun.backends import user_name
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    ExitCode,
    LeaseLost,
    NotYours,
    TakenOver,
    TimedOut,
    UsageError,
)
from lockrun.timing import format_duration, now

# lr1.<keeper's uid>.<keeper id: 16 hex digits>.<secret: 24 characters of base64url>:
# shell-safe, and no URI or password in it.
_TOKEN: Final = re.compile(
    r"lr1\.(0|[1-9][0-9]{0,9})\.([0-9a-f]{16})\.([A-Za-z0-9_-]{24})", re.ASCII
)
MAX_UID: Final = 2**32 - 2  # (uid_t) -1 is no user
_DOOR: Final = b"\0lockrun-keeper/"  # + the keeper id: one abstract name per keeper
MAX_REQUEST: Final = 64  # "release " + a secret, with room; anything longer is junk
MAX_REPLY: Final = 1024
_REPLIES: Final = {
    0: None,
    ExitCode.UNAVAILABLE: BackendUnavailable,
    ExitCode.LOST: LeaseLost,
    ExitCode.NOPERM: NotYours,
    ExitCode.CONFIG: ConfigError,
    ExitCode.TAKEN_OVER: TakenOver,
    ExitCode.TIMEOUT: TimedOut,
    ExitCode.USAGE: UsageError,  # what the keeper answers a request that is none of ours
}
VERBS: Final = ("release", "renew")
ANSWER: Final = 30.0  # how long `release` waits for the keeper (a release may reach a server)
BUSY: Final = "the keeper is busy; ask again"  # their answer: `ask` asks again
_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid
_GRANTED: Final = b"granted "
ACK: Final = b"ack"  # the parent wrote the token: detach and hold
NACK: Final = b"nack"  # the parent could not: release
HELD: Final = b"held"  # the keeper detached and holds the lock


class Token(NamedTuple):
    """What `acquire` prints: whose keeper, which one, and the secret it answers to.

    The uid lets a client tell the keeper from a squatter: another user who binds a gone
    keeper's name could otherwise answer root's `release` with "released".
    """

    uid: int
    keeper: str
    secret: str

    @classmethod
    def new(cls) -> Token:
        """Return a fresh token of ours (64 bits of id, 144 of secret)."""
        return cls(os.geteuid(), secrets.token_hex(8), secrets.token_urlsafe(18))

    def __str__(self) -> str:
        """Return the token as printed: ``lr1.<uid>.<id>.<secret>``."""
        return f"lr1.{self.uid}.{self.keeper}.{self.secret}"

    @property
    def door(self) -> bytes:
        """The keeper's abstract socket address."""
        return _DOOR + self.keeper.encode()


def parse_token(text: object) -> Token:
    """Return the token *text*; `UsageError` (64) for anything `acquire` did not print."""
    match = _TOKEN.fullmatch(text) if isinstance(text, str) else None
    if match is None or int(match[1]) > MAX_UID:
        msg = "malformed token: expected lr1.… as printed by `lockrun acquire`"
        raise UsageError(msg)
    return Token(int(match[1]), match[2], match[3])


class Grant(NamedTuple):
    """What the keeper tells its parent once it holds the lock."""

    token: Token
    fence: int | None


def grant_message(grant: Grant) -> bytes:
    """Encode what the keeper tells its parent once it holds the lock."""
    fence = "-" if grant.fence is None else str(grant.fence)
    return _GRANTED + f"{grant.token} {fence}".encode()


def read_grant(message: bytes) -> Grant | None:
    """Decode our keeper's ``granted TOKEN FENCE`` (None: it ended without the lock)."""
    if not message.startswith(_GRANTED):
        return None
    _, token, fence = message.decode().split(" ")
    return Grant(parse_token(token), None if fence == "-" else int(fence))


def read_request(data: bytes) -> tuple[str, str] | None:
    """Return (verb, secret) of a client's request, None if it is none of ours."""
    if len(data) > MAX_REQUEST:
        return None
    verb, _, secret = data.partition(b" ")
    text = verb.decode("ascii", "replace")
    if text not in VERBS or not secret.isascii():
        return None
    return text, secret.decode()


def read_reply(data: bytes) -> tuple[int, str] | None:
    """Return (status, message) of a keeper's answer, None if it is none a keeper gives."""
    if len(data) > MAX_REPLY:
        return None
    head, _, message = data.partition(b" ")
    if not head.isdigit() or len(head) > 3 or int(head) not in _REPLIES:  # noqa: PLR2004
        return None
    return int(head), message.decode(errors="replace")


# -- the client: release and renew ----------------------------------------------------------

_GONE: Final = (
    "no keeper holds a lock for this token: it was released, its owner exited, it was "
    "stopped or killed, or it runs in another network namespace"
)


def ask(text: object, verb: str) -> str:
    """Send *verb* to the keeper of the token *text*; return its line, or raise its status.

    No keeper is `LeaseLost` (76), a keeper of another user's `NotYours` (77), a keeper
    that does not answer `BackendUnavailable` (69). A keeper with a crowd at its door
    answers `BUSY`, or hangs up unread (the kernel then resets our end, and its answer may
    be lost): both are asked again until `ANSWER` is up. A request the keeper read is
    always answered, so one asked again was never carried out.
    """
    token = parse_token(text)
    me = os.geteuid()
    if me not in {0, token.uid}:  # it would not answer us: say so without trying
        msg = f"this token is of a keeper of another user (uid {token.uid}): not yours"
        raise NotYours(msg)
    deadline = now() + ANSWER
    while (answer := _ask_once(token, verb, deadline)) in {None, (ExitCode.UNAVAILABLE, BUSY)}:
        if now() >= deadline:
            break
        time.sleep(0.01)
    if answer is None:
        msg = "the keeper hung up without an answer"
        raise BackendUnavailable(msg)
    status, message = answer
    error = _REPLIES[status]
    if error is not None:
        raise error(message)
    return message


def _ask_once(token: Token, verb: str, deadline: float) -> tuple[int, str] | None:
    """Knock, send *verb*, and return the keeper's answer (None if we could read none)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as door:
        _knock(door, token, deadline)
        uid = peer_uid(door)
        if uid != token.uid:  # never show the secret to, nor believe, a squatter
            msg = f"{_GONE}; user {user_name(uid)} listens on its name instead, and was not asked"
            raise LeaseLost(msg)
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                # A keeper that turned us away (BUSY) has answered and hung up already:
                # its answer waits to be read.
                door.send(f"{verb} {token.secret}".encode())
            data = door.recv(MAX_REPLY + 1)
        except TimeoutError:
            msg = f"the keeper did not answer within {format_duration(ANSWER)}"
            raise BackendUnavailable(msg) from None
        except OSError as err:
            if err.errno not in {errno.ECONNRESET, errno.EPIPE}:
                raise BackendUnavailable(f"the keeper: {err.strerror or err}") from None
            return None
    if not data:  # hung up on us before we asked
        return None
    if (answer := read_reply(data)) is None:
        msg = "the keeper's answer is none a keeper gives"
        raise BackendUnavailable(msg)
    return answer


def _knock(door: socket.socket, token: Token, deadline: float) -> None:
    """Connect *door* to *token*'s keeper by *deadline*; raise its status if not."""
    door.settimeout(max(0.1, deadline - now()))
    while True:
        try:
            door.connect(token.door)
        except BlockingIOError:
            # A full backlog (a crowd at the door, maybe another user's) answers EAGAIN at
            # once, not after the timeout: ask again until the deadline.
            if now() >= deadline:
                msg = f"the keeper did not answer within {format_duration(ANSWER)}"
                raise BackendUnavailable(msg) from None
            time.sleep(0.01)
        except (ConnectionRefusedError, FileNotFoundError):
            raise LeaseLost(_GONE) from None
        except OSError as err:
            msg = f"cannot reach the keeper: {err.strerror or err}"
            raise BackendUnavailable(msg) from None
        else:
            door.settimeout(max(0.1, deadline - now()))
            return


def peer_uid(connection: socket.socket) -> int:
    """Return the uid of the process at the other end of the Unix socket *connection*."""
    _, uid, _ = _PEERCRED.unpack(
        connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return int(uid)


def answer(connection: socket.socket, status: int, message: str) -> None:
    """Send a keeper's answer without waiting: a client that does not read gets nothing."""
    with contextlib.suppress(OSError):
        connection.send(f"{int(status)} {message}".encode()[:MAX_REPLY], socket.MSG_DONTWAIT)


__all__ = [
    "ACK",
    "ANSWER",
    "BUSY",
    "HELD",
    "MAX_REPLY",
    "MAX_REQUEST",
    "NACK",
    "VERBS",
    "Grant",
    "Token",
    "answer",
    "ask",
    "grant_message",
    "parse_token",
    "peer_uid",
    "read_grant",
    "read_reply",
    "read_request",
]
