"""PostgreSQL's cheap grant: fences from an unlogged table, N proven once per kept session.

Every server here is a real PostgreSQL: the session's, or a test's own (to crash, to count
its WAL writes, to give roles). docs/design.md A8 says what each statement of a grant buys.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from lockrun import ExitCode, Lock
from tests.support.cli import lock_state, lockrun, one_line, wait_for
from tests.support.net import postgres_query as query
from tests.support.servers import PostgresServer, free_port

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun import Lease
    from tests.support.cli import Held

PASSWORD = "pw-for-fences"  # noqa: S105 - the throwaway server's
NOW_US = "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
FENCE = ("--", "printenv", "LOCKRUN_FENCE")


def role_uri(server: PostgresServer, role: str) -> str:
    """Create *role* (password login, no superuser, no CREATE on public); return its URI."""
    server.command(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    return f"postgresql://{role}@/lockrun?host={server.directory}&port={server.port}"


def as_role() -> dict[str, str]:
    """Return an environment in which libpq finds the roles' password."""
    return {**os.environ, "PGPASSWORD": PASSWORD}


def fence_of(uri: str, name: str, *options: str, env: dict[str, str] | None = None) -> int:
    """Run lockrun once on *name* and return its LOCKRUN_FENCE."""
    result = lockrun("--uri", uri, "-n", name, *options, *FENCE, env=env)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def wal_writes(uri: str) -> int:
    """Return how many times the server wrote WAL out (pg_stat_wal, 14+)."""
    [(writes,)] = query(uri, "SELECT wal_write FROM pg_stat_wal")
    return int(writes)


def no_lockrun_session(uri: str) -> bool:
    """Whether no lockrun session is left: an ended backend has reported its counters."""
    rows = query(
        uri, "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'lockrun%%'"
    )
    return rows == [(0,)]


def test_the_fence_is_the_clock_or_above_and_only_grows(
    postgres_uri: str, held: Callable[..., Held], name: str
) -> None:
    """LOCKRUN_FENCE is at least the server's clock in µs, and grows with every run, any N."""
    [(before,)] = query(postgres_uri, NOW_US)
    fences = [fence_of(postgres_uri, name, "-s", slots) for slots in ("1", "1", "2", "1")]
    assert before <= fences[0]
    assert fences == sorted(set(fences))
    holder = held("--uri", postgres_uri, "-n", name)
    assert holder.fence > fences[-1]
    [(after,)] = query(postgres_uri, NOW_US)
    assert after >= holder.fence  # seeded by the clock: one run in a µs is no counter's lead
    assert holder.finish() == 0


def test_a_grant_writes_no_wal_out(pg_server: PostgresServer, name: str) -> None:
    """A kept Lock's cycles make the server write WAL out far less than once per grant.

    The fence's table is unlogged, so a grant's commit waits for no WAL write and flush; a
    fence that was a transaction id made durable (a logical message) wrote once per grant.
    """
    cycles = 100
    first = Lock(name, uri=pg_server.uri)
    with first as lease:  # the table is made on first use
        assert lease.fence
    first.close()
    wait_for(lambda: no_lockrun_session(pg_server.uri), what="the first session's end")
    before = wal_writes(pg_server.uri)
    lock = Lock(name, uri=pg_server.uri)
    fences = []
    for _ in range(cycles):
        with lock as lease:
            assert lease.fence is not None
            fences.append(lease.fence)
    lock.close()  # a backend reports its counters as it ends
    wait_for(lambda: no_lockrun_session(pg_server.uri), what="the session's end")
    assert fences == sorted(set(fences))
    written = wal_writes(pg_server.uri) - before
    assert written < cycles // 4, written


def test_fences_grow_across_a_crash(pg_server: PostgresServer, name: str) -> None:
    """A crash empties the unlogged table; the clock seeds the fence above the last one."""
    uri = pg_server.uri
    fences = [fence_of(uri, name) for _ in range(3)]
    assert query(uri, "SELECT count(*) FROM lockrun_fences") == [(1,)]
    pg_server.restart()  # SIGQUIT: every session ends, nothing is saved; recovery on start
    assert query(uri, "SELECT count(*) FROM lockrun_fences") == [(0,)]  # the counter is gone
    after = fence_of(uri, name)
    assert after > fences[-1]
    assert fence_of(uri, name) > after


