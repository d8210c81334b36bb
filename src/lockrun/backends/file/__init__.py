"""flock(2) on files in a directory: the embedded default, with no server.

Slot 0 of a name is ``<dir>/<name>.lock``, the very file ``flock(1)`` would lock, so a
mutex excludes flock(1) users and the other way round. Lock files are never unlinked:
unlink-on-release lets two processes lock two inodes of one path (portalocker #115,
tox-dev/filelock #27). A semaphore queues its waiters on ``<name>.gate``, which the kernel
grants in arrival order; only the gate's holder sweeps the slot files ``<name>~<i>.lock``
and sleeps until a slot holder's abstract socket hangs up (docs/design.md A2).

A slot file's first line is the fence counter, which stays when the holder leaves; a
holder's JSON record follows it while the slot is held. So a grant reads and writes only
the file it locked: one ``pread`` and one ``pwrite`` (docs/design.md A1).

The modes (docs/design.md A1): --shared is flock(2)'s LOCK_SH on NAME.lock, with every
lockrun waiter queued on NAME.gate so a later reader cannot pass a waiting writer; a
--hold-at-least window is the record left in NAME.lock with an ``until``; a --take-over
request is a write lock on one byte of NAME.lock far past its end, which only a descriptor
open for writing can take, and the holders' bell an inotify watch on their lock file, which
the taker touches.

The package: `backend` takes locks and slots, `directory` opens the lock directory and its
files, `records` names the files and reads what they hold, `lease` keeps a held slot,
`takeover` asks holders to give way, and `status` reads /proc/locks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockrun.backends.directories import default_directory
from lockrun.backends.file.backend import FileBackend
from lockrun.backends.file.lease import FileLease
from lockrun.backends.file.records import DEFAULT_NAMESPACE
from lockrun.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from lockrun.uri import LockURI

__all__ = ["DEFAULT_NAMESPACE", "FileBackend", "FileLease", "connect"]


def connect(
    uri: LockURI,
    *,
    ttl: float | None = None,  # noqa: ARG001 - local locks are no leases
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> FileBackend:
    """Check the lock directory of a ``file:`` URI; it is opened (and made) on first use."""
    if uri.netloc not in {"", "localhost"}:
        msg = f"file: URIs name a local directory, not host {uri.netloc!r}"
        raise ConfigError(msg)
    if uri.query:
        msg = f"{uri.redacted}: file: URIs take no options (write a ? in a directory as %3F)"
        raise ConfigError(msg)
    if uri.path:
        if not uri.path.startswith("/"):
            msg = (
                f"{uri.redacted}: the lock directory must be an absolute path, as in "
                "file:///var/lock/myapp (this one would depend on the current directory)"
            )
            raise ConfigError(msg)
        return FileBackend(uri.path, private=False, make_below="/", warn=warn, note=note)
    default = default_directory()
    return FileBackend(default.path, private=True, make_below=default.parent, warn=warn, note=note)
