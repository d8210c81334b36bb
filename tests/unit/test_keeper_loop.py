"""The keeper (lockrun.keeper._Keeper) in this process: its door, answers, timers and lease.

No fork and no server: the keeper is built as `acquire`'s child builds it, over a fake
lease whose refreshes the test scripts (the lease is what the keeper is tried against), and
its clients are sockets of the test at its door. Most tests take one step at a time (accept,
serve, tick); the last ones run its loop while `lockrun.door.ask` knocks from a thread.
docs/semantics.md "Holding a lock across steps" is the contract.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

from lockrun import keeper as keeper_module
from lockrun.door import BUSY, MAX_REPLY, ask, read_reply
from lockrun.errors import BackendUnavailable, ExitCode, LeaseLost, TakenOver
from lockrun.hold import make_request
from lockrun.keeper import _Keeper, _Signals
from lockrun.runner import Options
from lockrun.supervise import FORWARDED
from lockrun.timing import now

if TYPE_CHECKING:
    from collections.abc import Iterator

NAME = "unit-keeper"


class FakeLease:
    """A held slot whose refreshes raise what the test queued (nothing: the lease is ours)."""

    slot, fence, fds, sessions, bells, orphan = 0, 3, (), (), (), None

    def __init__(self, *, heard: bool = True, ttl: float | None = 30.0) -> None:
        self.ttl = ttl
        self.confirmed = now()
        self.heard = heard
        self.errors: list[Exception] = []
        self.refreshes = 0
        self.released: list[float] = []

    def refresh(self) -> None:
        self.refreshes += 1
        if self.errors:
            raise self.errors.pop(0)

    def release(self, hold: float = 0.0) -> bool:
        self.released.append(hold)
        return self.heard


@pytest.fixture
def lease() -> FakeLease:
    return FakeLease()


@pytest.fixture
def lines() -> list[str]:
    return []


def make_keeper(lease: FakeLease, lines: list[str], **options: object) -> _Keeper:
    """Return a keeper of *lease* as `acquire`'s child makes it, with *options* of the CLI."""
    chosen = Options(name=NAME, verbose=True, **options)  # type: ignore[arg-type]
    request = make_request(chosen, "default", NAME, ("lockrun", "acquire", "--owner", "none"))
    return _Keeper(chosen, request, lease, None, lines.append, None)


@pytest.fixture
def keeper(lease: FakeLease, lines: list[str]) -> Iterator[_Keeper]:
    made = make_keeper(lease, lines)
    try:
        yield made
    finally:
        made.close()


def knock(keeper: _Keeper) -> tuple[socket.socket, int]:
    """Connect to *keeper*'s door and have it take the connection; return ours and its fd."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.settimeout(10)
    client.connect(keeper.token.door)
    before = set(keeper.clients)
    keeper._accept()
    (fd,) = set(keeper.clients) - before
    return client, fd


def exchange(keeper: _Keeper, request: bytes) -> bytes:
    """Send *request* through the door, have the keeper serve it, and return its answer."""
    client, fd = knock(keeper)
    with client:
        client.send(request)
        keeper._serve(fd)
        return client.recv(MAX_REPLY + 1)


def converse(keeper: _Keeper, request: bytes) -> tuple[int, str] | None:
    """Return the keeper's answer to *request*, read as `ask` reads it."""
    return read_reply(exchange(keeper, request))


def secret(keeper: _Keeper) -> bytes:
    return keeper.token.secret.encode()


# -- release --------------------------------------------------------------------------------


def test_release_with_the_secret_releases_and_ends_the_keeper(
    keeper: _Keeper, lease: FakeLease
) -> None:
    """`release TOKEN`: proved ours by a renewal, released with no window, 0; the keeper ends."""
    reply = converse(keeper, b"release " + secret(keeper))
    assert reply is not None
    status, message = reply
    assert status == 0
    assert message.startswith(f"released {NAME} after ")
    assert lease.refreshes == 1
    assert lease.released == [0.0]
    assert keeper.finished
    assert keeper.clients == {}


