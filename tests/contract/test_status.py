"""`lockrun status` on every backend: holders, waiters in arrival order, slots, awkward names.

Each scenario runs once per backend of the registry (the `uri` fixture). What a backend's
server shows besides lockrun's own words (its lock keys, its waiting sessions) is stated per
backend in the small tables below, not in branches.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import pytest

from lockrun import ExitCode
from lockrun.backends import cut, describe_pid
from lockrun.backends.mysql import lock_key as mysql_key
from lockrun.backends.postgres import lock_key as postgres_key
from lockrun.runner import states_for_status
from lockrun.uri import parse_uri, redact
from tests.support.cli import finish, lockrun, queue_length, start, wait_for
from tests.support.harness import on_valkey_too
from tests.support.net import HOST, ME, server_locks

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.support.cli import Held

COLUMNS = ["NAME", "SLOT", "STATE", "PID", "USER", "HOST", "SINCE", "COMMAND"]


def backend_of(uri: str) -> str:
    """Return the registry's backend name for *uri*."""
    return parse_uri(uri).kind.backend


class Shows(NamedTuple):
    """What a backend's `status` can tell (docs/backends.md)."""

    # The --slots of a held name (abstract: sockets do not say).
    slots: bool = True
    # A holder's and a waiter's argv is its recorded command; else lockrun's whole command
    # line read from /proc (file: waiters, abstract: everyone).
    holder_record: bool = True
    waiter_record: bool = True
    # A listing without a name shows every name; abstract: a name too long for a socket
    # name is hashed, and only a status that names it finds it.
    lists_hashed: bool = True


SHOWS: Final = {
    "file": Shows(waiter_record=False),
    "abstract": Shows(slots=False, holder_record=False, waiter_record=False, lists_hashed=False),
}


def shows(uri: str) -> Shows:
    """Return what `status` shows on *uri*'s backend."""
    return SHOWS.get(backend_of(uri), Shows())


def command(argv: list[str], *, recorded: bool) -> list[str]:
    """Return the command in a status entry's argv (after lockrun's ``--`` when not recorded)."""
    return argv if recorded else argv[argv.index("--") + 1 :]


# What `status` shows as WHERE, for the backends that say where the lock lives on the server.
WHERE: Final[dict[str, Callable[[str, str, int], str]]] = {
    "mysql": lambda namespace, name, _: mysql_key(namespace, name),
    "postgres": lambda namespace, name, slots: (
        f"advisory key {postgres_key(namespace, name, 0)}"
        + ("" if slots == 1 else f", gate {postgres_key(namespace, name, 'gate')}")
    ),
}


def where(uri: str, namespace: str, name: str, slots: int) -> str | None:
    """Return what `status` shows as WHERE for a name, for the backends that state it."""
    shown = WHERE.get(backend_of(uri))
    return None if shown is None else shown(namespace, name, slots)


def sessions_waiting(uri: str, namespace: str, name: str) -> int | None:
    """Return how many server sessions wait on *name*, where the backend blocks in them.

    The head of a semaphore's queue waits on every slot, the others on the gate.
    """
    locks = server_locks(uri, namespace, name)
    return None if locks is None else sum(not granted for _, granted, _ in locks)


def state_of(uri: str, namespace: str, name: str) -> dict[str, Any]:
    """Return `lockrun status --json` for one name, asked in this process (tests poll it)."""
    [state] = states_for_status(uri, namespace, name)
    shown = json.loads(json.dumps(state.to_dict()))
    assert isinstance(shown, dict)
    return shown


def waiting(uri: str, namespace: str, name: str) -> int:
    """Return how many waiters `status` lists for a name."""
    return len(state_of(uri, namespace, name)["waiters"])


