"""The fleet modes on every backend: --hold-at-least, --shared, --take-over (docs/semantics.md).

Each scenario runs once per backend of the registry (the `uri` fixture). The oracles are the
commands' own records (the times they started and ended, who ran), never the lock's word.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import pytest

from lockrun import ExitCode, Lock, LockBusy, TakenOver, UsageError
from lockrun.backends import parse_uri
from lockrun.uri import MODES
from tests.support.cli import (
    LOCKRUN,
    TEST_TTL,
    Held,
    finish,
    lock_state,
    lockrun,
    one_line,
    queue_length,
    refused_in_process,
    start,
    unmeasured,
    wait_for,
)
from tests.support.harness import on_valkey_too

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from lockrun.uri import Mode

HOUR = 3600.0  # a window no test outlives: whatever ends sooner is not the window's doing
# How long a holder may take to notice a take-over: at once where a bell rings (local), at
# its next renewal (every ttl/3) on a server; plus 3 s for a loaded machine. Only a wait
# before checking that nothing happened (a loaded machine makes it weaker, never red).
NOTICE = float(TEST_TTL) / 3 + 3.0


def stamp(log: Path, what: str) -> str:
    """Return a shell snippet that appends "WHAT <Unix time>" to *log*."""
    return f"echo {what} $(date +%s.%N) >> {log}"


def read_log(log: Path) -> list[tuple[str, float]]:
    """Return the (what, when) lines `stamp` wrote, in order."""
    if not log.exists():
        return []
    return [
        (what, float(when))
        for what, when in (line.split() for line in log.read_text().splitlines())
    ]


def offers(uri: str, mode: Mode) -> bool:
    """Whether *uri*'s backend offers *mode* (`Scheme.modes`); the others refuse it (64)."""
    return mode in parse_uri(uri).kind.modes


def needs(uri: str, mode: Mode) -> None:
    """Skip the test unless *uri*'s backend offers *mode*."""
    if not offers(uri, mode):
        pytest.skip(f"{parse_uri(uri).scheme}: declines --{mode} (Scheme.modes)")


# --hold-at-least ------------------------------------------------------------------------------


def test_hold_keeps_the_lock_taken_after_a_short_command(uri: str, name: str) -> None:
    """A run with --hold-at-least returns at once, and the lock stays busy until its window ends."""
    needs(uri, "hold-at-least")
    # An hour's window: lockrun returning at all (`lockrun` gives up after 60 s) proves it did
    # not stay for the window, however loaded the machine.
    asked = time.time()
    first = lockrun("--uri", uri, "-n", name, "--hold-at-least", f"{HOUR:g}", "--", "true")
    assert first.returncode == 0, first.stderr
    busy = lockrun("--uri", uri, "-n", name, "--", "true")
    assert busy.returncode == ExitCode.BUSY, busy.stderr
    line = one_line(busy.stderr)
    assert line.startswith(f"lockrun: {name} busy, held by ")
    assert "--hold-at-least" in line
    (holder,) = lock_state(uri, name)["holders"]
    # The window counts from the grant, which came between `asked` and now.
    assert asked + HOUR - 0.05 <= holder["until"] <= time.time() + HOUR


def test_a_window_frees_the_lock_as_it_ends(uri: str, name: str) -> None:
    """Once a --hold-at-least window has ended, the lock is free again and keeps no holder."""
    needs(uri, "hold-at-least")
    assert lockrun("--uri", uri, "-n", name, "--hold-at-least", "2", "--", "true").returncode == 0
    wait_for(
        lambda: lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0,
        timeout=60,  # a hang guard: each poll is a Python start-up on a loaded machine
        what="the window to end",
    )
    assert lock_state(uri, name)["holders"] == []