def test_a_wrong_secret_is_not_yours_and_changes_nothing(keeper: _Keeper, lease: FakeLease) -> None:
    """A token guessed but for its secret: 77, the lock still held, the keeper serving on."""
    assert converse(keeper, b"release " + b"x" * 24) == (
        ExitCode.NOPERM,
        "the token's secret is wrong: not yours",
    )
    assert lease.released == []
    assert not keeper.finished


def test_junk_at_the_door_is_a_usage_error(keeper: _Keeper, lease: FakeLease) -> None:
    """Anything but VERB SECRET: 64, and nothing done.

    Raw bytes: `read_reply` takes no 64, which `ask`, whose requests are good, never gets.
    """
    assert exchange(keeper, b"GET / HTTP/1.1") == b"64 not a request a keeper answers"
    assert (lease.refreshes, lease.released, keeper.finished) == (0, [], False)


def test_release_of_a_lease_found_gone_says_it_was_lost(keeper: _Keeper, lease: FakeLease) -> None:
    """The renewal before the release finds it gone: 76 naming the lock, never "released"."""
    lease.errors.append(LeaseLost("the key is gone"))
    assert converse(keeper, b"release " + secret(keeper)) == (
        ExitCode.LOST,
        f"{NAME}: the key is gone",
    )
    assert lease.released == [0.0]  # what is left of it goes back: a taker may run next
    assert keeper.finished


def test_release_after_a_take_over_was_asked_says_so(keeper: _Keeper, lease: FakeLease) -> None:
    """A take-over asked meanwhile: 79, the lock given to its taker."""
    lease.errors.append(TakenOver("taken over by alice"))
    assert converse(keeper, b"release " + secret(keeper)) == (
        ExitCode.TAKEN_OVER,
        f"{NAME}: taken over by alice",
    )
    assert lease.released == [0.0]


def test_an_unheard_release_is_unavailable_and_says_it_frees_itself(lines: list[str]) -> None:
    """The service never heard the release: 69, with the lock freeing by itself."""
    lease = FakeLease(heard=False)
    keeper = make_keeper(lease, lines)
    try:
        reply = converse(keeper, b"release " + secret(keeper))
    finally:
        keeper.close()
    assert reply is not None
    assert reply[0] == ExitCode.UNAVAILABLE
    assert reply[1].startswith(f"{NAME}: could not tell the server to release {NAME} after ")
    assert lease.released == [0.0]  # once: close() has nothing left to give back


def test_release_leaves_the_hold_at_least_window(lines: list[str]) -> None:
    """--hold-at-least 60: released with the window left, and the line says how long."""
    lease = FakeLease()
    keeper = make_keeper(lease, lines, hold_at_least=60.0)
    try:
        reply = converse(keeper, b"release " + secret(keeper))
    finally:
        keeper.close()
    assert reply is not None
    assert reply[0] == 0
    assert reply[1].endswith("more: --hold-at-least)")
    assert len(lease.released) == 1
    assert 59.0 < lease.released[0] <= 60.0


# -- renew ----------------------------------------------------------------------------------


def test_renew_proves_the_lock_held_by_asking_the_service(
    keeper: _Keeper, lease: FakeLease
) -> None:
    """`renew`: a round trip to the service, then 0 "is held"; the keeper holds on."""
    assert converse(keeper, b"renew " + secret(keeper)) == (0, f"{NAME} is held")
    assert lease.refreshes == 1
    assert lease.released == []
    assert not keeper.finished


def test_renew_with_max_time_counts_it_from_now(lines: list[str]) -> None:
    """--max-time: renewing moves its end to max-time from now, and says until when."""
    lease = FakeLease()
    keeper = make_keeper(lease, lines, max_time=600.0)
    try:
        keeper.deadline = now() + 1.0
        reply = converse(keeper, b"renew " + secret(keeper))
        assert keeper.deadline is not None
        assert keeper.deadline > now() + 500.0
    finally:
        keeper.close()
    assert reply is not None
    assert reply[0] == 0
    assert reply[1].startswith(f"{NAME} is held, until ")
    assert reply[1].endswith(" unless renewed")


def test_renew_unconfirmed_is_unavailable_and_the_keeper_holds_on(
    keeper: _Keeper, lease: FakeLease
) -> None:
    """The service did not answer: 69, and the lock is neither released nor given up."""
    lease.errors.append(BackendUnavailable("connection refused"))
    reply = converse(keeper, b"renew " + secret(keeper))
    assert reply is not None
    assert reply[0] == ExitCode.UNAVAILABLE
    assert "did not confirm the lease now (connection refused)" in reply[1]
    assert reply[1].startswith(f"{NAME}: ")
    assert lease.released == []
    assert keeper.held is not None
    assert not keeper.finished


