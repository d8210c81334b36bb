"""The lease clock's state machine (lockrun.lease_clock), in milliseconds: no process, no server.

docs/design.md A10 is the rule these cases hold it to: a lease counts from when the proving
request was sent, a renewal without an answer is a doubt, the deadline is a tenth of the
ttl early, and a doubt is given up --kill-after before it.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun.lease_clock import MARGIN, RETRY, Answer, LeaseClock, Verdict

TTL = 30.0


def clock(*, kill_after: float = 10.0, confirmed: float = 100.0) -> LeaseClock:
    return LeaseClock(TTL, confirmed, every=TTL / 3, kill_after=kill_after)


def test_a_fresh_lease_is_renewed_a_third_of_the_ttl_after_its_request_was_sent() -> None:
    """Counted from the request (100), not from the answer nor from now."""
    lease = clock()
    assert lease.refresh_due() == 110.0
    assert lease.deadline() == pytest.approx(100.0 + TTL * (1 - MARGIN))
    assert lease.verdict(109.0) is Verdict.HELD


def test_a_renewal_counts_from_when_it_was_sent_not_when_it_answered() -> None:
    """An answer that took 5 s moves the lease by the send time only."""
    lease = clock()
    lease.sending(110.0)
    assert lease.refresh_due() == math.inf  # one at a time
    lease.answered(110.0, Answer.HELD)
    assert lease.confirmed == 110.0
    assert lease.refresh_due() == 120.0
    assert lease.deadline() == pytest.approx(110.0 + 27.0)


def test_a_failed_renewal_is_a_doubt_asked_again_after_retry() -> None:
    """The doubt keeps the old confirmation: the deadline does not move."""
    lease = clock()
    lease.sending(110.0)
    lease.answered(110.0, Answer.DOUBT, "connection refused")
    assert lease.doubt == "connection refused"
    assert lease.refresh_due() == 110.0 + RETRY
    assert lease.deadline() == pytest.approx(127.0)
    assert lease.verdict(111.0) is Verdict.HELD


def test_a_renewal_that_hangs_is_a_doubt_after_retry() -> None:
    """Until RETRY it is just slow; then the loop must plan for a stop."""
    lease = clock()
    lease.sending(110.0)
    assert not lease.waiting(110.0 + RETRY / 2)
    assert lease.verdict(110.0 + RETRY / 2) is Verdict.HELD
    assert lease.waiting(110.0 + RETRY)
    assert lease.doubt == f"no answer for {RETRY:.1f}s"
    assert not lease.waiting(115.0)  # once


def test_a_doubt_is_given_up_kill_after_before_the_deadline() -> None:
    """TERM at term_due, so that KILL after --kill-after lands by the deadline."""
    lease = clock(kill_after=10.0)
    lease.answered(110.0, Answer.DOUBT, "down")
    assert lease.term_due() == pytest.approx(127.0 - 10.0)
    assert lease.verdict(116.9) is Verdict.HELD
    assert lease.verdict(117.0) is Verdict.GIVE_UP
    assert lease.verdict(127.0) is Verdict.LOST


def test_a_long_kill_after_is_cut_to_half_the_lease() -> None:
    """A --kill-after of a minute on a 30 s lease would stop the command at once."""
    lease = clock(kill_after=60.0)
    assert lease.term_due() == pytest.approx(127.0 - 13.5)


def test_a_confirmed_lease_is_not_given_up_at_term_due() -> None:
    """Only a doubt stops early; a confirmed lease runs to its deadline."""
    lease = clock()
    assert lease.verdict(lease.term_due()) is Verdict.HELD


def test_the_deadline_loses_a_lease_nobody_answered_for() -> None:
    """The API's and the supervisor's one rule: unconfirmed at the deadline is lost."""
    lease = clock()
    assert lease.verdict(126.9) is Verdict.HELD
    assert lease.verdict(127.0) is Verdict.LOST


def test_the_service_saying_lost_is_final() -> None:
    """A later answer cannot bring it back, and nothing more is due."""
    lease = clock()
    lease.answered(110.0, Answer.LOST)
    assert lease.verdict(110.0) is Verdict.LOST
    assert lease.refresh_due() == math.inf


def test_a_take_over_answer_still_confirms() -> None:
    """The taker waits for our release: the lease is ours and proved so."""
    lease = clock()
    lease.answered(115.0, Answer.TAKEN)
    assert lease.confirmed == 115.0
    assert lease.verdict(120.0) is Verdict.HELD


def test_a_bell_makes_the_renewal_due_now_and_the_renewal_answers_it() -> None:
    """A take-over bell asks for a renewal at once; sending it clears the bell."""
    lease = clock()
    lease.ring()
    assert lease.refresh_due() == -math.inf
    lease.sending(101.0)
    assert not lease.rung
    lease.answered(101.0, Answer.HELD)
    assert lease.refresh_due() == 111.0


def test_the_guardians_time_is_between_term_due_and_the_deadline() -> None:
    """A running lockrun sends TERM no later than this; a guardian acts after it."""
    lease = clock(kill_after=10.0)
    assert lease.latest_term() == pytest.approx(117.0)  # term_due
    lease.answered(125.0, Answer.DOUBT, "down")  # asked again at 126, a doubt at 127
    assert lease.latest_term() == pytest.approx(127.0)  # never past the deadline


def test_a_local_lock_has_no_deadline() -> None:
    """file: and abstract: are never lost by time; only the service's word loses them."""
    lease = LeaseClock(None, 100.0, every=10.0)
    assert lease.deadline() == math.inf
    assert lease.term_due() == math.inf
    lease.answered(110.0, Answer.DOUBT, "?")
    assert lease.verdict(1e9) is Verdict.HELD
    assert lease.refresh_due() == 111.0


@given(
    ttl=st.floats(1.0, 86400.0),
    kill_after=st.floats(0.0, 3600.0),
    steps=st.lists(st.tuples(st.floats(0.0, 100.0), st.sampled_from(list(Answer))), max_size=20),
)
def test_no_sequence_of_answers_lets_a_lease_outlive_its_last_proof(
    ttl: float, kill_after: float, steps: list[tuple[float, Answer]]
) -> None:
    """No answers let a lease outlive confirmed + ttl·(1−MARGIN).

    And the give-up time is never after the deadline nor before the last confirmation.
    """
    lease = LeaseClock(ttl, 0.0, kill_after=kill_after)
    current = 0.0
    for delay, answer in steps:
        current += delay
        lease.sending(current)
        lease.answered(current, answer, "why")
        assert lease.confirmed <= current
        assert lease.confirmed <= lease.term_due() <= lease.deadline()
        assert lease.deadline() == pytest.approx(lease.confirmed + ttl * (1 - MARGIN))
        assert lease.verdict(lease.deadline()) is Verdict.LOST
        if lease.doubt is None and not lease.lost:
            assert lease.verdict(lease.deadline() - ttl * 0.01) is Verdict.HELD
