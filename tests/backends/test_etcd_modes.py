"""The fleet modes as etcd keeps them: markers, windows, take-over keys and the bell (A13).

tests/contract/test_modes.py and test_detached.py hold what every backend must do; here is
what only etcd's keys do, and what tries to break them: the keys and leases each mode puts
and leaves (none), a window as the queue key moved onto a lease of its own, a holder whose
renewal is far off stopped by its watch, waiters ahead of a taker giving way, and keys that
another client of the server wrote. The oracles are the server's keys and leases (read
through the gateway, as an operator would) and what the commands themselves write, never
lockrun's word.
"""

from __future__ import annotations

import base64
import json
import shlex
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from lockrun.backends.etcd import lock_prefix
from lockrun.backends.etcd.lease import lease_for, window_for
from lockrun.detached import parse_token
from tests.backends.test_etcd import gateway, keys_of, leases, uri_of
from tests.support.cli import (
    LOCKRUN,
    Held,
    finish,
    lockrun,
    one_line,
    start,
    statuses_read,
    unmeasured,
    wait_for,
)
from tests.support.servers import EtcdServer, free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

pytestmark = [pytest.mark.server, pytest.mark.timeout(90)]

# A lease whose renewal (every ttl/3) is 100 s away: what happens within a test's 60 s is
# the watch's doing, not the renewal's.
FAR: Final = "300"
WINDOW: Final = 30  # a window no test outlives: what ends sooner is not its end
GRAIN: Final = 1.5  # etcd counts a lease's TTL in whole seconds, and ends leases twice a second


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdServer]:
    """Return an etcd of this module's own (one member)."""
    server = EtcdServer(port=free_port(), peer_port=free_port())
    yield server
    server.close()


def ended(process: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str]:
    """Wait for a `start`ed process; return its status and what it said on stderr."""
    _, err = process.communicate(timeout=timeout)
    return process.returncode, err or ""


def put(server: EtcdServer, name: str, key: str, value: bytes, lease: int = 0) -> None:
    """Put *value* at *key* of lock *name*, as another client of the server could."""
    body: dict[str, Any] = {
        "key": base64.b64encode(lock_prefix("default", name).encode() + key.encode()).decode(),
        "value": base64.b64encode(value).decode(),
    }
    if lease:
        body["lease"] = str(lease)
    gateway(server, "/v3/kv/put", body)


def wipe(server: EtcdServer, name: str) -> None:
    """Delete every key of lock *name* (what a test's hostile client left)."""
    prefix = lock_prefix("default", name).encode()
    end = prefix[:-1] + b"0"
    gateway(
        server,
        "/v3/kv/deleterange",
        {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()},
    )


def time_to_live(server: EtcdServer, lease: int) -> tuple[int, int]:
    """Return lease *lease*'s (TTL left, TTL granted) on the server; TTL -1: no such lease."""
    answer = gateway(server, "/v3/lease/timetolive", {"ID": str(lease)})
    return int(answer.get("TTL", 0)), int(answer.get("grantedTTL", 0))


def lease_named(key: str) -> int:
    """Return the lease a key ``q/LEASE`` (or ``w/``, ``t/``, ``tr/``) is named after."""
    return int(key.rpartition("/")[2], 16)


def state(uri: str, name: str) -> dict[str, Any]:
    """Return `lockrun status --json NAME`'s one entry, from a lockrun process."""
    shown = lockrun("status", "--uri", uri, "--json", name)
    assert (shown.returncode, shown.stderr) == (0, ""), shown.stderr
    (entry,) = json.loads(shown.stdout)
    assert isinstance(entry, dict)
    return entry


def stubborn(directory: Path, tag: str) -> tuple[str, Path, Path, Path]:
    """Return a command that notes a TERM and keeps running until told, and its files.

    (script, ready, term, go): the command touches *ready* when it runs and *term* when it
    is sent TERM, and ends once *go* exists.
    """
    ready, term, go = (directory / f"{what}-{tag}" for what in ("ready", "term", "go"))
    script = f"trap 'touch {term}' TERM; touch {ready}; while [ ! -e {go} ]; do sleep 0.05; done"
    return script, ready, term, go


