"""The Python API's lease (lockrun.lock.Lease), in-process, on a clock the test moves.

The backend's lease is a fake whose renewals the test scripts: the subject is what
`lockrun.lock.Lease` makes of them. docs/design.md A10 is the rule: a lease counts from when
the request that proved it was *sent*, and is lost once unconfirmed at its deadline, a tenth
of the ttl before the service may give it away.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import pytest

from lockrun import lock
from lockrun.errors import BackendUnavailable, ConfigError, LeaseLost, TakenOver
from lockrun.lease_clock import MARGIN, RETRY
from lockrun.lock import Lease
from lockrun.timing import now
from tests.support.cli import wait_for

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

TTL = 30.0
GRANTED = 100.0  # when the grant's request was sent
DEADLINE = GRANTED + TTL * (1 - MARGIN)  # 127: unconfirmed by then, the lease is lost
KEY = ("redis://localhost", "default", "unit-api-lease")


class Clock:
    """`timing.now` as the test sets it."""

    def __init__(self) -> None:
        self.time = GRANTED

    def __call__(self) -> float:
        return self.time


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(lock, "now", fake)
    return fake


class Scripted:
    """A backend lease whose every refresh does the next thing of its script.

    None answers (the lease is ours); an exception is raised; a callable is called (it may
    move the clock: a refresh that takes that long), then the next entry is taken.
    """

    slot, fence, fds, sessions, orphan = 1, 7, (), (), None

    def __init__(
        self, *script: object, ttl: float | None = TTL, bells: tuple[int, ...] = ()
    ) -> None:
        self.script = list(script)
        self.ttl = ttl
        self.bells = bells
        self.confirmed = GRANTED
        self.refreshes = 0
        self.released: list[float] = []

    def refresh(self) -> None:
        self.refreshes += 1
        step = self.script.pop(0)
        while callable(step) and not isinstance(step, BaseException):
            step()
            step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step

    def release(self, hold: float = 0.0) -> bool:
        self.released.append(hold)
        return True


def held(backend: Scripted, hold: float = 0.0) -> Lease:
    return Lease(backend, KEY, hold)


def takes(clock: Clock, seconds: float) -> Callable[[], None]:
    """Return a step of a refresh that answers *seconds* after it was sent."""

    def wait() -> None:
        clock.time += seconds

    return wait


# -- what the backend's lease says is kept ------------------------------------------------


@pytest.mark.usefixtures("clock")
def test_a_lease_shows_the_backends_slot_fence_and_ttl() -> None:
    """The API's lease says which slot, which fence and how long, as the backend granted."""
    lease = held(Scripted())
    assert (lease.slot, lease.fence, lease.ttl) == (1, 7, TTL)
    assert lease.confirmed == GRANTED
    assert (lease.lost, lease.taken, lease.released) == (None, None, False)


# -- renew ----------------------------------------------------------------------------------


def test_a_good_renewal_is_due_again_a_third_of_the_ttl_later(clock: Clock) -> None:
    """Renewed at 110: confirmed from 110, the next one in ttl/3."""
    lease = held(Scripted(None))
    clock.time = 110.0
    assert lease.renew() == pytest.approx(TTL / 3)
    assert lease.confirmed == 110.0


def test_a_renewal_counts_from_when_it_was_sent(clock: Clock) -> None:
    """An answer 5 s late proves the lease from its sending (110), not from 115."""
    lease = held(Scripted(takes(clock, 5.0), None))
    clock.time = 110.0
    assert lease.renew() == pytest.approx(110.0 + TTL / 3 - 115.0)
    assert lease.confirmed == 110.0


def test_a_renewal_answered_after_its_successor_was_due_is_renewed_at_once(clock: Clock) -> None:
    """Answered 15 s after it was sent: the next one is overdue, so due now (0), not negative."""
    lease = held(Scripted(takes(clock, 15.0), None))
    clock.time = 110.0
    assert lease.renew() == 0.0


@pytest.mark.parametrize(
    "error", [BackendUnavailable("connection refused"), ConfigError("no such database")]
)
def test_a_renewal_without_an_answer_is_a_doubt_asked_again_soon(
    clock: Clock, error: Exception
) -> None:
    """Unavailable or refused: not lost yet, asked again after RETRY; the lease still checks."""
    lease = held(Scripted(error))
    clock.time = 110.0
    assert lease.renew() == pytest.approx(RETRY)
    assert lease.lost is None
    assert lease.confirmed == GRANTED
    lease.check()


def test_a_doubt_at_the_deadline_is_a_lost_lease(clock: Clock) -> None:
    """Still unconfirmed at 0.9 ttl after the last good renewal was sent: lost, with the why."""
    lease = held(Scripted(BackendUnavailable("connection refused")))
    clock.time = DEADLINE
    assert lease.renew() is None
    assert isinstance(lease.lost, LeaseLost)
    assert str(lease.lost) == "lease could not be confirmed: connection refused"


