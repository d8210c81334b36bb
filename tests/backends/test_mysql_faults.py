"""MySQL/MariaDB-only faults: the gate session of a frozen semaphore head, and holder records.

What every server backend shares is in tests/contract. Here: a frozen N = 2 head whose gate
(a GET_LOCK of its own session) the server frees only once wait_timeout ends that session,
and the lockrun_holders table a refused try must leave alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

import pytest

from tests.support.cli import Held, finish, lockrun, wait_for
from tests.support.harness import (
    LEASE,
    SLACK,
    TTL,
    MysqlHarness,
    check_resumed_head,
    command,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.support.harness import Harness

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(40),
    pytest.mark.parametrize("shared_server_harness", ["mysql"], indirect=True),
]

# The server frees an idle session's locks after wait_timeout = ceil(ttl); lockrun must not
# let anyone in much earlier than that (a tenth: timer and clock granularity).
EARLY: Final = 0.9


def test_paused_head_of_a_semaphore_queue_lets_the_next_waiter_through(
    shared_server_harness: Harness,
    name: str,
    tmp_path: Path,
    spawn: Callable[..., Any],
    held: Callable[..., Held],
) -> None:
    """A frozen N = 2 head waiter frees the gate within ttl/3 + ttl; the next waiter gets in.

    The head asks for the slots in pieces of ttl/3, so once frozen its sessions idle and
    their wait_timeout ends them, no sooner. The waiter behind it takes the gate, waits on
    the slots and gets the first one freed; the resumed head runs only once a slot is free
    for it, after the second's command and with a larger fence.
    """
    harness = shared_server_harness
    assert isinstance(harness, MysqlHarness)
    options = ("--uri", harness.uri, *LEASE, "-n", name, "-s", "2", "-w", "forever")
    holders = sorted((held(*options) for _ in range(2)), key=lambda holder: holder.slot)
    head_argv, head_log, head_go = command(tmp_path, "head")
    next_argv, next_log, next_go = command(tmp_path, "next")
    head_go.touch()
    head = spawn(*options, "--", *head_argv)
    wait_for(lambda: len(harness.waits(name, head.pid)) == 2, what="the head's waits")
    gate = harness.holder(name, "gate")
    assert gate in harness.waits(name, head.pid)
    second = spawn(*options, "--", *next_argv)
    wait_for(
        lambda: list(harness.waits(name, second.pid).values()) == ["gate"],
        what="the second waiter at the gate",
    )
    try:
        with harness.paused(head):
            stopped_at = time.time()
            wait_for(
                lambda: harness.holder(name, "gate") != gate,
                timeout=TTL / 3 + TTL + SLACK,
                what="the server to end the frozen head's gate session",
            )
            took = time.time() - stopped_at
            print(f"the frozen head's gate session ended {took:.2f}s after it froze")
            assert took >= EARLY * TTL
            wait_for(
                lambda: sorted(harness.waits(name, second.pid).values()) == ["0", "1"],
                timeout=SLACK,
                what="the second waiter to become the head",
            )
            assert holders[0].finish() == 0
            wait_for(next_log.exists, timeout=SLACK, what="the second waiter's command")
        # Two commands run: the head must wait, or give up.
        wait_for(
            lambda: head.poll() is not None or harness.waits(name, head.pid),
            timeout=SLACK,
            what="the resumed head to give up or queue again",
        )
        assert not head_log.exists(), "a third command runs beside two holders of 2 slots"
    finally:
        next_go.touch()
    assert finish(second) == 0
    # A slot may still be busy with the other holder when it runs: not alone, only after.
    assert harness.gave_up == {69}
    check_resumed_head(harness, name, head, head_log, next_log, alone=False)
    assert holders[1].finish() == 0


def test_a_refused_mismatch_leaves_no_holder_record(
    shared_server_harness: Harness, name: str, held: Callable[..., Held]
) -> None:
    """-s 3 on a name held with -s 1 is refused (78) without a lockrun_holders row of its own."""
    harness = shared_server_harness
    assert isinstance(harness, MysqlHarness)
    holder = held("--uri", harness.uri, "--ttl", "10", "-n", name)
    result = lockrun("--uri", harness.uri, "--ttl", "10", "-n", name, "-s", "3", "--", "true")
    assert result.returncode == 78, result.stderr
    key = harness.lock(name).rpartition(":")[0]
    rows = harness.query("SELECT slot FROM lockrun_holders WHERE lock_key = %s", (key,))
    assert rows == ((0,),)  # only the holder's slot 0
    assert holder.finish() == 0
