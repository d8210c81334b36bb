"""PostgreSQL URIs: libpq's connection URI checked by libpq, and its words made safe to print."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Final, NamedTuple

import psycopg

from lockrun.backends import readable_file
from lockrun.errors import BackendUnavailable, ConfigError, LockrunError
from lockrun.uri import Secrets, scrub, secrets_of

if TYPE_CHECKING:
    from lockrun.uri import LockURI

# libpq's words for a refusal → what lockrun says (libpq gives no SQLSTATE for these)
FAILURES: Final[tuple[tuple[str, type[LockrunError], str], ...]] = (
    (
        r"authentication failed|no password supplied",
        BackendUnavailable,
        "{where}: authentication failed: {text}",
    ),
    (r'database ".*" does not exist', ConfigError, "{where}: no such database: {text}"),
    (r"invalid [\w ]*value", ConfigError, "{where}: {text}"),  # ?sslmode=bogus, ?port=x
    (
        r"too many clients|connection slots are reserved",
        BackendUnavailable,
        "{where}: the server has no free connection (max_connections): {text}",
    ),
    (
        r"ssl negotiation|expected authentication request|invalid length of startup packet",
        BackendUnavailable,
        "{where} does not answer like a PostgreSQL server",
    ),
)
# libpq parameters that name a file libpq opens and reads: a FIFO there would block it.
_FILE_PARAMETERS: Final = frozenset({"passfile", "sslcert", "sslkey", "sslrootcert", "sslcrl"})


class Settings(NamedTuple):
    """Where the server is, from a postgresql: or postgres: URI, which libpq reads as it is."""

    where: str  # the URI without its password, for messages
    conninfo: str
    secrets: Secrets  # what libpq's and the server's words must never show


def parse(uri: LockURI) -> Settings:
    """Check *uri* with libpq's own parser; raise `ConfigError` for a bad one.

    libpq ends the user information at its first ``@`` where RFC 3986 (and lockrun) take
    the last: any other ``@`` of it goes to libpq as ``%40``, so both read the same host.
    """
    conninfo = uri.text
    if uri.userinfo is not None and "@" in uri.userinfo:
        start = conninfo.index("//") + 2
        conninfo = (
            conninfo[:start]
            + uri.userinfo.replace("@", "%40")
            + "@"
            + uri.hosts
            + (conninfo[start + len(uri.netloc) :])
        )
    settings = Settings(uri.redacted, conninfo, secrets_of(uri.text, conninfo))
    try:
        parameters = psycopg.conninfo.conninfo_to_dict(conninfo)
    except (psycopg.Error, UnicodeError) as err:  # %-escapes that are not UTF-8, too
        reason = one_line(settings, str(err))
        msg = f"{uri.redacted}: not a libpq connection URI: {reason}"
        raise ConfigError(msg) from None
    for parameter in sorted(_FILE_PARAMETERS & parameters.keys()):
        path = str(parameters[parameter])
        if os.path.exists(path) and not readable_file(path):  # missing: libpq's to say
            msg = f"{uri.redacted}: {parameter} {path}: not a regular file we may read"
            raise ConfigError(msg)
    return settings


def one_line(settings: Settings, text: str) -> str:
    """Squeeze a libpq message into one line with no secret, nor a piece of one, in it."""
    text = " ".join(text.split()).removeprefix("connection failed: ")
    return scrub(text.replace(settings.conninfo, settings.where), settings.secrets)


def refusal(where: str, text: str) -> LockrunError | None:
    """Return what lockrun says of libpq's one-line *text* if it names a refusal (`FAILURES`)."""
    for pattern, kind, what in FAILURES:
        if re.search(pattern, text, re.IGNORECASE):
            return kind(what.format(where=where, text=text))
    return None
