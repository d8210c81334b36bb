"""Redis lock URIs: redis:, rediss:, unix:, redis+sentinel: and the cluster schemes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

from lockrun.backends import host_port, readable_file
from lockrun.errors import ConfigError
from lockrun.uri import Secrets, option_name, scrub, secrets_of

if TYPE_CHECKING:
    from collections.abc import Mapping

    from lockrun.uri import LockURI

DEFAULT_PORT: Final = 6379
SENTINEL_PORT: Final = 26379
_TLS_OPTIONS: Final = frozenset(
    {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}
)
_TLS_FILES: Final = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
_OPTIONS: Final = {
    "redis": frozenset({"db"}),
    "rediss": frozenset({"db"}) | _TLS_OPTIONS,
    "unix": frozenset({"db", "username", "password"}),
    "redis+sentinel": frozenset({"db", "sentinel_username", "sentinel_password"}) | _TLS_OPTIONS,
    "redis+cluster": frozenset(),
    "rediss+cluster": _TLS_OPTIONS,
}
CLUSTER_SCHEMES: Final = frozenset({"redis+cluster", "rediss+cluster"})


class Settings(NamedTuple):
    """Where the server is and how to log in: a redis:, rediss:, unix:, sentinel or cluster URI."""

    where: str  # the URI without its password, for messages
    kwargs: Mapping[str, Any]  # for redis.Redis, or for Sentinel.master_for
    secrets: Secrets  # what redis-py's and the server's words must never show
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    sentinel_kwargs: Mapping[str, Any] = {}
    cluster: tuple[tuple[str, int], ...] = ()  # a Redis Cluster's nodes, to ask first


class _Parts(NamedTuple):
    """A URI split: what each scheme's reader needs."""

    uri: LockURI
    kwargs: dict[str, object]  # the login so far: username and password
    hosts: str
    path: str  # unquoted
    query: dict[str, str]  # the options not read yet


def parse(uri: LockURI) -> Settings:
    """Translate a lock URI into redis-py settings; raise `ConfigError` for a bad one."""
    try:
        parts = urlsplit(uri.text)
    except ValueError as err:  # e.g. an unclosed [IPv6 bracket
        msg = f"{uri.redacted}: {scrub(str(err), secrets_of(uri.text))}"
        raise ConfigError(msg) from None
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - _OPTIONS[uri.scheme])
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS[uri.scheme])) or "none"
        name = option_name(unknown[0], parts.query)
        msg = f"{uri.redacted}: unknown option {name} (allowed: {allowed})"
        raise ConfigError(msg)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    kwargs: dict[str, object] = {
        "username": unquote(username) or query.pop("username", None),
        "password": unquote(password) or query.pop("password", None),
    }
    split = _Parts(uri, kwargs, hosts, unquote(parts.path), query)
    if uri.scheme == "unix":
        return _unix(split)
    if uri.scheme == "redis+sentinel":
        return _sentinel(split)
    if uri.scheme in CLUSTER_SCHEMES:
        return _cluster(split)
    return _server(split)


def _server(parts: _Parts) -> Settings:
    """Return the settings of a redis:// or rediss:// URI."""
    uri, kwargs, query = parts.uri, parts.kwargs, parts.query
    kwargs["host"], kwargs["port"] = host_port(uri, parts.hosts, DEFAULT_PORT)
    db = _one_db(uri, parts.path.strip("/"), query)
    if uri.scheme == "rediss":
        kwargs |= _tls(uri, query)
    kwargs["db"] = _db(uri, db)
    return Settings(uri.redacted, kwargs, secrets_of(uri.text))


def _unix(parts: _Parts) -> Settings:
    """Return the settings of a unix:///PATH URI."""
    uri, kwargs = parts.uri, parts.kwargs
    # A relative path is refused too: in unix:USER:PASSWORD@/x.sock (no //) redaction sees a
    # user information where urlsplit sees the path "USER:PASSWORD@/x.sock", which redis-py
    # would then quote in its errors (docs/security.md "Passwords in URIs").
    if not parts.path.startswith("/"):
        msg = f"{uri.redacted}: expected unix:///path/to/redis.sock"
        raise ConfigError(msg)
    kwargs["unix_socket_path"] = parts.path
    kwargs["db"] = _db(uri, parts.query.pop("db", "0"))
    return Settings(uri.redacted, kwargs, secrets_of(uri.text))


def _sentinel(parts: _Parts) -> Settings:
    """Return the settings of a redis+sentinel://HOST[:PORT],…/SERVICE[/DB] URI."""
    uri, kwargs, query = parts.uri, parts.kwargs, parts.query
    service, _, db = parts.path.strip("/").partition("/")
    if not service:
        msg = f"{uri.redacted}: expected redis+sentinel://HOST[:PORT],…/SERVICE[/DB]"
        raise ConfigError(msg)
    sentinels = tuple(host_port(uri, host, SENTINEL_PORT) for host in parts.hosts.split(","))
    if _TLS_OPTIONS & set(query):  # the primary speaks TLS only when the URI says so
        kwargs |= _tls(uri, query)
    kwargs["db"] = _db(uri, _one_db(uri, db, query))
    sentinel = {
        "username": query.pop("sentinel_username", None),
        "password": query.pop("sentinel_password", None),
    }
    return Settings(uri.redacted, kwargs, secrets_of(uri.text), sentinels, service, sentinel)


def _cluster(parts: _Parts) -> Settings:
    """Return the settings of a redis+cluster:// or rediss+cluster:// URI."""
    uri, kwargs = parts.uri, parts.kwargs
    if parts.path.strip("/") not in {"", "0"}:
        msg = (
            f"{uri.redacted}: a Redis Cluster has database 0 alone; "
            "expected redis+cluster://HOST[:PORT],…"
        )
        raise ConfigError(msg)
    nodes = tuple(host_port(uri, host, DEFAULT_PORT) for host in parts.hosts.split(","))
    if uri.scheme == "rediss+cluster":
        kwargs |= _tls(uri, parts.query)
    return Settings(uri.redacted, kwargs, secrets_of(uri.text), cluster=nodes)


def _one_db(uri: LockURI, in_path: str, query: dict[str, str]) -> str:
    """Return the database named in the path or in ``?db=``, refusing both at once."""
    if in_path and "db" in query:
        msg = f"{uri.redacted}: the database is given twice, in the path and as ?db="
        raise ConfigError(msg)
    return query.pop("db", in_path or "0")


def _db(uri: LockURI, text: str) -> int:
    if not text.isdigit():
        msg = f"{uri.redacted}: database {text!r} is not a number (redis://HOST/0 … /15)"
        raise ConfigError(msg)
    return int(text)


def _tls(uri: LockURI, query: dict[str, str]) -> dict[str, object]:
    tls: dict[str, object] = {"ssl": True}
    for option in sorted(_TLS_OPTIONS & set(query)):
        tls[option] = value = query.pop(option)
        if option in _TLS_FILES and not readable_file(value):
            msg = f"{uri.redacted}: {option} {value}: no such readable file"
            raise ConfigError(msg)
    if "ssl_check_hostname" in tls:
        tls["ssl_check_hostname"] = tls["ssl_check_hostname"] in {"1", "true", "yes", "on"}
    if tls.get("ssl_cert_reqs", "required") not in {"none", "optional", "required"}:
        msg = f"{uri.redacted}: ssl_cert_reqs must be none, optional or required"
        raise ConfigError(msg)
    return tls