def test_fences_grow_from_transaction_ids_to_the_table(
    pg_server: PostgresServer, name: str
) -> None:
    """A role that cannot make the table draws transaction ids; the table's fences pass them.

    Once another role made it (granted to PUBLIC), the first one draws from it too, even
    on a session of its own opened before: its grant asks whether the table exists.
    """
    plain = role_uri(pg_server, "plain")
    first = lockrun("-v", "--uri", plain, "-n", name, *FENCE, env=as_role())
    assert first.returncode == 0, first.stderr
    assert "fences are transaction ids: cannot make table lockrun_fences" in first.stderr
    os.environ["PGPASSWORD"] = PASSWORD
    try:
        kept = Lock(name, uri=plain)
        with kept as lease:
            xact = lease.fence or 0
        assert xact > int(first.stdout)
        made = fence_of(pg_server.uri, name)  # the superuser makes the table
        assert made > xact
        with kept as lease:  # the kept session: its grant finds the table made since
            again = lease.fence or 0
        assert again > made
        kept.close()
    finally:
        del os.environ["PGPASSWORD"]
    assert fence_of(plain, name, env=as_role()) > again


def test_a_read_only_database_gets_transaction_ids_or_no_fence(
    pg_server: PostgresServer, name: str
) -> None:
    """Read-only by default: no table can be made (ids); one made before: no fence, unset."""
    pg_server.command("CREATE DATABASE ro", database="postgres")
    pg_server.command("ALTER DATABASE ro SET default_transaction_read_only = on")
    uri = f"postgresql://lockrun@/ro?host={pg_server.directory}&port={pg_server.port}"
    first = lockrun("-v", "--uri", uri, "-n", name, *FENCE)
    assert first.returncode == 0, first.stderr
    assert "cannot make table lockrun_fences" in first.stderr
    assert fence_of(uri, name) > int(first.stdout)  # transaction ids, made durable
    pg_server.command("ALTER DATABASE ro SET default_transaction_read_only = off")
    table = "CREATE UNLOGGED TABLE lockrun_fences (key bigint PRIMARY KEY, fence bigint NOT NULL)"
    pg_server.command(table, database="ro")
    pg_server.command("ALTER DATABASE ro SET default_transaction_read_only = on")
    unset = ("--", "sh", "-c", "echo ${LOCKRUN_FENCE-unset}")
    after = lockrun("-v", "--uri", uri, "-n", name, *unset)
    assert (after.returncode, after.stdout) == (0, "unset\n"), after.stderr
    assert "no fence: cannot write table lockrun_fences" in after.stderr


def test_a_kept_lock_proves_its_n_once_and_counts_as_a_user(postgres_uri: str, name: str) -> None:
    """A kept session holds the (name, N) lock between grants: another N is refused, 78.

    It checks for other users of the name only on its first grant: anyone of another N
    who comes later sees its lock in their own check. Closed, it no longer counts.
    """
    lock = Lock(name, uri=postgres_uri)
    for _ in range(3):
        with lock as lease:
            assert lease.slot == 0
    refused = lockrun("--uri", postgres_uri, "-n", name, "-s", "2", "--", "echo", "ran")
    assert (refused.returncode, refused.stdout) == (ExitCode.CONFIG, ""), refused.stderr
    assert "in use with 1 slot" in one_line(refused.stderr)
    with lock as lease:  # the refused one left nothing behind
        assert lease.slot == 0
    lock.close()

    def free() -> bool:
        return lockrun("--uri", postgres_uri, "-n", name, "-s", "2", "--", "true").returncode == 0

    wait_for(free, what="another N once the kept session ended")  # its end, on the server