def test_a_renewal_that_hangs_past_the_deadline_and_fails_loses_the_lease(clock: Clock) -> None:
    """Sent at 110, failed at 140: the deadline (127, from the grant) passed meanwhile."""
    lease = held(Scripted(takes(clock, 30.0), BackendUnavailable("timed out")))
    clock.time = 110.0
    assert lease.renew() is None
    assert isinstance(lease.lost, LeaseLost)


def test_a_renewal_that_hangs_then_answers_keeps_the_lease(clock: Clock) -> None:
    """Sent at 110, proved at 140: the lease runs from 110, so it is held until 137."""
    lease = held(Scripted(takes(clock, 30.0), None))
    clock.time = 110.0
    assert lease.renew() == 0.0
    assert lease.lost is None
    clock.time = 110.0 + TTL * (1 - MARGIN) - 0.001
    lease.check()


def test_a_lease_the_service_says_is_gone_is_lost_at_once(clock: Clock) -> None:
    """LeaseLost from the service: no next renewal, the lease lost with the service's words."""
    gone = LeaseLost("the lock was taken over")
    lease = held(Scripted(gone))
    clock.time = 110.0
    assert lease.renew() is None
    assert lease.lost is gone


def test_a_take_over_asked_is_kept_and_the_lease_still_renewed(clock: Clock) -> None:
    """TakenOver: the slot is ours and proved so; renewals go on until the release."""
    asked = TakenOver("taken over by alice")
    lease = held(Scripted(asked, None))
    clock.time = 110.0
    assert lease.renew() == pytest.approx(TTL / 3)
    assert lease.taken is asked
    assert lease.confirmed == 110.0
    clock.time = 120.0
    assert lease.renew() == pytest.approx(TTL / 3)
    assert lease.taken is asked  # a later good renewal does not forget it


def test_a_bug_in_a_renewal_is_a_doubt_too(clock: Clock) -> None:
    """Any exception of the backend is a doubt the deadline settles, not a dead thread."""
    lease = held(Scripted(RuntimeError("a bug in the driver")))
    clock.time = 110.0
    assert lease.renew() == pytest.approx(RETRY)
    assert lease.lost is None


# -- confirm --------------------------------------------------------------------------------


def test_confirm_returns_why_the_service_did_not_answer(clock: Clock) -> None:
    """The doubt's cause for the caller to log; None once the service answered."""
    refused = BackendUnavailable("connection refused")
    lease = held(Scripted(refused, None))
    clock.time = 110.0
    assert lease.confirm() is refused
    clock.time = 111.0
    assert lease.confirm() is None
    assert lease.confirmed == 111.0


# -- check ----------------------------------------------------------------------------------


def test_check_passes_until_the_deadline_and_not_after(clock: Clock) -> None:
    """Never renewed: held just before 0.9 ttl from the grant's sending, lost at it."""
    lease = held(Scripted())
    clock.time = DEADLINE - 0.001
    lease.check()
    clock.time = DEADLINE
    with pytest.raises(LeaseLost, match="the lease was not confirmed for 27s"):
        lease.check()


def test_check_counts_from_the_last_good_renewal(clock: Clock) -> None:
    """Renewed at 120: the deadline moves to 147."""
    lease = held(Scripted(None))
    clock.time = 120.0
    lease.renew()
    clock.time = 120.0 + TTL * (1 - MARGIN) - 0.001
    lease.check()
    clock.time = 120.0 + TTL * (1 - MARGIN)
    with pytest.raises(LeaseLost):
        lease.check()


def test_check_asks_no_server(clock: Clock) -> None:
    """Cheap for every step of a loop: it reads what renewals found, no refresh."""
    backend = Scripted()
    lease = held(backend)
    clock.time = 120.0
    lease.check()
    assert backend.refreshes == 0


def test_check_raises_what_a_renewal_found_lost(clock: Clock) -> None:
    """The service's own error, the same object, as soon as a renewal found it."""
    gone = LeaseLost("the key is gone")
    lease = held(Scripted(gone))
    clock.time = 110.0
    lease.renew()
    with pytest.raises(LeaseLost) as raised:
        lease.check()
    assert raised.value is gone


def test_check_raises_a_take_over_asked(clock: Clock) -> None:
    """TakenOver (79) while the slot is still ours: the block should end and release."""
    lease = held(Scripted(TakenOver("taken over")))
    clock.time = 110.0
    lease.renew()
    with pytest.raises(TakenOver):
        lease.check()
    with pytest.raises(TakenOver):  # kept: every check says it until the release
        lease.check()


def test_a_lost_lease_is_said_before_a_take_over(clock: Clock) -> None:
    """Asked to stop, then found gone: the loss is what matters (76)."""
    lease = held(Scripted(TakenOver("taken over"), LeaseLost("gone")))
    clock.time = 110.0
    lease.renew()
    clock.time = 120.0
    lease.renew()
    with pytest.raises(LeaseLost, match="gone"):
        lease.check()


