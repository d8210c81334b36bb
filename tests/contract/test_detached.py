"""One lock held across jobs with no process at all: `lockrun acquire --no-keeper`.

On every backend whose registry row says it can (`Scheme.detachable`): Redis and etcd.

Each "job" is a process of its own that knows only the token and the lock URI from its
environment, as CI jobs on other runners would. Who ran when is judged by the oracle
(tests/support/oracle.py): the kernel's word on when each command connected and hung up,
not lockrun's (docs/semantics.md "Holding a lock across steps").
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from typing import TYPE_CHECKING, cast

import pytest

from lockrun import Lock, LockBusy
from lockrun.backends import Detachable, open_backend, parse_uri
from lockrun.detached import _hand_over, _Interrupts, acquire, parse_token, release
from lockrun.errors import Interrupted
from lockrun.lock import acquire as acquire_slot
from lockrun.runner import Options
from lockrun.uri import SCHEMES
from tests.support.cli import (
    LOCKRUN,
    lock_state,
    lockrun,
    one_line,
    queue_length,
    taken,
    wait_for,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from tests.support.oracle import Oracle

SLACK = 5.0  # Python start-ups on a loaded 2-core machine
# How far a lease's end, as the service reports and keeps it, is from the ms: etcd counts
# whole seconds (its time-to-live is cut to one) and ends leases twice a second
# (docs/semantics.md, "Across jobs and hosts"); Redis keeps ms.
GRAIN = {"redis": 0.0, "etcd": 1.5}


def grain(uri: str) -> float:
    """Return *uri*'s service's `GRAIN`."""
    return GRAIN[parse_uri(uri).kind.backend]


@pytest.fixture(
    params=[name for name, kind in SCHEMES.items() if kind.detachable and name == kind.backend]
)
def detachable_uri(request: pytest.FixtureRequest) -> str:
    """Return the session's server of each backend that keeps a lease with no process."""
    uri: str = request.getfixturevalue(f"{request.param}_uri")
    return uri