def assert_free(uri: str, namespace: str, name: str) -> None:
    """Assert that `status` shows *name* free and lists nothing; nothing left on the server."""
    free = state_of(uri, namespace, name)
    assert (free["holders"], free["waiters"]) == ([], [])
    table = lockrun("status", "--uri", uri, "--namespace", namespace, name)
    assert (table.returncode, table.stderr) == (0, "")
    [row] = table.stdout.splitlines()[1:]
    assert row.split()[:3] == [name, "-", "free"]
    if (shown := where(uri, namespace, name, 1)) is not None:
        assert row.split()[3:] == shown.split()
    check = lockrun("status", "--uri", uri, "--namespace", namespace, "--check", name)
    assert (check.returncode, check.stdout, check.stderr) == (0, table.stdout, "")
    listing = lockrun("status", "--uri", uri, "--namespace", namespace)
    assert (listing.returncode, listing.stderr) == (0, "")
    assert listing.stdout.startswith(f"no locks held or awaited in namespace {namespace} at ")
    listing = lockrun("status", "--uri", uri, "--namespace", namespace, "--json")
    assert json.loads(listing.stdout) == []
    assert server_locks(uri, namespace, name) in ([], None)  # no session holds or waits


def assert_table(uri: str, namespace: str, name: str, pids: list[int]) -> None:
    """Assert that the table and the listings show one holder then the waiters, in order."""
    table = lockrun("status", "--uri", uri, "--namespace", namespace, name)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split() == COLUMNS
    assert [row.split()[:6] for row in rows] == [
        [name, "0" if index == 0 else "-", "waiting" if index else "holding", str(pid), ME, HOST]
        for index, pid in enumerate(pids)
    ]
    listing = lockrun("status", "--uri", uri, "--namespace", namespace, "--json")
    assert [state["name"] for state in json.loads(listing.stdout)] == [name]
    everything = lockrun("status", "--uri", uri, "--namespace", namespace)
    assert everything.stdout == table.stdout
    check = lockrun("status", "--uri", uri, "--namespace", namespace, "--check", name)
    assert (check.returncode, check.stdout) == (ExitCode.BUSY, table.stdout)
    assert f"lockrun: {name} is held by {ME}@{HOST} pid {pids[0]} since " in check.stderr
    assert len(check.stderr.splitlines()) == 1, check.stderr
    elsewhere = lockrun("status", "--uri", uri, "--namespace", f"{namespace}-x", "--json")
    assert json.loads(elsewhere.stdout) == []


@on_valkey_too
def test_status_shows_the_holder_and_the_waiters_in_arrival_order(
    uri: str, held: Callable[..., Held], name: str, tmp_path: Path
) -> None:
    """The JSON, the table and the listing show holder and queue; -v names the holder."""
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    leased = parse_uri(uri).kind.leased
    order = tmp_path / "order"
    holder = held("--uri", uri, "-n", name, "--namespace", namespace)
    waiters = ("--uri", uri, "-n", name, "--namespace", namespace, "--wait", "forever")
    first = start(*waiters, "--", "sh", "-c", f"echo first >> {order}")
    second = None
    err = ""
    try:
        wait_for(lambda: waiting(uri, namespace, name) == 1, what="waiter 1")
        second = start("-v", *waiters, "--", "sh", "-c", f"echo second >> {order}")
        wait_for(lambda: waiting(uri, namespace, name) == 2, what="waiter 2")
        if sessions_waiting(uri, namespace, name) is not None:
            wait_for(lambda: sessions_waiting(uri, namespace, name) == 2, what="2 sessions")

        result = lockrun("status", "--uri", uri, "--namespace", namespace, "--json", name)
        assert result.returncode == 0, result.stderr
        [state] = json.loads(result.stdout)
        slots = 1 if shows(uri).slots else None
        assert (state["name"], state["namespace"], state["slots"]) == (name, namespace, slots)
        if (shown := where(uri, namespace, name, 1)) is not None:
            assert state["where"] == shown
        [owner] = state["holders"]
        assert (owner["pid"], owner["user"], owner["host"]) == (holder.process.pid, ME, HOST)
        assert command(owner["argv"], recorded=shows(uri).holder_record)[:2] == ["sh", "-c"]
        assert owner["slot"] == 0
        assert time.time() - 60 < owner["since"] <= time.time()
        if leased:  # the lease's end, renewed by the holder (--ttl 5 here)
            assert time.time() < owner["expires"] <= time.time() + 6
        assert [waiter["pid"] for waiter in state["waiters"]] == [first.pid, second.pid]
        assert [waiter["argv"][-1] for waiter in state["waiters"]] == [
            f"echo first >> {order}",
            f"echo second >> {order}",
        ]
        assert {waiter["user"] for waiter in state["waiters"]} == {ME}
        assert queue_length(uri, name) == 0  # another namespace: default has none of it

        assert_table(uri, namespace, name, [holder.process.pid, first.pid, second.pid])
    finally:
        statuses = [holder.finish(), finish(first)]
        if second is not None:
            _, err = second.communicate(timeout=30)
            statuses.append(second.returncode)
    assert statuses == [0, 0, 0], err
    assert order.read_text() == "first\nsecond\n"
    assert re.search(
        rf"^lockrun: waiting for {re.escape(name)} \({re.escape(redact(uri))}\) — held by "
        rf"{re.escape(HOST)}:{holder.process.pid} since ",
        err,
        re.MULTILINE,
    ), err
    assert_free(uri, namespace, name)


