"""The lease clock: when to renew a lease, when it is in doubt, when to stop, when it is lost.

Pure arithmetic over times the caller passes in: no threads, signals or I/O. The supervisor
(`lockrun.supervise`), the keeper (`lockrun.keeper`) and the Python API's renewals
(`lockrun.lock.Lease`) each drive one from their own loop, so the three agree by
construction (docs/design.md A10 states the rule):

- A lease counts from when the request that last proved it ours was *sent*, never from when
  the answer came: a stall anywhere after the grant comes out of the lease's time.
- It is renewed every *every* seconds (ttl/3). A renewal that fails, or that has not
  answered after `RETRY`, puts it in doubt; a doubted lease is asked again every `RETRY`.
- Its **deadline** is a tenth of the ttl (`MARGIN`) before the service may give it away. A
  lease is **lost** when the service says so, or when it is still unconfirmed at its
  deadline. A command under a doubted lease is sent TERM at `term_due`, --kill-after before
  the deadline (at most half the lease), so that KILL lands by it.

A local lock (``ttl`` None) has no deadline: only the service's word can lose it.
"""

from __future__ import annotations

import enum
import math
from typing import Final

RETRY: Final = 1.0  # a doubted lease is asked about again this often; a hang is a doubt after it
# The share of a lease held in reserve when it cannot be confirmed: KILL is due this much
# before the service may give the slot away (clock drift, scheduling).
MARGIN: Final = 0.1


class Answer(enum.Enum):
    """What a renewal found: the service's word, or none."""

    HELD = "held"  # proved ours
    TAKEN = "taken"  # proved ours, and another acquirer asked for a take-over
    LOST = "lost"  # the service says it is gone
    DOUBT = "doubt"  # no word: unreachable, refused, a reply askew


class Verdict(enum.Enum):
    """Where a lease stands at a given time."""

    HELD = "held"  # confirmed, or doubted with time left before anything must stop
    GIVE_UP = "give up"  # doubted too long: stop now so that KILL lands by the deadline
    LOST = "lost"  # gone: the service said so, or it is unconfirmed at its deadline


class LeaseClock:
    """The renewal and expiry times of one lease, and whether it is in doubt.

    *ttl* is the lease's (None: a local lock, never lost by time), *confirmed* the time the
    grant's request was sent, *every* the renewal period, *kill_after* the command's grace.
    """

    def __init__(
        self,
        ttl: float | None,
        confirmed: float,
        *,
        every: float | None = None,
        kill_after: float = 0.0,
    ) -> None:
        """Start the clock of a lease granted by a request sent at *confirmed*."""
        self.ttl = ttl
        self.every = every if every is not None else (ttl or 0.0) / 3
        self.kill_after = kill_after
        self.confirmed = confirmed
        self.next_refresh = confirmed + self.every
        self.doubt: str | None = None  # why the lease is unconfirmed, if it is
        self.asked: float | None = None  # when the renewal under way was sent
        self.rung = False  # a take-over bell rang: renew at once
        self.lost = False  # the service said so

    def deadline(self) -> float:
        """Return when KILL must have landed unless the lease is confirmed again."""
        if self.ttl is None:
            return math.inf
        return self.confirmed + self.ttl * (1 - MARGIN)

    def term_due(self) -> float:
        """Return when a doubted lease is given up: --kill-after before the deadline.

        A --kill-after longer than half the lease is shortened to that, so a refresh that
        hangs for a moment does not stop the command at once.
        """
        if self.ttl is None:
            return math.inf
        return self.deadline() - min(self.kill_after, self.ttl * (1 - MARGIN) / 2)

    def refresh_due(self) -> float:
        """Return when the next renewal should be sent (inf while one is under way)."""
        if self.lost or self.asked is not None:
            return math.inf
        return -math.inf if self.rung else self.next_refresh

    def latest_term(self) -> float:
        """Return the latest time a running lockrun sends TERM for this lease.

        A refresh due now is a doubt only `RETRY` later, and a doubt stops at `term_due`;
        never after the deadline. A guardian that outlives lockrun acts after this time.
        """
        return min(max(self.term_due(), self.next_refresh + RETRY), self.deadline())

    def ring(self) -> None:
        """Note a take-over bell: the next renewal is due now."""
        self.rung = True

    def sending(self, sent: float) -> None:
        """Note a renewal sent at *sent*; the bell that asked for it is answered by it."""
        self.asked = sent
        self.rung = False

    def waiting(self, current: float) -> bool:
        """Put the lease in doubt if the renewal under way is `RETRY` old; return whether it did."""
        if self.asked is None or self.doubt is not None or current - self.asked < RETRY:
            return False
        self.doubt = f"no answer for {current - self.asked:.1f}s"
        return True

    def answered(self, sent: float, answer: Answer, why: str = "") -> None:
        """Take what the renewal sent at *sent* found (*why*: the doubt's reason)."""
        self.asked = None
        if answer in {Answer.HELD, Answer.TAKEN}:
            self.confirmed, self.doubt = sent, None
            self.next_refresh = sent + self.every
        elif answer is Answer.LOST:
            self.lost = True
        else:
            self.doubt = why or "no answer"
            self.next_refresh = sent + RETRY

    def verdict(self, current: float) -> Verdict:
        """Return where the lease stands at *current*."""
        if self.lost or current >= self.deadline():
            return Verdict.LOST
        if self.doubt is not None and current >= self.term_due():
            return Verdict.GIVE_UP
        return Verdict.HELD


__all__ = ["MARGIN", "RETRY", "Answer", "LeaseClock", "Verdict"]