def test_a_local_lock_is_never_lost_by_time(clock: Clock) -> None:
    """A lease with no ttl: no deadline, however long the block runs."""
    lease = held(Scripted(ttl=None))
    clock.time = 1e9
    lease.check()


@pytest.fixture
def bell() -> Iterator[tuple[int, int]]:
    read, write = os.pipe()
    try:
        yield read, write
    finally:
        os.close(read)
        os.close(write)


def test_a_rung_bell_makes_check_renew_and_see_the_take_over(
    clock: Clock, bell: tuple[int, int]
) -> None:
    """A take-over bell readable: check renews at once and raises the TakenOver it found."""
    backend = Scripted(TakenOver("taken over by bob"), bells=(bell[0],))
    lease = held(backend)
    os.write(bell[1], b"!")
    clock.time = 101.0
    with pytest.raises(TakenOver, match="bob"):
        lease.check()
    assert backend.refreshes == 1


@pytest.mark.usefixtures("clock")
def test_a_silent_bell_asks_nothing(bell: tuple[int, int]) -> None:
    """Nothing to read on the bell: no renewal, check passes."""
    backend = Scripted(bells=(bell[0],))
    lease = held(backend)
    lease.check()
    assert backend.refreshes == 0


@pytest.mark.usefixtures("clock")
def test_a_bell_after_a_take_over_asks_no_more(bell: tuple[int, int]) -> None:
    """Once a take-over is known, a bell adds nothing: no second renewal."""
    backend = Scripted(TakenOver("taken over"), bells=(bell[0],))
    lease = held(backend)
    os.write(bell[1], b"!")
    with pytest.raises(TakenOver):
        lease.check()
    with pytest.raises(TakenOver):
        lease.check()
    assert backend.refreshes == 1


# -- release --------------------------------------------------------------------------------


@pytest.mark.usefixtures("clock")
def test_release_gives_the_slot_back_once() -> None:
    """Idempotent: the backend is asked to release once, however often it is called."""
    backend = Scripted()
    lease = held(backend)
    lease.release()
    lease.release()
    assert backend.released == [0.0]
    assert lease.released


@pytest.mark.usefixtures("clock")
def test_a_released_lease_checks_as_lost() -> None:
    """Released: it holds the lock no more, and check says so (76)."""
    lease = held(Scripted())
    lease.release()
    with pytest.raises(
        LeaseLost, match=r"unit-api-lease: released; this lease holds the lock no more"
    ):
        lease.check()


def test_release_keeps_what_is_left_of_hold_at_least(clock: Clock) -> None:
    """hold_at_least 10 s, released after 4: the slot stays taken 6 s more."""
    backend = Scripted()
    lease = held(backend, hold=10.0)
    clock.time += 4.0
    lease.release()
    assert backend.released == [pytest.approx(6.0)]


def test_release_after_hold_at_least_leaves_no_window(clock: Clock) -> None:
    """Held past the window: released at once, never a negative hold."""
    backend = Scripted()
    lease = held(backend, hold=10.0)
    clock.time += 60.0
    lease.release()
    assert backend.released == [0.0]


def test_release_of_a_lost_lease_releases_and_raises_the_loss(clock: Clock) -> None:
    """The code under the lock may have overlapped another holder's: said at the release."""
    gone = LeaseLost("the key is gone")
    backend = Scripted(gone)
    lease = held(backend)
    clock.time = 110.0
    lease.renew()
    with pytest.raises(LeaseLost) as raised:
        lease.release()
    assert raised.value is gone
    assert backend.released == [0.0]


def test_a_released_lost_lease_says_its_loss_not_its_release(clock: Clock) -> None:
    """After the release of a lost lease, check still says why it was lost."""
    lease = held(Scripted(LeaseLost("the key is gone")))
    clock.time = 110.0
    lease.renew()
    with pytest.raises(LeaseLost):
        lease.release()
    with pytest.raises(LeaseLost, match="the key is gone"):
        lease.check()


# -- the renewals' thread -----------------------------------------------------------------


def test_an_acquisition_due_no_sooner_than_the_renewals_thread_wakes_does_not_wake_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lease due later than the thread's own wake-up costs no switch to that thread."""
    renewals = lock._Renewals()

    def lease(confirmed: float) -> Lease:
        backend = Scripted(ttl=3600.0)  # never due within the test
        backend.confirmed = confirmed
        return held(backend)

    renewals.add(lease(now()))  # starts the thread, which sleeps until that one is due
    wait_for(lambda: renewals.wakes_at < math.inf, what="the renewals' thread to sleep")
    notified: list[int] = []
    monkeypatch.setattr(renewals.changed, "notify", lambda n=1: notified.append(n))
    for _ in range(5):  # acquire and release in a loop: each due after the first
        renewals.drop(renewals.add(lease(now())))
    assert notified == []
    renewals.add(lease(now() - 600.0))  # due before the thread would wake: woken
    assert notified == [1]
