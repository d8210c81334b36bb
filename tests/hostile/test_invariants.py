"""One invariant over a corpus of hostile invocations, and the fuzz target, run briefly.

Whatever the invocation: no traceback, never 70 (our own "bug" status), and a status of
lockrun's own comes with exactly one ``lockrun:`` line on stderr.
"""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING, Final, NamedTuple

import pytest

from tests.hostile import fuzz
from tests.support.cli import LOCKRUN, unmeasured

if TYPE_CHECKING:
    from pathlib import Path

# Statuses lockrun makes itself (the command's own, and 0, say nothing).
LOCKRUNS: Final = frozenset({64, 69, 74, 75, 76, 78, 124, 126, 127, 129, 130, 131, 143})


class Case(NamedTuple):
    """A hostile invocation: arguments, extra environment, and closed standard streams."""

    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    closed: str = ""  # e.g. ">&-" or "2>&-", as a shell would write it


def case(*args: str, env: dict[str, str] | None = None, closed: str = "") -> Case:
    """Return a `Case` (DIR in an argument stands for a directory of the test's own)."""
    return Case(args, tuple((env or {}).items()), closed)


CORPUS: Final = {
    # secrets parsers could split, and URIs that are no URIs
    "pw-question": case("--uri", "redis://:pa?ss@127.0.0.1:1/0", "--", "true"),
    "pw-only": case("--uri", "redis://SECRETPW@127.0.0.1:1/0", "--", "true"),
    "pw-at": case("--uri", "postgresql://u:p@ss@127.0.0.1:1/db", "--", "true"),
    "pw-slash": case("--uri", "mysql://u:pa/ss@127.0.0.1:1/db", "--", "true"),
    "pw-hash": case("--uri", "redis://:pw#frag@127.0.0.1:1/0", "--", "true"),
    "pw-as-option": case("--uri", "redis://127.0.0.1:1/0?hunter2", "--", "true"),
    "pw-ampersand": case("--uri", "unix:///nonexistent.sock?password=a&b", "--", "true"),
    "pw-bad-utf8": case("--uri", "redis://:\udcff%41@127.0.0.1:1/0", "--", "true"),
    "pw-bad-escape": case("--uri", "postgresql://u:%zz%@127.0.0.1:1/db", "--", "true"),
    "no-scheme": case("--uri", "alice:secret@db/x", "--", "true"),
    "opaque": case("--uri", "redis:u:pw@host", "--", "true"),
    "pw-empty-authority": case("--uri", "redis:///SECRETPW@127.0.0.1:1/0", "--", "true"),
    "ipv6-open": case("--uri", "redis://[::1/0", "--", "true"),
    "port-huge": case("--uri", "mysql://u@h:999999999999999999999/db", "--", "true"),
    "sentinel-empty": case("--uri", "redis+sentinel://:pw@127.0.0.1:1,127.0.0.1:2/", "--", "true"),
    "redacted": case("--", "true", env={"LOCKRUN_URI": "redis://***@127.0.0.1:1/0"}),
    "control": case("--uri", "file:///tmp/a\nb", "--", "true"),
    # paths
    "relative": case("--uri", "file:relative/dir", "--", "true"),
    "host": case("--uri", "file://otherhost/x", "--", "true"),
    "options": case("--uri", "file://DIR/locks?x=1", "--", "true"),
    "proc": case("--uri", "file:///proc/self/x", "--", "true"),
    "file-as-dir": case("--uri", "file:///etc/hostname", "--", "true"),
    "dev": case("--uri", "file:///dev", "-n", "null", "--", "true"),
    "abstract-long": case("--uri", "abstract:" + "x" * 300, "-n", "n" * 255, "--", "true"),
    # numbers
    "slots-float": case("--uri", "file://DIR", "--slots", "1e20", "--", "true"),
    "slots-huge": case("--uri", "file://DIR", "--slots", "9" * 40, "--", "true"),
    "wait-digits": case("--uri", "file://DIR", "--wait", "9" * 400, "--", "true"),
    "wait-inf": case("--uri", "file://DIR", "--wait", "inf", "--", "true"),
    "wait-nan": case("--uri", "file://DIR", "--wait", "nan", "--", "true"),
    "wait-arabic": case("--uri", "file://DIR", "--wait", "١٢", "--", "true"),
    "wait-fullwidth": case("--uri", "file://DIR", "--wait", "１２ｓ", "--", "true"),
    "wait-twice": case("--uri", "file://DIR", "--wait", "1h1h", "--", "true"),
    "wait-unit-alone": case("--uri", "file://DIR", "--wait", "ms", "--", "true"),
    "wait-days-huge": case("--uri", "file://DIR", "--wait", "9" * 400 + "d", "--", "true"),
    "ttl-two-dots": case("--uri", "file://DIR", "--", "true", env={"LOCKRUN_TTL": "1.5.5s"}),
    "ttl-tiny": case("--uri", "file://DIR", "--ttl", "0.001", "--", "true"),
    "kill-after-huge": case("--uri", "file://DIR", "--kill-after", "99999999999", "--", "true"),
    "max-time-zero": case("--uri", "file://DIR", "--max-time", "0", "--", "true"),
    "exit-code": case("--uri", "file://DIR", "-E", "-1", "--", "true"),
    # names
    "name-bad-utf8": case("--uri", "file://DIR", "-n", "\udcff", "--", "true"),
    "name-long": case("--uri", "file://DIR", "-n", "é" * 128, "--", "true"),
    "namespace-empty": case("--uri", "file://DIR", "--namespace", "", "--", "true"),
    # the environment
    "env-wait": case("--uri", "file://DIR", "--", "true", env={"LOCKRUN_WAIT": "abc"}),
    "env-verbose": case("--uri", "file://DIR", "--", "true", env={"LOCKRUN_VERBOSE": "maybe"}),
    "env-exit": case(
        "--uri", "file://DIR", "--", "true", env={"LOCKRUN_CONFLICT_EXIT_CODE": "999"}
    ),
    "env-namespace": case("--uri", "file://DIR", "--", "true", env={"LOCKRUN_NAMESPACE": "\udcff"}),
    "env-version": case("--uri", "file://DIR", "--", "true", env={"LOCKRUN_VERSION": "1"}),
    "env-debug": case("--uri", "file://DIR", "--", "true", env={"LOCKRUN_DEBUG": "yes"}),
    # commands
    "command-empty": case("--uri", "file://DIR", "--", ""),
    "command-missing": case("--uri", "file://DIR", "--", "/nonexistent/cmd"),
    "command-directory": case("--uri", "file://DIR", "--", "/etc"),
    "command-not-executable": case("--uri", "file://DIR", "--", "/etc/hostname"),
    "no-command": case("--uri", "file://DIR"),
    # closed streams
    "stdout-closed": case("--uri", "file://DIR", "--", "true", closed=">&-"),
    "all-closed": case("--uri", "file://DIR", "--", "true", closed="<&- >&- 2>&-"),
    # status
    "status-pw": case("status", "--uri", "redis://:pa?ss@127.0.0.1:1/0"),
    "status-missing-dir": case("status", "--uri", "file://DIR/none/such"),
    "status-long-name": case("status", "--uri", "file://DIR", "x" * 300),
    "status-closed": case("status", "--uri", "file://DIR", closed=">&-"),
    "status-bad-utf8": case("status", "--uri", "file://DIR", "\udcff"),
    "status-check-closed": case("status", "--check", "--uri", "file://DIR", "x", closed=">&-"),
    "status-check-nameless": case("status", "--check", "-q", "--uri", "file://DIR"),
}


