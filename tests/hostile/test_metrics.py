"""The metrics file against what others put there: junk, planted links, FIFOs, hostile names.

The previous file is read back by every run, and whoever may write its directory may have
written it; lock names are any UTF-8. The oracles: Prometheus's own parser
(prometheus_client), the bytes of files that must not change, and the exit status, which is
always the command's (docs/semantics.md "Metrics").
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from lockrun import metrics
from lockrun.names import MAX_NAME_BYTES
from tests.support.cli import lockrun, one_line
from tests.support.users import needs_root

if TYPE_CHECKING:
    from collections.abc import Iterator

    from tests.support.users import Runner

PRECIOUS = "precious: root's file, not metrics\n"
OURS = 'lockrun_skipped_total{namespace="default",name="{name}"} 41'


def counts(path: Path, name: str) -> dict[str, float]:
    """Return *name*'s samples in *path*, read by Prometheus's parser, by sample and outcome."""
    found = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("namespace") == "default"
            assert labels.pop("name") == name, "a series of no lock of ours survived"
            found[sample.name + "/" + labels.pop("outcome", "")] = sample.value
            assert labels == {}
    return found


# -- the previous file: anyone's text -------------------------------------------------------


# Lines that look like ours and are not: each is dropped, never a crash or a count.
FORGED = [
    'lockrun_skipped_total{namespace="default",name="{name}"} NaN',
    'lockrun_skipped_total{namespace="default",name="{name}"} -5',
    'lockrun_skipped_total{namespace="default",name="{name}"} 1e300',
    'lockrun_skipped_total{namespace="default",name="{name}"} 1152921504606846976',
    'lockrun_skipped_total{namespace="default",name="{name}"} 2.5',
    'lockrun_skipped_total{namespace="default",name="{name}",name="{name}"} 7',
    'lockrun_skipped_total{namespace="default",name="{name}",job="x"} 7',
    'lockrun_skipped_total{name="{name}"} 7',
    'lockrun_skipped_total{namespace="default",name="{name}\\q"} 7',
    'lockrun_runs_total{namespace="default",name="{name}",outcome="pwned"} 7',
    'lockrun_last_exit_status{namespace="default",name="{name}"} 256',
    'lockrun_skipped_total{namespace="",name="{name}"} 7',
    'lockrun_made_up{namespace="default",name="{name}"} 7',
    'lockrun_skipped_total{namespace="default",name="{name}"} 7 1700000000000',
]


@pytest.mark.parametrize(
    ("previous", "skipped"),
    [
        (b"\x00\xff\xfe junk \x1b[2J" * 100 + b"\n" * 3, 0),
        ("# HELP other_metric Anyone's.\nother_metric 5\n" + OURS + "\nnode_load1 3\n", 41),
        ("\n".join([*FORGED, OURS]) + "\n", 41),
        (OURS + "\n" + "x" * (metrics.MAX_BYTES + 10), 0),
    ],
    ids=["binary", "others-metrics", "forged-lines", "huge"],
)
def test_a_previous_file_keeps_only_lockruns_counts(
    tmp_path: Path, name: str, previous: str | bytes, skipped: int
) -> None:
    """Junk and others' metrics are dropped, ours carry on; the command's status stands."""
    path = tmp_path / "m.prom"
    text = previous if isinstance(previous, bytes) else previous.replace("{name}", name).encode()
    path.write_bytes(text)
    result = lockrun("--uri", f"file://{tmp_path}/locks", "-n", name, "--metrics-file", str(path),
                     "--", "sh", "-c", "exit 3")  # fmt: skip
    assert result.returncode == 3
    if len(text) > metrics.MAX_BYTES:
        assert "over 4 MiB, not lockrun's; starting over" in one_line(result.stderr)
    else:
        assert result.stderr == ""
    found = counts(path, name)
    assert found["lockrun_runs_total/failed"] == 1
    assert found["lockrun_skipped_total/"] == skipped
    assert found["lockrun_last_exit_status/"] == 3


NOT_FILES = {
    "fifo": "it is a FIFO",
    "directory": "it is a directory",
    "device": "it is a character device",
    "missing-directory": "No such file or directory",
}


@pytest.mark.parametrize("kind", NOT_FILES)
def test_what_is_not_a_file_is_left_as_it_is_and_changes_no_status(
    tmp_path: Path, name: str, kind: str
) -> None:
    """A FIFO, a directory, a device (/dev/null): left alone, never blocked on; one line."""
    path = tmp_path / "m.prom"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "device":  # as --metrics-file /dev/null would be, to turn metrics off
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    else:
        path = tmp_path / "missing" / "m.prom"
    before = path.lstat().st_mode if path.exists() else None
    result = lockrun("--uri", f"file://{tmp_path}/locks", "-n", name, "--metrics-file", str(path),
                     "--", "sh", "-c", "exit 3", timeout=30)  # fmt: skip
    assert result.returncode == 3
    line = one_line(result.stderr)
    assert line.startswith(f"lockrun: {name}: metrics file {path} not updated: "), line
    assert NOT_FILES[kind] in line
    assert (path.lstat().st_mode if path.exists() else None) == before
    assert [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".")] == []


# -- other users -----------------------------------------------------------------------------


@pytest.fixture
def target() -> Iterator[Path]:
    """Return a directory of root's, elsewhere, holding a file that must keep its bytes."""
    path = Path(tempfile.mkdtemp(prefix="lockrun-target-", dir="/tmp"))
    path.chmod(0o755)
    (path / "passwd").write_text(PRECIOUS)
    yield path
    shutil.rmtree(path)


