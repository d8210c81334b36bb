"""Run a command under a named lock or one slot of an N-slot semaphore.

``import lockrun`` imports neither click nor any database driver, nor asyncio until
`AsyncLock` is asked for (docs/api.md).
"""

from typing import TYPE_CHECKING

from lockrun.errors import (
    BackendUnavailable,
    CommandNotExecutable,
    CommandNotFound,
    ConfigError,
    ExitCode,
    Interrupted,
    LeaseLost,
    LockBusy,
    LockrunError,
    TakenOver,
    TimedOut,
    UsageError,
)
from lockrun.lock import Lease, Lock

if TYPE_CHECKING:
    from lockrun.aio import AsyncLock

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """Import `AsyncLock` (and asyncio) on first use only: the CLI never needs them."""
    if name == "AsyncLock":
        from lockrun.aio import AsyncLock  # noqa: PLC0415 - on demand, see above

        return AsyncLock
    msg = f"module 'lockrun' has no attribute {name!r}"
    raise AttributeError(msg)


__all__ = [
    "AsyncLock",
    "BackendUnavailable",
    "CommandNotExecutable",
    "CommandNotFound",
    "ConfigError",
    "ExitCode",
    "Interrupted",
    "Lease",
    "LeaseLost",
    "Lock",
    "LockBusy",
    "LockrunError",
    "TakenOver",
    "TimedOut",
    "UsageError",
    "__version__",
]
