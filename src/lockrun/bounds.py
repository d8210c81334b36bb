"""The bounds of every number lockrun takes, checked once for the CLI and the Python API.

A number out of bounds is a usage error (64; `UsageError` in the API) before anything is
opened, so no backend meets a slot count, a lease or a wait it cannot express. docs/semantics.md's
"Options" table lists the bounds.
"""

from __future__ import annotations

import math
from typing import Final

from lockrun.errors import UsageError
from lockrun.timing import format_duration

MAX_SLOTS: Final = 1000  # a semaphore's head holds one server session (or file) per slot
MIN_TTL: Final = 1.0  # a lease must outlast a slow answer and the command's start
MAX_TTL: Final = 86400.0  # a longer lease only delays the recovery from a crash
MAX_WAIT: Final = 366 * 86400.0  # --wait and --max-time: a year; 'forever' has no bound
MAX_KILL_AFTER: Final = 86400.0
# Fences are signed 64-bit integers (LOCKRUN_FENCE, PostgreSQL's bigint): a stored counter
# beyond is one lockrun never wrote, and is read as no counter at all.
MAX_FENCE: Final = 2**63 - 1


def check_slots(slots: object, what: str = "slots") -> int:
    """Return *slots* if it is a whole number of slots, 1 … `MAX_SLOTS`."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        msg = f"{what} must be a whole number from 1 to {MAX_SLOTS}, not {slots!r}"
        raise UsageError(msg)
    return slots


def check_seconds(
    value: object, what: str, *, low: float = 0.0, high: float, above: bool = False
) -> float:
    """Return *value* as seconds if it is a real number in [*low*, *high*] (or (*low*, …])."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{what} must be a number of seconds, not {value!r}"
        raise UsageError(msg)
    seconds = float(value)
    if math.isnan(seconds) or seconds > high or seconds < low or (above and seconds == low):
        relation = "more than" if above else "at least"
        msg = (
            f"{what} must be {relation} {format_duration(low)} and at most "
            f"{format_duration(high)}, not {_shown(seconds, low, high)}"
        )
        raise UsageError(msg)
    return seconds


def check_wait(wait: object, what: str = "wait") -> float | None:
    """Return *wait* in seconds, or None for forever (None, or infinity in the API)."""
    if wait is None or (isinstance(wait, float) and wait == math.inf):
        return None
    return check_seconds(wait, what, high=MAX_WAIT)


def check_ttl(ttl: object, what: str = "ttl") -> float:
    """Return *ttl* if it is a usable lease length, `MIN_TTL` … `MAX_TTL`."""
    return check_seconds(ttl, what, low=MIN_TTL, high=MAX_TTL)


def check_modes(
    slots: int, *, shared: bool, hold: object, take_over: bool = False, cli: bool = False
) -> float:
    """Return the seconds of *hold* if a hold, *shared* and *take_over* combine with *slots*.

    Each mode keeps one lock: with N slots, which slot would a reader or a window take,
    and whom would a taker stop, one holder or all N? Refused rather than guessed
    (docs/semantics.md "Fleet modes"). *cli* spells the options as the command line does.
    """
    spell = {
        "slots": "--slots",
        "shared": "--shared",
        "hold": "--hold-at-least",
        "take_over": "--take-over",
    }
    if not cli:
        spell = {key: key if key != "hold" else "hold_at_least" for key in spell}
    check_flag(shared, spell["shared"])
    check_flag(take_over, spell["take_over"])
    seconds = check_seconds(hold, spell["hold"], high=MAX_WAIT)
    if slots > 1 and (shared or seconds or take_over):
        what = spell["shared"] if shared else spell["hold"] if seconds else spell["take_over"]
        msg = f"{what} applies to a lock of one slot, not to {spell['slots']} {slots}"
        raise UsageError(msg)
    if shared and seconds:
        msg = f"{spell['shared']} and {spell['hold']} do not combine: a hold keeps one run's lock"
        raise UsageError(msg)
    return seconds


def check_flag(value: object, what: str) -> bool:
    """Return *value* if it is a bool: ``shared="no"`` would otherwise mean yes."""
    if not isinstance(value, bool):
        msg = f"{what} must be True or False, not {value!r}"
        raise UsageError(msg)
    return value


def _shown(seconds: float, *bounds: float) -> str:
    """Render *seconds* for people, exactly where that would read as one of the *bounds*.

    format_duration rounds: "at most 1d00h, not 1d00h" said nothing (#29); 86400.4s does.
    """
    if not math.isfinite(seconds) or seconds < 0:
        return str(seconds)
    shown = format_duration(seconds) if seconds >= 1 else f"{seconds:g}s"  # 0.001s, not 0s
    if seconds not in bounds and shown in {format_duration(bound) for bound in bounds}:
        return f"{seconds!r}".removesuffix(".0") + "s"  # the shortest text that is this float
    return shown