@needs_root
def test_a_symlink_planted_as_the_metrics_file_is_replaced_never_followed(
    mallory: Runner, shared: Path, target: Path, name: str
) -> None:
    """Root's run over mallory's link to root's file: the link goes, the file keeps its bytes."""
    path = shared / "m.prom"
    assert mallory.run(["ln", "-s", str(target / "passwd"), str(path)]).returncode == 0
    result = lockrun("--uri", f"file://{shared}/locks", "-n", name, "--metrics-file", str(path),
                     "--", "true")  # fmt: skip
    assert (result.returncode, result.stderr) == (0, "")
    assert (target / "passwd").read_text() == PRECIOUS
    info = path.lstat()
    assert stat.S_ISREG(info.st_mode)
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o644)
    assert counts(path, name)["lockrun_runs_total/ok"] == 1


@needs_root
def test_a_symlinked_directory_planted_by_another_user_is_refused(
    mallory: Runner, shared: Path, target: Path, name: str
) -> None:
    """--metrics-file /shared/link/m.prom where mallory made link: one line, nothing written."""
    assert mallory.run(["ln", "-s", str(target), str(shared / "link")]).returncode == 0
    path = shared / "link" / "m.prom"
    result = lockrun("--uri", f"file://{shared}/locks", "-n", name, "--metrics-file", str(path),
                     "--", "sh", "-c", "exit 4")  # fmt: skip
    assert result.returncode == 4
    line = one_line(result.stderr)
    assert f"metrics directory {shared}/link is a symlink; refusing to follow it" in line
    assert sorted(entry.name for entry in target.iterdir()) == ["passwd"]


@pytest.mark.parametrize("unreadable", [False, True], ids=["directory", "file"])
def test_what_we_may_not_write_or_read_is_one_line(
    alice: Runner, name: str, unreadable: bool
) -> None:
    """Alice's file in root's directory, or root's 0600 file in hers: one line, her status."""
    directory = tempfile.mkdtemp(prefix="lockrun-roots-", dir="/tmp")
    path = f"{directory}/m.prom"
    try:
        os.chmod(directory, 0o1777 if unreadable else 0o755)  # sticky: alice's, root's file
        if unreadable:
            Path(path).write_text(PRECIOUS)
            os.chmod(path, 0o600)
        result = alice.lockrun("-n", name, "--metrics-file", path, "--", "sh", "-c", "exit 5")
        assert result.returncode == 5, result.stderr
        line = one_line(result.stderr)
        assert line == f"lockrun: {name}: metrics file {path} not updated: Permission denied"
        assert os.listdir(directory) == (["m.prom"] if unreadable else [])
        assert not unreadable or Path(path).read_text() == PRECIOUS
    finally:
        shutil.rmtree(directory)


