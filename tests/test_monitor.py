"""Monitoring end to end: the hooks and --metrics-file (docs/semantics.md "Monitoring").

The oracles are what a hook was told (its environment, dumped with ``env -0``), the metrics
file read by Prometheus's own parser, and the exit statuses, never lockrun's word.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import TYPE_CHECKING

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lockrun import monitor
from lockrun.errors import ExitCode
from lockrun.monitor import HOOK_GRACE
from lockrun.uri import redact
from tests.support.cli import (
    LOCKRUN,
    Held,
    finish,
    gone,
    lockrun,
    one_line,
    queue_length,
    start,
    unmeasured,
    wait_for,
)
from tests.support.harness import shared_harness_for
from tests.support.servers import free_port, installed

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

RAN = ("ok", "failed", "killed", "timed-out", "lost", "taken-over", "not-run", "error")
# The shells' polls look every 50 ms: each look is a fork and exec of sleep(1), and at 10 ms
# a hook or command waiting for a file kept a CPU busy beside the other tests.
LOOP = "while :; do sleep 0.05; done"


def told(dump: Path) -> dict[str, str]:
    """Return the LOCKRUN_* variables a hook dumped with ``env -0 > DUMP``."""
    wait_for(dump.exists, what=f"the hook's dump {dump.name}")
    pairs = (entry.partition("=") for entry in dump.read_text().split("\0") if entry)
    return {key: value for key, _, value in pairs if key.startswith("LOCKRUN_")}


def dumping(dump: Path) -> str:
    """Return a hook that dumps its environment to *dump*, whole once it appears."""
    return f"env -0 > {dump}.tmp && mv {dump}.tmp {dump}"


def samples(path: Path) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Read the metrics file with Prometheus's parser: (sample, labels) to value."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(path.read_text())
        for sample in family.samples
    }


def of(
    name: str, metric: str, outcome: str = "", namespace: str = "default"
) -> tuple[str, frozenset[tuple[str, str]]]:
    """Return the key of *name*'s sample of *metric* in `samples`."""
    labels = {"namespace": namespace, "name": name} | ({"outcome": outcome} if outcome else {})
    return metric, frozenset(labels.items())


# -- how a run that got the lock ended ----------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "options", "command", "status"),
    [
        ("ok", (), ["true"], 0),
        ("failed", (), ["sh", "-c", "exit 3"], 3),
        ("killed", (), ["sh", "-c", "kill -KILL $$"], 128 + signal.SIGKILL),
        ("not-run", (), ["/nonexistent/command"], ExitCode.NOT_FOUND),
        ("timed-out", ("--max-time", "0.2", "--kill-after", "1"), ["sleep", "30"], 124),
    ],
)
def test_on_exit_is_told_how_the_run_ended(
    file_uri: str,
    name: str,
    tmp_path: Path,
    outcome: str,
    options: tuple[str, ...],
    command: list[str],
    status: int,
) -> None:
    """Each outcome: the status lockrun exits with, in the hook's environment and the file."""
    dump, metrics, busy = tmp_path / "dump", tmp_path / "m.prom", tmp_path / "busy"
    before = time.time()
    result = lockrun(
        *("--uri", file_uri, "-n", name, *options, "--metrics-file", str(metrics)),
        *("--on-exit", dumping(dump), "--on-busy", f"touch {busy}", "--", *command),
    )
    after = time.time()
    assert result.returncode == status, result.stderr
    if outcome in {"ok", "failed", "killed"}:
        assert result.stderr == ""
    else:
        one_line(result.stderr)
    env = told(dump)
    assert (env["LOCKRUN_STATUS"], env["LOCKRUN_OUTCOME"]) == (str(status), outcome)
    assert (env["LOCKRUN_NAME"], env["LOCKRUN_NAMESPACE"]) == (name, "default")
    assert (env["LOCKRUN_SLOT"], env["LOCKRUN_SLOTS"], env["LOCKRUN_URI"]) == ("0", "1", file_uri)
    assert int(env["LOCKRUN_FENCE"]) > 0
    began, ended = float(env["LOCKRUN_STARTED_AT"]), float(env["LOCKRUN_ENDED_AT"])
    assert before - 0.001 <= began <= ended <= after + 0.001
    assert 0 <= float(env["LOCKRUN_DURATION"]) <= ended - began + 0.01
    assert 0 <= float(env["LOCKRUN_WAITED"]) < after - before
    assert not busy.exists()
    found = samples(metrics)
    for each in RAN:
        assert found[of(name, "lockrun_runs_total", each)] == (each == outcome)
    assert found[of(name, "lockrun_skipped_total")] == 0
    assert found[of(name, "lockrun_last_exit_status")] == status
    assert found[of(name, "lockrun_last_start_timestamp_seconds")] == pytest.approx(
        began, abs=0.002
    )
    assert found[of(name, "lockrun_last_end_timestamp_seconds")] == pytest.approx(ended, abs=0.002)
    assert found[of(name, "lockrun_last_duration_seconds")] == float(env["LOCKRUN_DURATION"])
    success = of(name, "lockrun_last_success_timestamp_seconds")
    assert (found.get(success) == found[of(name, "lockrun_last_end_timestamp_seconds")]) == (
        outcome == "ok"
    )
    assert [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".")] == []


