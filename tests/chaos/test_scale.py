"""100 waiters on one name with 10 slots, on every backend.

Ten holders take the slots; 90 waiters then start 30 ms apart and queue; the holders
let go, and each waiter runs a 50 ms command. The oracle (tests/support/oracle.py) checks
that never more than 10 ran at once and gives the order they were granted in, which is
compared with the order they started in (Kendall's tau; 1 is exactly first come, first
served). Each lockrun is reaped with wait4, so its CPU (with its command's) is measured;
the servers' connection count is sampled throughout. The README's connection budget
comes from these numbers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Final

import pytest

from lockrun.uri import BACKENDS
from tests.support.cli import LOCKRUN, queue_length, unmeasured
from tests.support.harness import PeakSessions

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

    from tests.support.harness import Harness
    from tests.support.oracle import Oracle

pytestmark = pytest.mark.slow

WAITERS: Final = 100
SLOTS: Final = 10
PACE: Final = 0.03  # seconds between two waiters' starts
HOLD: Final = 0.05  # each waiter's command

# etcd is left out of the heavy phase, which its three runs took past CI's 12 minutes; run
# before that, on etcd they passed: no more than N at once, nothing leaked (the closing
# note of issue 33 has the numbers). The modes storm on etcd only ran writers: no modes.
BUT_ETCD: Final = pytest.mark.parametrize(
    "harness", [backend for backend in BACKENDS if backend != "etcd"], indirect=True
)


def kendall_tau(order: Sequence[int]) -> float:
    """Return Kendall's tau between *order* and its sorted self (no ties): 1 is sorted."""
    n = len(order)
    concordant = sum(1 if order[i] < order[j] else -1 for i in range(n) for j in range(i + 1, n))
    return concordant / (n * (n - 1) / 2)


def spawn(argv: list[str], errors: Path) -> int:
    """Start *argv* with stdout discarded and stderr appended to *errors*; return its pid."""
    actions = [
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_OPEN, 2, str(errors), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
    ]
    return os.posix_spawn(argv[0], argv, unmeasured(), file_actions=actions)


def test_kendall_tau() -> None:
    """The statistic itself: sorted, reversed, one swap."""
    assert kendall_tau([0, 1, 2, 3]) == 1
    assert kendall_tau([3, 2, 1, 0]) == -1
    assert kendall_tau([1, 0, 2, 3]) == pytest.approx(4 / 6)


@BUT_ETCD
@pytest.mark.heavy
@pytest.mark.timeout(300)
def test_100_waiters_on_10_slots(
    harness: Harness, oracle: Oracle, name: str, tmp_path: Path, record: Callable[..., None]
) -> None:
    """All 100 run, never more than 10 at once, granted close to the order they came in."""
    options = ["--uri", harness.uri, "-n", name, "-s", str(SLOTS), "-w", "forever"]
    errors = tmp_path / "stderr"
    sessions = None if harness.kind.local else PeakSessions(harness)
    pids: list[int] = []
    try:
        pids += [
            spawn([*LOCKRUN, *options, "--", *oracle.command(f"h{i}")], errors)
            for i in range(SLOTS)
        ]
        oracle.wait(lambda: oracle.running == SLOTS, 60, "10 holders")
        holders = list(oracle.runs)
        began = time.monotonic()
        for i in range(WAITERS - SLOTS):
            command = oracle.command(str(i), hold=HOLD)
            pids.append(spawn([*LOCKRUN, *options, "--", *command], errors))
            time.sleep(max(0.0, began + (i + 1) * PACE - time.monotonic()))
        oracle.wait(
            lambda: queue_length(harness.uri, name) == WAITERS - SLOTS,
            120,
            f"{WAITERS - SLOTS} waiters to queue; lockrun said: {errors.read_text()[-2000:]}",
        )
        queued = time.monotonic() - began
        for run in holders:
            oracle.release(run)
        released = time.monotonic()
        cpu, statuses = 0.0, []
        for pid in pids:
            _, status, usage = os.wait4(pid, 0)
            statuses.append(os.waitstatus_to_exitcode(status))
            cpu += usage.ru_utime + usage.ru_stime
        drained = time.monotonic() - released
        pids.clear()
    finally:
        peak_sessions = sessions.stop() if sessions else None
        for pid in pids:  # a failure: leave nothing running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    granted = [
        int(run.tag) for run in sorted(oracle.runs, key=lambda run: run.start) if run.tag.isdigit()
    ]
    tau = kendall_tau(granted)
    record(
        "100 waiters, 10 slots",
        backend=harness.backend,
        peak=oracle.peak,
        tau=tau,
        queued_in=queued,
        drained_in=drained,
        lockrun_cpu_per_process=cpu / WAITERS,
        peak_connections=peak_sessions if peak_sessions is not None else "-",
    )
    assert statuses == [0] * WAITERS, errors.read_text()[-2000:]
    assert len(oracle.runs) == WAITERS
    assert oracle.peak <= SLOTS
    assert sorted(granted) == list(range(WAITERS - SLOTS))
    assert tau > 0.5, granted
