"""`pthread_sigmask` and `valid_signals` without the signal module's enum conversions.

``signal.pthread_sigmask`` converts every signal of the old mask to a ``Signals`` enum
member, and ``signal.valid_signals`` every one of the 64: a Python-level enum lookup each,
20-25 µs a mask for lockrun's, and the hand-over path sets several (issue 32). ``_signal``
is the C module that ``signal`` wraps (CPython's Lib/signal.py); its functions return
plain numbers, which every caller here only hands back to `pthread_sigmask`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # typeshed knows the wrapper's signature; the masks only go back into it
    from signal import pthread_sigmask, valid_signals
else:
    try:
        from _signal import pthread_sigmask, valid_signals
    except ImportError:  # pragma: no cover - an implementation without CPython's _signal
        from signal import pthread_sigmask, valid_signals

__all__ = ["pthread_sigmask", "valid_signals"]
