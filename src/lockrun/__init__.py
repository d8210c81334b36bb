"""Run a command under a named lock or one slot of an N-slot semaphore.

``import lockrun`` imports neither click nor any database driver (docs/api.md).
"""

from lockrun.backends import Lease
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
    TimedOut,
    UsageError,
)
from lockrun.lock import Lock

__version__ = "0.1.0"

__all__ = [
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
    "TimedOut",
    "UsageError",
    "__version__",
]