def test_a_waiter_starts_only_once_the_window_has_ended(
    uri: str, name: str, tmp_path: Path, record: Callable[..., None]
) -> None:
    """A waiter behind a window runs as it ends: not before, and without polling for long."""
    needs(uri, "hold-at-least")
    log = tmp_path / "log"
    hold = 2.0
    # The window counts from the grant, which comes after this and before the first stamp:
    # a command slow to start (at load 17) stamps up to a few tenths after the grant.
    asked = time.time()
    first = lockrun(
        *("--uri", uri, "-n", name, "--hold-at-least", f"{hold}"),
        *("--", "sh", "-c", stamp(log, "first")),
    )
    assert first.returncode == 0, first.stderr
    second = lockrun(
        *("--uri", uri, "-n", name, "--wait", "30"), *("--", "sh", "-c", stamp(log, "second"))
    )
    assert second.returncode == 0, second.stderr
    (_, began), (_, then) = read_log(log)
    assert then - asked >= hold - 0.05  # the log's clock is the host's: one clock
    # How late after the window it ran is a Python start-up plus a nap of the window's wait
    # (file.py's _WINDOW_NAP): for the record; a waiter that missed the end would be busy (75).
    record("the waiter behind a window", late=then - began - hold)


def test_a_window_longer_than_the_wait_is_busy(uri: str, name: str) -> None:
    """--wait shorter than what remains of a window exits 75, not after the window."""
    needs(uri, "hold-at-least")
    window = ("--hold-at-least", f"{HOUR:g}")
    assert lockrun("--uri", uri, "-n", name, *window, "--", "true").returncode == 0
    # A waiter that waited the window out would run (0) an hour on: 75 is the wait's end.
    result = lockrun("--uri", uri, "-n", name, "--wait", "1", "--", "true")
    assert result.returncode == ExitCode.BUSY, result.stderr


def test_a_command_longer_than_its_hold_frees_the_lock_at_once(uri: str, name: str) -> None:
    """A hold shorter than the run adds nothing: the lock is free when the command ends."""
    needs(uri, "hold-at-least")
    result = lockrun("--uri", uri, "-n", name, "--hold-at-least", "0.2", "--", "sleep", "0.5")
    assert result.returncode == 0, result.stderr
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0


def test_hold_runs_a_fleets_short_job_once_per_tick(uri: str, name: str, tmp_path: Path) -> None:
    """Five 'hosts' whose cron fires up to a second apart run a 0.1 s job once, not five times."""
    needs(uri, "hold-at-least")
    log = tmp_path / "ran"
    job = (
        shlex.join([*LOCKRUN, "--uri", uri, "-n", name, "--hold-at-least", "30", "-q", "--"])
        + f" sh -c 'echo $$ >> {log}; sleep 0.1'"
    )
    hosts = []
    for _ in range(5):
        hosts.append(subprocess.Popen(["sh", "-c", job], env=unmeasured()))
        time.sleep(0.25)
    statuses = sorted(host.wait(60) for host in hosts)
    assert statuses == [0, 75, 75, 75, 75]
    assert len(log.read_text().split()) == 1


def test_a_failed_or_missing_command_holds_as_a_run_does(uri: str, name: str) -> None:
    """A command that fails still holds its window; one that cannot start holds nothing."""
    needs(uri, "hold-at-least")
    failed = lockrun("--uri", uri, "-n", name, "--hold-at-least", "30", "--", "false")
    assert failed.returncode == 1
    assert lockrun("--uri", uri, "-n", f"{name}", "--", "true").returncode == ExitCode.BUSY
    other = f"{name}-missing"
    missing = lockrun("--uri", uri, "-n", other, "--hold-at-least", "30", "--", "/nonexistent")
    assert missing.returncode == ExitCode.NOT_FOUND
    assert lockrun("--uri", uri, "-n", other, "--", "true").returncode == 0