def _messages(server: PostgresServer, pid: int) -> list[str]:
    """Return the messages the server session *pid* was sent, in order (log_statement=all)."""
    prefix = f"{pid}|LOG:  statement: "
    return [
        line.removeprefix(prefix) for line in server.log().splitlines() if line.startswith(prefix)
    ]


def test_a_grant_after_a_wait_rides_in_the_waits_message(name: str) -> None:
    """A waiter sends nothing between its wait's message and its release: the grant rode in it.

    The fence, the holder's name, the check of N and of takers come back with the wait's
    answer (one round trip after the wake, as a bare pg_advisory_lock); it was two. Counted
    by the server's own log of each message. `status` dates the new holder from the end of
    that message, not from when its wait began.
    """
    server = PostgresServer("log_statement=all", "log_line_prefix=%p|", port=free_port())
    try:
        holder, waiter = Lock(name, uri=server.uri), Lock(name, uri=server.uri, wait=None)
        held = holder.acquire()
        granted: list[Lease] = []
        thread = threading.Thread(target=lambda: granted.append(waiter.acquire()))
        thread.start()
        waiting = "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        wait_for(lambda: len(query(server.uri, waiting)) == 1, what="the waiter to queue")
        [(pid,)] = query(server.uri, waiting)
        released = time.time()
        fence = held.fence
        held.release()
        thread.join(30)
        [lease] = granted
        assert lease.fence is not None
        assert fence is not None
        assert lease.fence > fence
        [owner] = lock_state(server.uri, name)["holders"]
        assert (owner["pid"], owner["slot"]) == (os.getpid(), 0)
        assert owner["since"] >= released  # the grant's, not the wait's start
        lease.release()
        holder.close()
        waiter.close()
        sent = _messages(server, int(pid))
        [wait] = [at for at, message in enumerate(sent) if "pg_advisory_lock(" in message]
        assert "pg_advisory_unlock" in sent[wait + 1], sent[wait:]
    finally:
        server.close()


def test_a_kept_lock_that_waited_waits_at_once_next_time(name: str) -> None:
    """A kept Lock that found the slot taken skips its try next time: one message to wait.

    Its wait's statement tries first (a free slot is granted without a wait), so a
    contended cycle is a wait and a release, as a bare advisory lock's: it was three
    messages. Counted by the server's own log of each message.
    """
    server = PostgresServer("log_statement=all", "log_line_prefix=%p|", port=free_port())
    try:
        holder, waiter = Lock(name, uri=server.uri), Lock(name, uri=server.uri, wait=None)
        waiting = "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        pids = []
        turns = [threading.Event(), threading.Event()]
        done = [threading.Event(), threading.Event()]

        def wait_twice() -> None:  # one thread: a Lock keeps a session per thread
            for turn, finished in zip(turns, done, strict=True):
                turn.wait(30)
                waiter.acquire().release()
                finished.set()
            waiter.close()

        thread = threading.Thread(target=wait_twice)
        thread.start()
        for turn, finished in zip(turns, done, strict=True):
            held = holder.acquire()
            turn.set()
            wait_for(lambda: len(query(server.uri, waiting)) == 1, what="the waiter to queue")
            pids += query(server.uri, waiting)
            held.release()
            assert finished.wait(30)
        thread.join(30)
        holder.close()
        [(pid,), (again,)] = pids
        assert pid == again  # the kept session
        sent = _messages(server, int(pid))
        waits = [at for at, message in enumerate(sent) if "pg_advisory_lock(" in message]
        assert len(waits) == 2, sent
        second = waits[1]
        assert "pg_try_advisory_lock(" in sent[second]  # the try rides in the wait
        # The first release prepared the unlock; the same EXECUTE came right before the
        # second wait (no try between) and right after it (the grant rode in the wait).
        assert "pg_advisory_unlock" in sent[waits[0] + 1], sent[waits[0] :]
        release = sent[second + 1].partition("*/ ")[2]
        assert release.startswith("EXECUTE "), sent[second:]
        assert sent[waits[0] + 1].endswith(release), sent[waits[0] :]
        assert sent[second - 1].endswith(release), sent[waits[0] :]
    finally:
        server.close()
