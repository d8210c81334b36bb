"""PostgreSQL through the Python API and the backend itself: renewals, checks, other roles."""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import Lock, LockBusy
from lockrun.backends import Holder, Request, open_backend, parse_uri
from lockrun.backends.postgres import slots_key
from lockrun.errors import LeaseLost
from tests.support.cli import finish, lockrun, one_line, queue_length, wait_for
from tests.support.servers import postgres_bin

if TYPE_CHECKING:
    from collections.abc import Callable
    from subprocess import Popen

    from tests.support.cli import Held
    from tests.support.servers import PostgresServer

PASSWORD = "pw-for-roles"  # noqa: S105 - the throwaway server's


def role_uri(server: PostgresServer, role: str) -> str:
    """Create *role* (password login) on *server* and return a URI without the password."""
    server.command(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
    return f"postgresql://{role}@/lockrun?host={server.directory}&port={server.port}"


def as_role() -> dict[str, str]:
    """Return an environment in which libpq finds the roles' password (PGPASSWORD)."""
    return {**os.environ, "PGPASSWORD": PASSWORD}


def test_api_lease_outlives_the_idle_timeout_while_the_block_runs(
    postgres_uri: str, name: str
) -> None:
    """A block longer than idle_session_timeout (the ttl) keeps the lock: checks renew it."""
    with Lock(name, uri=postgres_uri, ttl=1.2) as lease:
        time.sleep(3)
        with pytest.raises(LockBusy), Lock(name, uri=postgres_uri, ttl=1.2):
            pass
        assert lease.fence is not None
    with Lock(name, uri=postgres_uri) as lease:
        assert lease.slot == 0


def test_api_reports_a_session_terminated_while_the_block_ran(
    pg_server: PostgresServer, name: str
) -> None:
    """pg_terminate_backend during the block: leaving it raises LeaseLost; the name is free."""
    lock = Lock(name, uri=pg_server.uri, ttl=1.5)
    lock.acquire()
    ended = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = "
    pg_server.command(f"{ended} 'lockrun:{name}:0'")
    time.sleep(1.5)  # more than ttl/3: a check has found the session gone
    with pytest.raises(LeaseLost, match="session holding the lock ended"):
        lock.release()
    with Lock(name, uri=pg_server.uri) as lease:
        assert lease.slot == 0


def test_a_check_finds_a_lock_given_back_on_a_live_session(postgres_uri: str, name: str) -> None:
    """The check asks pg_locks, not merely whether the session lives."""
    backend = open_backend(parse_uri(postgres_uri), ttl=5)
    request = Request("default", name, 1, 5, Holder.me(["test"]))
    lease = backend.acquire(request, None)
    assert lease is not None
    lease.refresh()
    lease.session.rows("SELECT pg_advisory_unlock_all()", timeout=5)  # type: ignore[attr-defined]
    with pytest.raises(LeaseLost, match="no longer gives this session the lock"):
        lease.refresh()
    lease.release()
    lease.release()
    lease.refresh()  # released: nothing to prove, and no error
    backend.close()


def test_a_waiter_cancelled_on_the_server_queues_again(
    pg_server: PostgresServer,
    name: str,
    held: Callable[..., Held],
    spawn: Callable[..., Popen[str]],
) -> None:
    """pg_cancel_backend of a waiting session: the waiter asks again and runs when free."""
    uri = pg_server.uri
    holder = held("--uri", uri, "-n", name)
    waiter = spawn("--uri", uri, "-n", name, "-w", "forever", "--", "true")
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter in the queue")
    cancelled = pg_server.command(
        "SELECT count(pg_cancel_backend(pid)) FROM pg_locks "
        "WHERE locktype = 'advisory' AND NOT granted"
    )
    assert cancelled == "1"
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter queued again")
    assert waiter.poll() is None
    assert holder.finish() == 0
    assert finish(waiter) == 0


def test_fence_without_pg_logical_emit_message(pg_server: PostgresServer, name: str) -> None:
    """Where the durable write is not allowed, the fence is the bare id and -v says so."""
    uri = role_uri(pg_server, "plain")
    for signature in ("boolean, text, text", "boolean, text, bytea"):
        pg_server.command(
            f"REVOKE EXECUTE ON FUNCTION pg_logical_emit_message({signature}) FROM PUBLIC"
        )
    before = int(pg_server.command("SELECT pg_current_xact_id()"))
    result = lockrun(
        "--uri", uri, "-n", name, "-v", "--", "sh", "-c", "echo $LOCKRUN_FENCE", env=as_role()
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > before
    assert "pg_logical_emit_message is not allowed" in result.stderr
    again = lockrun(
        "--uri", uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE", env=as_role()
    )
    assert int(again.stdout) > int(result.stdout)


def test_another_roles_holder_shows_as_its_session(
    pg_server: PostgresServer, name: str, held: Callable[..., Held]
) -> None:
    """Another role's statements are unreadable: status and the mismatch use pg_locks alone.

    Without pg_read_all_stats pg_stat_activity hides another role's statements, so the
    comment naming its lockrun; what pg_locks and the session's row show to everyone remains.
    """
    alice, bob = role_uri(pg_server, "alice"), role_uri(pg_server, "bob")
    os.environ["PGPASSWORD"] = PASSWORD  # for the held factory's process
    try:
        holder = held("--uri", alice, "-n", name, "-s", "2")
    finally:
        del os.environ["PGPASSWORD"]
    shown = lockrun("status", "--uri", bob, "--json", name, env=as_role())
    assert shown.returncode == 0, shown.stderr
    [state] = json.loads(shown.stdout)
    [seen] = state["holders"]
    assert seen["user"] == "alice"
    assert seen["host"].startswith("local socket (backend ")
    assert seen["slot"] == 0
    assert state["slots"] == 2  # from the shared (name, N) lock everyone can see
    refused = lockrun("--uri", bob, "-n", name, "--", "true", env=as_role())
    assert refused.returncode == 78
    assert "held with --slots 2; all users of a name must agree" in one_line(refused.stderr)
    assert holder.finish() == 0


def test_sessions_outlast_the_lease_and_commit_to_disk(pg_server: PostgresServer) -> None:
    """The server's keepalive gives up on a silent lockrun only after its lease; fences flush.

    A server that dropped a silent holder's session sooner would free the lock before the
    supervisor stops the command; a role's synchronous_commit = off would let a crash hand
    the same fence out twice.
    """
    backend = open_backend(parse_uri(pg_server.tcp_uri), ttl=30)
    session = backend.session()  # type: ignore[attr-defined]
    try:
        idle, interval, count, commit, idle_limit = session.rows(
            "SELECT current_setting('tcp_keepalives_idle'), "
            "current_setting('tcp_keepalives_interval'), "
            "current_setting('tcp_keepalives_count'), current_setting('synchronous_commit'), "
            "current_setting('idle_session_timeout')",
            timeout=5,
        )[0]
    finally:
        session.close()
    assert int(idle) + int(interval) * int(count) >= 30  # over TCP, so the server uses them
    assert commit == "local"
    assert idle_limit == "30s"


def test_a_shared_key_collision_is_not_a_slots_mismatch(
    pg_server: PostgresServer, name: str
) -> None:
    """The (name, N) lock is 32 bits: a holder whose comment names another lock is ignored."""
    key = slots_key("default", name)
    other = json.dumps(
        {
            "token": "t",
            "namespace": "default",
            "name": f"{name}-other",
            "slots": 5,
            "holder": {"host": "h", "pid": 1, "user": "u", "argv": []},
        }
    )
    tagged = f"/* lockrun {other} */ SELECT pg_advisory_lock_shared({key}, 5), pg_sleep(60)"
    psql = (postgres_bin("psql"), "-X", "-h", pg_server.directory, "-p", str(pg_server.port))
    impostor = subprocess.Popen([*psql, "-U", "lockrun", "-d", "lockrun", "-c", tagged])
    try:
        wait_for(
            lambda: (
                pg_server.command(
                    "SELECT count(*) FROM pg_locks WHERE objsubid = 2 AND objid = 5 AND granted"
                )
                == "1"
            ),
            what="the colliding shared lock",
        )
        result = lockrun("--uri", pg_server.uri, "-n", name, "--", "true")
        assert result.returncode == 0, result.stderr
        untagged = lockrun("--uri", pg_server.uri, "-n", name, "-s", "2", "--", "true")
        assert untagged.returncode == 0, untagged.stderr
    finally:
        impostor.kill()
        impostor.wait(10)
