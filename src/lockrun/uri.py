"""Parse lock URIs (SPEC §3) and keep passwords out of every message."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final
from urllib.parse import SplitResult, unquote, urlsplit

from lockrun.errors import ConfigError

DEFAULT_URI: Final = "file:"
_SCHEME: Final = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class LockURI:
    """A parsed lock URI; `text` is the original, `redacted` is safe to print."""

    text: str
    parts: SplitResult

    @property
    def scheme(self) -> str:
        """The lower-case scheme, e.g. ``file`` or ``redis``."""
        return self.parts.scheme

    @property
    def path(self) -> str:
        """The percent-decoded path (``file:``'s directory, ``abstract:``'s prefix)."""
        return unquote(self.parts.path)

    @property
    def redacted(self) -> str:
        """The URI with any password replaced by ``***``."""
        return redact(self.text)


def parse_uri(text: str) -> LockURI:
    """Parse *text*; raise `ConfigError` for a malformed URI or an unknown scheme."""
    from lockrun.backends import SCHEMES  # noqa: PLC0415 - backends imports this module

    if _SCHEME.match(text) is None:
        msg = f"malformed lock URI {redact(text)!r}: expected SCHEME:…, e.g. file: or redis://host"
        raise ConfigError(msg)
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - validates the port now, not deep inside a driver
    except ValueError as err:
        msg = f"malformed lock URI {redact(text)!r}: {err}"
        raise ConfigError(msg) from None
    if parts.scheme not in SCHEMES:
        known = ", ".join(f"{scheme}:" for scheme in SCHEMES)
        msg = f"unknown lock URI scheme {parts.scheme!r} in {redact(text)!r}; expected {known}"
        raise ConfigError(msg)
    return LockURI(text, parts)


def redact(text: str) -> str:
    """Replace the password of a URI (and of any ``password=`` query item) with ``***``."""
    text = re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", text)
    return re.sub(r"(?i)((?:^|[?&])password=)[^&]*", r"\1***", text)
