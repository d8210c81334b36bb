"""PostgreSQL advisory-lock keys of a name, and the words its sessions carry (docs/design.md A8).

Keys are signed 64-bit: the first 8 bytes, big-endian, of SHA-256(namespace NUL name NUL
part), where part is ``0`` … ``N-1`` for the slots, ``gate`` for the queue of a semaphore and
``stop`` for a taker's (never ``hashtext``: 32 bits collide). pg_locks shows key k as
``classid = k >> 32`` and ``objid = k & 0xffffffff`` (both unsigned), ``objsubid = 1``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import TYPE_CHECKING, Final

from lockrun.backends import read_identity
from lockrun.backends.sessionlock import GATE

if TYPE_CHECKING:
    from lockrun.backends import Holder, Identity, Request

STOP: Final = "stop"  # the part of a name whose key a taker holds while it waits
TAG_BYTES: Final = 900  # pg_stat_activity keeps 1024 bytes of a statement by default
_TAGGED: Final = re.compile(r"/\* lockrun (?P<json>\{.*\}) \*/", re.DOTALL)


def lock_key(namespace: str, name: str, part: str | int) -> int:
    r"""Return the advisory-lock key of a slot (*part* 0 … N-1) or of ``"gate"``.

    In SQL: ``('x' || left(encode(sha256(convert_to(namespace, 'UTF8') || '\x00'::bytea
    || convert_to(name, 'UTF8') || '\x00'::bytea || convert_to(part, 'UTF8')), 'hex'),
    16))::bit(64)::bigint``.
    """
    digest = hashlib.sha256(f"{namespace}\0{name}\0{part}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def slots_key(namespace: str, name: str) -> int:
    """Return the int4 half of the shared lock (key, N) that every holder of the name takes."""
    digest = hashlib.sha256(f"{namespace}\0{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


def halves(key: int) -> tuple[int, int]:
    """Return pg_locks' (classid, objid) of a bigint key."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


class Keys:
    """The keys of one name: its slots, its gate, its stop key, the shared (name, N) lock."""

    def __init__(self, namespace: str, name: str, slots: int) -> None:
        """Derive the keys of *name* in *namespace* used with *slots* slots."""
        self.slots = [lock_key(namespace, name, slot) for slot in range(slots)]
        self.gate = lock_key(namespace, name, GATE)
        self.stop = lock_key(namespace, name, STOP)
        self.agreed = slots_key(namespace, name)


def channel(keys: Keys) -> str:
    """Return the LISTEN channel on which takers of a name ring its holders' bells."""
    return f"lockrun_{keys.stop & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def application_name(name: str, slot: int | str) -> str:
    """Return ``lockrun:NAME:SLOT`` in the 63 bytes PostgreSQL keeps, cut at a character."""
    suffix = f":{slot}"
    room = 63 - len("lockrun:") - len(suffix)
    cut = name.encode()[:room].decode(errors="ignore")
    return f"lockrun:{cut}{suffix}"


def comment(request: Request, token: str, holder: Holder) -> str:
    """Return the comment every statement of a session carries: who runs it, for status."""
    return f"/* lockrun {identity(request, token, holder)} */"


def identity(request: Request, token: str, holder: Holder, room: int = TAG_BYTES) -> str:
    """Return who runs a session's statements as JSON, for its comment or a window's row.

    ``/`` and ``*`` are escaped (valid JSON) so the text can neither end nor nest the
    comment (PostgreSQL nests ``/* */``); a long command line is cut so the whole fits
    *room* bytes: for a comment the 1024 bytes pg_stat_activity keeps.
    """
    first = '{"token": ' + _escaped(json.dumps(token)) + ", "
    rest = _record(request.namespace, request.name, request.slots, holder, room - len(first) + 1)
    return first + rest[1:]


@functools.lru_cache(maxsize=16)  # a kept Lock's waiter says the same every time
def _record(namespace: str, name: str, slots: int, holder: Holder, room: int) -> str:
    """Return `identity`'s JSON but the token, in *room* bytes where the command line allows."""
    argv = holder.argv
    while True:
        record = {
            "namespace": namespace,
            "name": name,
            "slots": slots,
            "holder": holder._replace(argv=argv).to_dict(),
        }
        text = _escaped(json.dumps(record))
        if len(text) <= room or not argv:
            return text
        argv = argv[: len(argv) // 2]


def _escaped(text: str) -> str:
    """Escape ``/`` and ``*`` in JSON *text*, which stays valid JSON."""
    return text.replace("/", "\\/").replace("*", "\\u002a")


def tagged(query: str) -> Identity | None:
    """Read the comment `comment` wrote back from a statement; None if it is not ours.

    Any role of the database can run a statement with such a comment: it is read as
    untrusted (`read_identity`).
    """
    match = _TAGGED.search(query)
    return None if match is None else read_identity(match["json"])
