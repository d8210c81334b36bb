"""Faults in the queue, once for every backend they apply to: dead, frozen and interrupted waiters.

Each test queues lockrun waiters on a real server (or a local backend) through its `Harness`
(tests/support/harness.py) and then kills, freezes or interrupts one of them, or disagrees on
`--slots`. The evidence is the commands' own logs (Unix-time stamps, /proc), `lockrun status`,
and the server's view through the harness: which session holds each slot (and the gate, the
queue of a semaphore whose lock is a session), and on what each session of a waiter waits.
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from tests.support.cli import (
    Held,
    finish,
    holder_pids,
    interval_log,
    lockrun,
    one_line,
    wait_for,
    waiter_pids,
)
from tests.support.harness import (
    CALM,
    HOLD,
    LEASE,
    SESSION_BACKENDS,
    SLACK,
    TTL,
    Harness,
    check_resumed_head,
    command,
    most_at_once,
    read_run,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

GRACE: Final = 2.0  # how soon a waiter's sessions are gone after it exits
SESSIONS_ONLY: Final = pytest.mark.parametrize(
    "shared_server_harness", SESSION_BACKENDS, indirect=True
)


def test_a_sigkilled_head_waiter_is_passed_over_at_once(
    shared_server_harness: Harness,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """SIGKILL of the head waiter: the release passes it over; the next gets in at once.

    The release hands the slot to the dead head, sees that it is gone (its session closed;
    on Redis, its connection gone from CLIENT LIST) and hands it on, far sooner than the
    ttl (an hour here) after which the grant would lapse: the second getting in at all
    proves the pass-over. `status` then lists only the second.
    """
    harness = shared_server_harness
    if not harness.passes_over_the_dead:
        pytest.skip(f"{harness.backend}: a dead waiter's place lapses with its lease (A13)")
    options = ("--uri", harness.uri, "-n", name, "--ttl", "3600")
    holder = held(*options)
    head, second, _, next_log, next_go = harness.queue_two(spawn, tmp_path, *options)
    try:
        head.send_signal(signal.SIGKILL)
        head.wait(10)
        killed_at = time.time()
        assert holder.finish() == 0
        wait_for(next_log.exists, timeout=60, what="the second waiter's command")  # hang guard
        waited = read_run(next_log).begun - killed_at
        print(f"second waiter got in {waited:.2f}s after the head waiter's SIGKILL")
        assert waited > 0
        assert holder_pids(harness.uri, name) == [second.pid]
        assert waiter_pids(harness.uri, name) == []
    finally:
        next_go.touch()
    assert finish(second) == 0


def test_a_paused_head_waiter_is_passed_over_and_never_runs_without_the_lock(
    shared_server_harness: Harness,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """A frozen head waiter granted the lock loses it a ttl later; never runs meanwhile.

    The release grants the frozen head, which cannot take it up: its session idles until the
    server ends it (wait_timeout, idle_session_timeout), or its grant lapses with its lease.
    The second waiter gets in about a ttl after the grant. Resumed while the second runs,
    the first must not run its command until the second's ended: it gives up (69, or 76 for
    the lock it never used), or queues again and runs after it, alone, with a larger fence.
    """
    harness = shared_server_harness
    options = ("--uri", harness.uri, *LEASE, "-n", name)
    holder = held(*options)
    head, second, head_log, next_log, next_go = harness.queue_two(spawn, tmp_path, *options)
    (head_session,) = harness.waits(name, head.pid)
    try:
        with harness.paused(head):
            assert holder.finish() == 0
            # The server hands the lock to the frozen head's session, which cannot answer.
            wait_for(lambda: harness.holder(name) == head_session, what="the grant")
            granted = harness.settled_expiry(name, TTL, handle=head_session) - harness.free_after(
                TTL
            )
            wait_for(next_log.exists, timeout=TTL + SLACK, what="the second waiter's command")
            passed = read_run(next_log).begun - granted
            print(f"the second waiter got in {passed:.2f}s after the frozen head was granted")
            assert (1 - harness.early_share) * harness.free_after(TTL) <= passed < TTL + SLACK
        # The second still runs: the head must wait, or give up.
        wait_for(
            lambda: head.poll() is not None or harness.waits(name, head.pid),
            timeout=SLACK,
            what="the resumed head to give up or queue again",
        )
        assert not head_log.exists(), "the resumed waiter runs its command beside the holder"
    finally:
        next_go.touch()
    assert finish(second) == 0
    check_resumed_head(harness, name, head, head_log, next_log)


def test_a_paused_semaphore_head_is_passed_over_and_never_exceeds_the_slots(
    shared_server_harness: Harness, name: str, tmp_path: Path, spawn: Callable[..., Any]
) -> None:
    """N = 2: a frozen head lets the queue move within ttl/3 + a ttl; never 3 commands at once.

    A session head holds the gate and waits on each slot in pieces of ttl/3; a freed slot
    may be granted to its frozen session. Either way its sessions idle and the server ends
    them (a Redis head's place lapses with its lease), so the waiter behind it gets the free
    slot within ttl/3 + a ttl of the stop. Resumed, the head queues again (or gives up) and
    runs only when a slot is free: the commands' own intervals never show more than 2.
    """
    harness = shared_server_harness
    options = ("--uri", harness.uri, *LEASE, "-n", name, "-s", "2", "-w", "forever", "--")
    labels = ("a", "b", "head", "second")
    argvs = {label: command(tmp_path, label) for label in labels}
    try:
        first = [spawn(*options, *argvs[label][0]) for label in ("a", "b")]
        wait_for(
            lambda: all(argvs[label][1].exists() for label in ("a", "b")),
            what="both holders' commands",
        )
        head = spawn(*options, *argvs["head"][0])
        wait_for(
            lambda: sorted(harness.waits(name, head.pid).values()) == harness.expected_waits(2),
            what="the head's waits on both slots",
        )
        if harness.kind.session:
            assert harness.holder(name, "gate") in harness.waits(name, head.pid)
        second = spawn(*options, *argvs["second"][0])
        behind = harness.expected_waits(2, head=False)
        wait_for(
            lambda: sorted(harness.waits(name, second.pid).values()) == behind,
            what="the second waiter to queue behind the head",
        )
        harness.pause(head)
        paused = time.time()
        argvs["a"][2].touch()  # slot 0 comes free while the head is frozen
        assert finish(first[0]) == 0
        second_log = argvs["second"][1]
        wait_for(
            second_log.exists, timeout=TTL / 3 + TTL + SLACK, what="the second waiter's command"
        )
        passed = read_run(second_log).begun - paused
        print(f"N=2: the waiter behind the frozen head got in {passed:.2f}s after the stop")
        assert passed < TTL / 3 + TTL + SLACK
        harness.resume(head)
        wait_for(
            lambda: head.poll() is not None or harness.waits(name, head.pid),
            timeout=SLACK,
            what="the resumed head to give up or queue again",
        )
        # Both slots are taken (b, second): the head must not run.
        assert not argvs["head"][1].exists(), "the resumed head runs beside two holders"
        argvs["b"][2].touch()
        assert finish(first[1]) == 0
        if head.poll() is None:
            wait_for(argvs["head"][1].exists, timeout=SLACK, what="the resumed head's command")
    finally:
        for _, _, go in argvs.values():
            go.touch()
    assert finish(second) == 0
    _, err = head.communicate(timeout=SLACK + 10)
    print(f"the resumed semaphore head exited {head.returncode}: {err.strip()}")
    runs = [read_run(log) for _, log, _ in argvs.values() if log.exists()]
    assert most_at_once(runs) <= 2
    assert "internal error" not in err
    if head.returncode != 0:
        assert head.returncode in harness.gave_up, err
        assert name in one_line(err)
        assert not argvs["head"][1].exists()


def test_a_briefly_paused_semaphore_head_waits_on(
    shared_server_harness: Harness,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """An N = 2 head waiter (-w forever) paused for less than its lease keeps waiting, then runs.

    Paused longer than a ttl/3 piece of its wait, shorter than its sessions' timeout (or
    its place's lease), it keeps every session (and a session head its gate).
    """
    harness = shared_server_harness
    options = ("--uri", harness.uri, *LEASE, "-n", name, "-s", "2", "-w", "forever")
    holders = [held(*options) for _ in range(2)]
    argv, log, go = command(tmp_path, "head")
    go.touch()
    head = spawn(*options, "--", *argv)
    waiting = harness.expected_waits(2)
    wait_for(
        lambda: sorted(harness.waits(name, head.pid).values()) == waiting,
        what="the head's waits",
    )
    handles = harness.waits(name, head.pid)
    with harness.paused(head):
        time.sleep(TTL / 2)
        assert all(harness.alive(name, handle) for handle in handles)  # they live on
        if harness.kind.session:
            assert harness.holder(name, "gate") is not None
    try:
        wait_for(
            lambda: (
                head.poll() is not None or sorted(harness.waits(name, head.pid).values()) == waiting
            ),
            timeout=SLACK,
            what="the resumed head to wait again",
        )
        assert head.poll() is None, head.communicate()[1]
    finally:
        assert [holder.finish() for holder in holders] == [0, 0]
    _, err = head.communicate(timeout=SLACK + 10)
    assert head.returncode == 0, err
    assert log.exists()


# -- waiters that give up or get in leave nothing behind ------------------------------------------


@SESSIONS_ONLY
@pytest.mark.parametrize(
    ("signo", "slots", "behind"),
    [
        pytest.param(signal.SIGINT, 1, False, id="INT-mutex-head"),
        pytest.param(signal.SIGTERM, 1, True, id="TERM-mutex-queued"),
        pytest.param(signal.SIGTERM, 3, False, id="TERM-semaphore-head"),
        pytest.param(signal.SIGINT, 3, True, id="INT-semaphore-queued"),
    ],
)
def test_interrupted_waiter_leaves_no_session_and_no_gate(
    shared_server_harness: Harness,
    name: str,
    held: Callable[..., Held],
    spawn: Callable[..., Any],
    signo: signal.Signals,
    slots: int,
    behind: bool,
) -> None:
    """INT/TERM while waiting: 130/143 with one line; its sessions and waits leave the server.

    As head of an N = 3 queue the waiter holds the gate and waits on every slot with 3
    sessions; queued *behind* another waiter it waits on the gate (N = 1: on slot 0). Soon
    after the signal none of its sessions is left, nothing waits or is held for it, the
    waiter ahead keeps its place (and gate), and once everyone finishes nothing is held.
    """
    harness = shared_server_harness
    options = ("--uri", harness.uri, *CALM, "-n", name, "-s", str(slots))
    holders = [held(*options) for _ in range(slots)]
    before = harness.session_ids()
    ahead, theirs = None, set[int]()
    if behind:
        ahead = spawn(*options, "-w", "forever", "--", "true")
        wait_for(
            lambda: (
                sorted(harness.waits(name, ahead.pid).values()) == harness.expected_waits(slots)
            ),
            what="the waiter ahead",
        )
        theirs = harness.session_ids() - before
    waiter = spawn(*options, "-w", "forever", "--", "true")
    expected = harness.expected_waits(slots, head=not behind)
    wait_for(
        lambda: sorted(harness.waits(name, waiter.pid).values()) == expected,
        what="the waiter's waits",
    )
    waits = harness.waits(name, waiter.pid)
    assert harness.session_ids() - before - theirs == waits.keys()  # every session of it waits
    if slots > 1:
        assert harness.holder(name, "gate") in (theirs if behind else waits.keys())
    signalled = time.monotonic()
    waiter.send_signal(signo)
    _, err = waiter.communicate(timeout=10)
    assert waiter.returncode == 128 + signo, err
    line = one_line(err)
    assert name in line
    assert "nothing is held" in line
    wait_for(
        lambda: not harness.waits(name, waiter.pid) and harness.session_ids() - before == theirs,
        timeout=GRACE + 0.5 + harness.hangup_delay,
        what="the waiter's sessions to end",
    )
    print(f"the waiter's sessions were gone {time.monotonic() - signalled:.2f}s after {signo!r}")
    if ahead is not None:  # the waiter ahead keeps its place and its gate
        assert sorted(harness.waits(name, ahead.pid).values()) == harness.expected_waits(slots)
        if slots > 1:
            assert harness.holder(name, "gate") in theirs
    elif slots > 1:
        assert harness.holder(name, "gate") is None
    assert [holder.finish() for holder in holders] == [0] * slots
    if ahead is not None:
        assert finish(ahead) == 0
    parts: list[int | str] = [*range(slots), "gate"]
    # A holder's goodbye is sent, not awaited: the server frees its slot a moment later.
    wait_for(
        lambda: [harness.holder(name, part) for part in parts] == [None] * (slots + 1),
        timeout=5,
        what="every slot and the gate to be free",
    )
    after = lockrun(*options, "--", "true")
    assert after.returncode == 0, after.stderr


@SESSIONS_ONLY
@pytest.mark.parametrize("freed", [0, 2])
def test_granted_head_keeps_one_session_and_one_slot(
    shared_server_harness: Harness,
    name: str,
    held: Callable[..., Held],
    tmp_path: Path,
    spawn: Callable[..., Any],
    freed: int,
) -> None:
    """An N = 3 head waiter granted a slot: its helper sessions end, it holds that slot only.

    Slot 0 comes free on the head's first session (which also holds the gate); slot 2 on a
    helper. Either way the head keeps exactly one session, holding that slot and neither
    the gate nor anything else; the other holders' slots stay with their sessions.
    """
    harness = shared_server_harness
    options = ("--uri", harness.uri, *CALM, "-n", name, "-s", "3")
    holders = sorted((held(*options) for _ in range(3)), key=lambda holder: holder.slot)
    assert [holder.slot for holder in holders] == [0, 1, 2]
    owners = [harness.holder(name, slot) for slot in range(3)]
    assert None not in owners
    before = harness.session_ids()
    ready, go = tmp_path / "head.ready", tmp_path / "head.go"
    head = spawn(*options, "-w", "forever", "--", "sh", "-c", HOLD.format(ready=ready, go=go))
    try:
        wait_for(
            lambda: sorted(harness.waits(name, head.pid).values()) == ["0", "1", "2"],
            what="the head's waits",
        )
        assert len(harness.session_ids() - before) == 3
        assert holders[freed].finish() == 0
        wait_for(lambda: ready.exists() or head.poll() is not None, what="the head's command")
        assert int(ready.read_text()) == freed
        now_owners = [harness.holder(name, slot) for slot in range(3)]
        mine = now_owners[freed]
        assert mine is not None
        assert mine not in owners  # a session of the head's
        # Its other sessions end; of the holders', only the one that finished is gone.
        wait_for(
            lambda: harness.session_ids() - before == {mine},
            timeout=SLACK,
            what="the head's helper sessions to end",
        )
        assert owners[freed] not in harness.session_ids()
        assert not harness.waits(name, head.pid)
        assert now_owners.count(mine) == 1
        assert [now_owners[slot] for slot in range(3) if slot != freed] == [
            owners[slot] for slot in range(3) if slot != freed
        ]
        assert harness.holder(name, "gate") is None
        harness.check_granted(name, mine, freed, 3)
    finally:
        go.touch()
    assert finish(head) == 0


# -- --slots agreement and exclusion ------------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_slots_never_hold_three(shared_harness: Harness, name: str, tmp_path: Path) -> None:
    """8 processes × 3 acquisitions of -s 2 -w forever: never 3 at once, 2 at once at least once.

    The conformance suite runs N = 3; with N = 2 a session head waits on slot 0 on its own
    session and on slot 1 on one helper.
    """
    options = ("--uri", shared_harness.uri, *CALM, "-n", name)
    runs, slots, peak = interval_log(tmp_path, options, slots=2, rounds=3)
    assert slots <= {0, 1}
    assert runs == 24
    assert peak == 2
