"""The Lua scripts (lua/*.lua), as the server is sent them, and the keys they name.

Each script is its file after the prelude (lua/prelude.lua, after MAX_SLOTS and
MAX_WINDOW), with the general path (lua/machinery.lua) where it says
``-- #include machinery.lua``: after its fast path, so that the common cases make only
the calls their outcome needs. Each file is headed by its KEYS, ARGV and reply; each reply
is read by one decoder of `lockrun.backends.redis.replies`.
"""

from __future__ import annotations

import hashlib
import secrets
from importlib.resources import files
from typing import TYPE_CHECKING, Any, Final, Generic, NamedTuple, TypeVar

from lockrun.backends.redis.replies import (
    DETACHED,
    SHARED,
    Acquired,
    Renewed,
    Snapshot,
    Woken,
    decode_acquire,
    decode_renew,
    decode_status,
    decode_woken,
)
from lockrun.bounds import MAX_SLOTS, MAX_WAIT
from lockrun.names import key_part

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.backends import Request

T = TypeVar("T")

PREFIX: Final = "lockrun"
# KEYS, in the order the prelude unpacks them (lua/prelude.lua)
_KEYS: Final = (
    *("holders", "queue", "waiters", "ticket", "fence", "owners", "info", "n", "clients", "stop"),
)
_INCLUDE: Final = "-- #include machinery.lua\n"


def _lua(name: str) -> str:
    """Return the text of lua/*name*, from the package (a wheel, a checkout or lockrun.pyz)."""
    return files(__package__).joinpath("lua", name).read_text(encoding="utf-8")


def _compose(name: str) -> str:
    """Return the text the server runs for script *name*: prelude, then its file."""
    constants = (
        f"local MAX_SLOTS = {MAX_SLOTS}\n"
        f"local MAX_WINDOW = {round(MAX_WAIT * 1000)}  -- ms: the longest --hold-at-least\n"
    )
    own = _lua(f"{name}.lua")
    if _INCLUDE in own:
        own = own.replace(_INCLUDE, _lua("machinery.lua"), 1)
    return constants + _lua("prelude.lua") + own


class Script(Generic[T]):
    """One of our scripts: its name, its text, the SHA-1 EVALSHA names it by, its decoder."""

    __slots__ = ("decode", "name", "sha1", "text")

    def __init__(self, name: str, decode: Callable[[Any], T]) -> None:
        """Load script *name*; *decode* turns its reply into a typed one, or raises `Malformed`."""
        self.name = name
        self.text = _compose(name)
        # EVALSHA names a script by the SHA-1 of its text; SCRIPT LOAD where the server lacks it.
        self.sha1 = hashlib.sha1(self.text.encode(), usedforsecurity=False).hexdigest()
        self.decode = decode

    def __repr__(self) -> str:
        """Name the script, not its 12 kB of text."""
        return f"Script({self.name!r})"


ACQUIRE: Final[Script[Acquired]] = Script("acquire", decode_acquire)
RENEW: Final[Script[Renewed | None]] = Script("renew", decode_renew)
RELEASE: Final[Script[Woken]] = Script("release", decode_woken)
DROP: Final[Script[Woken]] = Script("drop", decode_woken)
STATUS: Final[Script[Snapshot]] = Script("status", decode_status)
SCRIPTS: Final[dict[str, Script[Any]]] = {
    script.name: script for script in (ACQUIRE, RENEW, RELEASE, DROP, STATUS)
}
SHA1: Final = {name: script.sha1 for name, script in SCRIPTS.items()}


def key_prefix(namespace: str, name: str) -> str:
    """Return the common prefix of a lock's keys: ``lockrun:{NS/NAME}``.

    Bytes that would split the hash tag, the namespace from the name, or a SCAN pattern are
    percent-escaped; everything else (UTF-8 included) stays readable in redis-cli.
    """
    return f"{PREFIX}:{{{key_part(namespace)}/{key_part(name)}}}"


def info_pattern(namespace: str) -> str:
    """Return the SCAN pattern of the info key of every lock in *namespace*."""
    return f"{PREFIX}:{{{key_part(namespace)}/*}}:info"


def keys_of(prefix: str) -> list[str]:
    """Return the KEYS every script is given for the lock of *prefix*."""
    return [f"{prefix}:{part}" for part in _KEYS]


class Claim(NamedTuple):
    """One acquisition: the lock's key prefix, our random token, N, and the lease in ms.

    The ARGV every script begins with (lua/prelude.lua).
    """

    prefix: str
    token: str
    slots: int
    ttl_ms: int

    @classmethod
    def of(cls, request: Request) -> Claim:
        """Return a new acquisition for *request*; a reader's token says so ("s:").

        So does a lease kept with no process ("d:"), whose id the caller chose.
        """
        token = f"{DETACHED}{request.lease_id}" if request.lease_id else secrets.token_hex(10)
        return cls(
            key_prefix(request.namespace, request.name),
            f"{SHARED}{token}" if request.shared else token,
            request.slots,
            max(1, round(request.ttl * 1000)),
        )

    @classmethod
    def reading(cls, prefix: str) -> Claim:
        """Return the claim the status script is run with: no token, for the lock of *prefix*."""
        return cls(prefix, "", 1, 1)
