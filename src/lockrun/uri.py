"""Parse lock URIs (SPEC §3) and keep passwords out of every message."""

from __future__ import annotations

import re
from typing import Final, NamedTuple

from lockrun.errors import ConfigError

DEFAULT_URI: Final = "file:"
# RFC 3986 appendix B, rather than urllib.parse: its import (with ipaddress) is a tenth of
# our start-up, and the server backends that need more import it themselves.
_URI: Final = re.compile(
    r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):(?://(?P<netloc>[^/?#]*))?"
    r"(?P<path>[^?#]*)(?:\?(?P<query>[^#]*))?(?:#.*)?",
    re.DOTALL,
)


class LockURI(NamedTuple):
    """A parsed lock URI; `text` is the original, `redacted` is safe to print."""

    text: str
    scheme: str
    netloc: str
    path: str  # percent-decoded: file:'s directory, abstract:'s prefix
    query: str

    @property
    def redacted(self) -> str:
        """The URI with any password replaced by ``***``."""
        return redact(self.text)


def parse_uri(text: str) -> LockURI:
    """Parse *text*; raise `ConfigError` for a malformed URI or an unknown scheme."""
    from lockrun.backends import SCHEMES  # noqa: PLC0415 - backends imports this module

    match = _URI.fullmatch(text)
    if match is None:
        msg = f"malformed lock URI {redact(text)!r}: expected SCHEME:…, e.g. file: or redis://host"
        raise ConfigError(msg)
    scheme = match["scheme"].lower()
    if scheme not in SCHEMES:
        known = ", ".join(f"{scheme}:" for scheme in SCHEMES)
        msg = f"unknown lock URI scheme {scheme!r} in {redact(text)!r}; expected {known}"
        raise ConfigError(msg)
    return LockURI(
        text, scheme, match["netloc"] or "", unquote(match["path"]), match["query"] or ""
    )


def host_port(uri: LockURI, text: str, default_port: int) -> tuple[str, int]:
    """Split ``HOST[:PORT]`` or ``[IPV6][:PORT]`` of *uri*; no host means localhost.

    Without a port, *default_port* (0: let the driver decide).
    """
    match = re.fullmatch(r"\[(.+)\](?::(\d*))?|([^:\[\]]*)(?::(\d*))?", text)
    if match is None:
        msg = f"{uri.redacted}: expected HOST[:PORT] or [IPV6][:PORT] after the last @"
        raise ConfigError(msg)
    host = match[1] or match[3] or "localhost"
    port_text = match[2] if match[1] else match[4]
    port = int(port_text) if port_text else default_port
    if port_text and not 0 < port < 65536:  # noqa: PLR2004 - TCP's port range
        msg = f"{uri.redacted}: port {port} is out of range"
        raise ConfigError(msg)
    return host, port


def query_items(text: str) -> dict[str, str]:
    """Decode ``a=1&b=2`` as urllib.parse.parse_qsl does (``+`` is a space), last one wins."""
    items = {}
    for item in text.split("&"):
        if item:
            key, _, value = item.partition("=")
            items[unquote(key.replace("+", " "))] = unquote(value.replace("+", " "))
    return items


def unquote(text: str) -> str:
    """Decode %XX escapes (as UTF-8, like urllib.parse.unquote)."""
    if "%" not in text:
        return text
    raw = re.sub(rb"%([0-9A-Fa-f]{2})", lambda match: bytes([int(match[1], 16)]), text.encode())
    return raw.decode(errors="replace")


# A password runs to the last @ of the whole text: unescaped, it may hold @, /, ? or #,
# which end the authority for a parser. Hiding too much is the safe mistake.
_USERINFO: Final = re.compile(r"//[^/@:?#]*:(.*)@", re.DOTALL)
_OPTION: Final = re.compile(r"(^|[?&])([^=&#?]*)=([^&#]*)")


def secret_spans(text: str) -> list[tuple[int, int]]:
    """Return where *text* holds passwords, in order (some may be empty).

    The userinfo's, and the value of every query option after it whose name, %-decoded,
    ends in ``password`` (``?password=``, ``?sslpassword=``, ``?pass%77ord=`` …).
    """
    userinfo = _USERINFO.search(text)
    spans = [userinfo.span(1)] if userinfo else []
    options = _OPTION.finditer(text, userinfo.end() if userinfo else 0)
    spans += [match.span(3) for match in options if unquote(match[2]).lower().endswith("password")]
    return spans


def redact(text: str) -> str:
    """Replace the password of a URI (and of any ``…password=`` query item) with ``***``."""
    for start, end in reversed(secret_spans(text)):
        text = f"{text[:start]}***{text[end:]}"
    return text
