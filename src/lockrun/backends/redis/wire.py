"""Commands on the wire: our scripts and pipelines in one round trip, and what errors mean.

Packed here: redis-py's packer and command machinery cost more than the round trip for a
script's 18 arguments. Every reply is read within the bounds of `resp` (on connect, every
connection lockrun makes reads through its parser).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from redis import exceptions as errors
from redis.sentinel import MasterNotFoundError

from lockrun.errors import BackendUnavailable, ConfigError, LockrunError
from lockrun.uri import scrub

if TYPE_CHECKING:
    from lockrun.backends.redis.scripts import Script
    from lockrun.backends.redis.uri import Settings

# Client-side caching's tracking, for a lease's take-over bell (`RedisBackend.track`).
TRACK: Final = (("CLIENT", "TRACKING", "ON", "OPTIN"), ("CLIENT", "CACHING", "yes"))

# What redis-py raises besides its own errors when a "server" answers what Redis never
# would (its parsers and handshake trust the protocol): a reply to report, not a bug (#8).
REPLY_ERRORS: Final = (
    errors.RedisError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
    KeyError,
    RecursionError,
)


def command(*words: str | int) -> bytes:
    """Return one command in Redis's protocol (RESP)."""
    encoded = [(word if type(word) is str else str(word)).encode() for word in words]
    return b"*%d\r\n" % len(encoded) + b"".join([b"$%d\r\n%b\r\n" % (len(d), d) for d in encoded])


def run(
    connection: Any,  # noqa: ANN401 - redis-py's Connection
    script: Script[Any],
    keys: list[str],
    argv: list[Any],
    *after: tuple[str, ...],
    asking: bool = False,
) -> list[Any]:
    """Run *script* on *connection*, then the commands *after*, in one round trip.

    Return their replies, the script's not decoded yet; an error reply to one of *after* is
    returned as the exception. A server that lacks the script (a restart, SCRIPT FLUSH,
    another server behind the address) is given it, once. *asking*: ASKING first, for the
    node a cluster's ASK redirected us to.
    """
    packed = b"".join(
        [
            command("ASKING") if asking else b"",
            command("EVALSHA", script.sha1, len(keys), *keys, *argv),
            *(command(*c) for c in after),
        ]
    )
    for _attempt in range(2):
        connection.send_packed_command([packed])  # a list of chunks, as pack_command gives
        try:
            if asking:
                connection.read_response()  # OK
            reply = connection.read_response()
        except errors.NoScriptError:
            for _ in after:  # their replies, before the connection is used again
                reply_of(connection)
            connection.send_packed_command([command("SCRIPT", "LOAD", script.text)])
            connection.read_response()
            continue
        except errors.ResponseError:
            for _ in after:  # the connection stays in step, then the error is reported
                reply_of(connection)
            raise
        return [reply, *(reply_of(connection) for _ in after)]
    msg = "the server forgot our script as soon as it was loaded"
    raise errors.ConnectionError(msg)


def reply_of(connection: Any) -> Any:  # noqa: ANN401 - redis-py's Connection, and any reply
    """Read one reply; an error reply (a refused command) is returned, not raised.

    Its whole reply has been read, so the connection stays in step for the next.
    """
    try:
        return connection.read_response()
    except errors.ResponseError as refused:
        return refused


def pipeline(connection: Any, *commands: tuple[str, ...]) -> list[Any]:  # noqa: ANN401
    """Send *commands* in one round trip; return their replies (errors as values, `reply_of`)."""
    connection.send_packed_command([b"".join(command(*each) for each in commands)])
    return [reply_of(connection) for _ in commands]


# redis-py's error (one of its classes, or words of its message) → what lockrun says; the
# first that matches wins.
_FAILURES: Final[
    tuple[tuple[tuple[type[Exception], ...], tuple[str, ...], type[LockrunError], str], ...]
] = (
    (
        (),
        ("NOAUTH", "HELLO must be called"),
        BackendUnavailable,
        (
            "{where}: the server requires a password; put it in the URI "
            "(or in LOCKRUN_URI, to keep it out of ps)"
        ),
    ),
    (
        (errors.ReadOnlyError,),
        (),
        BackendUnavailable,
        "{where} is a read-only replica; point --uri at the primary (or use redis+sentinel://)",
    ),
    (
        (errors.AuthenticationError,),
        ("WRONGPASS",),
        BackendUnavailable,
        "{where}: authentication failed: {text}",
    ),
    (
        (errors.NoPermissionError,),
        (),
        BackendUnavailable,
        "{where}: the Redis user lacks a permission: {text}",
    ),
    (
        (),
        ("WRONGTYPE",),  # another client wrote a key of the lock as something else
        BackendUnavailable,
        (
            "{where}: a key of this lock holds data lockrun did not write (WRONGTYPE); delete "
            "the lock's keys (docs/backends.md: Redis)"
        ),
    ),
    (
        (),
        ("DB index is out of range",),
        ConfigError,
        "{where}: no such database on this server: {text}",
    ),
    (
        (),
        ("cluster support disabled",),  # CLUSTER MYID, after a grant on a redis+cluster:// URI
        ConfigError,
        "{where}: the server is no node of a Redis Cluster; use redis://HOST[:PORT]",
    ),
    (
        (),
        ("SELECT is not allowed in cluster mode",),
        ConfigError,
        (
            "{where} is a node of a Redis Cluster, which has database 0 alone; "
            "use redis+cluster://HOST[:PORT],…"
        ),
    ),
    (
        (errors.TimeoutError,),
        (),
        BackendUnavailable,
        "{where}: no answer within {timeout:g}s ({text})",
    ),
    ((errors.ConnectionError,), (), BackendUnavailable, "{where}: {text}"),
    (
        (errors.InvalidResponse,),
        ("Protocol error",),
        BackendUnavailable,
        "{where} does not answer like a Redis server ({text})",
    ),
)


def failure(err: Exception, settings: Settings, timeout: float) -> LockrunError:
    """Translate a redis-py error into one line, naming the server but no password."""
    where = settings.where
    if not isinstance(err, errors.RedisError):  # one of REPLY_ERRORS: not Redis talking
        return BackendUnavailable(
            f"{where}: the server's reply is not Redis's ({type(err).__name__})"
        )
    text = str(err).splitlines()[0] if str(err) else type(err).__name__
    text = scrub(text, settings.secrets)
    if isinstance(err, MasterNotFoundError):
        sentinels = ",".join(f"{host}:{port}" for host, port in settings.sentinels)
        return BackendUnavailable(
            f"{where}: no majority of the sentinels at {sentinels} named a reachable "
            f"primary for {settings.service!r}"
        )
    for kinds, words, error, what in _FAILURES:
        if isinstance(err, kinds) or any(word in text for word in words):
            return error(what.format(where=where, text=text, timeout=timeout))
    return BackendUnavailable(f"{where}: {text}")


def not_redis(where: str, script: str) -> BackendUnavailable:
    """Return the error for a reply our *script* could not have given: not Redis, or tampered."""
    return BackendUnavailable(f"{where}: the server's reply is not Redis's (to {script})")
