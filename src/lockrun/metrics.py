"""The Prometheus text file of ``--metrics-file``: read back, changed, replaced atomically.

node_exporter's textfile collector reads every ``*.prom`` file of a directory at each scrape
(https://github.com/prometheus/node_exporter#textfile-collector), so the file is never
written in place: a new one is written beside it and renamed over it. Counters carry
over from run to run, so an update reads the file back first; concurrent lockruns of a user
serialise that read-modify-write with a flock(2) on a file in the user's own lock directory,
which no other user can open: any lock another user can take (a flock on the metrics
directory needs only read access) could hold every run up (docs/security.md). What is read
back may have been written by anyone who may write the directory: it is parsed as untrusted
text, and only lockrun's own series survive (docs/semantics.md "Metrics").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import re
import stat
import sys
import time
from typing import TYPE_CHECKING, Any, Final

from lockrun.backends.directories import default_directory, open_directory
from lockrun.errors import LockrunError, UsageError
from lockrun.names import check_name
from lockrun.timing import format_duration, now

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeAlias

    Lock: TypeAlias = tuple[str, str]  # (namespace, name)
    Sample: TypeAlias = tuple[str, str]  # (metric, outcome); outcome "" but in runs_total
    Locks: TypeAlias = dict[Lock, dict[Sample, float]]

# Each metric: its type and its HELP text (https://prometheus.io/docs/practices/naming/).
METRICS: Final = {
    "lockrun_last_start_timestamp_seconds": ("gauge", "When the last run got the lock."),
    "lockrun_last_end_timestamp_seconds": ("gauge", "When the last run under the lock ended."),
    "lockrun_last_success_timestamp_seconds": (
        "gauge",
        "When a run under the lock last ended with status 0.",
    ),
    "lockrun_last_duration_seconds": ("gauge", "How long the last run held the lock."),
    "lockrun_last_exit_status": ("gauge", "The status lockrun exited with after the last run."),
    "lockrun_runs_total": ("counter", "Runs that got the lock, by outcome."),
    "lockrun_skipped_total": (
        "counter",
        "Runs that did not get the lock: busy, or gave way to a take-over.",
    ),
}
# How a run that got the lock ended: LOCKRUN_OUTCOME (docs/semantics.md "Monitoring").
RAN: Final = ("ok", "failed", "killed", "timed-out", "lost", "taken-over", "not-run", "error")
MAX_BYTES: Final = 4 << 20  # a file beyond this is no file lockrun wrote: it starts over
LOCK_WAIT: Final = 5.0  # seconds an update waits for another update of ours before giving up
_MAX_VALUE: Final = 2.0**53  # every integer below is exact in a double
_MAX_STATUS: Final = 255
_READ: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_SERIAL: Final = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_READABLE: Final = 0o644  # by node_exporter, which runs as a user of its own

# A sample line as lockrun writes it: no timestamp, a plain decimal value.
_SAMPLE: Final = re.compile(r"(lockrun_[a-z_]+)\{(.*)\} (\d{1,20}(?:\.\d{1,9})?)")
_LABEL: Final = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)",?')
_ESCAPES: Final = {"\\": "\\\\", '"': '\\"', "\n": "\\n"}
# What the text format would carry raw (it escapes only backslash, quote and line feed) and a
# reader or a terminal would act on: C0 controls but the line feed, DEL, C1 controls (NEL),
# Unicode line separators. A CR forges a line for readers that split on it, an ESC drives
# the terminal of whoever cats the file; a lock so named is not recorded (docs/semantics.md).
_RAW: Final = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")
_UNESCAPES: Final = {escaped: plain for plain, escaped in _ESCAPES.items()}


def check_path(path: str) -> str:
    """Return *path* if it can name a metrics file, else raise `UsageError`."""
    base = os.path.basename(path)
    if not path.startswith("/") or base in {"", ".", ".."}:
        msg = f"--metrics-file must be the absolute path of a file, not {path!r}"
        raise UsageError(msg)
    return path


def escape(value: str) -> str:
    r"""Escape a label value as the text format requires: ``\``, ``"`` and line feeds."""
    return "".join(_ESCAPES.get(character, character) for character in value)


