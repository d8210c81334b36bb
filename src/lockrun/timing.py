"""The clock lockrun measures waits and leases with, DURATION parsing, and times for people."""

from __future__ import annotations

import math
import re
import time
from typing import Final

from lockrun.errors import UsageError

_UNITS: Final = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION: Final = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)", re.ASCII)
FOREVER: Final = "forever"


def now() -> float:
    """Return seconds on a clock that never steps back and keeps counting through suspend."""
    # clock_gettime(2): CLOCK_MONOTONIC stops while the machine sleeps; a laptop that
    # suspends mid-lease must not believe its lease is still fresh (docs/design.md D1).
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def parse_duration(text: str, *, allow_forever: bool = False) -> float | None:
    """Parse ``90``, ``1.5``, ``90s``, ``15m``, ``2h``, ``1d`` (and ``forever`` → None)."""
    cleaned = text.strip().lower()
    if allow_forever and cleaned in {FOREVER, "inf", "infinity"}:
        return None
    match = _DURATION.fullmatch(cleaned)
    if match is None:
        hint = ", or 'forever'" if allow_forever else ""
        msg = f"invalid duration {text!r}: use seconds or a number with s, m, h or d{hint}"
        raise UsageError(msg)
    seconds = float(match[1]) * _UNITS[match[2]]
    if not math.isfinite(seconds):
        msg = f"invalid duration {text!r}: too large"
        raise UsageError(msg)
    return seconds


def format_duration(seconds: float) -> str:
    """Render *seconds* for people: ``0.25s``, ``12s``, ``3m05s``, ``2h00m``."""
    if seconds < 10:  # noqa: PLR2004 - sub-10 s waits are worth their decimals
        return f"{seconds:.2f}s".replace(".00s", "s")
    if seconds >= 1e9:  # noqa: PLR2004 - no one reads 31 years in hours
        return f"{seconds:.3g}s"
    whole = round(seconds)
    if whole < 60:  # noqa: PLR2004
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:  # noqa: PLR2004
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:  # noqa: PLR2004
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def clock_time(stamp: float) -> str:
    """Render a Unix time as local HH:MM:SS, with the date if it is not today."""
    try:
        local = time.localtime(stamp)
    except (OverflowError, ValueError, OSError):  # a holder record we cannot trust
        return "?"
    if time.strftime("%Y-%m-%d", local) == time.strftime("%Y-%m-%d"):
        return time.strftime("%H:%M:%S", local)
    return time.strftime("%Y-%m-%d %H:%M:%S", local)