def job(uri: str, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``lockrun ARGS`` as a job of its own: the URI (and token) from its environment."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("LOCKRUN_")}
    env["LOCKRUN_URI"] = uri
    if token is not None:
        env["LOCKRUN_TOKEN"] = token
    return lockrun(*args, env=env)


def test_jobs_hold_one_lock_until_the_last_one_releases(
    detachable_uri: str,
    name: str,
    tmp_path: Path,
    oracle: Oracle,
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    """Acquire and exit, renew and release from other processes; nobody gets in before."""
    outputs = tmp_path / "github_output"
    options = ("--no-keeper", "--ttl", "30", "--env-file", str(outputs), "--var", "token")
    asked = time.time()
    taken = job(detachable_uri, "acquire", *options, name)  # as the GitHub example's lock job
    assert (taken.returncode, taken.stdout, taken.stderr) == (0, "", "")
    variable, _, token = outputs.read_text().strip().partition("=")
    assert variable == "token"
    (holder,) = lock_state(detachable_uri, name)["holders"]
    assert holder["detached"] is True  # the acquire has exited: nothing of ours holds it
    assert holder["argv"] == ["lockrun", "acquire", "--no-keeper", name]
    slack = grain(detachable_uri)
    assert asked + 30 - 0.05 - slack <= holder["expires"] <= time.time() + 30  # granted between
    shown = lockrun("status", "--uri", detachable_uri, name)
    assert "no process, until " in shown.stdout
    work = subprocess.Popen(oracle.command("deploy"))  # a job's step: under the lease alone
    oracle.wait_started("deploy")
    competitor = spawn(
        "--uri", detachable_uri, "-n", name, "-w", "60", "--", *oracle.command("next")
    )
    wait_for(lambda: queue_length(detachable_uri, name) == 1, what="the competitor to queue")
    renewed = job(detachable_uri, "renew", "-v", token=token)
    assert renewed.returncode == 0
    assert one_line(renewed.stderr).startswith(f"lockrun: {name} is held, until ")
    assert lock_state(detachable_uri, name)["holders"][0]["expires"] > holder["expires"]
    (deploy,) = oracle.started("deploy")
    oracle.release(deploy)
    oracle.wait_ended(deploy)
    assert work.wait(30) == 0
    assert oracle.started("next") == []
    asked = time.monotonic()
    released = job(detachable_uri, "release", "-v", token=token)
    assert (released.returncode, released.stderr) == (0, f"lockrun: released {name}\n")
    following = oracle.wait_started("next")
    assert following.start > asked
    assert oracle.overlaps() == []
    for verb in ("release", "renew"):
        again = job(detachable_uri, verb, token=token)
        assert again.returncode == 76
        assert "no lease for this token" in one_line(again.stderr)
    oracle.release(following)
    assert competitor.wait(30) == 0


def test_a_lease_nobody_renews_frees_itself_one_ttl_later(
    detachable_uri: str,
    name: str,
    oracle: Oracle,
    spawn: Callable[..., subprocess.Popen[str]],
    record: Callable[..., None],
) -> None:
    """Every job gone: the next holder starts once the ttl ran out on the server, not before."""
    taken = job(detachable_uri, "acquire", "--no-keeper", "--ttl", "3", name)
    assert taken.returncode == 0, taken.stderr
    expires = lock_state(detachable_uri, name)["holders"][0]["expires"]  # the server's clock
    competitor = spawn(
        "--uri", detachable_uri, "-n", name, "-w", "60", "--", *oracle.command("next")
    )
    wait_for(lambda: queue_length(detachable_uri, name) == 1, what="the competitor to queue")
    queued_in_time = time.time() < expires
    following = oracle.wait_started("next", timeout=30)
    started = following.start + time.time() - time.monotonic()  # as Unix time: one host
    assert expires <= started
    # Redis dates a grant on its own clock, in the granting script; etcd has no clock to
    # ask, and the holder dates its record as its command starts (docs/design.md A13).
    granted = lock_state(detachable_uri, name)["holders"][0]["since"]
    if not grain(detachable_uri):
        assert expires <= granted <= started
    if queued_in_time:  # it waited: the lateness is the lease's, not a slow start-up's
        assert started - expires < 1.0 + grain(detachable_uri)
        record(
            "after a kept lease ran out",
            grant=granted - expires,
            command_start=started - expires,
        )
    oracle.release(following)
    assert competitor.wait(30) == 0
    late = job(detachable_uri, "renew", token=taken.stdout.strip())
    assert late.returncode == 76


def test_a_take_over_waits_for_the_renewal_that_lets_go(
    detachable_uri: str,
    name: str,
    oracle: Oracle,
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    """--take-over cannot stop a lease with no process: its next renew exits 79 and frees it."""
    token = job(detachable_uri, "acquire", "--no-keeper", "--ttl", "30", name).stdout.strip()
    taker = spawn(
        *("--uri", detachable_uri, "-n", name, "--take-over", "-w", "60"),
        *("--", *oracle.command("taker")),
    )
    wait_for(lambda: queue_length(detachable_uri, name) == 1, what="the taker to queue")
    assert taken(detachable_uri, name)
    assert oracle.started("taker") == []
    asked = time.monotonic()
    renewed = job(detachable_uri, "renew", token=token)
    assert renewed.returncode == 79
    assert one_line(renewed.stderr).startswith(f"lockrun: {name}: taken over by ")
    assert "released it" in renewed.stderr
    following = oracle.wait_started("taker")
    assert following.start > asked
    assert job(detachable_uri, "release", token=token).returncode == 76
    oracle.release(following)
    assert taker.wait(30) == 0
    token = kept(detachable_uri, name)  # and a release lets a waiting taker in: held until then
    taker = spawn(
        *("--uri", detachable_uri, "-n", name, "--take-over", "-w", "60"),
        *("--", *oracle.command("second")),
    )
    wait_for(lambda: queue_length(detachable_uri, name) == 1, what="the second taker to queue")
    asked = time.monotonic()
    assert release(token, detachable_uri) == f"released {name}; a take-over waited, and runs next"
    assert oracle.wait_started("second").start > asked
    oracle.release(oracle.started("second")[0])
    assert taker.wait(30) == 0


def kept(uri: str, name: str, **options: object) -> str:
    """Take *name* with --no-keeper, in this process; return the token."""
    tokens: list[str] = []
    settings = Options(name=name, uri=uri, ttl=30.0, **options)  # type: ignore[arg-type]
    assert acquire(settings, tokens.append, log=lambda _line: None) == 0
    return tokens[0]


def test_readers_slots_and_a_window_are_kept_too(detachable_uri: str, name: str) -> None:
    """--shared, --slots and --hold-at-least with --no-keeper: as with a keeper or a run."""
    readers = [kept(detachable_uri, name, shared=True, verbose=True, wait=1.0) for _ in range(2)]
    holders = lock_state(detachable_uri, name)["holders"]
    assert [(each["shared"], each["detached"]) for each in holders] == [(True, True)] * 2
    writer = Lock(name, uri=detachable_uri)  # waits for every reader, kept by no process
    with pytest.raises(LockBusy, match=r"\(shared\) since .*, a lease with no process until"):
        writer.acquire()
    writer.close()
    for token in readers:
        release(token, detachable_uri)
    slots = [kept(detachable_uri, f"{name}-n", slots=2) for _ in range(2)]
    with pytest.raises(LockBusy):
        kept(detachable_uri, f"{name}-n", slots=2)
    for token in slots:
        release(token, detachable_uri)
    token = kept(detachable_uri, name, hold_at_least=20.0)
    granted = lock_state(detachable_uri, name)["holders"][0]["since"]
    said = release(token, detachable_uri)
    assert re.fullmatch(rf"released {name} \(taken [0-9.]+s more: --hold-at-least\)", said)
    (window,) = lock_state(detachable_uri, name)["holders"]
    assert window["detached"] is False  # a window, as a run leaves: counted from the grant
    assert window["until"] == pytest.approx(granted + 20, abs=0.01 + grain(detachable_uri))
    assert taken(detachable_uri, name)
    assert parse_token(token).hold_ms == 20000


def test_a_signal_while_waiting_or_an_unwritable_token_leaves_nothing(
    detachable_uri: str, name: str
) -> None:
    """TERM while acquire --no-keeper waits: 143, out of the queue; a closed stdout: 74, freed."""
    token = kept(detachable_uri, name)
    waiter = subprocess.Popen(
        [
            *LOCKRUN,
            "acquire",
            "--uri",
            detachable_uri,
            "--no-keeper",
            "--ttl",
            "30",
            "-w",
            "1m",
            name,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LOCKRUN_VERBOSE": "1"},
    )
    wait_for(lambda: queue_length(detachable_uri, name) == 1, what="the acquire to queue")
    waiter.send_signal(signal.SIGUSR1)  # noted and dropped (taken first: the lower number)
    waiter.send_signal(signal.SIGTERM)
    out, err = waiter.communicate(timeout=30)
    assert (waiter.returncode, out) == (143, "")
    lines = err.splitlines()
    assert f"lockrun: SIGUSR1 while waiting for {name}: no command to pass it to; dropped" in lines
    assert lines[-1] == f"lockrun: SIGTERM while waiting for {name}; nothing is held"
    assert queue_length(detachable_uri, name) == 0
    release(token, detachable_uri)
    read, write = os.pipe()
    os.close(read)
    unwritten = subprocess.run(
        [*LOCKRUN, "acquire", "--uri", detachable_uri, "--no-keeper", "--ttl", "30", name],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )
    os.close(write)
    assert unwritten.returncode == 74
    assert "released the lock" in one_line(unwritten.stderr)
    assert not taken(detachable_uri, name)


def test_a_signal_before_the_wait_or_after_the_grant_holds_nothing(
    detachable_uri: str, name: str
) -> None:
    """TERM before the backend could be told, or between the grant and the token: released."""
    ours = parse_token(kept(detachable_uri, name))  # so that a wait would block
    request = ours.request()._replace(lease_id="0123456789abcdef0123")
    with _Interrupts(lambda _line: None, name) as interrupts:
        assert interrupts.thread.ident is not None
        signal.pthread_kill(interrupts.thread.ident, signal.SIGTERM)  # at the thread alone
        wait_for(lambda: interrupts.signo == signal.SIGTERM, what="the thread to take it")
        backend = open_backend(parse_uri(detachable_uri), ttl=30)
        interrupts.watch(
            cast("Detachable", backend)
        )  # the signal came first: ends the wait at once
        with pytest.raises(Interrupted, match=f"TERM while waiting for {name}") as raised:
            interrupts.wait(lambda: acquire_slot(backend, request, 60))
        assert raised.value.exit_code == 143
        assert queue_length(detachable_uri, name) == 0
        release(str(ours), detachable_uri)
        lease = acquire_slot(backend, request, 0)  # granted; the TERM is still on record
        delivered: list[str] = []
        token = ours._replace(lease_id=request.lease_id)
        with pytest.raises(
            Interrupted, match=rf"TERM before the token of {name} was written; released it"
        ):
            _hand_over(lease, token, delivered.append, interrupts)
        backend.close()
    assert delivered == []
    assert not taken(detachable_uri, name)