@pytest.mark.slow  # 5-9 s on PostgreSQL and MariaDB under load
def test_status_of_a_semaphore_shows_each_slot_and_the_head_waiter_once(
    uri: str, held: Callable[..., Held], name: str, tmp_path: Path
) -> None:
    """--slots 3: three holders on distinct slots; the head waits on every slot but shows once."""
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    order = tmp_path / "order"
    options = ("--uri", uri, "-n", name, "--namespace", namespace, "--slots", "3")
    holders = [held(*options) for _ in range(3)]
    assert sorted(holder.slot for holder in holders) == [0, 1, 2]
    assert [holder.fence for holder in holders] == sorted({holder.fence for holder in holders})
    script = f'echo "$0 $LOCKRUN_SLOT" >> {order}'
    head = start(*options, "--wait", "forever", "--", "sh", "-c", script, "head")
    second = None
    try:
        wait_for(lambda: waiting(uri, namespace, name) == 1, what="the head in the queue")
        if sessions_waiting(uri, namespace, name) is not None:  # on slots 0, 1 and 2
            wait_for(lambda: sessions_waiting(uri, namespace, name) == 3, what="every slot")
        second = start(*options, "--wait", "forever", "--", "sh", "-c", script, "second")
        wait_for(lambda: waiting(uri, namespace, name) == 2, what="the second in the queue")
        if sessions_waiting(uri, namespace, name) is not None:  # and the second on the gate
            wait_for(lambda: sessions_waiting(uri, namespace, name) == 4, what="the gate")
        if server_locks(uri, namespace, name) is not None:
            # A waiter's lock wait is a timed statement it repeats: a snapshot may fall
            # between two of them (seen once in CI at load 8), so ask until it shows.
            def waited() -> list[str]:
                locks = server_locks(uri, namespace, name) or []
                return [part for part, granted, _ in locks if not granted]

            wait_for(lambda: waited() == ["0", "1", "2", "gate"], what="each slot and the gate")

        state = state_of(uri, namespace, name)
        assert state["slots"] == (3 if shows(uri).slots else None)
        if (shown := where(uri, namespace, name, 3)) is not None:
            assert state["where"] == shown
        assert sorted((owner["slot"], owner["pid"]) for owner in state["holders"]) == sorted(
            (holder.slot, holder.process.pid) for holder in holders
        )
        assert any("sh" in " ".join(owner["argv"]) for owner in state["holders"])
        assert [waiter["pid"] for waiter in state["waiters"]] == [head.pid, second.pid]
        table = lockrun("status", "--uri", uri, "--namespace", namespace, name)
        assert table.returncode == 0
        assert table.stdout.splitlines()[0].split() == COLUMNS
        roles = [row.split()[1:4] for row in table.stdout.splitlines()[1:]]
        assert sorted(roles[:3]) == [
            [str(holder.slot), "holding", str(holder.process.pid)]
            for holder in sorted(holders, key=lambda holder: holder.slot)
        ]
        assert roles[3:] == [["-", "waiting", str(head.pid)], ["-", "waiting", str(second.pid)]]

        [freed] = [holder for holder in holders if holder.slot == 1]
        assert freed.finish() == 0
        assert finish(head) == 0
        assert finish(second) == 0
    finally:
        for holder in holders:
            if holder.process.poll() is None:
                holder.finish()
        for waiter in (head, second):
            if waiter is not None and waiter.poll() is None:
                waiter.kill()
                waiter.communicate(timeout=30)
    assert order.read_text() == "head 1\nsecond 1\n"
    assert_free(uri, namespace, name)  # the gate too is given back with the last waiter


