"""MySQL and MariaDB: user locks (GET_LOCK) as a first-in first-out semaphore.

docs/design.md A6 and A7 give the reasons behind this design.

Names are digests, so a lock is the same on MySQL and MariaDB whatever the name's length,
case or characters: ``lr:`` and 40 hex digits of SHA-256(namespace NUL name), then ``:0`` …
``:N-1`` for the slots and ``:gate`` for the queue of a semaphore.

The semaphore is `lockrun.backends.sessionlock`'s, on GET_LOCK, which the server grants in
arrival order; the head of a semaphore's queue KILLs its losing helper sessions.

A slot lives with its session: the server frees it when the connection closes, or after the
session idled for its ``wait_timeout``, which is the lease. The holder proves ownership every
ttl/3 with ``IS_USED_LOCK(slot) = CONNECTION_ID()`` and never reconnects: a session that
failed once has lost its locks (docs/design.md P19).

The modes (docs/design.md A7) add ``KEY:r:TOKEN`` for each shared holder, ``KEY:stop`` for a
take-over request, and rows in lockrun_marks: hold windows on the server's clock, shared
holders, who takes over.

The modules: `uri` (the URI as PyMySQL's settings), `session` (PyMySQL's connection, bounded;
sessions, waits and failures), `statements` (lock names, the tables and their statements),
`batch` (named statement batches), `records` (the check of N and the grant's round trip),
`modes`, `status`, `ports` (the semaphore's statements, requests and faults), `lease` (the
statements on a held slot) and `backend`, which composes them.
"""

from __future__ import annotations

from lockrun.backends.mysql.backend import MySQLBackend, connect
from lockrun.backends.mysql.lease import MySQLLease
from lockrun.backends.mysql.statements import FENCES, HOLDERS, MARKS, TABLES, lock_key
from lockrun.backends.mysql.uri import Settings, parse

__all__ = [
    "FENCES",
    "HOLDERS",
    "MARKS",
    "TABLES",
    "MySQLBackend",
    "MySQLLease",
    "Settings",
    "connect",
    "lock_key",
    "parse",
]
