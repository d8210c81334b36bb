"""What lockrun says to a MySQL or MariaDB server: lock names, its tables, their statements.

To create the tables ahead of time (docs/backends.md), run the statements of `TABLES`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Final

from lockrun.bounds import MAX_FENCE, MAX_SLOTS, MAX_WAIT

if TYPE_CHECKING:
    from lockrun.backends import Request

FENCES: Final = "lockrun_fence"
HOLDERS: Final = "lockrun_holders"
MARKS: Final = "lockrun_marks"  # hold windows, shared holders, take-over requests
RECORD_ROOM: Final = 2048  # bytes of a holder's record in lockrun_holders
TABLES: Final = (
    # The fence and the holders live in memory (docs/design.md A7): a grant writes them with
    # no redo log to flush. A restart empties them, as it frees every GET_LOCK; the fence
    # then starts again from the server's clock. Tables an earlier lockrun made in InnoDB
    # work as they are, one flush a grant; `ALTER TABLE … ENGINE=MEMORY` ends it.
    f"""CREATE TABLE IF NOT EXISTS {FENCES} (
      lock_key CHAR(43) CHARACTER SET ascii COLLATE ascii_bin NOT NULL PRIMARY KEY,
      fence BIGINT UNSIGNED NOT NULL
    ) ENGINE=MEMORY""",
    # MEMORY has no TEXT: the record is ASCII JSON (`fitted`), in a column it fits.
    f"""CREATE TABLE IF NOT EXISTS {HOLDERS} (
      lock_key CHAR(43) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
      slot INT UNSIGNED NOT NULL,
      slots INT UNSIGNED NOT NULL,
      connection_id BIGINT UNSIGNED NOT NULL,
      namespace VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      holder VARCHAR({RECORD_ROOM}) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
      PRIMARY KEY USING BTREE (lock_key, slot)
    ) ENGINE=MEMORY""",
    # One row per lock and mark: ``hold``, a --hold-at-least window ending at until_us (the
    # server's Unix time in µs); ``r:TOKEN``, a --shared holder of GET_LOCK KEY:r:TOKEN;
    # ``stop``, a --take-over request of the holder of KEY:stop (docs/design.md A7).
    f"""CREATE TABLE IF NOT EXISTS {MARKS} (
      lock_key CHAR(43) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
      mark VARCHAR(24) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
      connection_id BIGINT UNSIGNED NOT NULL,
      until_us BIGINT NOT NULL DEFAULT 0,
      namespace VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
      holder TEXT CHARACTER SET utf8mb4 NOT NULL,
      PRIMARY KEY (lock_key, mark)
    ) ENGINE=InnoDB""",
)
# The server's clock as Unix time in µs, free of the session's time zone (`NOW_US`).
NOW_US_TEXT: Final = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
# The server's clock in µs seeds the fence, so it keeps rising if the table is ever lost.
_MICROS: Final = "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS UNSIGNED)"
# A counter at or past 2^63 - 1 is one lockrun never wrote (fence + 1 would overflow):
# it counts as lost, and the clock seeds the fence again.
# The grant's writes happen only on the session that holds the slot named last: so they
# may follow a try in the same round trip, and do nothing if the try failed.
NEXT_FENCE: Final = (
    f"INSERT INTO {FENCES} (lock_key, fence) SELECT %s, LAST_INSERT_ID({_MICROS}) FROM DUAL "
    "WHERE IS_USED_LOCK(%s) = CONNECTION_ID() "
    f"ON DUPLICATE KEY UPDATE fence = LAST_INSERT_ID(IF(fence >= {MAX_FENCE}, {_MICROS}, "
    f"GREATEST(fence + 1, {_MICROS})))"
)
RECORD: Final = (
    f"REPLACE INTO {HOLDERS} (lock_key, slot, slots, connection_id, namespace, name, holder) "
    "SELECT %s, %s, %s, CONNECTION_ID(), %s, %s, %s FROM DUAL "
    "WHERE IS_USED_LOCK(%s) = CONNECTION_ID()"
)
OURS: Final = "SELECT IS_USED_LOCK(%s) = CONNECTION_ID()"  # whether this session holds a lock
# A record whose holder waits for the slot in the same query: its "since" is the server's
# clock when the grant runs (`SINCE_LATER` in the JSON, which no string of it can hold:
# quotes are escaped there), not the client's when it began to wait.
SINCE_LATER: Final = '"since": 0.0'
RECORD_LATER: Final = RECORD.replace(
    "CONNECTION_ID(), %s, %s, %s FROM DUAL",
    f"CONNECTION_ID(), %s, %s, REPLACE(%s, '{SINCE_LATER}', "
    f"CONCAT('\"since\": ', {NOW_US_TEXT} / 1000000)) FROM DUAL",
)
FORGET: Final = (
    f"DELETE FROM {HOLDERS} WHERE lock_key = %s AND slot = %s AND connection_id = CONNECTION_ID()"
)
# What no longer counts, where a table in memory is full (max_heap_table_size): a record
# whose session no longer holds its slot, and a fence a day behind the server's clock,
# which seeds the next fence as high anyway (unless the clock steps a day back).
SWEEPS: Final = (
    (
        f"DELETE FROM {HOLDERS} "
        "WHERE NOT COALESCE(IS_USED_LOCK(CONCAT(lock_key, ':', slot)) = connection_id, 0)"
    ),
    f"DELETE FROM {FENCES} WHERE fence < {_MICROS} - 86400000000",
)
# A live holder of the name with another N (its session still holds the slot it recorded).
MISMATCH: Final = (
    f"SELECT slots, holder FROM {HOLDERS} WHERE lock_key = %s AND slots <> %s "
    f"AND slots BETWEEN 1 AND {MAX_SLOTS} "  # a row lockrun could have written
    "AND IS_USED_LOCK(CONCAT(lock_key, ':', slot)) = connection_id LIMIT 1"
)
# The server's clock as Unix time in µs, free of the session's time zone (UNIX_TIMESTAMP of
# NOW() repeats an hour when daylight saving time ends). One value for a whole statement.
NOW_US: Final = NOW_US_TEXT
# A window read back is cut to the longest one lockrun writes: a forged until_us of the year
# 9999 keeps a lock busy no longer than a --hold-at-least could (and never overflows).
MAX_HOLD_US: Final = int(MAX_WAIT * 1_000_000)
HOLD: Final = "hold"
STOP: Final = "stop"
READER: Final = re.compile(r"r:[0-9a-f]{16}")  # the mark of a shared holder of ours
# Whether a reader's row is live: its session holds its lock (NULL, not live, where either
# is NULL). The name is made of our key and a mark of 18 characters, so no row can make
# GET_LOCK's name too long (1059).
_LIVE_READER: Final = (
    "CASE WHEN mark LIKE 'r:%%' AND CHAR_LENGTH(mark) = 18 "
    "THEN IS_USED_LOCK(CONCAT(%s, ':', mark)) = connection_id END"
)
# The window left (µs, 0 … MAX_HOLD_US) and the shared holders of a lock, live or not (the
# dead are swept), with their records and the server's time. Read in a statement of its
# own after the slot is ours, so that it sees every mark committed before the slot was free.
# `lockrun.backends.mysql.modes.mark_row` owns the order of its columns.
MARKS_OF: Final = (
    f"SELECT mark, connection_id, "
    f"LEAST(GREATEST(until_us, {NOW_US}), {NOW_US} + {MAX_HOLD_US}) - {NOW_US}, "
    f"{_LIVE_READER}, holder, {NOW_US} FROM {MARKS} WHERE lock_key = %s "
    f"AND (mark = '{HOLD}' AND until_us > {NOW_US} OR mark LIKE 'r:%%') ORDER BY mark LIMIT 1000"
)
SWEEP: Final = (  # the rows of shared holders whose sessions ended without a goodbye
    f"DELETE FROM {MARKS} WHERE lock_key = %s AND mark LIKE 'r:%%' "
    f"AND NOT COALESCE({_LIVE_READER}, 0)"
)
MARK: Final = (
    f"REPLACE INTO {MARKS} (lock_key, mark, connection_id, until_us, namespace, name, holder) "
    "VALUES (%s, %s, CONNECTION_ID(), 0, %s, %s, %s)"
)
UNMARK: Final = (
    f"DELETE FROM {MARKS} WHERE lock_key = %s AND mark = %s AND connection_id = CONNECTION_ID()"
)
WINDOW: Final = (
    f"REPLACE INTO {MARKS} (lock_key, mark, connection_id, until_us, namespace, name, holder) "
    f"VALUES (%s, '{HOLD}', CONNECTION_ID(), {NOW_US} + %s, %s, %s, %s)"
)
END_WINDOW: Final = f"DELETE FROM {MARKS} WHERE lock_key = %s AND mark = '{HOLD}'"
STOP_MARK: Final = (  # only by the session that got the stop lock: who asks, for the message
    f"REPLACE INTO {MARKS} (lock_key, mark, connection_id, until_us, namespace, name, holder) "
    f"SELECT %s, '{STOP}', CONNECTION_ID(), 0, %s, %s, %s FROM DUAL "
    "WHERE IS_USED_LOCK(%s) = CONNECTION_ID()"
)
TAKER: Final = (
    f"SELECT holder FROM {MARKS} WHERE lock_key = %s AND mark = '{STOP}' AND connection_id = %s"
)
# A live shared holder, for a user of N > 1: readers are users of one slot.
SHARED_MISMATCH: Final = (
    f"SELECT 1, holder FROM {MARKS} WHERE lock_key = %s AND mark LIKE 'r:%%' "
    f"AND {_LIVE_READER} LIMIT 1"
)
# The names that lockrun's tables have holders or windows of, for `status` of a namespace.
RECORDED: Final = (
    (
        f"SELECT DISTINCT name FROM {HOLDERS} WHERE namespace = %s "
        "AND IS_USED_LOCK(CONCAT(lock_key, ':', slot)) = connection_id"
    ),
    (  # the names of rows that may count; `status` reads each lock's own
        f"SELECT DISTINCT name FROM {MARKS} WHERE namespace = %s "
        f"AND (mark = '{HOLD}' AND until_us > {NOW_US} OR mark LIKE 'r:%%') LIMIT 1000"
    ),
)
# The grant's reads after its commit, in one statement of one row (docs/design.md A7): the
# session holding KEY:stop; a live holder of another N, as "SLOTS RECORD" (`other_row`); and,
# for N = 1, whether lockrun_marks has rows that may count (then `MARKS_OF` reads them, in a
# round trip of its own), for N > 1 a live shared holder, as "1 RECORD". Every subquery runs
# after the statements before it, so after the slot was ours.
_OTHER_N: Final = (
    f"(SELECT CONCAT(slots, ' ', holder) FROM {HOLDERS} WHERE lock_key = %s AND slots <> %s "
    f"AND slots BETWEEN 1 AND {MAX_SLOTS} "
    "AND IS_USED_LOCK(CONCAT(lock_key, ':', slot)) = connection_id LIMIT 1)"
)
GRANT_READS: Final = (
    f"SELECT IS_USED_LOCK(%s), {_OTHER_N}, EXISTS (SELECT 1 FROM {MARKS} WHERE lock_key = %s "
    f"AND (mark = '{HOLD}' AND until_us > {NOW_US} OR mark LIKE 'r:%%'))"
)
GRANT_READS_N: Final = (
    f"SELECT IS_USED_LOCK(%s), {_OTHER_N}, (SELECT CONCAT('1 ', holder) FROM {MARKS} "
    f"WHERE lock_key = %s AND mark LIKE 'r:%%' AND {_LIVE_READER} LIMIT 1)"
)
# `lockrun.backends.mysql.status.holder_row` owns the order of its columns.
HOLDERS_OF: Final = f"SELECT slot, slots, connection_id, holder FROM {HOLDERS} WHERE lock_key = %s"
# What a waiter puts after its GET_LOCK, for `lockrun status` to read in the processlist.
# A waiter waits in GET_LOCK for a slot, the gate, a take-over's stop lock or a shared
# holder to leave; or sleeps, holding slot 0, until a hold window ends (named by its column).
WAITING: Final = re.compile(
    r"SELECT (?:GET_LOCK\(|SLEEP\([0-9.]+\) AS )"
    r"'(?P<key>lr:[0-9a-f]{40}):(?P<part>gate|\d+|stop|r:[0-9a-f]{16})'(?:, [0-9.]+\))? "
    r"/\* lockrun (?P<json>\{.*\}) \*/",
    re.DOTALL,
)


def other_row(text: object) -> tuple[int, str] | None:
    """Return the (slots, holder) of a "SLOTS RECORD" that `GRANT_READS` found; None for none."""
    if text is None:
        return None
    slots, _, record = (text.decode() if isinstance(text, bytes) else str(text)).partition(" ")
    return int(slots), record


def lock_key(namespace: str, name: str) -> str:
    r"""Return the GET_LOCK name of (namespace, name) without its ``:slot`` or ``:gate``.

    In SQL: ``CONCAT('lr:', LEFT(SHA2(CONCAT(namespace, '\0', name), 256), 40))``.
    """
    digest = hashlib.sha256(f"{namespace}\0{name}".encode()).hexdigest()
    return f"lr:{digest[:40]}"


def comment(request: Request, token: str) -> str:
    """Return the comment a waiter's GET_LOCK carries: who waits, for `lockrun status`."""
    identity = {
        "token": token,
        "namespace": request.namespace,
        "name": request.name,
        "slots": request.slots,
        "holder": request.holder.to_dict(),
    }
    return "/* lockrun " + json.dumps(identity).replace("*/", "*\\/") + " */"


def get_lock(lock: str, seconds: float, tag: str) -> str:
    """Return a GET_LOCK of *lock* that waits up to *seconds*, with the waiter's *tag*."""
    # Only hex digits, a colon and "gate" ever reach the quotes.
    return f"SELECT GET_LOCK('{lock}', {seconds:.3f}) {tag}"


def slot_lock(key: str, slot: int) -> str | None:
    """Return the GET_LOCK name of *slot* of *key*; None for -1, no slot."""
    return None if slot < 0 else f"{key}:{slot}"


def first_free(key: str, slots: int) -> str:
    """Return a statement that takes the first free slot (CASE stops at the first) or -1."""
    tries = " ".join(f"WHEN GET_LOCK('{key}:{slot}', 0) = 1 THEN {slot}" for slot in range(slots))
    return f"SELECT CASE {tries} ELSE -1 END"