AWKWARD: Final = [
    "with spaces and 'single' \"double\" quotes",
    "a*/b */ -- d; SELECT 1 *",
    "a*/b'c\"d\\e\nf 🔒 -- #",
    "a/b {c}*% d\tüñí",
    "100% _LIKE_ \\%",
    "🔒 lock ✓ 名前",
    "x" * 255,
    "line\nbreak\ttab",
]
# A command line that survives SQL comments, and one too long to record whole.
AWKWARD_ARGV: Final = ["echo", "*/ SELECT 1; --", "ü\n*/", "y" * 5000]


@pytest.mark.slow
def test_status_and_the_environment_carry_awkward_names_unchanged(
    uri: str, spawn: Callable[..., subprocess.Popen[str]], tmp_path: Path
) -> None:
    """Quotes, comment ends, %, emoji, newlines and 255 bytes survive status and LOCKRUN_NAME.

    A waiter's command line with comment ends comes back unchanged; a long one is cut, with
    a marker. Another namespace lists none of them.
    """
    namespace = f"x/y*/{uuid.uuid4().hex[:8]} %"
    # Written aside, then renamed: the file must not be seen before the name is in it.
    script = (
        'printf %s "$LOCKRUN_NAME" > "$0.tmp" && mv "$0.tmp" "$0"; '
        "while [ ! -e go ]; do sleep 0.05; done"
    )
    holders = {
        name: spawn(
            *("--uri", uri, "-n", name, "--namespace", namespace),
            *("--", "sh", "-c", script, f"name-{index}"),
            cwd=tmp_path,
        )
        for index, name in enumerate(AWKWARD)
    }
    for index in range(len(AWKWARD)):
        wait_for((tmp_path / f"name-{index}").exists, what=f"holder {index}")
    for index, name in enumerate(AWKWARD):
        assert (tmp_path / f"name-{index}").read_text() == name
    first = AWKWARD[0]
    waiter = spawn(
        *("--uri", uri, "-n", first, "--namespace", namespace, "-w", "forever", "--"),
        *AWKWARD_ARGV,
        stdout=subprocess.DEVNULL,
    )
    wait_for(lambda: waiting(uri, namespace, first) == 1, what="the waiter")
    listing = lockrun("status", "--uri", uri, "--namespace", namespace, "--json")
    assert listing.returncode == 0, listing.stderr
    listed = {state["name"] for state in json.loads(listing.stdout)}
    if shows(uri).lists_hashed:
        assert sorted(listed) == sorted(AWKWARD)
    else:
        assert listed < set(AWKWARD)
    for index, (name, holder) in enumerate(holders.items()):
        state = state_of(uri, namespace, name)
        assert (state["name"], state["namespace"]) == (name, namespace)
        [owner] = state["holders"]
        assert (owner["pid"], owner["slot"]) == (holder.pid, 0)
        recorded = command(owner["argv"], recorded=shows(uri).holder_record)
        assert recorded == ["sh", "-c", script, f"name-{index}"]
        busy = lockrun("--uri", uri, "-n", name, "--namespace", namespace, "--", "true")
        assert (busy.returncode, busy.stdout) == (ExitCode.BUSY, ""), name
        shown = name.replace("\n", "\\x0a").replace("\t", "\\x09")  # escaped control chars
        assert f"lockrun: {shown} busy, held by {ME}@{HOST} pid {holder.pid}" in busy.stderr
    [queued] = state_of(uri, namespace, first)["waiters"]
    assert queued["pid"] == waiter.pid
    # A long command line is cut, with a marker (lockrun's own, where /proc is read).
    assert queued["argv"][-1].endswith("more characters not recorded]")
    if shows(uri).waiter_record:
        assert queued["argv"] == list(cut(AWKWARD_ARGV))
    else:
        assert command(queued["argv"], recorded=False)[:3] == AWKWARD_ARGV[:3]
    for other in (namespace[:-1], f"{namespace}x", "x"):
        elsewhere = lockrun("status", "--uri", uri, "--namespace", other, "--json")
        assert json.loads(elsewhere.stdout) == [], other
    (tmp_path / "go").touch()
    assert [finish(holder) for holder in holders.values()] == [0] * len(AWKWARD)
    assert finish(waiter) == 0
    listing = lockrun("status", "--uri", uri, "--namespace", namespace, "--json")
    assert json.loads(listing.stdout) == []