def test_api_hold_at_least_keeps_the_lock_after_the_block(uri: str, name: str) -> None:
    """`Lock(hold_at_least=…)` leaves the lock taken after the block, for others and itself."""
    needs(uri, "hold-at-least")
    with Lock(name, uri=uri, hold_at_least=30):
        pass
    with pytest.raises(LockBusy, match="--hold-at-least"):
        Lock(name, uri=uri).acquire()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (("--hold-at-least", "5", "--slots", "2"), "--hold-at-least applies to a lock of one slot"),
        (("--shared", "--slots", "3"), "--shared applies to a lock of one slot"),
        (("--shared", "--hold-at-least", "5"), "do not combine"),
        (("--take-over",), "--take-over waits for the holders to stop"),
        (("--take-over", "-w", "5", "--slots", "2"), "--take-over applies to a lock of one slot"),
        (("--hold-at-least", "-1"), "--hold-at-least"),
        (("--hold-at-least", "nan"), "--hold-at-least"),
    ],
)
def test_modes_that_do_not_combine_are_usage_errors(
    uri: str, name: str, options: tuple[str, ...], said: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Each refused combination exits 64 with one line, before anything is taken.

    In this process (what `lockrun` does past its start-up): the options only feed run's
    checks. The test below refuses modes from a process.
    """
    for mode in sorted(MODES - parse_uri(uri).kind.modes):
        if f"--{mode}" in options:
            pytest.skip(f"--{mode} is refused by itself here (the test below)")
    result = refused_in_process(capfd, "--uri", uri, "-n", name, *options, "--", "true")
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert said in one_line(result.stderr)
    assert lock_state(uri, name)["holders"] == []


def test_a_mode_the_backend_declines_is_a_usage_error(uri: str, name: str) -> None:
    """Each mode its scheme does not offer: 64 and one line (CLI), UsageError (API), no holder."""
    declined = sorted(MODES - parse_uri(uri).kind.modes)
    if not declined:
        pytest.skip("this backend offers every mode")
    for mode in declined:
        value = {"hold-at-least": ("1h",), "take-over": ("--wait", "5")}.get(mode, ())
        result = lockrun("--uri", uri, "-n", name, f"--{mode}", *value, "--", "true")
        assert result.returncode == ExitCode.USAGE, result.stderr
        assert f"--{mode} is not supported by {parse_uri(uri).scheme}:" in one_line(result.stderr)
        keyword = {mode.replace("-", "_"): 3600 if mode == "hold-at-least" else True}
        with pytest.raises(UsageError, match="is not supported by"):
            Lock(name, uri=uri, wait=5, **keyword)  # type: ignore[arg-type]
    assert lock_state(uri, name)["holders"] == []


# --shared -------------------------------------------------------------------------------------


def test_shared_holders_run_together_and_exclude_a_writer(
    uri: str, name: str, held: Callable[..., Held]
) -> None:
    """Two --shared holders run at once; an exclusive try is busy; status marks them shared."""
    needs(uri, "shared")
    readers = [held("--uri", uri, "-n", name, "--shared") for _ in range(2)]
    writer = lockrun("--uri", uri, "-n", name, "--", "true")
    assert writer.returncode == ExitCode.BUSY, writer.stderr
    assert "(shared)" in one_line(writer.stderr)
    holders = lock_state(uri, name)["holders"]
    assert sorted(holder["pid"] for holder in holders) == sorted(r.process.pid for r in readers)
    assert all(holder["shared"] for holder in holders)
    assert [reader.finish() for reader in readers] == [0, 0]
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0


def test_a_writer_excludes_readers(uri: str, name: str, held: Callable[..., Held]) -> None:
    """An exclusive holder makes a --shared try busy."""
    needs(uri, "shared")
    writer = held("--uri", uri, "-n", name)
    reader = lockrun("--uri", uri, "-n", name, "--shared", "--", "true")
    assert reader.returncode == ExitCode.BUSY, reader.stderr
    assert writer.finish() == 0
    assert lockrun("--uri", uri, "-n", name, "--shared", "--", "true").returncode == 0


def test_a_queued_writer_is_not_overtaken_by_later_readers(
    uri: str, name: str, held: Callable[..., Held], tmp_path: Path
) -> None:
    """Readers that come after a queued writer wait behind it, in arrival order (FIFO)."""
    needs(uri, "shared")
    log = tmp_path / "order"
    reader = held("--uri", uri, "-n", name, "--shared")
    writer = start(
        *("--uri", uri, "-n", name, "--wait", "forever"), *("--", "sh", "-c", stamp(log, "writer"))
    )
    wait_for(lambda: queue_length(uri, name) == 1, what="the writer to queue")
    late = lockrun("--uri", uri, "-n", name, "--shared", "--", "true")
    assert late.returncode == ExitCode.BUSY, "a reader overtook the queued writer"
    later = start(
        *("--uri", uri, "-n", name, "--shared", "--wait", "forever"),
        *("--", "sh", "-c", stamp(log, "reader")),
    )
    wait_for(lambda: queue_length(uri, name) == 2, what="the second reader to queue")
    assert reader.finish() == 0
    assert finish(writer) == 0
    assert finish(later) == 0
    assert [what for what, _ in read_log(log)] == ["writer", "reader"]


MIXED = """
import os, pathlib, sys, time
log, active, mode = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
mine = active / f"{mode}-{os.getpid()}"
start = time.monotonic_ns()
mine.touch()
time.sleep(0.03)
mine.unlink()
with open(log, "a") as out:
    out.write(f"{mode} {start} {time.monotonic_ns()}\\n")
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readers_and_writers_under_the_interval_oracle(uri: str, name: str, tmp_path: Path) -> None:
    """Mixed readers and writers: a writer's interval never meets another's, nor a reader's.

    That readers share is shown without a clock by
    test_shared_holders_run_together_and_exclude_a_writer: here their 30 ms holds need not
    meet when each start-up takes longer, at load 30.
    """
    needs(uri, "shared")
    log, active = tmp_path / "intervals", tmp_path / "active"
    active.mkdir()
    script = tmp_path / "mixed.py"
    script.write_text(MIXED)
    loops = []
    for worker in range(6):
        mode = "writer" if worker % 3 == 0 else "reader"
        shared = ["--shared"] if mode == "reader" else []
        argv = shlex.join([*LOCKRUN, "--uri", uri, "-n", name, *shared, "-w", "forever", "--"])
        command = shlex.join([sys.executable, str(script), str(log), str(active), mode])
        loop = f"for i in $(seq 6); do {argv} {command} || exit 1; done"
        loops.append(subprocess.Popen(["sh", "-c", loop], env=unmeasured()))
    assert [loop.wait(300) for loop in loops] == [0] * len(loops)
    runs = [line.split() for line in log.read_text().splitlines()]
    assert len(runs) == 36
    writers = [(int(begin), int(end)) for mode, begin, end in runs if mode == "writer"]
    readers = [(int(begin), int(end)) for mode, begin, end in runs if mode == "reader"]
    for begin, end in writers:
        overlapping = [
            other
            for other in writers + readers
            if other != (begin, end) and other[0] < end and begin < other[1]
        ]
        assert overlapping == [], "a writer ran beside another holder"


def test_api_shared_locks_share_across_threads(uri: str, name: str) -> None:
    """`Lock(shared=True)` in two threads holds at once; an exclusive try is busy meanwhile."""
    needs(uri, "shared")
    inside = threading.Barrier(3, timeout=30)

    def read() -> None:
        with Lock(name, uri=uri, shared=True):
            inside.wait()  # both readers in
            inside.wait()  # the writer has tried

    threads = [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    inside.wait()
    with pytest.raises(LockBusy):
        Lock(name, uri=uri).acquire()
    inside.wait()
    for thread in threads:
        thread.join(30)
    with Lock(name, uri=uri):
        pass


# --take-over ----------------------------------------------------------------------------------


# The shell reports its TERMed `sleep` ("Terminated") on stderr: keep that out of lockrun's,
# which must hold exactly one line (as tests/support/harness.py's Victim does).
TRAPPED = "exec 2>/dev/null; trap '{end}; exit 0' TERM; {begin}; while :; do sleep 0.05; done"


@on_valkey_too
def test_take_over_stops_the_holder_and_runs_after_it(
    uri: str, name: str, tmp_path: Path, record: Callable[..., None]
) -> None:
    """The holder's command gets TERM, its lockrun exits 79; the taker runs only after it ended."""
    needs(uri, "take-over")
    log = tmp_path / "log"
    holder = start(
        *("--uri", uri, "-n", name, "--"),
        *("sh", "-c", TRAPPED.format(begin=stamp(log, "begin"), end=stamp(log, "end"))),
    )
    wait_for(lambda: read_log(log), what="the holder's command")
    began = time.monotonic()
    taker = lockrun(
        *("--uri", uri, "-n", name, "--take-over", "--wait", "60"),
        *("--", "sh", "-c", stamp(log, "taker")),
    )
    took = time.monotonic() - began
    assert taker.returncode == 0, taker.stderr
    assert finish(holder) == ExitCode.TAKEN_OVER
    _, err = holder.communicate()
    line = one_line(err)
    assert line.startswith(f"lockrun: {name}: taken over by "), line
    assert [what for what, _ in read_log(log)] == ["begin", "end", "taker"]
    (_, ended), (_, took_over) = read_log(log)[1:]
    assert ended <= took_over
    # A holder that never heard would keep renewing past the taker's --wait: the taker's 0 is
    # the proof. How soon it heard (a bell, or the next renewal) is for the record.
    record("the take-over", took=took)


def test_take_over_kills_a_holder_that_ignores_term(uri: str, name: str, tmp_path: Path) -> None:
    """A command that ignores TERM is killed after --kill-after; the taker never overlaps it."""
    needs(uri, "take-over")
    log = tmp_path / "log"
    stubborn = f"trap '' TERM; {stamp(log, 'begin')}; while :; do sleep 0.05; done"
    holder = start("--uri", uri, "-n", name, "--kill-after", "1", "--", "sh", "-c", stubborn)
    wait_for(lambda: read_log(log), what="the holder's command")
    taker = lockrun(
        *("--uri", uri, "-n", name, "--take-over", "--wait", "60"),
        *("--", "sh", "-c", stamp(log, "taker")),
    )
    assert taker.returncode == 0, taker.stderr
    assert finish(holder) == ExitCode.TAKEN_OVER


def test_take_over_of_a_free_lock_just_runs(uri: str, name: str) -> None:
    """Nobody to stop: the taker runs at once."""
    needs(uri, "take-over")
    result = lockrun("--uri", uri, "-n", name, "--take-over", "--wait", "5", "--", "true")
    assert result.returncode == 0, result.stderr


def test_a_waiter_ahead_of_a_taker_gives_way(uri: str, name: str, tmp_path: Path) -> None:
    """A waiter queued before the taker exits 79 without running its command."""
    needs(uri, "take-over")
    log = tmp_path / "log"
    holder = start(
        *("--uri", uri, "-n", name, "--"),
        *("sh", "-c", TRAPPED.format(begin=stamp(log, "begin"), end=stamp(log, "end"))),
    )
    wait_for(lambda: read_log(log), what="the holder's command")
    ahead = start(
        *("--uri", uri, "-n", name, "--wait", "forever"), *("--", "sh", "-c", stamp(log, "ahead"))
    )
    wait_for(lambda: queue_length(uri, name) == 1, what="the waiter to queue")
    taker = lockrun(
        *("--uri", uri, "-n", name, "--take-over", "--wait", "60"),
        *("--", "sh", "-c", stamp(log, "taker")),
    )
    assert taker.returncode == 0, taker.stderr
    assert finish(holder) == ExitCode.TAKEN_OVER
    assert finish(ahead) == ExitCode.TAKEN_OVER
    assert [what for what, _ in read_log(log)] == ["begin", "end", "taker"]


def test_a_taker_that_dies_leaves_no_stop_behind(
    uri: str, name: str, held: Callable[..., Held]
) -> None:
    """SIGKILL of a waiting taker: the holder keeps running, and later holders are not stopped."""
    needs(uri, "take-over")
    holder = held("--uri", uri, "-n", name, "--kill-after", "1")
    # A taker that cannot wait long enough for the holder gives up (75) and leaves nothing.
    taker = start("--uri", uri, "-n", name, "--take-over", "--wait", "forever", "--", "true")
    # A bell may stop the holder within milliseconds, so the taker's time in line is short.
    wait_for(
        lambda: queue_length(uri, name) == 1 or holder.process.poll() is not None,
        what="the taker to queue",
    )
    taker.kill()
    finish(taker)  # and close its pipes
    # A holder that heard the taker before it died stops (79), one that did not ends its
    # command as asked (0): when a loaded machine lets it hear is no business of this test.
    assert holder.finish() in {0, ExitCode.TAKEN_OVER}
    # The taker may have got in and been killed holding: its guardian then frees the lock,
    # which may take a while at load 30. Wait for that (a hang guard, not a budget).
    later = Held(holder.ready.parent, "--uri", uri, "-n", name, "--wait", "60")
    time.sleep(NOTICE)
    assert later.process.poll() is None, "a dead taker's request stopped a later holder"
    assert later.finish() == 0


def test_api_holder_sees_a_take_over_in_check(uri: str, name: str) -> None:
    """A Python holder's `lease.check()` raises `TakenOver`; the taker gets in after release."""
    needs(uri, "take-over")
    with Lock(name, uri=uri, ttl=float(TEST_TTL)) as lease:  # renewed as often as the CLI's
        taker = start("--uri", uri, "-n", name, "--take-over", "--wait", "60", "--", "true")
        deadline = time.monotonic() + 60  # the taker's --wait: a hang guard, not a budget
        while True:
            try:
                lease.check()
            except TakenOver:
                break
            assert time.monotonic() < deadline, "check() never saw the take-over"
            time.sleep(0.05)
    assert finish(taker) == 0


# -- status --------------------------------------------------------------------------------------


def test_status_shows_readers_as_sharing_and_a_window_as_held_until(
    uri: str, name: str, held: Callable[..., Held]
) -> None:
    """`lockrun status` says `sharing` for each reader, `held until HH:MM:SS` for a window."""
    needs(uri, "shared")
    readers = [held("--uri", uri, "-n", name, "--shared") for _ in range(2)]
    table = lockrun("status", "--uri", uri, name)
    assert table.returncode == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith(name)]
    assert len(rows) == 2
    assert all(" sharing " in row for row in rows), table.stdout
    assert [reader.finish() for reader in readers] == [0, 0]
    if not offers(uri, "hold-at-least"):
        return
    other = f"{name}-held"
    assert lockrun("--uri", uri, "-n", other, "--hold-at-least", "60", "--", "true").returncode == 0
    table = lockrun("status", "--uri", uri, other)
    (row,) = [line for line in table.stdout.splitlines() if line.startswith(other)]
    assert re.search(r" held until \d\d:\d\d:\d\d ", row), table.stdout


def test_a_shared_taker_joins_readers_and_stops_a_writer(
    uri: str, name: str, held: Callable[..., Held]
) -> None:
    """--shared --take-over shares with the readers it finds; a writer it stops (79)."""
    needs(uri, "take-over")
    reader = held("--uri", uri, "-n", name, "--shared")
    joined = lockrun(
        *("--uri", uri, "-n", name, "--shared", "--take-over", "--wait", "30", "--", "true")
    )
    assert joined.returncode == 0, joined.stderr
    assert reader.process.poll() is None, "a reader was stopped by a shared taker"
    assert reader.finish() == 0
    writer = held("--uri", uri, "-n", f"{name}-w", "--kill-after", "1")
    taker = lockrun(
        *("--uri", uri, "-n", f"{name}-w", "--shared", "--take-over", "--wait", "60"),
        *("--", "true"),
    )
    assert taker.returncode == 0, taker.stderr
    assert writer.process.wait(30) == ExitCode.TAKEN_OVER