def parse(data: bytes) -> Locks:
    """Return lockrun's series found in *data*; anything else in it is dropped.

    Only lines as `render` writes them count, with labels that are lock names and values
    that a lockrun could have written: a file of anyone's changes no more than its numbers.
    """
    locks: Locks = {}
    for line in data.decode(errors="surrogateescape").split("\n"):
        sample = _SAMPLE.fullmatch(line)
        labels = None if sample is None else _labels(sample[2])
        if sample is None or labels is None or sample[1] not in METRICS:
            continue
        metric, value = sample[1], round(float(sample[3]), 3)  # as `render` writes it
        outcome = labels.pop("outcome", "") if metric == "lockrun_runs_total" else ""
        lock = (labels.pop("namespace", ""), labels.pop("name", ""))
        if labels or not _plausible(metric, outcome, value) or not all(map(_is_name, lock)):
            continue
        locks.setdefault(lock, {}).setdefault((metric, outcome), value)
    return locks


def _labels(text: str) -> dict[str, str] | None:
    """Return the labels of ``a="x",b="y"``, unescaped; None if *text* is not that."""
    labels: dict[str, str] = {}
    position = 0
    while position < len(text):
        label = _LABEL.match(text, position)
        if label is None or label[1] in labels:
            return None
        labels[label[1]] = re.sub(r"\\.", lambda pair: _UNESCAPES[pair[0]], label[2])
        position = label.end()
    return labels


def _plausible(metric: str, outcome: str, value: float) -> bool:
    """Tell whether *value* is one lockrun could have written for *metric* and *outcome*."""
    if metric == "lockrun_runs_total" and outcome not in RAN:
        return False
    whole = METRICS[metric][0] == "counter" or metric == "lockrun_last_exit_status"
    high = _MAX_STATUS if metric == "lockrun_last_exit_status" else _MAX_VALUE
    return value <= high and (not whole or value.is_integer())


def _is_name(text: str) -> bool:
    """Whether *text* is a lock name that a label may carry: no character `_RAW` matches."""
    try:
        check_name(text)
    except UsageError:
        return False
    return _RAW.search(text) is None


def render(locks: Locks) -> str:
    """Return *locks* in the text format, each metric with its HELP and TYPE lines."""
    lines = []
    for metric, (kind, text) in METRICS.items():
        samples = sorted(
            (lock, outcome, value)
            for lock, values in locks.items()
            for (each, outcome), value in values.items()
            if each == metric
        )
        if samples:
            lines += [f"# HELP {metric} {text}", f"# TYPE {metric} {kind}"]
        for (namespace, name), outcome, value in samples:
            labels = f'namespace="{escape(namespace)}",name="{escape(name)}"'
            labels += f',outcome="{outcome}"' if outcome else ""
            shown = f"{value:.0f}" if value.is_integer() else f"{value:.3f}"
            lines.append(f"{metric}{{{labels}}} {shown}")
    return "".join(f"{line}\n" for line in lines)


def counted(locks: Locks, lock: Lock) -> dict[Sample, float]:
    """Return *lock*'s samples, its counters there at 0 if they were not.

    A counter that appears only at its first increment hides that increment from
    ``increase()`` (https://prometheus.io/docs/practices/instrumentation/#avoid-missing-metrics).
    """
    values = locks.setdefault(lock, {})
    for sample in [("lockrun_skipped_total", ""), *(("lockrun_runs_total", x) for x in RAN)]:
        values.setdefault(sample, 0.0)
    return values


def bump(values: dict[Sample, float], sample: Sample) -> None:
    """Add one to the counter *sample*, which stops at 2^53 rather than lose its exactness."""
    values[sample] = min(values.get(sample, 0.0) + 1, _MAX_VALUE)


def update(
    path: str,
    change: Callable[[Locks], None],
    *,
    log: Callable[[str], None],
    wait: float | None = None,
) -> None:
    """Apply *change* to the locks recorded in the file *path*, and replace the file.

    Never raises for what it meets on disk: that is one line to *log*, and lockrun's
    status stands. The directory is opened as a lock directory is (no symlink that another
    user could have planted on the way), and the file's name in it is only ever renamed
    over, so nothing outside the directory is written or truncated. *wait* (`LOCK_WAIT` if
    None) bounds the wait for another update of this user's; nothing of another user's is
    ever waited for.
    """
    directory, base = os.path.split(path)
    try:
        fd = open_directory(directory or "/", what="metrics directory")
    except LockrunError as err:
        log(f"metrics file {path} not updated: {err}")
        return
    serial = None
    try:
        serial = _serial(fd, base)
        patience = LOCK_WAIT if wait is None else wait
        if serial is not None and not _lock(serial, patience):
            waited = format_duration(patience)
            log(f"metrics file {path} not updated: another update kept it for {waited}")
            return
        if (kind := _foreign(fd, base)) is not None:
            # A device (/dev/null, to turn metrics off), a FIFO, a socket, a directory:
            # renaming over it would replace it, and root may rename anything.
            log(f"metrics file {path} not updated: it is {kind}, not a file of metrics")
            return
        data = _read(fd, base)
        if len(data) > MAX_BYTES:
            log(f"metrics file {path}: over {MAX_BYTES >> 20} MiB, not lockrun's; starting over")
            data = b""
        locks = parse(data)
        change(locks)
        if not all(map(_is_name, (label for lock in locks for label in lock))):
            log(
                f"metrics file {path} not updated: the lock's name or namespace holds a "
                "control character (a CR, an ESC…), which would be written raw"
            )
            return
        _replace(fd, base, render(locks))
    except OSError as err:
        log(f"metrics file {path} not updated: {err.strerror or err}")
    finally:
        os.close(fd)
        if serial is not None:
            os.close(serial)  # and with it the flock