HOLD_FLOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX if sys.argv[2] == "-x" else fcntl.LOCK_SH)
print("held", flush=True)
sys.stdin.read()
"""
# lockrun, with any wait of the metrics update for a lock made endless: a run that waited on
# a lock another user holds would never end while that user holds it.
PATIENT_LOCKRUN = """
import runpy, sys
from lockrun import metrics
metrics.LOCK_WAIT = 1e9
sys.argv[0] = "lockrun"
runpy.run_module("lockrun", run_name="__main__", alter_sys=True)
"""


@needs_root
@pytest.mark.parametrize("mode", ["-s", "-x"])
@pytest.mark.parametrize("what", ["directory", "file"])
def test_another_users_flock_on_the_metrics_path_never_delays_a_run(
    mallory: Runner, name: str, tmp_path: Path, what: str, mode: str
) -> None:
    """Mallory flocks root's world-readable metrics directory or file: the run never waits.

    Oracle: the run, whose metrics update would wait for ever on a lock it waits for,
    ends while mallory still holds hers, and the file counts the run.
    """
    directory = Path(tempfile.mkdtemp(prefix="lockrun-metrics-", dir="/tmp"))
    directory.chmod(0o755)  # root's, readable by all, as node_exporter's directory is
    path = directory / "m.prom"
    path.write_text("")
    path.chmod(0o644)
    holding = mallory.python(HOLD_FLOCK, str(directory if what == "directory" else path), mode,
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        assert holding.stdout is not None
        assert holding.stdout.readline() == "held\n"
        result = subprocess.run(
            [sys.executable, "-c", PATIENT_LOCKRUN, "--uri", f"file://{tmp_path}/locks",
             "-n", name, "--metrics-file", str(path), "--", "sh", "-c", "exit 3"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert holding.poll() is None  # she held it all along
        assert (result.returncode, result.stderr) == (3, "")
        assert counts(path, name)["lockrun_runs_total/failed"] == 1
    finally:
        holding.kill()
        holding.communicate()
        shutil.rmtree(directory)


# -- hostile names -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hostile",
    [
        'back\\slash "quoted" new\nline',
        'x"} 1\nlockrun_skipped_total{namespace="default",name="victim"} 99\n#',
        "é漢字\u202e}{,=",
    ],
)
def test_hostile_names_come_back_whole_from_the_file_and_the_hook(
    tmp_path: Path, hostile: str
) -> None:
    """Backslash, quote, line feed: escaped in the label, exact to Prometheus and the hook."""
    path, dump = tmp_path / "m.prom", tmp_path / "dump"
    result = lockrun(
        *("--uri", f"file://{tmp_path}/locks", "-n", hostile, "--metrics-file", str(path)),
        *("--on-exit", f"env -0 > {dump}", "--", "true"),
    )
    assert (result.returncode, result.stderr) == (0, "")
    assert counts(path, hostile)["lockrun_runs_total/ok"] == 1
    told = dict(entry.partition("=")[::2] for entry in dump.read_text().split("\0") if entry)
    assert told["LOCKRUN_NAME"] == hostile


@pytest.mark.parametrize(
    "hostile",
    [
        'x"} 1\rlockrun_skipped_total{namespace="default",name="victim"} 99\r#',
        "bell\x07 and \x1b[2J\x1b]0;title\x07",
        "next\x85line",
        "line\u2028separator",
        "del\x7f",
    ],
    ids=["cr", "esc", "nel", "u2028", "del"],
)
def test_names_with_control_characters_are_never_written_raw(
    tmp_path: Path, name: str, hostile: str
) -> None:
    """A name a terminal or a line splitter would act on: one line, the file keeps its bytes.

    The text format escapes only backslash, quote and line feed, so such a label would be
    written raw: a CR forges a line for readers that split on it, an ESC drives the terminal
    of whoever cats the file. The run's status stands; other locks' series stay.
    """
    path = tmp_path / "m.prom"
    uri = f"file://{tmp_path}/locks"
    assert (
        lockrun("--uri", uri, "-n", name, "--metrics-file", str(path), "--", "true").returncode == 0
    )
    before = path.read_bytes()
    for namespace, lock in (("default", hostile), (hostile, name)):
        result = lockrun("--uri", uri, "--namespace", namespace, "-n", lock,
                         "--metrics-file", str(path), "--", "sh", "-c", "exit 3")  # fmt: skip
        assert result.returncode == 3
        line = one_line(result.stderr)
        assert f"metrics file {path} not updated: " in line
        assert "control character" in line
        assert "\x1b" not in line
        assert "\r" not in line
        assert path.read_bytes() == before
    planted = (
        before
        + metrics.render({("default", hostile): {("lockrun_skipped_total", ""): 5.0}}).encode()
    )
    assert metrics.parse(planted) == metrics.parse(before)  # read back: dropped


# -- properties: the reader and the escaping ---------------------------------------------------

# Names a label may carry: no controls but the line feed, no line separators (those are
# refused: test_names_with_control_characters_are_never_written_raw).
lock_names = st.text(
    st.characters(exclude_categories=["Cs", "Cc"], exclude_characters="\u2028\u2029")
    | st.just("\n"),
    min_size=1,
).filter(lambda text: len(text.encode()) <= MAX_NAME_BYTES)
values = st.one_of(
    st.integers(0, 2**53).map(float),
    st.floats(0, 4e9).map(metrics.stamp),
)
samples = st.sampled_from(
    [(metric, "") for metric in metrics.METRICS if metric != "lockrun_runs_total"]
    + [("lockrun_runs_total", outcome) for outcome in metrics.RAN]
)


def _plausible(sample: tuple[str, str], value: float) -> float:
    """Make *value* one lockrun writes for *sample*: whole counters, a status of 0 … 255."""
    metric, _ = sample
    if metric == "lockrun_last_exit_status":
        return float(int(value) % 256)
    return float(int(value)) if metrics.METRICS[metric][0] == "counter" else value


locks_strategy = st.dictionaries(
    st.tuples(lock_names, lock_names),
    st.dictionaries(samples, values, min_size=1).map(
        lambda found: {sample: _plausible(sample, value) for sample, value in found.items()}
    ),
    max_size=4,
)


@settings(max_examples=50)  # each example runs Prometheus's parser too
@given(locks=locks_strategy)
@example(locks={("default", 'a\\b"c\nd'): {("lockrun_skipped_total", ""): 3.0}})
def test_what_lockrun_writes_it_reads_back_and_prometheus_reads_alike(
    locks: metrics.Locks,
) -> None:
    """Parsing what render wrote gives it back; Prometheus reads the same names and values."""
    text = metrics.render(locks)
    assert metrics.parse(text.encode()) == locks
    seen: metrics.Locks = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            key = (labels["namespace"], labels["name"])
            seen.setdefault(key, {})[(sample.name, labels.get("outcome", ""))] = sample.value
    assert seen == locks


def _spliced(locks: metrics.Locks, at: int, cut: int, text: str) -> bytes:
    """Return what lockrun wrote for *locks*, with *cut* characters at *at* replaced by *text*."""
    written = metrics.render(locks)
    at %= len(written) + 1
    return (written[:at] + text + written[at + cut :]).encode(errors="surrogateescape")


# Anything, and lockrun's own text with a piece cut out or put in: a near miss of the format.
near_misses = st.builds(
    _spliced,
    locks_strategy,
    st.integers(0, 10**6),
    st.integers(0, 8),
    st.text(alphabet='\\"\n{},=. 0123456789e-+_aZ\x00\udcff', max_size=6),
)


@given(data=st.binary(max_size=2000) | st.text(max_size=2000).map(str.encode) | near_misses)
@example(data=b'lockrun_runs_total{namespace="d",name="n",outcome="ok"} 3\n')
def test_the_reader_takes_anything_and_keeps_only_what_lockrun_could_write(data: bytes) -> None:
    """Any bytes: no exception, and what survives renders and reads back unchanged."""
    locks = metrics.parse(data)
    assert metrics.parse(metrics.render(locks).encode()) == locks