def yielding(directory: Path, tag: str) -> tuple[str, Path, Path]:
    """Return a command that ends at TERM, noting it, and its files (script, ready, log).

    It writes ``begin`` to *log* when it runs and ``term`` when TERM comes; its shell's
    "Terminated" for the sleep the TERM killed goes nowhere, so stderr is lockrun's alone.
    """
    ready, log = directory / f"ready-{tag}", directory / "log"
    script = (
        f"exec 2>/dev/null; trap 'echo term >> {log}; exit 0' TERM; echo begin >> {log};"
        f" touch {ready}; while :; do sleep 0.05; done"
    )
    return script, ready, log


def has_keys(server: EtcdServer, name: str, count: int) -> Callable[[], bool]:
    """Return whether lock *name* has *count* keys now, as a condition to wait for."""
    return lambda: len(keys_of(server, name)) == count


def lines(log: Path) -> list[str]:
    """Return what the commands wrote to *log*, in order."""
    return log.read_text().split() if log.exists() else []


# -- what each mode puts, and leaves -----------------------------------------------------------


def test_a_writer_puts_a_queue_key_and_a_marker_and_a_reader_only_its_queue_key(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """Writer: q/LEASE and w/LEASE on its lease, one revision; reader: q/LEASE; busy: nothing."""
    uri = uri_of(etcd)
    before = leases(etcd)
    writer = Held(tmp_path, "--uri", uri, "-n", name, "--ttl", "10")
    ((queue, mine), (marker, its)) = sorted(keys_of(etcd, name).items())
    assert (queue[:2], marker[:2]) == ("q/", "w/")
    assert queue[2:] == marker[2:]
    # one transaction: the same create revision, the same lease
    assert (mine["created"], mine["lease"]) == (its["created"], its["lease"])
    assert mine["lease"] == lease_named(queue)
    assert mine["created"] == writer.fence
    assert leases(etcd) - before == {mine["lease"]}
    for mode in ((), ("--shared",)):
        busy = lockrun("--uri", uri, "-n", name, "-w", "0", *mode, "--", "true")
        assert busy.returncode == 75, busy.stderr
        assert f"{name} busy" in one_line(busy.stderr)
        assert keys_of(etcd, name) == {queue: mine, marker: its}
    assert writer.finish() == 0
    assert keys_of(etcd, name) == {}
    reader = Held(tmp_path, "--uri", uri, "-n", name, "--shared", "--ttl", "10")
    assert reader.fence == 0  # LOCKRUN_FENCE unset
    ((key, kv),) = keys_of(etcd, name).items()
    assert key.startswith("q/")
    assert kv["lease"] == lease_named(key)
    record = json.loads(keys_of(etcd, name)[key]["value"])
    assert record["holder"]["shared"] is True
    assert reader.finish() == 0
    assert keys_of(etcd, name) == {}
    assert leases(etcd) - before == set()


@pytest.mark.parametrize("shared", [False, True], ids=["writer", "reader"])
def test_a_takers_request_lives_on_its_lease_and_a_taker_that_gives_up_takes_it_away(
    etcd: EtcdServer, name: str, tmp_path: Path, *, shared: bool
) -> None:
    """t/LEASE (tr/ for --shared) beside the taker's key; a later taker that gives up leaves none.

    The older taker, queued first, is not stopped by the younger's request once that is gone.
    """
    uri = uri_of(etcd)
    before = leases(etcd)
    script, ready, term, go = stubborn(tmp_path, "holder")
    holder = start("--uri", uri, "-n", name, "--ttl", FAR, "--kill-after", "60", "--",
                   "sh", "-c", script)  # fmt: skip
    wait_for(ready.exists, what="the holder's command")
    mode = ("--shared",) if shared else ()
    ran = tmp_path / "ran"
    first = start(
        *("--uri", uri, "-n", name, "--ttl", FAR, "--take-over", "-w", "60", *mode),
        *("--", "sh", "-c", f"touch {ran}"),
    )
    wait_for(term.exists, what="the holder's TERM")
    kind = "tr/" if shared else "t/"
    keys = keys_of(etcd, name)
    (request,) = [key for key in keys if key.startswith(("t/", "tr/"))]
    assert request.startswith(kind)
    taker = lease_named(request)
    assert keys[request]["lease"] == taker
    assert keys[f"q/{taker:016x}"]["created"] == keys[request]["created"]
    assert (f"w/{taker:016x}" in keys) is not shared
    assert json.loads(keys[request]["value"])["pid"] == first.pid
    second = lockrun("--uri", uri, "-n", name, "--take-over", "-w", "1", "--", "true")
    assert second.returncode == 75, second.stderr
    one_line(second.stderr)
    assert [key for key in keys_of(etcd, name) if key.startswith(("t/", "tr/"))] == [request]
    go.touch()
    assert finish(holder) == 79
    assert finish(first) == 0, first.stderr  # the younger request went with its taker
    assert ran.exists()
    assert keys_of(etcd, name) == {}
    assert leases(etcd) - before == set()


# -- --hold-at-least ---------------------------------------------------------------------------


def test_a_window_keeps_the_queue_key_and_its_fence_on_a_lease_of_its_own(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """After the run: q/ and w/ on a window lease, same create revision; the run's lease gone."""
    uri = uri_of(etcd)
    fence = tmp_path / "fence"
    asked = time.time()
    ran = lockrun(
        *("--uri", uri, "-n", name, "--ttl", "10", "--hold-at-least", str(WINDOW)),
        *("--", "sh", "-c", f"echo $LOCKRUN_FENCE > {fence}"),
    )
    assert (ran.returncode, ran.stderr) == (0, "")
    keys = keys_of(etcd, name)
    ((queue, kv), (marker, its)) = sorted(keys.items())
    assert (queue[:2], marker[:2]) == ("q/", "w/")
    assert kv["created"] == int(fence.read_text())  # the place, and the fence, stayed
    window = kv["lease"]
    assert window not in {0, lease_named(queue)}
    assert its["lease"] == window
    assert lease_named(queue) not in leases(etcd)  # the run's own lease was revoked
    left, granted = time_to_live(etcd, window)
    assert granted <= WINDOW
    assert WINDOW - 10 < left <= WINDOW
    (holder,) = state(uri, name)["holders"]
    assert asked + WINDOW - GRAIN <= holder["until"] <= time.time() + WINDOW + GRAIN
    assert "held until" in lockrun("status", "--uri", uri, name).stdout
    for mode in (("-w", "2"), ("-w", "0"), ("--take-over", "-w", "2")):
        busy = lockrun("--uri", uri, "-n", name, *mode, "--", "true")
        assert busy.returncode == 75, busy.stderr
        said = one_line(busy.stderr)
        assert "(--hold-at-least)" in said, said
        assert keys_of(etcd, name) == keys  # no taker's request, nor its key, stays
    gateway(etcd, "/v3/lease/revoke", {"ID": str(window)})  # the window's end, brought forward
    assert keys_of(etcd, name) == {}
    after = lockrun("--uri", uri, "-n", name, "--", "sh", "-c", "echo $LOCKRUN_FENCE")
    assert int(after.stdout) > int(fence.read_text())


def test_a_holder_with_a_window_taken_over_leaves_no_window(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """--hold-at-least holder, --take-over asked while it runs: 79, the taker runs, no key left."""
    uri = uri_of(etcd)
    before = leases(etcd)
    script, ready, log = yielding(tmp_path, "holder")
    holder = start(
        *("--uri", uri, "-n", name, "--ttl", FAR, "--hold-at-least", str(WINDOW)),
        *("--", "sh", "-c", script),
    )
    wait_for(ready.exists, what="the holder's command")
    taker = lockrun(
        *("--uri", uri, "-n", name, "--take-over", "-w", "30"),
        *("--", "sh", "-c", f"echo taker >> {log}"),
    )
    assert taker.returncode == 0, taker.stderr
    assert finish(holder) == 79
    assert lines(log) == ["begin", "term", "taker"]
    assert keys_of(etcd, name) == {}
    assert leases(etcd) - before == set()


def test_a_killed_a_lost_or_a_missing_command_leaves_no_window(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """SIGKILL to lockrun, a lease revoked under it (76), a command not found (127): no window."""
    uri = uri_of(etcd)
    before = leases(etcd)
    hold = ("--hold-at-least", str(WINDOW))
    missing = lockrun("--uri", uri, "-n", name, *hold, "--", str(tmp_path / "nowhere"))
    assert missing.returncode == 127, missing.stderr
    assert keys_of(etcd, name) == {}
    ready = tmp_path / "ready"
    killed = start("--uri", uri, "-n", name, "--ttl", FAR, *hold, "--",
                   "sh", "-c", f"touch {ready}; sleep 600")  # fmt: skip
    wait_for(ready.exists, what="the command")
    killed.send_signal(signal.SIGKILL)
    finish(killed)
    wait_for(lambda: not keys_of(etcd, name), timeout=30, what="the guardian's revoke")
    held = Held(tmp_path, "--uri", uri, "-n", name, "--ttl", "3", "--kill-after", "1", *hold)
    ((_, kv), _) = sorted(keys_of(etcd, name).items())
    gateway(etcd, "/v3/lease/revoke", {"ID": str(kv["lease"])})
    held.process.communicate(timeout=30)
    assert held.process.returncode == 76
    assert keys_of(etcd, name) == {}
    wait_for(lambda: not leases(etcd) - before, timeout=30, what="every lease gone")


# -- take-over: the bell, and the waiters ahead of the taker -----------------------------------


@pytest.mark.parametrize("ahead", [1, 2], ids=["next-in-line", "second-in-line"])
def test_a_far_renewal_is_no_obstacle_and_waiters_ahead_give_way_unrun(
    etcd: EtcdServer, name: str, tmp_path: Path, ahead: int
) -> None:
    """Holder renewing every 100 s: stopped by its bell; waiters ahead of the taker exit 79.

    The taker's 30 s wait proves the holder heard the request long before its renewal, and
    the waiters' far renewals that they heard it through their watches.
    """
    uri = uri_of(etcd)
    before = leases(etcd)
    script, ready, log = yielding(tmp_path, "holder")
    holder = start("--uri", uri, "-n", name, "--ttl", FAR, "--", "sh", "-c", script)
    wait_for(ready.exists, what="the holder's command")
    waiters: list[subprocess.Popen[str]] = []
    for each in range(ahead):
        waiters.append(
            start(
                *("--uri", uri, "-n", name, "--ttl", FAR, "-w", "60"),
                *("--", "sh", "-c", f"echo waiter{each} >> {log}"),
            )
        )
        count = 2 * (each + 2)  # two keys a writer: the holder's and each waiter's
        wait_for(has_keys(etcd, name, count), what="the waiter's keys")
    taker = lockrun(
        *("--uri", uri, "-n", name, "--ttl", FAR, "--take-over", "-w", "30"),
        *("--", "sh", "-c", f"echo taker >> {log}"),
    )
    assert taker.returncode == 0, taker.stderr
    status, said = ended(holder)
    assert status == 79
    assert "taken over by " in one_line(said)
    for waiter in waiters:
        assert finish(waiter) == 79
    assert lines(log) == ["begin", "term", "taker"]  # no waiter's command ran
    assert keys_of(etcd, name) == {}
    assert leases(etcd) - before == set()


@pytest.mark.parametrize("reader_holds", [False, True], ids=["reader-waits", "writer-waits"])
def test_a_waiter_behind_a_holder_of_the_other_mode_gives_way_to_a_writers_take_over(
    etcd: EtcdServer, name: str, tmp_path: Path, *, reader_holds: bool
) -> None:
    """A writer holds and a reader waits on its marker, or the other way round.

    An exclusive taker stops both, and the waiter's command never runs.
    """
    uri = uri_of(etcd)
    holding, waiting = ("reader", "writer") if reader_holds else ("writer", "reader")
    script, ready, log = yielding(tmp_path, holding)
    holder = start(
        *("--uri", uri, "-n", name, "--ttl", FAR, *(("--shared",) * reader_holds)),
        *("--", "sh", "-c", script),
    )
    wait_for(ready.exists, what=f"the {holding}'s command")
    waiter = start(
        *(
            "--uri",
            uri,
            "-n",
            name,
            "--ttl",
            FAR,
            "-w",
            "60",
            *(("--shared",) * (not reader_holds)),
        ),
        *("--", "sh", "-c", f"echo {waiting} >> {log}"),
    )
    wait_for(lambda: len(keys_of(etcd, name)) == 3, what=f"the {waiting}'s keys")
    taker = lockrun(
        *("--uri", uri, "-n", name, "--ttl", FAR, "--take-over", "-w", "30"),
        *("--", "sh", "-c", f"echo taker >> {log}"),
    )
    assert taker.returncode == 0, taker.stderr
    assert finish(holder) == 79
    assert finish(waiter) == 79
    assert lines(log) == ["begin", "term", "taker"]
    assert keys_of(etcd, name) == {}


def test_a_shared_taker_behind_a_queued_writer_gets_in_beside_the_readers(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """Reader holds, writer waits, a --shared taker asks: the writer gives way, the taker reads.

    The writer was queued before the taker, and a reader's request stops writers; the
    taker joins the reader that holds. Nothing the writer watches moves (the reader holds
    on): it looks at its next keep-alive, every ttl/3 (2 s here), well within the taker's
    30 s wait, as a Redis waiter asks again every ttl/2 (docs/design.md A13).
    """
    uri = uri_of(etcd)
    reader = Held(tmp_path, "--uri", uri, "-n", name, "--shared", "--ttl", FAR)
    ran = tmp_path / "ran"
    writer = start("--uri", uri, "-n", name, "--ttl", "6", "-w", "60", "--",
                   "sh", "-c", f"touch {ran}")  # fmt: skip
    wait_for(lambda: len(keys_of(etcd, name)) == 3, what="the writer's keys")
    joined = tmp_path / "joined"
    taker = lockrun(
        *("--uri", uri, "-n", name, "--ttl", FAR, "--shared", "--take-over", "-w", "30"),
        *("--", "sh", "-c", f"touch {joined}"),
    )
    # The writer's outcome before the reader ends: 79 if it gave way, else still waiting.
    gave_way = writer.poll() is not None
    assert reader.finish() == 0
    writer_status = finish(writer, timeout=60)
    assert taker.returncode == 0, taker.stderr
    assert joined.exists()
    assert gave_way
    assert writer_status == 79
    assert not ran.exists()


# -- readers and writers -----------------------------------------------------------------------

STAMPED = (
    'echo "{mode} $(date +%s%N)" >> {log}; sleep 0.05; echo "{mode}-end $(date +%s%N)" >> {log}'
)


def test_readers_share_writers_run_alone_and_no_reader_passes_a_queued_writer(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """Interval oracle from the commands' own clock: a writer's run meets no other run."""
    uri = uri_of(etcd)
    log = tmp_path / "log"
    # Two readers that can end only together: they must hold at once.
    one, two = tmp_path / "r1", tmp_path / "r2"
    wait = "while [ ! -e {} ]; do sleep 0.02; done"
    both = [
        start(
            *("--uri", uri, "-n", name, "--shared", "-w", "30", "--"),
            *("sh", "-c", f"touch {mine}; " + wait.format(other)),
        )
        for mine, other in ((one, two), (two, one))
    ]
    assert [finish(each) for each in both] == [0, 0]
    # A reader holds; a writer queues; a later reader waits for the writer.
    first = Held(tmp_path, "--uri", uri, "-n", name, "--shared")
    writer = start("--uri", uri, "-n", name, "-w", "30", "--", "sh", "-c",
                   STAMPED.format(mode="writer", log=log))  # fmt: skip
    wait_for(lambda: len(keys_of(etcd, name)) == 3, what="the writer's keys")
    late = lockrun("--uri", uri, "-n", name, "--shared", "-w", "0", "--", "true")
    assert late.returncode == 75, late.stderr
    later = start("--uri", uri, "-n", name, "--shared", "-w", "30", "--", "sh", "-c",
                  STAMPED.format(mode="reader", log=log))  # fmt: skip
    wait_for(lambda: len(keys_of(etcd, name)) == 4, what="the later reader's key")
    assert first.finish() == 0
    assert finish(writer) == 0
    assert finish(later) == 0
    assert [line.split()[0] for line in lines_of(log)] == [
        "writer",
        "writer-end",
        "reader",
        "reader-end",
    ]
    # Mixed loops: 2 writers and 3 readers, 3 runs each.
    mixed = tmp_path / "mixed"
    loops = []
    for worker in range(5):
        mode = "writer" if worker < 2 else "reader"
        shared = [] if mode == "writer" else ["--shared"]
        body = STAMPED.format(mode=mode, log=mixed)
        argv = shlex.join([*LOCKRUN, "--uri", uri, "-n", name, *shared, "-w", "60", "--"])
        loop = f"for i in 1 2 3; do {argv} sh -c {shlex.quote(body)} || exit 1; done"
        loops.append(subprocess.Popen(["sh", "-c", loop], env=unmeasured()))
    assert [each.wait(120) for each in loops] == [0] * 5
    runs = intervals(mixed)
    assert len(runs) == 15
    writers = [(b, e) for mode, b, e in runs if mode == "writer"]
    for begin, end in writers:
        met = [(m, b, e) for m, b, e in runs if (b, e) != (begin, end) and b < end and begin < e]
        assert met == [], "a writer ran beside another holder"
    assert keys_of(etcd, name) == {}


def lines_of(log: Path) -> list[str]:
    """Return *log*'s lines."""
    return log.read_text().splitlines()


def intervals(log: Path) -> list[tuple[str, int, int]]:
    """Pair each run's start and end lines of *log*: (mode, start, end), in ns."""
    opened: dict[str, list[int]] = {"writer": [], "reader": []}
    runs = []
    for line in lines_of(log):
        what, stamp = line.split()
        if what.endswith("-end"):
            mode = what.removesuffix("-end")
            runs.append((mode, opened[mode].pop(0), int(stamp)))
        else:
            opened[what].append(int(stamp))
    return runs


# -- keys another client wrote -----------------------------------------------------------------

HOSTILE_REQUESTS: Final = {
    "garbage": b"not json at all",
    "empty": b"",
    "an object": b"{}",
    "wrong types": b'{"user": 1, "host": [], "pid": "x"}',
    "escapes": json.dumps({"user": "m\x1b[31m", "host": "evil\nsecond line", "pid": 1}).encode(),
    "huge": b"x" * (1100 << 10),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_REQUESTS))
def test_a_request_another_client_wrote_stops_the_holder_in_one_line(
    etcd: EtcdServer, name: str, tmp_path: Path, kind: str
) -> None:
    """A t/ key written after the holder's queue key is a request: 79, one line, no 70."""
    uri = uri_of(etcd)
    put(etcd, name, "t/" + "0" * 16, b"older")  # before the holder's key: no request for it
    script, ready, log = yielding(tmp_path, "holder")
    holder = start("--uri", uri, "-n", name, "--ttl", FAR, "--", "sh", "-c", script)
    wait_for(ready.exists, what="the holder's command")
    put(etcd, name, "t/" + "X" * 16, HOSTILE_REQUESTS[kind])
    status, err = ended(holder)
    assert status == 79
    said = one_line(err)
    assert "taken over by " in said
    assert "\x1b" not in said
    if kind != "escapes":
        assert "whose record is unreadable" in said, said
    assert lines(log) == ["begin", "term"]
    assert set(keys_of(etcd, name)) == {"t/" + "0" * 16, "t/" + "X" * 16}
    statuses_read(uri, name)
    later = lockrun("--uri", uri, "-n", name, "--", "true")  # the request is older than it
    assert (later.returncode, later.stderr) == (0, "")
    wipe(etcd, name)


HOSTILE_KEYS: Final = {
    "a writer's marker of nobody": ("w/" + "X" * 16, b"junk"),
    "a queue key with no lease name": ("q/nothex", b"junk"),
    "a queue key of garbage": ("q/" + "0" * 15 + "1", b"\xff\xfe{"),
    "a queue key of another N": (
        "q/" + "0" * 15 + "2",
        json.dumps(
            {
                "token": "0" * 15 + "2",
                "namespace": "default",
                "name": "x",
                "slots": 3,
                "holder": {"user": "u", "host": "h", "pid": 1},
            }
        ).encode(),
    ),
    "a huge queue key": ("q/" + "0" * 15 + "3", b"{" * (1100 << 10)),
    "a reader's request of nobody": ("tr/" + "X" * 16, b"[]"),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_KEYS))
def test_keys_another_client_wrote_never_make_a_traceback(
    etcd: EtcdServer, name: str, kind: str
) -> None:
    """Runs, readers, takers and status meet junk keys: a status and one line, never 70."""
    uri = uri_of(etcd)
    key, value = HOSTILE_KEYS[kind]
    put(etcd, name, key, value)
    for mode in ((), ("--shared",), ("--take-over",)):
        ran = lockrun("--uri", uri, "-n", name, "-w", "1", *mode, "--", "true")
        assert ran.returncode in {0, 75, 78}, (mode, ran.returncode, ran.stderr)
        assert "Traceback" not in ran.stderr
        if ran.returncode:
            one_line(ran.stderr)
    statuses_read(uri, name)
    assert set(keys_of(etcd, name)) == {key}  # ours all went
    wipe(etcd, name)


# -- --no-keeper -------------------------------------------------------------------------------


def test_a_lease_with_no_process_is_the_tokens_and_any_process_renews_or_releases_it(
    etcd: EtcdServer, name: str
) -> None:
    """The acquire's lease (--no-keeper): of --ttl, named by the token; its record: detached."""
    uri = uri_of(etcd)
    before = leases(etcd)
    taken = lockrun("acquire", "--uri", uri, "--no-keeper", "--ttl", "30", name)
    assert (taken.returncode, taken.stderr) == (0, ""), taken.stderr
    token = taken.stdout.strip()
    lease = lease_for(parse_token(token).lease_id)
    keys = keys_of(etcd, name)
    assert set(keys) == {f"q/{lease:016x}", f"w/{lease:016x}"}
    assert all(kv["lease"] == lease for kv in keys.values())
    record = json.loads(keys[f"q/{lease:016x}"]["value"])
    assert record["detached"] is True
    assert "detached" not in record["holder"]
    assert leases(etcd) - before == {lease}
    left, granted = time_to_live(etcd, lease)
    assert granted == 30
    assert 25 < left <= 30
    wait_for(lambda: time_to_live(etcd, lease)[0] < left, timeout=10, what="a second to pass")
    renewed = lockrun("renew", "--uri", uri, token)
    assert (renewed.returncode, renewed.stderr) == (0, "")
    assert time_to_live(etcd, lease)[0] >= left  # restarted on the server's clock
    released = lockrun("release", "--uri", uri, token)
    assert (released.returncode, released.stderr) == (0, "")
    assert keys_of(etcd, name) == {}
    assert leases(etcd) - before == set()
    again = lockrun("renew", "--uri", uri, token)
    assert again.returncode == 76
    one_line(again.stderr)


def test_a_lease_with_no_process_has_its_window_from_the_grant(etcd: EtcdServer, name: str) -> None:
    """--hold-at-least 20: the window's lease exists from the acquire; release moves the key."""
    uri = uri_of(etcd)
    before = leases(etcd)
    taken = lockrun(
        "acquire", "--uri", uri, "--no-keeper", "--ttl", "30", "--hold-at-least", "20", name
    )
    assert taken.returncode == 0, taken.stderr
    token = taken.stdout.strip()
    lease = lease_for(parse_token(token).lease_id)
    window = window_for(lease)
    assert leases(etcd) - before == {lease, window}
    left, granted = time_to_live(etcd, window)
    assert granted == 20
    assert 15 < left <= 20
    created = keys_of(etcd, name)[f"q/{lease:016x}"]["created"]
    released = lockrun("release", "--uri", uri, token)
    assert released.returncode == 0, released.stderr
    keys = {key: (kv["created"], kv["lease"]) for key, kv in keys_of(etcd, name).items()}
    assert keys == {f"q/{lease:016x}": (created, window), f"w/{lease:016x}": (created, window)}
    assert leases(etcd) - before == {window}
    busy = lockrun("--uri", uri, "-n", name, "-w", "0", "--", "true")
    assert busy.returncode == 75
    assert "(--hold-at-least)" in one_line(busy.stderr)
    gateway(etcd, "/v3/lease/revoke", {"ID": str(window)})
    assert keys_of(etcd, name) == {}


def test_a_lease_with_no_process_released_for_a_taker_leaves_no_window(
    etcd: EtcdServer, name: str, tmp_path: Path
) -> None:
    """A taker waits on a --no-keeper lease with a window: the release lets it in, no window."""
    uri = uri_of(etcd)
    before = leases(etcd)
    taken = lockrun(
        "acquire", "--uri", uri, "--no-keeper", "--ttl", "30", "--hold-at-least", "20", name
    )
    assert taken.returncode == 0, taken.stderr
    token = taken.stdout.strip()
    ran = tmp_path / "ran"
    taker = start("--uri", uri, "-n", name, "--take-over", "-w", "60", "--",
                  "sh", "-c", f"touch {ran}")  # fmt: skip
    wait_for(lambda: any(key.startswith("t/") for key in keys_of(etcd, name)), what="the taker")
    assert not ran.exists()
    renewed = lockrun("renew", "--uri", uri, token)
    assert renewed.returncode == 79
    assert "released it" in one_line(renewed.stderr)
    assert finish(taker) == 0
    assert ran.exists()
    assert keys_of(etcd, name) == {}
    assert leases(etcd) - before == set()  # the window's lease went with it
    assert lockrun("release", "--uri", uri, token).returncode == 76


def test_a_window_that_ended_before_the_release_leaves_nothing(etcd: EtcdServer, name: str) -> None:
    """--no-keeper with a 2 s window released after it ended: the key goes, no window."""
    uri = uri_of(etcd)
    taken = lockrun(
        "acquire", "--uri", uri, "--no-keeper", "--ttl", "30", "--hold-at-least", "2", name
    )
    assert taken.returncode == 0, taken.stderr
    token = taken.stdout.strip()
    window = window_for(lease_for(parse_token(token).lease_id))
    wait_for(lambda: window not in leases(etcd), timeout=15, what="the window's end")
    released = lockrun("release", "--uri", uri, token)
    assert released.returncode == 0, released.stderr
    assert keys_of(etcd, name) == {}
