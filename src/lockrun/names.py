"""Lock names: validation, the derived default, and escaping for file and socket names."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

from lockrun.errors import UsageError
from lockrun.uri import unquote

if TYPE_CHECKING:
    from collections.abc import Sequence

MAX_NAME_BYTES: Final = 255
_PLAIN: Final = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
# What a server's key may not hold of a name as written: the separator of its parts (/),
# Redis's hash tag ({}), a pattern's wildcards (* ? [ ] and backslash), blanks, control
# characters, and % itself.
_KEY_UNSAFE: Final = r"[%/{}\s\x00-\x1f\x7f*?\[\]\\]"


def check_name(name: object, what: str = "lock name") -> str:
    """Return *name* if it is 1…255 bytes of UTF-8, else raise `UsageError`."""
    if not isinstance(name, str):
        msg = f"{what} must be a string, not {type(name).__name__}"
        raise UsageError(msg)
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        msg = f"{what} {name!r} is not valid UTF-8"
        raise UsageError(msg) from None
    if "\0" in name:  # no C string, file name or SQL text can carry it
        msg = f"{what} must not hold a NUL character"
        raise UsageError(msg)
    if size == 0:
        msg = f"{what} must not be empty"
        raise UsageError(msg)
    if size > MAX_NAME_BYTES:
        msg = f"{what} is {size} bytes; at most {MAX_NAME_BYTES} are allowed"
        raise UsageError(msg)
    return name


def default_name(argv: Sequence[str]) -> str:
    """Derive a name from a command: its basename plus a short hash of the whole argv."""
    import hashlib  # noqa: PLC0415 - OpenSSL's load is a tenth of our start-up; only here

    digest = hashlib.sha256("\0".join(argv).encode(errors="surrogateescape")).hexdigest()[:8]
    base = os.path.basename(argv[0]) or "command"
    return f"{base[:200]}-{digest}"


def escape(text: str) -> str:
    """Percent-encode every byte but letters, digits, ``_`` and ``-`` (so ``.`` and ``/`` too)."""
    return "".join(chr(byte) if byte in _PLAIN else f"%{byte:02X}" for byte in text.encode())


def unescape(text: str) -> str:
    """Invert `escape`."""
    return unquote(text)


def key_part(text: str) -> str:
    """Percent-escape what would split a server's key (`_KEY_UNSAFE`); the rest stays readable.

    Redis (``lockrun:{NS/NAME}:…``) and etcd (``lockrun/NS/NAME/…``) keys, readable in
    redis-cli and etcdctl, UTF-8 included.
    """
    import re  # noqa: PLC0415 - the server backends' alone

    return re.sub(_KEY_UNSAFE, lambda match: f"%{ord(match[0]):02X}", text)
