"""The scripts' replies, decoded once into named types (lua/*.lua head each with its reply).

Any client of the server, or something that is not Redis at all, may have written what a
script reads or answered in its place: each decoder checks the shape first and raises
`Malformed` for anything our script could not have returned (the backend says so in one
line, 69). What the fields mean is then in the type, not in a position.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final, NamedTuple
from urllib.parse import unquote

from lockrun.backends import Holder, LockState, read_json
from lockrun.bounds import MAX_SLOTS, MAX_WAIT

if TYPE_CHECKING:
    from collections.abc import Sequence

SHARED: Final = "s:"  # the start of a reader's token (--shared)
# Next (after any "s:"): a lease kept with no process (acquire --no-keeper). Only such a
# token can be renewed or released by another process (`DetachedLease`): a run's or a
# keeper's lease cannot be named by a token of `lockrun release`.
DETACHED: Final = "d:"
GAVE_WAY: Final = 2  # the acquire script's code for "granted during a take-over: given back"
_FIELDS: Final = 5  # the acquire reply's code, three numbers and a text, before the woken
_STATUS_FIELDS: Final = 7  # ms, N, holders, queue, owners, info, waiters

# What grant() writes in the owners hash: slot, fence (0 for a reader), and when it was
# granted (server ms); then the end of a --hold-at-least window (server ms), or "y:TOKEN"
# for a waiter granted while TOKEN's take-over was pending (it gives way when it claims).
OWNER: Final = re.compile(
    r"(?P<slot>\d{1,19}) (?P<fence>\d{1,19}) (?P<granted>\d{1,19})"
    r"(?: (?P<window>\d{1,19})| y:\S+)?",
    re.ASCII,
)


class Malformed(ValueError):
    """A reply our script could not have returned: not Redis's, or tampered with."""


# The {token, CLIENT ID} pairs of waiters a script woke ("" where a waiter named none).
Woken = tuple[tuple[str, str], ...]


class Granted(NamedTuple):
    """The acquire script granted us a slot; our lease runs."""

    slot: int
    fence: int  # 0 for a reader's, which has none


class Mismatch(NamedTuple):
    """The live users of the name have another N: nothing was queued."""

    slots: int


class GaveWay(NamedTuple):
    """Granted while a take-over was pending, and given back at once for the taker."""

    taker: str  # the taker's record (anyone's)
    woken: Woken


class Queued(NamedTuple):
    """Not granted: our place in the queue (in 'try' mode, where we would be; not queued)."""

    place: int
    lapse_ms: int  # until a lease, or a place ahead of ours, may lapse
    taken_ms: int  # the lock stays taken at least this long (a --hold-at-least window)
    woken: Woken


Acquired = Granted | Mismatch | GaveWay | Queued


class Renewed(NamedTuple):
    """The lease was extended; *taker*: the record of a take-over that asks us to stop."""

    taker: str | None


class Snapshot(NamedTuple):
    """One consistent read of a lock's keys (the status script)."""

    server_ms: int
    slots: str  # the N stored, as stored ('' for none)
    holders: dict[str, str]  # token → lease expiry in server ms, as stored
    queue: list[str]  # tokens, in order
    owners: dict[str, str]  # token → what grant() wrote (`OWNER`)
    info: dict[str, str]  # token → holder record (JSON, anyone's)
    waiters: dict[str, str]  # token → when its place lapses, in server ms


# -- the shapes ------------------------------------------------------------------------------


def _numbers(items: Sequence[Any]) -> bool:
    return all(isinstance(item, int) for item in items)


def _texts(items: Sequence[Any]) -> bool:
    return all(isinstance(item, str) for item in items)


def _pairs_of_texts(items: Any) -> bool:  # noqa: ANN401 - a reply's element
    """Return whether *items* is a flat list of texts, [k1, v1, k2, v2, …]."""
    return isinstance(items, list) and len(items) % 2 == 0 and _texts(items)


def _pairs(flat: list[str]) -> dict[str, str]:
    """Turn a flat Redis reply [k1, v1, k2, v2, …] into a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


# -- the decoders ----------------------------------------------------------------------------


def decode_acquire(reply: Any) -> Acquired:  # noqa: ANN401 - Lua's reply
    """Decode {code, number, number, number, text, token, CLIENT ID, …} (lua/acquire.lua)."""
    if not (isinstance(reply, list) and len(reply) >= _FIELDS and _numbers(reply[:4])):
        raise Malformed(reply)
    code, number, extra, taken, text = reply[:_FIELDS]
    if not isinstance(text, str):
        raise Malformed(reply)
    woken = decode_woken(reply[_FIELDS:])
    if code == 1:
        return Granted(number, extra)
    if code == -1:
        return Mismatch(number)
    if code == GAVE_WAY:
        return GaveWay(text, woken)
    return Queued(number, extra, taken, woken)


def decode_renew(reply: Any) -> Renewed | None:  # noqa: ANN401 - Lua's reply
    """Decode 1 (extended), 0 (lost: None) or a taker's record (extended, asked to stop)."""
    if isinstance(reply, str):
        return Renewed(reply)
    if not isinstance(reply, int):
        raise Malformed(reply)
    return Renewed(None) if reply == 1 else None


