"""The bounds of every number lockrun takes, checked once for the CLI and the Python API.

A number out of bounds is a usage error (64; `UsageError` in the API) before anything is
opened, so no backend meets a slot count, a lease or a wait it cannot express; nor a mode it
does not offer (`check_modes`, from the registry's `Scheme.modes`). docs/semantics.md's
"Options" table lists the bounds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final, get_args

from lockrun.errors import UsageError
from lockrun.timing import format_duration
from lockrun.uri import SCHEMES, Mode

if TYPE_CHECKING:
    from collections.abc import Iterable

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
    slots: int,
    *,
    shared: bool,
    hold: object,
    take_over: bool = False,
    cli: bool = False,
    scheme: str | None = None,
) -> float:
    """Return the seconds of *hold* if a hold, *shared* and *take_over* combine with *slots*.

    Each mode keeps one lock: with N slots, which slot would a reader or a window take,
    and whom would a taker stop, one holder or all N? Refused rather than guessed
    (docs/semantics.md "Fleet modes"), as is a mode *scheme*'s backend does not offer
    (`check_offered`). *cli* spells the options as the command line does.
    """
    check_flag(shared, _spelled("shared", cli=cli))
    check_flag(take_over, _spelled("take-over", cli=cli))
    seconds = check_seconds(hold, _spelled("hold-at-least", cli=cli), high=MAX_WAIT)
    asked = {"shared": shared, "hold-at-least": seconds > 0, "take-over": take_over}
    modes = [mode for mode in get_args(Mode) if asked[mode]]
    if scheme is not None:
        check_offered(scheme, modes, cli=cli)
    if slots > 1 and modes:
        what, many = _spelled(modes[0], cli=cli), _spelled("slots", cli=cli)
        msg = f"{what} applies to a lock of one slot, not to {many} {slots}"
        raise UsageError(msg)
    if shared and seconds:
        both = f"{_spelled('shared', cli=cli)} and {_spelled('hold-at-least', cli=cli)}"
        msg = f"{both} do not combine: a hold keeps one run's lock"
        raise UsageError(msg)
    return seconds


def check_offered(scheme: str, modes: Iterable[Mode], *, cli: bool = True) -> None:
    """Raise `UsageError` for the first of *modes* that *scheme*'s backend does not offer.

    The registry says what each offers (`lockrun.uri.Scheme.modes`); the command line,
    ``lockrun acquire`` and the Python API all ask here, before anything is opened, so a
    backend never meets a mode it would have to guess at (docs/semantics.md "Fleet modes").
    """
    offered = SCHEMES[scheme].modes
    for mode in modes:
        if mode not in offered:
            others = [_spelled(each, cli=cli) for each in get_args(Mode) if each in offered]
            if not others:
                which = "no mode is"
            elif len(others) == 1:
                which = f"only {others[0]} is"
            else:
                which = f"only {', '.join(others[:-1])} and {others[-1]} are"
            msg = f"{_spelled(mode, cli=cli)} is not supported by {scheme}: ({which})"
            raise UsageError(msg)


def _spelled(option: str, *, cli: bool) -> str:
    """Spell *option* (a `Mode`, or "slots") as the command line or the Python API does."""
    return f"--{option}" if cli else option.replace("-", "_")


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
