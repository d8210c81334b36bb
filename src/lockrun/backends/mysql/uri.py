"""A mysql: or mariadb: URI as PyMySQL's settings: login, address, TLS and option files."""

from __future__ import annotations

import configparser
import contextlib
import os
import ssl
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import pymysql

from lockrun.backends import host_port, readable_file
from lockrun.errors import ConfigError
from lockrun.uri import Secrets, option_name, query_items, secrets_of, unquote

if TYPE_CHECKING:
    from collections.abc import Mapping

    from lockrun.uri import LockURI

_OPTIONS: Final = frozenset(
    {"unix_socket", "ssl_ca", "ssl_cert", "ssl_key", "read_default_file", "charset"}
)
_FILES: Final = frozenset({"ssl_ca", "ssl_cert", "ssl_key", "read_default_file"})
_TLS: Final = frozenset({"ssl_ca", "ssl_cert", "ssl_key"})
_FORM: Final = "mysql://[USER[:PASSWORD]@]HOST[:PORT][/DATABASE]"


class Settings(NamedTuple):
    """Where the server is and how to log in, from a mysql: or mariadb: URI."""

    where: str  # the URI without its password, for messages
    kwargs: Mapping[str, Any]  # for pymysql.connect
    secrets: Secrets  # what PyMySQL's and the server's words must never show


def parse(uri: LockURI) -> Settings:
    """Translate a lock URI into PyMySQL settings; raise `ConfigError` for a bad one."""
    query = query_items(uri.query)
    _refuse_unknown(uri, query)
    _check_files(uri, query)
    kwargs = login(uri) | {"charset": query.pop("charset", "utf8mb4")} | address(uri)
    kwargs |= {option: value for option, value in query.items() if value}
    if "ssl_ca" in kwargs:  # a CA to check the server against: check its name too
        kwargs["ssl_verify_identity"] = True
    _check_tls(uri, kwargs)
    _check_charset(uri, str(kwargs["charset"]))
    return Settings(uri.redacted, kwargs, secrets_of(uri.text))


def login(uri: LockURI) -> dict[str, object]:
    """Return the user, password and database a URI names (None where it names none)."""
    username, _, password = (uri.userinfo or "").partition(":")
    database = uri.path.strip("/")
    if "/" in database:
        msg = f"{uri.redacted}: expected {_FORM}"
        raise ConfigError(msg)
    return {
        "user": unquote(username) or None,
        "password": unquote(password),
        "database": database or None,
    }


def address(uri: LockURI) -> dict[str, object]:
    """Return the host and port a URI names; none without a host, no port without one."""
    if not uri.hosts:
        return {}
    host, port = host_port(uri, uri.hosts, 0)  # no port: the option file's, else 3306
    return {"host": host, "port": port} if port else {"host": host}


def _refuse_unknown(uri: LockURI, query: Mapping[str, str]) -> None:
    unknown = sorted(set(query) - _OPTIONS)
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS))
        name = option_name(unknown[0], uri.query)
        msg = f"{uri.redacted}: unknown option {name} (allowed: {allowed})"
        raise ConfigError(msg)


def _check_files(uri: LockURI, query: dict[str, str]) -> None:
    """Expand ``~`` in the file options and make sure each names a readable file."""
    for option in sorted(_FILES & set(query)):
        path = query[option] = os.path.expanduser(query[option])
        if not readable_file(path):
            msg = f"{uri.redacted}: {option} {path}: no such readable file"
            raise ConfigError(msg)
    if "read_default_file" in query:
        _check_option_file(uri, query["read_default_file"])


def _check_option_file(uri: LockURI, path: str) -> None:
    """Refuse an option file PyMySQL cannot read, naming the line but none of its text."""
    parser = configparser.RawConfigParser(strict=False, allow_no_value=True)
    try:
        parser.read(path)
    except configparser.Error as err:
        line = getattr(err, "lineno", None)
        where = f" line {line}" if line else ""
        msg = f"{uri.redacted}: read_default_file {path}{where}: not a MySQL option file"
        raise ConfigError(msg) from None


def _check_tls(uri: LockURI, kwargs: Mapping[str, object]) -> None:
    """Load the TLS files now, so a bad one is a configuration error (78), not the server's.

    Without TLS options there is nothing to load: the system's CA store costs 20–40 ms,
    which PyMySQL's "preferred" TLS never uses (`lockrun.backends.mysql.session`).
    """
    if not _TLS & set(kwargs):
        return
    if "ssl_key" in kwargs and "ssl_cert" not in kwargs:
        msg = f"{uri.redacted}: ssl_key needs ssl_cert (the client certificate it belongs to)"
        raise ConfigError(msg)
    option = "ssl_ca"
    try:
        context = ssl.create_default_context(cafile=kwargs.get("ssl_ca"))  # type: ignore[arg-type]
        if "ssl_cert" in kwargs:
            option = "ssl_cert"
            context.load_cert_chain(kwargs["ssl_cert"], kwargs.get("ssl_key"))  # type: ignore[arg-type]
    except (ssl.SSLError, OSError) as err:
        reason = getattr(err, "reason", None) or err.strerror or type(err).__name__
        msg = f"{uri.redacted}: {option} {kwargs.get(option)}: unusable ({reason})"
        raise ConfigError(msg) from None


def _check_charset(uri: LockURI, charset: str) -> None:
    with contextlib.suppress(KeyError):  # PyMySQL returns None for an unknown one, or raised
        if pymysql.charset.charset_by_name(charset) is not None:
            return
    msg = f"{uri.redacted}: unknown charset {charset!r}"
    raise ConfigError(msg)


def carries(settings: Settings, *texts: str | None) -> None:
    """Refuse a name the URI's charset cannot carry (78), before any statement.

    Names go into the holders table as they are; latin1, say, has no ``名``.
    """
    charset = settings.kwargs["charset"]
    encoding = pymysql.charset.charset_by_name(str(charset)).encoding
    for text in texts:
        try:
            (text or "").encode(encoding)
        except UnicodeEncodeError:
            msg = (
                f"{settings.where}: charset {charset} cannot carry the name "
                f"{text!r}; use charset=utf8mb4 (the default)"
            )
            raise ConfigError(msg) from None