def test_renew_of_a_lease_found_gone_is_lost_and_released(
    keeper: _Keeper, lease: FakeLease
) -> None:
    """The service says it is gone: 76, what is left released, the keeper lingering to say so."""
    lease.errors.append(LeaseLost("the key is gone"))
    assert converse(keeper, b"renew " + secret(keeper)) == (76, f"{NAME}: the key is gone")
    assert lease.released == [0.0]
    assert keeper.held is None
    assert not keeper.finished  # it lingers: a `release` may still ask why


def test_after_the_lock_ended_every_request_hears_why(keeper: _Keeper, lease: FakeLease) -> None:
    """Lost, then asked again: renew and release both answer the loss, nothing more released."""
    lease.errors.append(LeaseLost("the key is gone"))
    converse(keeper, b"renew " + secret(keeper))
    lost = (ExitCode.LOST, f"{NAME}: the key is gone")
    assert converse(keeper, b"renew " + secret(keeper)) == lost
    assert converse(keeper, b"release " + secret(keeper)) == lost
    assert lease.released == [0.0]


# -- the door -------------------------------------------------------------------------------


def test_a_crowd_at_the_door_is_told_busy(keeper: _Keeper) -> None:
    """More than CLIENTS at once: the ones past it hear BUSY and are hung up on."""
    crowd = [knock(keeper)[0] for _ in range(keeper_module.CLIENTS)]
    try:
        late = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        crowd.append(late)
        late.settimeout(10)
        late.connect(keeper.token.door)
        keeper._accept()
        assert len(keeper.clients) == keeper_module.CLIENTS
        assert read_reply(late.recv(MAX_REPLY + 1)) == (ExitCode.UNAVAILABLE, BUSY)
    finally:
        for client in crowd:
            client.close()


def test_a_client_that_does_not_ask_in_time_is_hung_up_on(keeper: _Keeper) -> None:
    """Silent past PATIENCE: hung up on at the next tick, its place freed."""
    client, fd = knock(keeper)
    with client:
        keeper.clients[fd] = keeper.clients[fd]._replace(deadline=now() - 1.0)
        keeper._tick()
        assert keeper.clients == {}
        assert client.recv(MAX_REPLY + 1) == b""