def test_a_lost_lock_is_told_as_lost(file_uri: str, name: str, tmp_path: Path) -> None:
    """The lock file deleted under the holder: 76, and the hook hears "lost"."""
    dump, ready = tmp_path / "dump", tmp_path / "ready"
    holder = start(
        *("--uri", file_uri, "-n", name, "--ttl", "1", "--on-exit", dumping(dump)),
        *("--", "sh", "-c", f"exec 2>/dev/null; touch {ready}; {LOOP}"),
    )
    wait_for(ready.exists, what="the holder's command")
    (tmp_path / "locks" / f"{name}.lock").unlink()
    assert finish(holder) == ExitCode.LOST
    env = told(dump)
    assert (env["LOCKRUN_STATUS"], env["LOCKRUN_OUTCOME"]) == ("76", "lost")


def test_a_take_over_is_told_to_the_holder_the_waiter_and_the_taker(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """Holder 79 (on-exit: taken-over), a waiter ahead 79 (on-busy: taken-over), taker 0."""
    ready, metrics = tmp_path / "ready", tmp_path / "m.prom"
    common = ("--uri", file_uri, "-n", name, "--metrics-file", str(metrics))
    dumps = {who: tmp_path / who for who in ("holder", "ahead", "taker")}
    holder = start(
        *common, "--on-exit", dumping(dumps["holder"]),
        *("--", "sh", "-c", f"exec 2>/dev/null; touch {ready}; {LOOP}"),
    )  # fmt: skip
    wait_for(ready.exists, what="the holder's command")
    ahead = start(*common, "-w", "forever", "--on-busy", dumping(dumps["ahead"]), "--", "true")
    wait_for(lambda: queue_length(file_uri, name) == 1, what="the waiter to queue")
    taker = lockrun(
        *common, "--take-over", "-w", "60", "--on-exit", dumping(dumps["taker"]), "--", "true"
    )
    assert taker.returncode == 0, taker.stderr
    assert (finish(holder), finish(ahead)) == (ExitCode.TAKEN_OVER, ExitCode.TAKEN_OVER)
    heard = {who: told(dump) for who, dump in dumps.items()}
    assert {who: (env["LOCKRUN_STATUS"], env["LOCKRUN_OUTCOME"]) for who, env in heard.items()} == {
        "holder": ("79", "taken-over"),
        "ahead": ("79", "taken-over"),
        "taker": ("0", "ok"),
    }
    assert "LOCKRUN_SLOT" not in heard["ahead"]  # it never held the lock
    found = samples(metrics)
    assert found[of(name, "lockrun_runs_total", "taken-over")] == 1
    assert found[of(name, "lockrun_runs_total", "ok")] == 1
    assert found[of(name, "lockrun_skipped_total")] == 1


# -- a run that did not get the lock ------------------------------------------------------------


def test_busy_runs_on_busy_alone_quietly_and_counts_a_skip(
    file_uri: str, name: str, tmp_path: Path, held: Callable[..., Held]
) -> None:
    """-q -E 0: silent, status 0; on-busy told "busy" and nothing of a slot; skipped counts 1."""
    dump, other, metrics = tmp_path / "dump", tmp_path / "other", tmp_path / "m.prom"
    holder = held("--uri", file_uri, "-n", name)
    # A lockrun nested in a locked job inherits the job's LOCKRUN_*: none reaches the hook.
    nested = os.environ | {"LOCKRUN_SLOT": "7", "LOCKRUN_FENCE": "9", "LOCKRUN_DURATION": "1"}
    result = lockrun(
        *("--uri", file_uri, "-n", name, "-q", "-E", "0", "--metrics-file", str(metrics)),
        *("--on-busy", dumping(dump), "--on-exit", f"touch {other}", "--", "true"),
        env=nested,
    )
    assert (result.returncode, result.stderr) == (0, "")
    env = told(dump)
    assert (env["LOCKRUN_STATUS"], env["LOCKRUN_OUTCOME"], env["LOCKRUN_NAME"]) == (
        "0",
        "busy",
        name,
    )
    assert float(env["LOCKRUN_WAITED"]) >= 0
    assert (
        not {"LOCKRUN_SLOT", "LOCKRUN_FENCE", "LOCKRUN_DURATION", "LOCKRUN_STARTED_AT"} & env.keys()
    )
    assert not other.exists()
    found = samples(metrics)
    assert found[of(name, "lockrun_skipped_total")] == 1
    assert not [key for key in found if key[0].startswith("lockrun_last_")]
    assert holder.finish() == 0


@pytest.mark.parametrize(
    ("arguments", "status"),
    [
        (("--uri", "file:relative/dir"), ExitCode.CONFIG),
        (("--uri", "redis://127.0.0.1:1/0"), ExitCode.UNAVAILABLE),  # nobody listens on port 1
        (("--hook-max-time", "0"), ExitCode.USAGE),
        (("--metrics-file", "relative.prom"), ExitCode.USAGE),
    ],
)
def test_a_run_that_never_asked_for_the_lock_runs_no_hook(
    tmp_path: Path, name: str, arguments: tuple[str, ...], status: int
) -> None:
    """Usage and configuration errors, a lock service out of reach: one line, no hook, no file."""
    hook = f"touch {tmp_path}/hooked"
    result = lockrun(
        "-n", name, "--on-start", hook, "--on-busy", hook, "--on-exit", hook, *arguments,
        "--", "true",
        env=os.environ | {"LOCKRUN_METRICS_FILE": str(tmp_path / "m.prom")},
    )  # fmt: skip
    assert result.returncode == status
    one_line(result.stderr)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_wait_runs_no_hook(
    file_uri: str, name: str, tmp_path: Path, held: Callable[..., Held]
) -> None:
    """INT while waiting: 130, nothing held, no hook and no count (the run never happened)."""
    holder = held("--uri", file_uri, "-n", name)
    hook, metrics = f"touch {tmp_path}/hooked", tmp_path / "m.prom"
    waiter = start(
        *("--uri", file_uri, "-n", name, "-w", "60", "--metrics-file", str(metrics)),
        *("--on-start", hook, "--on-busy", hook, "--on-exit", hook, "--", "true"),
    )
    wait_for(lambda: queue_length(file_uri, name) == 1, what="the waiter to queue")
    waiter.send_signal(signal.SIGINT)
    assert finish(waiter) == 130
    assert holder.finish() == 0
    assert not (tmp_path / "hooked").exists()
    assert not metrics.exists()


def test_hooks_are_read_from_the_command_line_only(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """LOCKRUN_ON_START/EXIT/BUSY are a parent's, never settings; the rest are settings."""
    metrics = tmp_path / "m.prom"
    result = lockrun(
        "--uri", file_uri, "-n", name, "--", "true",
        env=os.environ | {
            "LOCKRUN_ON_START": f"touch {tmp_path}/hooked",
            "LOCKRUN_ON_EXIT": f"touch {tmp_path}/hooked",
            "LOCKRUN_ON_BUSY": f"touch {tmp_path}/hooked",
            "LOCKRUN_METRICS_FILE": str(metrics),
        },
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (0, "")
    assert not (tmp_path / "hooked").exists()
    assert samples(metrics)[of(name, "lockrun_runs_total", "ok")] == 1


# -- how a hook runs ----------------------------------------------------------------------------


def test_hooks_come_after_the_release(uri: str, name: str, tmp_path: Path) -> None:
    """While the on-exit hook of one run still runs, the next run gets the lock at once."""
    running, go, dump = tmp_path / "running", tmp_path / "go", tmp_path / "dump"
    hook = f"{dumping(dump)}; touch {running}; while [ ! -e {go} ]; do sleep 0.05; done"
    first = start("--uri", uri, "-n", name, "--on-exit", hook, "--", "true")
    wait_for(running.exists, what="the first run's hook")
    second = lockrun("--uri", uri, "-n", name, "--", "true")
    assert (second.returncode, second.stderr) == (0, "")
    go.touch()
    assert finish(first) == 0
    env = told(dump)
    assert (env["LOCKRUN_OUTCOME"], env["LOCKRUN_URI"]) == ("ok", redact(uri))


@pytest.mark.parametrize(
    ("end", "said"), [("exit 9", "exited 9"), ("kill -TERM $$", "was killed by SIGTERM")]
)
def test_a_hooks_output_goes_to_stderr_and_its_failure_is_one_line(
    file_uri: str, name: str, end: str, said: str
) -> None:
    """The command keeps stdout, the hook reads /dev/null, and its failure changes nothing."""
    result = lockrun(
        "--uri", file_uri, "-n", name,
        "--on-exit", f"cat; echo from-the-hook; {end}", "--", "echo", "from-the-command",
        input="for-the-command\n",
    )  # fmt: skip
    assert result.returncode == 0
    assert result.stdout == "from-the-command\n"
    assert result.stderr == f"from-the-hook\nlockrun: {name}: --on-exit hook {said}\n"


def test_a_hook_without_a_shell_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """No /bin/sh to run the hook with: said once, and the run's report goes on."""
    monkeypatch.setattr(monitor, "SHELL", "/nonexistent/sh")
    run = monitor.Run("default", "n", "file:", 1, 0, "ok", 0.0)
    said: list[str] = []
    monitor.hook("--on-exit", "true", run, max_time=1.0, ignored=frozenset(), log=said.append)
    assert said == ["n: --on-exit hook: cannot run /nonexistent/sh: No such file or directory"]


def test_a_hook_that_outlives_its_time_is_stopped_with_its_group(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """TERM ignored: KILL a grace later, to the hook's whole group; the command's 3 stands."""
    pids = tmp_path / "pids"
    # An hour's sleep: lockrun ending at all (`lockrun` gives up after 60 s) proves the KILL.
    hook = f"trap '' TERM; sleep 3600 & echo $$ $! > {pids}.tmp; mv {pids}.tmp {pids}; wait"
    began = time.monotonic()
    result = lockrun(
        "--uri", file_uri, "-n", name, "--on-exit", hook, "--", "sh", "-c", "exit 3",
        env=os.environ | {"LOCKRUN_HOOK_MAX_TIME": "0.3"},
    )  # fmt: skip
    took = time.monotonic() - began
    assert result.returncode == 3
    line = one_line(result.stderr)
    assert (
        line
        == f"lockrun: {name}: --on-exit hook still ran after 0.30s (--hook-max-time): stopped it"
    )
    assert took >= 0.3 + HOOK_GRACE  # TERM first, KILL only a grace later
    hook_pids = [int(pid) for pid in pids.read_text().split()]
    wait_for(lambda: all(map(gone, hook_pids)), timeout=30, what="the hook's processes to end")


def test_a_hook_that_leaves_its_group_is_still_stopped_in_time(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """A hook that moved itself to another process group is KILLed too: lockrun ends."""
    pid_file = tmp_path / "pid"
    escape = (  # into lockrun's own group, out of the one lockrun signals
        "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "os.setpgid(0, os.getpgid(os.getppid())); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(3600)"
    )
    # The hook sleeps an hour: lockrun ending within `lockrun`'s 60 s proves the KILL.
    result = lockrun(
        "--uri", file_uri, "-n", name, "--hook-max-time", "0.3",
        "--on-exit", f"exec {sys.executable} -c {shlex.quote(escape)}", "--", "true",
    )  # fmt: skip
    assert result.returncode == 0
    assert "--on-exit hook still ran after 0.30s (--hook-max-time): stopped it" in result.stderr
    wait_for(lambda: gone(int(pid_file.read_text())), timeout=30, what="the hook to end")


def test_a_signal_to_lockrun_during_a_hook_goes_to_the_hook(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """TERM while the hook runs: the hook gets it and ends; lockrun keeps the command's 5."""
    ready, heard = tmp_path / "ready", tmp_path / "heard"
    hook = f"exec 2>/dev/null; trap 'touch {heard}; exit 0' TERM; touch {ready}; {LOOP}"
    process = start("--uri", file_uri, "-n", name, "--on-exit", hook, "--", "sh", "-c", "exit 5")
    wait_for(ready.exists, what="the hook")
    process.send_signal(signal.SIGTERM)
    assert finish(process, timeout=10) == 5
    assert heard.exists()


# -- --on-start: a start ping beside the command -------------------------------------------------


def test_on_start_runs_beside_the_command_holding_the_lock_and_before_on_exit(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """The hook sees the lock held and the command's fence; the command waits for it; then on-exit.

    Each waits for the other's mark: were the command started only once the hook had
    ended, or the hook only once the command had, neither would get past its wait.
    """
    dump, order, marked = tmp_path / "start-dump", tmp_path / "order", tmp_path / "hook-ran"
    check = shlex.join([*LOCKRUN, "status", "--uri", file_uri, "--check", "-q", name])
    on_start = (
        f"{check}; echo held=$? >> {order}; {dumping(dump)}; touch {marked}; "
        f"while [ ! -e {tmp_path}/command-ran ]; do sleep 0.05; done; echo start-end >> {order}"
    )
    command = (
        f'echo "fence=$LOCKRUN_FENCE" > {tmp_path}/fence; touch {tmp_path}/command-ran; '
        f"while [ ! -e {marked} ]; do sleep 0.05; done; exit 3"
    )
    nested = os.environ | {"LOCKRUN_STATUS": "9", "LOCKRUN_OUTCOME": "ok", "LOCKRUN_ENDED_AT": "1"}
    result = lockrun(
        *("--uri", file_uri, "-n", name, "--on-start", on_start),
        *("--on-exit", f"echo exit=$LOCKRUN_STATUS >> {order}", "--", "sh", "-c", command),
        env=nested,
    )
    assert (result.returncode, result.stderr) == (3, "")
    # on-exit comes after the start hook ended, even though the command ended first
    assert order.read_text().splitlines() == ["held=75", "start-end", "exit=3"]
    env = told(dump)
    assert f"fence={env['LOCKRUN_FENCE']}" == (tmp_path / "fence").read_text().strip()
    assert (env["LOCKRUN_NAME"], env["LOCKRUN_SLOT"], env["LOCKRUN_SLOTS"]) == (name, "0", "1")
    assert (env["LOCKRUN_URI"], env["LOCKRUN_NAMESPACE"]) == (file_uri, "default")
    assert float(env["LOCKRUN_STARTED_AT"]) > 0
    assert float(env["LOCKRUN_WAITED"]) >= 0
    # nothing of the end, not even an outer lockrun's
    assert not {"LOCKRUN_STATUS", "LOCKRUN_OUTCOME", "LOCKRUN_ENDED_AT", "LOCKRUN_DURATION"} & (
        env.keys()
    )


def test_a_hanging_on_start_hook_is_stopped_while_the_command_runs(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """TERM ignored: KILLed within the run (the command waits for that); the command's 3 stands."""
    pids = tmp_path / "pids"
    hook = f"trap '' TERM; sleep 3600 & echo $$ $! > {pids}.tmp; mv {pids}.tmp {pids}; wait"
    # The command ends only once the hook's shell is gone: stopped during the run, not after.
    command = (
        f"while [ ! -e {pids} ]; do sleep 0.05; done; read hook _ < {pids}; "
        "while kill -0 $hook 2>/dev/null; do sleep 0.05; done; exit 3"
    )
    result = lockrun(
        *("--uri", file_uri, "-n", name, "--hook-max-time", "0.3", "--on-start", hook),
        *("--on-exit", f"touch {tmp_path}/exited", "--", "sh", "-c", command),
    )
    assert result.returncode == 3
    line = one_line(result.stderr)
    assert (
        line
        == f"lockrun: {name}: --on-start hook still ran after 0.30s (--hook-max-time): stopped it"
    )
    assert (tmp_path / "exited").exists()
    hook_pids = [int(pid) for pid in pids.read_text().split()]
    wait_for(lambda: all(map(gone, hook_pids)), timeout=30, what="the hook's processes to end")


def test_on_exit_waits_for_an_on_start_hook_that_outlives_the_command(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """The command ends first; the start hook is stopped at its time, and only then on-exit runs."""
    pid, never = tmp_path / "pid", tmp_path / "never"
    hook = f"echo $$ > {pid}.tmp; mv {pid}.tmp {pid}; while [ ! -e {never} ]; do sleep 0.05; done"
    seen = f"if kill -0 $(cat {pid}); then echo alive; else echo gone; fi > {tmp_path}/seen"
    result = lockrun(
        *("--uri", file_uri, "-n", name, "--hook-max-time", "0.3", "--on-start", hook),
        *(
            "--on-exit",
            f"{seen} 2>/dev/null",
            "--",
            "sh",
            "-c",
            f"until [ -e {pid} ]; do sleep 0.05; done",
        ),
    )
    assert result.returncode == 0
    assert one_line(result.stderr).endswith(
        "--on-start hook still ran after 0.30s (--hook-max-time): stopped it"
    )
    assert (tmp_path / "seen").read_text() == "gone\n"


@pytest.mark.parametrize(
    ("end", "said"), [("exit 4", "exited 4"), ("kill -KILL $$", "was killed by SIGKILL")]
)
def test_a_failing_on_start_hook_costs_one_line_and_no_status(
    file_uri: str, name: str, end: str, said: str
) -> None:
    """The hook fails; the command runs all the same and its status is lockrun's."""
    result = lockrun(
        "--uri", file_uri, "-n", name, "--on-start", f"echo from-the-hook; {end}",
        "--", "echo", "from-the-command",
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, "from-the-command\n")
    assert result.stderr == f"from-the-hook\nlockrun: {name}: --on-start hook {said}\n"


def test_a_busy_run_runs_no_on_start_hook(
    file_uri: str, name: str, tmp_path: Path, held: Callable[..., Held]
) -> None:
    """Busy: 75 and --on-busy; the start hook never runs, nor does the command."""
    holder = held("--uri", file_uri, "-n", name)
    result = lockrun(
        *("--uri", file_uri, "-n", name, "--on-start", f"touch {tmp_path}/started"),
        *("--on-busy", f"touch {tmp_path}/busy", "--", "touch", f"{tmp_path}/ran"),
    )
    assert result.returncode == ExitCode.BUSY
    assert (tmp_path / "busy").exists()
    assert not (tmp_path / "started").exists()
    assert not (tmp_path / "ran").exists()
    assert holder.finish() == 0


@pytest.mark.parametrize(
    ("hook", "made"),
    [
        ("", ""),  # --on-start "$PING" with PING unset: no hook, the job runs
        ("printf a >> {f}\nprintf b >> {f}\n", "ab"),  # two lines of shell
        ("printf '%s' \"$LOCKRUN_NAME\" >> {f}", "NAME"),  # the name is told, not quoted in
    ],
    ids=["empty", "newlines", "name"],
)
def test_on_start_takes_any_shell_text(file_uri: str, tmp_path: Path, hook: str, made: str) -> None:
    """An empty hook runs nothing; lines and a hostile name are the shell's, as written."""
    name = "$(touch pwned); `touch pwned`\n"  # a name the shell must never run
    target = tmp_path / "made"
    result = lockrun(
        "--uri", file_uri, "-n", name, "--on-start", hook.format(f=target), "--", "true",
        cwd=tmp_path,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (0, "")
    assert (target.read_text() if target.exists() else "") == made.replace("NAME", name)
    assert not (tmp_path / "pwned").exists()


# -- on a server: a lost lease, and no password anywhere ----------------------------------------


def test_a_lost_postgres_lease_is_told_without_the_password(
    postgres_uri: str, name: str, tmp_path: Path
) -> None:
    """pg_terminate_backend of the holder: 76; hook and file say so and never the password."""
    password = "hunter2-never-shown"  # noqa: S105 - made to be looked for
    secret_uri = postgres_uri.replace("lockrun@", f"lockrun:{password}@", 1)
    assert secret_uri != postgres_uri, "the test server's URI changed form"
    dump, ready, metrics = tmp_path / "dump", tmp_path / "ready", tmp_path / "m.prom"
    holder = start(
        *("--uri", secret_uri, "-n", name, "--metrics-file", str(metrics)),
        *("--on-exit", dumping(dump), "--", "sh", "-c", f"exec 2>/dev/null; touch {ready}; {LOOP}"),
    )
    wait_for(ready.exists, what="the holder's command")
    harness = shared_harness_for("postgres", tmp_path, postgres_uri)
    try:
        harness.end_session(name)
    finally:
        harness.close()
    _, err = holder.communicate(timeout=30)
    assert holder.returncode == ExitCode.LOST, err
    one_line(err)
    env = told(dump)
    assert (env["LOCKRUN_STATUS"], env["LOCKRUN_OUTCOME"]) == ("76", "lost")
    assert env["LOCKRUN_URI"].startswith("postgresql://***@")
    for text in (err, dump.read_text(), metrics.read_text()):
        assert password not in text
    assert samples(metrics)[of(name, "lockrun_runs_total", "lost")] == 1


def test_a_short_run_writes_the_metrics_file_once_and_syncs_nothing(
    file_uri: str, name: str, tmp_path: Path
) -> None:
    """A run shorter than a second: one rename over the file (the end's), and no fsync.

    It was two writes (the start's, the end's), each fsynced. The rename is what makes an
    update atomic for the collector (docs/semantics.md "Metrics"). strace slows the run: a
    machine so loaded that it held the lock a second gets three tries.
    """
    metrics, trace = tmp_path / "m.prom", tmp_path / "trace"
    calls = ["trace=fsync,fdatasync,sync_file_range,rename,renameat,renameat2"]
    argv = ["strace", "-f", "-qq", "-o", str(trace), "-e", *calls, *LOCKRUN]
    renames = []
    for _ in range(3):
        run = subprocess.run(
            [*argv, "--uri", file_uri, "-n", name, "--metrics-file", str(metrics), "--", "true"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        traced = trace.read_text()
        assert "sync" not in traced, traced
        renames.append(traced.count('"m.prom"'))
        if renames[-1] == 1:
            break
    assert renames[-1] == 1, renames
    assert samples(metrics)[of(name, "lockrun_runs_total", "ok")] == len(renames)


# -- the metrics file under concurrency ---------------------------------------------------------


def test_concurrent_busy_runs_lose_no_count(
    file_uri: str, name: str, tmp_path: Path, held: Callable[..., Held]
) -> None:
    """Ten busy lockruns beside a holder that records its start: skipped = the 75s counted."""
    metrics = tmp_path / "m.prom"
    holder = held("--uri", file_uri, "-n", name, "--metrics-file", str(metrics))
    wait_for(metrics.exists, what="the holder's start record")
    argv = [*LOCKRUN, "--uri", file_uri, "-n", name, "-q", "--metrics-file", str(metrics), "--"]
    busy = [subprocess.Popen([*argv, "true"], env=unmeasured()) for _ in range(10)]
    statuses = [process.wait(60) for process in busy]
    assert holder.finish() == 0
    found = samples(metrics)
    assert found[of(name, "lockrun_skipped_total")] == statuses.count(ExitCode.BUSY) == 10
    assert found[of(name, "lockrun_runs_total", "ok")] == 1


UPDATES = """
import sys
from lockrun import metrics
def bump(locks):
    metrics.bump(metrics.counted(locks, ("default", sys.argv[2])), ("lockrun_skipped_total", ""))
for _ in range(int(sys.argv[3])):
    metrics.update(sys.argv[1], bump, log=lambda line: sys.exit(line), wait=60)
"""


def test_concurrent_updates_serialise_their_read_modify_write(tmp_path: Path, name: str) -> None:
    """Four processes bump one counter 30 times each, at once: it reads 120, no file left over."""
    metrics = tmp_path / "m.prom"
    argv = [sys.executable, "-c", UPDATES, str(metrics), name, "30"]
    workers = [subprocess.Popen(argv, env=unmeasured()) for _ in range(4)]
    assert [worker.wait(60) for worker in workers] == [0] * 4
    assert samples(metrics)[of(name, "lockrun_skipped_total")] == 120
    assert [entry.name for entry in tmp_path.iterdir()] == ["m.prom"]


# -- the real reader: node_exporter's textfile collector ----------------------------------------


def test_node_exporter_reads_the_file_without_an_error(
    tmp_path: Path, name: str, held: Callable[..., Held]
) -> None:
    """A run, a skip and a hostile name: node_exporter serves them all and no scrape error."""
    program = shutil.which("node_exporter") or installed("prometheus-node-exporter")
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    hostile = f'{name} "quoted" back\\slash\nline'
    common = (
        "--uri",
        f"file://{tmp_path}/locks",
        "--metrics-file",
        str(textfiles / "lockrun.prom"),
    )
    holder = held(*common, "-n", name)
    assert lockrun(*common, "-n", name, "-q", "--", "true").returncode == ExitCode.BUSY
    assert holder.finish() == 0
    assert lockrun(*common, "-n", hostile, "--", "sh", "-c", "exit 3").returncode == 3
    port = free_port()
    exporter = subprocess.Popen(
        [program, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
         "--collector.textfile", f"--collector.textfile.directory={textfiles}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        scraped: list[str] = []
        wait_for(lambda: _scrape(port, scraped), what="node_exporter to answer")
    finally:
        exporter.kill()
        exporter.wait()
    found = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(scraped[0])
        for sample in family.samples
    }
    assert found[("node_textfile_scrape_error", frozenset())] == 0
    assert found[of(name, "lockrun_skipped_total")] == 1
    assert found[of(name, "lockrun_runs_total", "ok")] == 1
    assert found[of(hostile, "lockrun_runs_total", "failed")] == 1
    assert found[of(hostile, "lockrun_last_exit_status")] == 3


def _scrape(port: int, into: list[str]) -> bool:
    """Append node_exporter's /metrics to *into*; False while it does not answer yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            into.append(answer.read().decode())
    except OSError:
        return False
    return True