def decode_woken(reply: Any) -> Woken:  # noqa: ANN401 - Lua's reply
    """Decode the {token, CLIENT ID} pairs of the waiters a script woke."""
    if not _pairs_of_texts(reply):
        raise Malformed(reply)
    return tuple(zip(reply[::2], reply[1::2], strict=True))


def decode_status(reply: Any) -> Snapshot:  # noqa: ANN401 - Lua's reply
    """Decode {server ms, N, holders+expiry, queue, owners, info, waiters+expiry}."""
    if not (isinstance(reply, list) and len(reply) == _STATUS_FIELDS):
        raise Malformed(reply)
    server_ms, slots, holders, queue, owners, info, waiters = reply
    paired = (holders, owners, info, waiters)
    if not (isinstance(server_ms, int) and isinstance(slots, str)):
        raise Malformed(reply)
    if not (all(_pairs_of_texts(part) for part in paired) and _texts_list(queue)):
        raise Malformed(reply)
    if not all(_score(value) for value in (*holders[1::2], *waiters[1::2])):
        raise Malformed(reply)  # a score Redis would never give
    return Snapshot(
        server_ms,
        slots,
        _pairs(holders),
        list(queue),
        _pairs(owners),
        _pairs(info),
        _pairs(waiters),
    )


def _texts_list(items: Any) -> bool:  # noqa: ANN401 - a reply's element
    return isinstance(items, list) and _texts(items)


def _score(text: str) -> bool:
    """Return whether *text* reads as a sorted set's score (a float, inf included)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def granted(reply: Any) -> bool:  # noqa: ANN401 - Lua's reply
    """Return whether an acquire or renew *reply*, not yet decoded, granted or extended a lease.

    A renewal answered with a taker's record extended the lease too. Asked before the
    reply is decoded: whether a replica must have it (`cluster.check_durable`).
    """
    return reply == 1 or isinstance(reply, str) or (isinstance(reply, list) and reply[:1] == [1])


# -- what they say ---------------------------------------------------------------------------


def stored_slots(text: str) -> int | None:
    """Return the N stored for a lock, if it is one lockrun could have stored."""
    digits = len(str(MAX_SLOTS))
    if text.isascii() and text.isdigit() and len(text) <= digits and 1 <= int(text) <= MAX_SLOTS:
        return int(text)
    return None


def clients_of(woken: Woken) -> list[str]:
    """Return the CLIENT IDs the woken named (one per token, the last it was paired with)."""
    return [client for client in dict(woken).values() if client]


def gone(woken: Woken, alive: set[str]) -> list[str]:
    """Return the flat {token, CLIENT ID} pairs of the woken whose connection is not *alive*."""
    return [
        item
        for token, client in dict(woken).items()
        if client and client not in alive
        for item in (token, client)
    ]


def window_left(snapshot: Snapshot, token: str, hold_ms: int) -> int:
    """Return the ms of *token*'s --hold-at-least window of *hold_ms* left, from its grant.

    An entry that is none of ours (another client wrote it) leaves the whole window from
    now: longer than asked, never shorter.
    """
    owner = OWNER.fullmatch(snapshot.owners.get(token, ""))
    granted_ms = int(owner["granted"]) if owner else snapshot.server_ms
    return max(0, min(granted_ms + hold_ms - snapshot.server_ms, hold_ms))


def describe(snapshot: Snapshot, namespace: str, name: str | None, prefix: str) -> LockState | None:
    """Return the lock's state from *snapshot*; None if nobody holds or waits.

    A *name* asked for by the user is reported even when free.
    """
    now_ms = snapshot.server_ms
    held = tuple(
        _person(snapshot, token, expiry)
        for token, expiry in snapshot.holders.items()
        if float(expiry) > now_ms
    )
    waiting = tuple(
        _person(snapshot, token, None)
        for token in snapshot.queue
        if token in snapshot.waiters and float(snapshot.waiters[token]) > now_ms
    )
    if name is None:
        if not held and not waiting:
            return None
        name = unquote(prefix.partition("/")[2].removesuffix("}"))
    slots = stored_slots(snapshot.slots)
    return LockState(namespace, name, prefix, slots, held, waiting)


def _person(snapshot: Snapshot, token: str, expires_ms: str | None) -> Holder:
    """Return who holds (with *expires_ms*) or waits (None) under *token*."""
    # Any client of this server may have written these: a bad record shows as "?".
    try:
        holder = Holder.from_dict(read_json(snapshot.info.get(token, "")))
    except ValueError:
        holder = Holder("?", 0, "?", ())
    # The token says the mode, the owners entry a window; never the record's word.
    holder = holder._replace(shared=token.startswith(SHARED), until=None, detached=False)
    owner = OWNER.fullmatch(snapshot.owners.get(token, ""))
    if expires_ms is None or owner is None:
        return holder
    slot = int(owner["slot"])
    expires = float(expires_ms) / 1000
    # A window's end is the lease's (what the scripts go by), shown no later than the
    # longest window from now: another client may have written +inf.
    window = min(expires, snapshot.server_ms / 1000 + MAX_WAIT) if owner["window"] else None
    return holder._replace(
        slot=slot if slot < MAX_SLOTS else None,
        since=int(owner["granted"]) / 1000,
        expires=expires,
        until=window,
        detached=window is None and token.removeprefix(SHARED).startswith(DETACHED),
    )