@pytest.mark.parametrize("label", sorted(CORPUS))
def test_no_hostile_invocation_gives_a_traceback_or_70(label: str, tmp_path: Path) -> None:
    """A corpus of hostile invocations: no traceback, no 70, one line per lockrun status."""
    invocation = CORPUS[label]
    args = [arg.replace("DIR", str(tmp_path)) for arg in invocation.args]
    env = unmeasured() | dict(invocation.env)
    argv = [os.fsencode(arg) for arg in (*LOCKRUN, *args)]
    if invocation.closed:
        quoted = " ".join("'" + os.fsdecode(arg).replace("'", "'\\''") + "'" for arg in argv)
        argv = [b"sh", b"-c", f"exec {quoted} {invocation.closed}".encode(errors="surrogateescape")]
    result = subprocess.run(argv, capture_output=True, check=False, timeout=60, env=env)
    stderr = result.stderr.decode(errors="replace")
    assert "Traceback" not in stderr
    assert result.returncode != 70, stderr
    said = [line for line in stderr.splitlines() if line.startswith("lockrun: ")]
    if result.returncode in LOCKRUNS and "2>&-" not in invocation.closed:
        assert len(said) == 1, stderr
        assert said == stderr.splitlines(), stderr
    assert "SECRETPW" not in stderr
    assert "hunter2" not in stderr
    assert "pa?ss" not in stderr


def test_fuzz_target() -> None:
    """The fuzz target of tests/hostile/fuzz.py, for LOCKRUN_FUZZ_EXAMPLES inputs."""
    fuzz.fuzz()
