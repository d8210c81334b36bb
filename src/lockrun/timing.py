"""The clock lockrun measures waits and leases with, DURATION parsing, and times for people."""

from __future__ import annotations

import math
import re
import time
from typing import Final

from lockrun.errors import UsageError

# A DURATION (docs/semantics.md "Options"): a number of seconds alone, or numbers each with
# a unit, largest unit first and each once: `1h30m`, `1m30s`, `500ms`, `2d 12h`. The units and
# the optional spaces are systemd.time(7)'s, the compound form Go's time.ParseDuration's; the
# order rule refuses what reads as a typo (`30m1h`, `1h1h`) rather than add it up.
_UNITS: Final = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_BLANKS: Final = " \t\n\r\f\v"  # around it; str.strip() would also take Unicode spaces
# Compiled on first use, like lockrun.uri's (issue #32).
_COMPONENT: Final = r"([0-9.]+)[ \t]*(ms|[dhms])?[ \t]*"
_NUMBER: Final = r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+"
_SHOWN: Final = 40  # characters of a bad DURATION quoted back: 400 digits are not news
FOREVER: Final = "forever"

# The clock's constants every front end and backend share (one home, issue 31).
DEFAULT_TTL: Final = 30.0  # a lease's length when none is given; `status` fits timeouts to it
RECONNECT_INTERVAL: Final = 1.0  # a queued waiter that lost its server asks again this often


def now() -> float:
    """Return seconds on a clock that never steps back and keeps counting through suspend."""
    # clock_gettime(2): CLOCK_MONOTONIC stops while the machine sleeps; a laptop that
    # suspends mid-lease must not believe its lease is still fresh (docs/design.md D1).
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def parse_duration(text: str, *, allow_forever: bool = False) -> float | None:
    """Parse ``90``, ``1.5``, ``500ms``, ``15m``, ``1h30m``, ``2d 12h`` (and ``forever`` → None)."""
    cleaned = text.strip(_BLANKS).lower()
    if allow_forever and cleaned in {FOREVER, "inf", "infinity"}:
        return None
    if not cleaned:
        raise _invalid(text, "empty; " + _hint(allow_forever=allow_forever))
    # One number and its unit, as the defaults are (30s): read without a regex (#32).
    unit = next((each for each in ("ms", "d", "h", "m", "s") if cleaned.endswith(each)), "")
    number = cleaned.removesuffix(unit)
    plain = number.replace(".", "", 1)
    if plain.isascii() and plain.isdigit():
        seconds = float(number) * _UNITS[unit or "s"]
        if math.isfinite(seconds):
            return seconds
    components, position = [], 0
    while position < len(cleaned):
        match = re.compile(_COMPONENT).match(cleaned, position)
        if match is None or not re.compile(_NUMBER).fullmatch(match[1]):  # `ms`, `1.5.5s`, `5x`
            raise _invalid(text, _what_is_wrong(cleaned, allow_forever=allow_forever))
        components.append((match[1], match[2]))
        position = match.end()
    if len(components) > 1 and any(unit is None for _, unit in components):
        raise _invalid(text, "each number of a compound needs its unit (1h30m, 1m30s)")
    scales = [_UNITS[unit or "s"] for _, unit in components]
    if scales != sorted(set(scales), reverse=True):
        raise _invalid(text, "units must come largest first, each once (d, h, m, s, ms)")
    seconds = sum(
        float(number) * scale for (number, _), scale in zip(components, scales, strict=True)
    )
    if not math.isfinite(seconds):
        raise _invalid(text, "too large")
    return seconds


def _what_is_wrong(cleaned: str, *, allow_forever: bool) -> str:
    if not cleaned.isascii():  # "١٢".isdigit() is True: only ASCII digits are read
        return "only ASCII digits and the units d, h, m, s, ms are read"
    if cleaned.startswith("-"):
        return "a duration cannot be negative"
    return _hint(allow_forever=allow_forever)


def _hint(*, allow_forever: bool) -> str:
    forever = ", or 'forever'" if allow_forever else ""
    return f"use seconds (90, 1.5) or units d, h, m, s, ms, largest first (1h30m, 500ms){forever}"


def _invalid(text: str, why: str) -> UsageError:
    shown = text if len(text) <= _SHOWN else text[:_SHOWN] + "…"
    return UsageError(f"invalid duration {shown!r}: {why}")


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
