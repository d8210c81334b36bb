"""The calls the etcd backend and its leases make, each one request (docs/design.md A13).

`Store` is what one process asks of one etcd cluster: leases (grant, keep-alive, time to
live, revoke), the reads and writes of a lock's keys beside its queue (slots, take-over
requests, windows), each decoded here. `EtcdBackend` adds the queue and the wait.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import TYPE_CHECKING, Any

from lockrun.backends.etcd.gateway import Gateway, Refused, b64, number, unb64
from lockrun.backends.etcd.lease import lease_for
from lockrun.backends.etcd.queue import (
    Stop,
    keys_under,
    kvs_of,
    marker_of,
    ranges_of,
    read_stops,
    stopping,
    stops_body,
)
from lockrun.errors import BackendUnavailable
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Mapping

    from lockrun.backends.etcd.uri import Settings


class Store:
    """The members of one etcd cluster, asked one call at a time on a kept connection."""

    def __init__(self, settings: Settings, timeout: float) -> None:
        """Remember *settings*; nothing is asked until the first call."""
        self.settings = settings
        self.gateway = Gateway(settings, timeout)
        self.heard: float | None = None  # when (`timing.now`) a member last answered
        self._busy = threading.Lock()  # one call at a time on the kept connection

    @property
    def timeout(self) -> float:
        """How long a connect, or any one answer, may take."""
        return self.gateway.timeout

    def call(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        """One request to the cluster (`Gateway.call`); a refusal is one line, 69."""
        with self._busy:
            try:
                answer = self.gateway.call(path, body)
            except Refused as refused:
                raise BackendUnavailable(f"{self.settings.where}: {refused.message}") from None
            self.heard = now()
            return answer

    def grant(self, lease_id: int, ttl: float) -> int:
        """Make lease *lease_id* of about *ttl* seconds; return the TTL the server gave it.

        The ID is ours, so that a grant retried on another member makes no second lease.
        """
        body = {"ID": str(lease_id), "TTL": str(max(1, math.ceil(ttl)))}
        try:
            answer = self.call("/v3/lease/grant", body)
        except BackendUnavailable as err:
            if "lease already exists" not in str(err):
                raise
            return max(1, math.ceil(ttl))  # our first try's answer was lost: it is ours
        return number(answer, "TTL") or max(1, math.ceil(ttl))

    def just_before(self, under: bytes, created: int) -> bytes:
        """Return the key under *under* created last before revision *created* (b"" if none)."""
        start, end = keys_under(under)
        body = {
            "key": b64(start),
            "range_end": b64(end),
            "sort_order": "DESCEND",
            "sort_target": "CREATE",
            "max_create_revision": str(created - 1),
            "limit": "1",
            "keys_only": True,
        }
        kvs = kvs_of(self.call("/v3/kv/range", body)) or []
        return unb64(kvs[0].get("key")) if kvs else b""

    def claim_slot(self, prefix: bytes, lease_id: int, slots: int) -> int:
        """Take the lowest free slot key ``s/I`` on our lease (N > 1); 0 for one slot."""
        if slots == 1:
            return 0
        start, end = keys_under(prefix + b"s/")
        while True:
            body = {
                "key": b64(start),
                "range_end": b64(end),
                "keys_only": True,
                "limit": str(slots + 1),
            }
            taken = {unb64(kv.get("key")) for kv in kvs_of(self.call("/v3/kv/range", body)) or []}
            free = next((i for i in range(slots) if start + str(i).encode() not in taken), None)
            if free is None:
                raise self.malformed(what="the slot keys")  # N holders have N keys: someone else's
            slot_key = b64(start + str(free).encode())
            unclaimed = {
                "target": "CREATE",
                "key": slot_key,
                "create_revision": "0",
                "result": "EQUAL",
            }
            put = {"request_put": {"key": slot_key, "value": b64(b""), "lease": str(lease_id)}}
            answer = self.call("/v3/kv/txn", {"compare": [unclaimed], "success": [put]})
            if answer.get("succeeded") is True:
                return free

    def keep_alive(self, lease_id: int) -> bool:
        """Extend lease *lease_id* by its TTL; False if the server no longer has it."""
        answer = self.call("/v3/lease/keepalive", {"ID": str(lease_id)})
        result = answer.get("result")
        return number(result, "TTL") > 0

    def time_to_live(self, lease_id: int) -> float:
        """Return the seconds lease *lease_id* has left on the server's clock; 0 if none."""
        answer = self.call("/v3/lease/timetolive", {"ID": str(lease_id)})
        return float(max(0, number(answer, "TTL")))

    def touch(self, key: bytes, record: str, lease_id: int, *, writer: bool = False) -> None:
        """Put our queue key *key* again with *record*, if it is still ours (best effort).

        A put event for whoever watches it: the next waiter looks (A13). *writer*: our
        writer's marker too, which readers watch.
        """
        with contextlib.suppress(BackendUnavailable):
            self._put_again(key, lease_id, lease_id, writer=writer, record=record)

    def stops(self, key: bytes) -> tuple[Stop | None, Stop | None]:
        """Read the newest take-over request of each kind of the lock of queue key *key*."""
        _, stops = self.created_and_stops(key)
        return stops

    def created_and_stops(self, key: bytes) -> tuple[int, tuple[Stop | None, Stop | None]]:
        """Read queue key *key*'s create revision (0: gone) and the lock's newest requests."""
        prefix = key[: key.rindex(b"q/")]
        body = stops_body(prefix)
        body["success"].append({"request_range": {"key": b64(key), "keys_only": True}})
        try:
            *stops, ours = ranges_of(self.call("/v3/kv/txn", body), 3)
        except ValueError:
            raise self.malformed(what="a transaction") from None
        return (number(ours[0], "create_revision") if ours else 0), read_stops(stops)

    def move_onto(
        self, key: bytes, lease_id: int, window: int, *, writer: bool, record: str = ""
    ) -> bool:
        """Move queue key *key* (and a writer's marker) from lease *lease_id* onto *window*.

        A put of an existing key keeps its create revision: the place, and the fence, stay
        (A13). *record*: the key's new value (the window's end), else it keeps its own.
        Whether it was still ours to move.
        """
        return self._put_again(key, lease_id, window, writer=writer, record=record)

    def _put_again(
        self, key: bytes, lease_id: int, onto: int, *, writer: bool, record: str
    ) -> bool:
        """Put queue key *key* (and a writer's marker) again on lease *onto*, if on *lease_id*.

        With *record* as its value, else keeping its own. Whether it was still ours.
        """
        lease = str(onto)
        value = {"value": b64(record)} if record else {"ignore_value": True}
        puts = [{"request_put": {"key": b64(key), "lease": lease, **value}}]
        if writer:
            marker: dict[str, object] = {"key": b64(marker_of(key, b"w/")), "lease": lease}
            puts.append({"request_put": marker})
        answer = self.call("/v3/kv/txn", {"compare": [_on(key, lease_id)], "success": puts})
        return answer.get("succeeded") is True

    def leave_window(self, key: bytes, lease_id: int, mine: int, hold: float, record: str) -> None:
        """Keep the slot of queue key *key* taken *hold* more seconds with no process of ours.

        The window is a lease of its own, which a take-over waiting now takes back at once
        (a taker asked for the lock now: docs/semantics.md). Best effort: a window the
        server did not hear of is no window, as a killed run leaves none.
        """
        window = lease_for("")
        try:
            self.grant(window, hold)
            moved = self.move_onto(key, lease_id, window, writer=True, record=record)
            stopped = stopping(self.stops(key), mine, shared=False) is not None
        except BackendUnavailable:
            moved, stopped = False, False
        if not moved or stopped:
            self.revoke(window)

    def revoke(self, lease_id: int) -> bool:
        """Revoke lease *lease_id*, deleting its keys; whether the server heard it (best effort)."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease_id)})
        except BackendUnavailable:
            return False
        return True

    @property
    def where(self) -> str:
        """The URI, with no password: for messages."""
        return self.settings.where

    def place(self) -> str:
        """Name the cluster we reach, alike for every spelling of its URI, with no credentials.

        Its members, hosts in lower case, in any order (`lockrun.detached`'s tokens).
        """
        members = sorted(f"{host.lower()}:{port}" for host, port in self.settings.endpoints)
        return "etcd " + ",".join(members)

    def malformed(self, what: str) -> BackendUnavailable:
        """Return the one line for an answer that is not what etcd sends."""
        return BackendUnavailable(f"{self.settings.where}: {what} came back malformed")

    def abandon(self, orphan: bytes) -> None:
        """Free the lease of a lockrun that died (`EtcdLease.orphan`), in its guardian."""
        self.revoke(int(orphan))


def _on(key: bytes, lease_id: int) -> dict[str, str]:
    """Return the compare that key *key* is on lease *lease_id* (still ours)."""
    return {"target": "LEASE", "key": b64(key), "lease": str(lease_id), "result": "EQUAL"}