def _serial(directory: int, base: str) -> int | None:
    """Open the file whose flock serialises this user's updates of *base* in *directory*.

    It lives in the user's own lock directory (docs/security.md: one no other user can
    make or open), named by the metrics directory's identity and *base*. None if that
    directory cannot be had (a home of someone else's): the update then goes unserialised,
    and two updates of ours at the same instant may lose one count.
    """
    info = os.fstat(directory)
    digest = _sha256(f"{info.st_dev}:{info.st_ino}/{base}".encode(errors="surrogateescape"))
    default = default_directory()
    try:
        private = open_directory(default.path, make_below=default.parent, private=True)
    except LockrunError:
        return None
    try:
        return os.open(f"metrics-{digest.hexdigest()[:40]}.lock", _SERIAL, 0o600, dir_fd=private)
    except OSError:
        return None
    finally:
        os.close(private)


def _sha256(data: bytes) -> Any:  # noqa: ANN401 - a hashlib object, which has no public type
    """Return the SHA-256 of *data*, from CPython's own module where there is one.

    hashlib loads OpenSSL for every algorithm it offers, about 5 ms of a run's start-up;
    the builtin module gives the same digest (issue #32).
    """
    with contextlib.suppress(ImportError):
        return __import__("_sha2" if sys.version_info >= (3, 12) else "_sha256").sha256(data)
    import hashlib  # noqa: PLC0415 - a build without it

    return hashlib.sha256(data)


def _lock(fd: int, wait: float) -> bool:
    """Take an exclusive flock of *fd* within *wait* seconds; False if it stayed taken.

    Polled: each holder keeps it for one read and one write, and a blocking flock(2)
    cannot be given a deadline from any thread (the start record is written in one).
    """
    deadline, pause = now() + wait, 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if now() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        else:
            return True


def _foreign(directory: int, base: str) -> str | None:
    """Name what *base* is if it is neither a regular file nor a symlink (None: it is, or none)."""
    try:
        mode = os.stat(base, dir_fd=directory, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):  # a planted link is replaced, never followed
        return None
    kinds = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
    kinds |= {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}
    return kinds.get(stat.S_IFMT(mode), "not a regular file")


def _read(directory: int, base: str) -> bytes:
    """Return the first `MAX_BYTES` + 1 bytes of the regular file *base*; b"" if there is none.

    A symlink, a FIFO, a socket or a directory there holds nothing of ours: none is followed
    or read (and none blocks: O_NONBLOCK), and the rename replaces what it can of them.
    """
    try:
        fd = os.open(base, _READ, dir_fd=directory)
    except OSError as err:
        if err.errno in {errno.ENOENT, errno.ELOOP, errno.ENXIO}:  # ELOOP: a symlink
            return b""
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        chunks, left = [], MAX_BYTES + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _replace(directory: int, base: str, text: str) -> None:
    """Write *text* to a new file in *directory* and rename it over *base*.

    The new file's name is hidden and not ``*.prom``, so the collector never reads it half
    written; O_EXCL never opens what is there. Only a SIGKILL between its creation and the
    rename can leave it behind. No fsync(2): rename(2) alone is what makes the replacement
    atomic for a reader (the collector's, node_exporter#textfile-collector), and durability
    buys a metrics file nothing: after a crash its numbers are stale either way, and the
    next run rewrites it (docs/semantics.md "Metrics", issue #32).
    """
    temporary = f".lockrun-{os.urandom(6).hex()}.tmp"
    fd = os.open(temporary, _CREATE, _READABLE, dir_fd=directory)
    try:
        try:
            os.fchmod(fd, _READABLE)  # whatever the umask
            data = text.encode()
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.rename(temporary, base, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=directory)
        raise


def stamp(value: float) -> float:
    """Return a Unix time or a duration as the file keeps it: milliseconds, never negative."""
    return max(0.0, round(value, 3)) if math.isfinite(value) else 0.0
