"""etcd lock URIs: ``etcd://[USER:PASSWORD@]HOST[:PORT][,HOST[:PORT]…]`` and ``etcds://…``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

from lockrun.backends import host_port, readable_file
from lockrun.errors import ConfigError
from lockrun.uri import Secrets, option_name, query_items, secrets_of, unquote

if TYPE_CHECKING:
    from lockrun.uri import LockURI

DEFAULT_PORT: Final = 2379  # etcd's client port (IANA)
# The TLS options of rediss:// (docs/backends.md "etcd"), with the same meanings.
_TLS_OPTIONS: Final = frozenset(
    {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}
)
_TLS_FILES: Final = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
_REQS: Final = ("none", "optional", "required")


class TLS(NamedTuple):
    """How to speak TLS to every endpoint (etcds://)."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"
    check_hostname: bool = True


class Settings(NamedTuple):
    """Where the members are and how to log in."""

    where: str  # the URI without its password, for messages
    endpoints: tuple[tuple[str, int], ...]  # tried in this order, then round again
    user: str | None
    password: str | None
    secrets: Secrets  # what the server's words must never show
    tls: TLS | None = None

    def __repr__(self) -> str:
        """Show no password: a repr lands in tracebacks and logs."""
        return f"Settings({self.where!r}, {self.endpoints!r})"


def parse(uri: LockURI) -> Settings:
    """Translate an etcd:// or etcds:// URI; raise `ConfigError` for a bad one.

    From the parts `parse_uri` split, as MySQL's: urllib.parse (and ipaddress with it)
    was 2 ms of every etcd run's start-up (issue #33).
    """
    if uri.path.strip("/"):
        msg = f"{uri.redacted}: an etcd URI names no database: {uri.scheme}://HOST[:PORT],…"
        raise ConfigError(msg)
    query = _options(uri, uri.query)
    user, password = _login(uri.userinfo)
    endpoints = tuple(host_port(uri, host, DEFAULT_PORT) for host in uri.hosts.split(","))
    tls = _tls(uri, query) if uri.scheme == "etcds" else None
    return Settings(uri.redacted, endpoints, user, password, secrets_of(uri.text), tls)


def _options(uri: LockURI, text: str) -> dict[str, str]:
    """Return the URI's options; any but etcds://'s TLS options is refused."""
    query = query_items(text)
    allowed = _TLS_OPTIONS if uri.scheme == "etcds" else frozenset()
    unknown = sorted(set(query) - allowed)
    if unknown:
        listed = ", ".join(sorted(allowed)) or "none"
        msg = f"{uri.redacted}: unknown option {option_name(unknown[0], text)} (allowed: {listed})"
        raise ConfigError(msg)
    return query


def _login(userinfo: str | None) -> tuple[str | None, str | None]:
    """Split the user information into user and password (both None without an @).

    ``USER@`` logs in with an empty password, which etcd refuses (69) unless it has auth
    off: as a wrong password is, not a malformed URI.
    """
    if userinfo is None:
        return None, None
    user, _, password = userinfo.partition(":")
    return unquote(user), unquote(password)


def _tls(uri: LockURI, query: dict[str, str]) -> TLS:
    for option in sorted(_TLS_FILES & set(query)):
        if not readable_file(query[option]):
            msg = f"{uri.redacted}: {option} {query[option]}: no such readable file"
            raise ConfigError(msg)
    reqs = query.get("ssl_cert_reqs", "required")
    if reqs not in _REQS:
        msg = f"{uri.redacted}: ssl_cert_reqs must be none, optional or required"
        raise ConfigError(msg)
    check = query.get("ssl_check_hostname", "true") in {"1", "true", "yes", "on"}
    return TLS(
        query.get("ssl_ca_certs"), query.get("ssl_certfile"), query.get("ssl_keyfile"), reqs, check
    )