@pytest.mark.parametrize(
    ("suffix", "namespace", "argv"),
    [
        (" /* x", "default", ["true"]),
        ("", "/*", ["true"]),
        ("", "default", ["echo", "/var/log/*.log"]),
        # echo, not ls: ls failed on another worker's directory gone after the glob
        ("", "default", ["sh", "-c", "echo /tmp/* >/dev/null"]),
    ],
    ids=["name", "namespace", "argument", "shell-glob"],
)
def test_a_comment_opener_in_a_name_or_command_runs(
    uri: str, name: str, suffix: str, namespace: str, argv: list[str]
) -> None:
    """/* in a name, a namespace or the command (a glob like /var/log/*) runs like any text."""
    result = lockrun("--uri", uri, "-n", f"{name}{suffix}", "--namespace", namespace, "--", *argv)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("ü" * 127 + "z", ["sh", "-c", "sleep 30"]),
        ("long-command", ["sh", "-c", "sleep 30", "y" * 600]),
    ],
    ids=["255-bytes-non-ascii-name", "600-byte-command"],
)
def test_status_reads_back_a_holder_with_a_long_name_or_command(
    uri: str, spawn: Callable[..., subprocess.Popen[str]], name: str, argv: list[str]
) -> None:
    """A 255-byte non-ASCII name, or a long command, is still listed with its holder's pid."""
    namespace = f"ns-{uuid.uuid4().hex[:8]}"
    holder = spawn("--uri", uri, "-n", name, "--namespace", namespace, "--", *argv)
    wait_for(lambda: state_of(uri, namespace, name)["holders"], what="the holder")
    listing = lockrun("status", "--uri", uri, "--namespace", namespace, "--json", name)
    states = json.loads(listing.stdout)
    assert [state["name"] for state in states] == [name]
    assert [owner["pid"] for owner in states[0]["holders"]] == [holder.pid]
    if shows(uri).lists_hashed:  # a renewal between the two may move a lease's expiry on
        listing = lockrun("status", "--uri", uri, "--namespace", namespace, "--json")
        assert _without_expiry(json.loads(listing.stdout)) == _without_expiry(states)


def _without_expiry(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Return *states* without the holders' lease expiry, which every renewal moves on."""
    return [
        state
        | {"holders": [{k: v for k, v in h.items() if k != "expires"} for h in state["holders"]]}
        for state in states
    ]


def test_holders_that_vanished_are_described_without_details() -> None:
    """A pid that no longer exists is still described, with what is known."""
    gone = subprocess.run(["true"], check=True)
    assert gone.returncode == 0
    holder = describe_pid(2**22 + 1)  # above pid_max: never a live process
    assert (holder.pid, holder.user, holder.argv) == (2**22 + 1, "?", ())


def test_unknown_uid_is_shown_as_a_number(tmp_path: Path) -> None:
    """A holder whose uid has no passwd entry shows the number."""
    probe = tmp_path / "probe"
    probe.touch()
    os.chown(probe, 54321, 54321) if os.geteuid() == 0 else pytest.skip("needs root")
    process = subprocess.Popen(["sleep", "30"], user=54321)
    try:
        assert describe_pid(process.pid).user == "54321"
    finally:
        process.kill()
        process.wait()