def test_a_client_within_its_patience_is_kept(
    keeper: _Keeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tick before its deadline leaves it connected."""
    monkeypatch.setattr(keeper_module, "PATIENCE", 3600.0)  # a stalled test is not a slow client
    client, fd = knock(keeper)
    with client:
        keeper._tick()
        assert fd in keeper.clients


def test_a_closed_keeper_has_no_door(lease: FakeLease, lines: list[str]) -> None:
    """close(): the lease given back, the door gone: `ask` finds no keeper (76)."""
    keeper = make_keeper(lease, lines)
    token = keeper.token
    keeper.close()
    assert lease.released == [0.0]
    with pytest.raises(LeaseLost, match="no keeper holds a lock for this token"):
        ask(str(token), "renew")


def test_each_keeper_has_its_own_door(lease: FakeLease, lines: list[str]) -> None:
    """Two keepers: two tokens, two names, two secrets."""
    first, second = make_keeper(lease, lines), make_keeper(FakeLease(), lines)
    try:
        assert first.token.door != second.token.door
        assert first.token.secret != second.token.secret
        assert first.token.uid == os.geteuid()
    finally:
        first.close()
        second.close()


# -- timers ---------------------------------------------------------------------------------


def test_a_tick_renews_when_due_and_not_before(keeper: _Keeper, lease: FakeLease) -> None:
    """Every ttl/3: a tick before renew_at asks nothing; one after renews and moves it on."""
    keeper._tick()
    assert lease.refreshes == 0
    keeper.renew_at = now() - 1.0
    keeper._tick()
    assert lease.refreshes == 1
    assert keeper.renew_at > now() + 5.0  # ttl/3 (10 s) on


def test_a_tick_that_finds_the_lease_gone_releases_it(keeper: _Keeper, lease: FakeLease) -> None:
    """A renewal that finds it gone ends the hold: released, the loss kept for `release`."""
    lease.errors.append(LeaseLost("the key is gone"))
    keeper.renew_at = now() - 1.0
    keeper._tick()
    assert keeper.held is None
    assert str(keeper.ended) == f"{NAME}: the key is gone"
    assert lease.released == [0.0]


def test_max_time_releases_with_the_window_and_tells_release(lines: list[str]) -> None:
    """--max-time up: released (its --hold-at-least window kept), and `release` hears 124."""
    lease = FakeLease()
    keeper = make_keeper(lease, lines, max_time=600.0, hold_at_least=60.0)
    try:
        keeper.deadline = now() - 1.0
        keeper._tick()
        assert keeper.held is None
        assert len(lease.released) == 1
        assert lease.released[0] > 59.0
        reply = converse(keeper, b"release " + secret(keeper))
    finally:
        keeper.close()
    assert reply == (
        ExitCode.TIMEOUT,
        f"{NAME}: --max-time 10m00s expired; the lock was released",
    )


def test_a_keeper_whose_lock_ended_lingers_then_ends(keeper: _Keeper, lease: FakeLease) -> None:
    """Ended: it waits LINGER for a `release` to ask why, then finishes."""
    lease.errors.append(LeaseLost("the key is gone"))
    keeper.renew_at = now() - 1.0
    keeper._tick()
    assert keeper.linger > now() + keeper_module.LINGER / 2
    keeper._tick()
    assert not keeper.finished
    keeper.linger = now() - 1.0
    keeper._tick()
    assert keeper.finished


def test_finish_gives_the_lock_back_once_with_its_window(lines: list[str]) -> None:
    """The owner exited: released with the window left; close() releases nothing more."""
    lease = FakeLease()
    keeper = make_keeper(lease, lines, hold_at_least=60.0)
    keeper.finish()
    keeper.close()
    assert keeper.finished
    assert len(lease.released) == 1
    assert lease.released[0] > 59.0


# -- signals and the loop -------------------------------------------------------------------


@pytest.fixture
def handlers() -> Iterator[None]:
    """Put back the handlers of the forwarded signals and the mask, which _Signals changes."""
    saved = {signo: signal.getsignal(signo) for signo in FORWARDED}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        yield
    finally:
        for signo, handler in saved.items():
            signal.signal(signo, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@pytest.mark.usefixtures("handlers")
def test_a_term_ends_the_keeper_with_143_and_releases(keeper: _Keeper, lease: FakeLease) -> None:
    """TERM to a keeper: its lock given back, its status 128+15."""
    with _Signals() as keeper.signals:
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        assert select.select([keeper.signals.fd], [], [], 30)[0]
        assert keeper.end_on_signals() == signal.SIGTERM
    assert keeper.status == 143
    assert keeper.finished
    assert lease.released == [0.0]


@pytest.mark.usefixtures("handlers")
def test_usr1_is_no_end_of_a_keeper(keeper: _Keeper, lease: FakeLease) -> None:
    """USR1 and USR2 have no command to go to: ignored, the lock kept."""
    with _Signals() as keeper.signals:
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        assert keeper.end_on_signals() == 0
    assert lease.released == []
    assert not keeper.finished


@pytest.mark.usefixtures("handlers")
def test_the_loop_serves_renew_then_release_to_ask(keeper: _Keeper, lease: FakeLease) -> None:
    """The keeper's own loop, `ask` from a thread: renewed, then released, and it returns."""
    token, loop = str(keeper.token), threading.get_ident()

    def client() -> list[str]:
        try:
            return [ask(token, "renew"), ask(token, "release")]
        except BaseException:
            signal.pthread_kill(loop, signal.SIGTERM)  # end the loop, so the failure shows
            raise

    with ThreadPoolExecutor(max_workers=1) as pool, _Signals() as keeper.signals:
        answers = pool.submit(client)
        keeper.run()
        assert answers.result(timeout=30)[0] == f"{NAME} is held"
        assert answers.result(timeout=30)[1].startswith(f"released {NAME} after ")
    assert keeper.finished
    assert lease.released == [0.0]
