"""Another local user plants, pre-empts, squats and spoofs; lockrun, often root, stays put.

Each attack is made by a real other Unix user (hostile/users.py), in a directory every
user may write to, as on a shared host. The oracle is the file system and the exit status,
not lockrun's word: a planted target keeps its bytes, nothing appears where it must not.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest

from lockrun.backends import Holder, Request, directories
from lockrun.backends import file as file_backend
from lockrun.backends.abstract import _base as abstract_base
from tests.support.cli import Held, holder_pids, lockrun, one_line, wait_for, waiter_pids
from tests.support.users import Runner, needs_root

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

pytestmark = needs_root
PRECIOUS = "precious: root's file, not a lock\n"


@pytest.fixture
def target() -> Iterator[Path]:
    """Return a directory of root's, elsewhere, with a file that must keep its bytes."""
    path = Path(tempfile.mkdtemp(prefix="lockrun-target-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def untouched(directory: Path, name: str) -> None:
    """Assert lockrun wrote nothing in *directory*: its lock file kept its bytes, no fence."""
    assert (directory / f"{name}.lock").read_text() == PRECIOUS
    assert not (directory / f"{name}.fence").exists()


# -- paths: symlinks, FIFOs, hard links -------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "/", "//", "/.", "/./"])
def test_a_symlink_planted_as_the_lock_directory_is_refused_however_it_is_written(
    mallory: Runner, shared: Path, target: Path, name: str, suffix: str
) -> None:
    """file:///link, file:///link/, file:///link/. : never followed, nothing written."""
    (target / f"{name}.lock").write_text(PRECIOUS)
    assert mallory.run(["ln", "-s", str(target), str(shared / "locks")]).returncode == 0
    result = lockrun("--uri", f"file://{shared}/locks{suffix}", "-n", name, "--", "true")
    assert result.returncode == 78
    assert "is a symlink; refusing to follow it" in one_line(result.stderr)
    untouched(target, name)


def test_a_symlinked_parent_planted_by_another_user_is_refused(
    mallory: Runner, shared: Path, target: Path, name: str
) -> None:
    """file:///shared/link/locks where mallory made link: refused, naming who could plant it."""
    (target / "locks").mkdir()
    (target / "locks" / f"{name}.lock").write_text(PRECIOUS)
    assert mallory.run(["ln", "-s", str(target), str(shared / "parent")]).returncode == 0
    for uri in (f"file://{shared}/parent/locks", f"file://{shared}/parent/locks/"):
        result = lockrun("--uri", uri, "-n", name, "--", "true")
        assert result.returncode == 78
        line = one_line(result.stderr)
        assert f"{shared}/parent is a symlink that user {mallory.user.name} could" in line
    untouched(target / "locks", name)


def test_a_symlink_that_only_we_could_have_made_is_followed(tmp_path: Path, name: str) -> None:
    """Like /var/lock → /run/lock: ours, in a directory of ours, so it is no plant."""
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    result = lockrun("--uri", f"file://{tmp_path}/alias/locks", "-n", name, "--", "true")
    assert (result.returncode, result.stderr) == (0, "")
    assert (tmp_path / "real" / "locks" / f"{name}.lock").exists()


def test_a_symlink_of_ours_in_a_directory_another_user_may_write_is_refused(
    target: Path, name: str
) -> None:
    """Root's own link counts for nothing where mallory could swap it (no sticky bit)."""
    open_dir = Path(tempfile.mkdtemp(prefix="lockrun-open-", dir="/tmp"))
    try:
        open_dir.chmod(0o777)  # writable by all, not sticky: anyone may rename our link
        (open_dir / "link").symlink_to(target)
        result = lockrun("--uri", f"file://{open_dir}/link/locks", "-n", name, "--", "true")
        assert result.returncode == 78
        assert "could have planted" in one_line(result.stderr)
        assert not (target / "locks").exists()
    finally:
        (open_dir / "link").unlink()
        open_dir.rmdir()


@pytest.fixture
def locks(shared: Path) -> Path:
    """Return a lock directory shared by every user, sticky (flock(1) users share such)."""
    path = shared / "locks"
    path.mkdir()
    path.chmod(0o1777)
    return path


@pytest.mark.parametrize("planted", ["lock", "fence"])
def test_a_symlink_planted_as_a_lock_or_fence_file_is_refused(
    mallory: Runner, locks: Path, target: Path, name: str, planted: str
) -> None:
    """NAME.lock or NAME.fence as mallory's link to root's file: 78, the file keeps its bytes."""
    precious = target / "passwd"
    precious.write_text(PRECIOUS)
    link = locks / f"{name}.{planted}"
    assert mallory.run(["ln", "-s", str(precious), str(link)]).returncode == 0
    result = lockrun("--uri", f"file://{locks}", "-n", name, "--", "true")
    assert result.returncode == 78, result.stderr
    assert f"{link}" in one_line(result.stderr)
    assert "symlink" in result.stderr  # not "Too many levels of symbolic links"
    assert "lockrun-mallory" in result.stderr  # who made it
    assert precious.read_text() == PRECIOUS


@pytest.mark.parametrize("planted", ["lock", "fence", "gate"])
def test_a_fifo_planted_as_a_lock_file_neither_hangs_run_nor_status(
    mallory: Runner, locks: Path, name: str, planted: str
) -> None:
    """A FIFO where a lock file goes: `-w 0` and status answer at once, 78 and 0."""
    fifo = locks / f"{name}.{planted}"
    assert mallory.run(["mkfifo", "-m", "666", str(fifo)]).returncode == 0
    slots = ["-s", "2"] if planted == "gate" else []
    started = time.monotonic()
    result = lockrun("--uri", f"file://{locks}", "-n", name, *slots, "-w", "0", "--", "true")
    assert result.returncode == 78, result.stderr
    assert "is not a regular file" in one_line(result.stderr)
    status = lockrun("status", "--uri", f"file://{locks}", name, timeout=30)
    assert status.returncode == 0, status.stderr
    listing = lockrun("status", "--uri", f"file://{locks}", "--json", timeout=30)
    assert listing.returncode == 0, listing.stderr
    assert time.monotonic() - started < 20  # each would hang for ever on the FIFO's open


@pytest.mark.parametrize("slots", [1, 3])
def test_a_hard_link_planted_as_a_lock_file_is_never_written(
    mallory: Runner, locks: Path, name: str, slots: int
) -> None:
    """NAME.lock (and NAME.gate, NAME.fence) as second names of mallory's files.

    Each is locked, never written: her files keep their bytes, and root's jobs run (they
    were refused, 78, for as long as her links stayed: alice could not even remove them
    from a sticky directory). -v says so.
    """
    make = "".join(
        f'printf %s "$0" > {locks}/hers.{kind} && ln {locks}/hers.{kind} {locks}/{name}.{kind}; '
        for kind in ("lock", "gate", "fence")
    )
    assert mallory.run(["sh", "-c", make, PRECIOUS]).returncode == 0
    uri = f"file://{locks}"
    for _ in range(2):
        result = lockrun("-v", "--uri", uri, "-n", name, "-s", str(slots), "--", "true")
        assert result.returncode == 0, result.stderr
        assert "2 names" in result.stderr
    for kind in ("lock", "gate", "fence"):
        assert (locks / f"hers.{kind}").read_text() == PRECIOUS
    assert mallory.lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0


def test_a_file_given_as_the_lock_directory_is_a_configuration_error(
    tmp_path: Path, name: str
) -> None:
    """A regular file where the directory should be: 78, not 69, and it is left alone."""
    (tmp_path / "file").write_text(PRECIOUS)
    for uri in (f"file://{tmp_path}/file", f"file://{tmp_path}/file/locks"):
        result = lockrun("--uri", uri, "-n", name, "--", "true")
        assert result.returncode == 78
        assert "Not a directory" in one_line(result.stderr)
    assert (tmp_path / "file").read_text() == PRECIOUS


def test_a_relative_directory_is_refused_not_taken_from_the_cwd(tmp_path: Path, name: str) -> None:
    """file:relative/dir would lock wherever cron happens to run: 78 with the fix."""
    result = lockrun("--uri", "file:locks/here", "-n", name, "--", "true", cwd=tmp_path)
    assert result.returncode == 78
    assert "must be an absolute path" in one_line(result.stderr)
    assert list(tmp_path.iterdir()) == []


def test_status_makes_no_directory(tmp_path: Path, name: str) -> None:
    """Asking who holds a lock creates nothing: a missing directory holds no locks."""
    where = tmp_path / "nowhere" / "locks"
    listing = lockrun("status", "--uri", f"file://{where}")
    assert (listing.returncode, listing.stderr) == (0, "")
    assert "no locks held" in listing.stdout
    one = lockrun("status", "--uri", f"file://{where}", "--json", name)
    assert json.loads(one.stdout)[0]["holders"] == []
    assert not (tmp_path / "nowhere").exists()


# -- default directories another user could make first ------------------------------------


def test_roots_default_directory_is_one_no_other_user_can_make(mallory: Runner, name: str) -> None:
    """Root locks in /run/lockrun (0700, in root's /run), whatever is in 1777 /run/lock."""
    squat = Path("/run/lock/lockrun")
    if not squat.exists():  # the old default, which anyone could make first
        assert mallory.run(["mkdir", "-m", "777", str(squat)]).returncode == 0
    result = lockrun("-n", name, "--", "true")
    assert (result.returncode, result.stderr) == (0, "")
    assert Path("/run/lockrun", f"{name}.lock").exists()
    info = os.stat("/run/lockrun")
    assert (info.st_uid, info.st_mode & 0o777) == (0, 0o700)
    assert mallory.run(["mkdir", f"/run/lockrun-{name}"]).returncode != 0  # /run is root's


def test_a_users_default_directory_cannot_be_taken_by_another_user(
    alice: Runner, mallory: Runner, name: str
) -> None:
    """Mallory's /tmp/lockrun-ALICE changes nothing: alice locks under her own home."""
    squat = Path(f"/tmp/lockrun-{alice.user.uid}")  # the old default, and the fallback
    shutil.rmtree(squat, ignore_errors=True)
    assert mallory.run(["mkdir", "-m", "777", str(squat)]).returncode == 0
    try:
        result = alice.lockrun("-n", name, "--", "true")
        assert (result.returncode, result.stderr) == (0, "")
        mine = Path(alice.user.home, ".cache", "lockrun", os.uname().nodename)
        assert (mine / f"{name}.lock").exists()
        assert os.stat(mine).st_mode & 0o777 == 0o700
        assert not (squat / f"{name}.lock").exists()
    finally:
        squat.rmdir()


def test_without_a_home_a_taken_fallback_is_refused_in_one_line(
    alice: Runner, mallory: Runner, name: str
) -> None:
    """No home of ours: /tmp/lockrun-UID, and if another user made it, 78 saying who."""
    squat = Path(f"/tmp/lockrun-{mallory.user.uid}")
    shutil.rmtree(squat, ignore_errors=True)
    assert alice.run(["mkdir", "-m", "777", str(squat)]).returncode == 0
    try:
        result = mallory.lockrun("-n", name, "--", "true")
        assert result.returncode == 78
        assert "belongs to user lockrun-alice, not to us" in one_line(result.stderr)
    finally:
        squat.rmdir()


class _Entry(NamedTuple):
    pw_dir: str
    pw_name: str


def as_uid(monkeypatch: pytest.MonkeyPatch, uid: int, home: str | None) -> None:
    """Make lockrun's directories module see effective user *uid* with home *home*."""
    monkeypatch.setattr("os.geteuid", lambda: uid)

    def getpwuid(asked: int) -> _Entry:
        if home is None or asked != uid:
            raise KeyError(asked)
        return _Entry(home, "someone")

    monkeypatch.setattr("pwd.getpwuid", getpwuid)


def test_a_users_default_is_under_a_home_that_is_theirs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """~/.cache/lockrun/HOST when home is ours and not writable by others; else /tmp."""
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chown(home, 4242, 4242)
    host = os.uname().nodename
    as_uid(monkeypatch, 4242, str(home))
    assert directories.default_directory() == (f"{home}/.cache/lockrun/{host}", str(home))
    home.chmod(0o777)  # others may write it: they could plant .cache
    assert directories.default_directory() == ("/tmp/lockrun-4242", "/tmp")
    home.chmod(0o755)
    os.chown(home, 4343, 4343)  # someone else's
    assert directories.default_directory().path == "/tmp/lockrun-4242"
    as_uid(monkeypatch, 4242, None)  # no entry in the password database
    assert directories.default_directory().path == "/tmp/lockrun-4242"
    as_uid(monkeypatch, 4242, "relative/home")
    assert directories.default_directory().path == "/tmp/lockrun-4242"


def test_a_chain_of_trusted_symlinks_ends_in_78_not_a_hang(tmp_path: Path, name: str) -> None:
    """Links of ours that point at each other: ELOOP after 40, a configuration error."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    result = lockrun("--uri", f"file://{tmp_path}/a/locks", "-n", name, "--", "true")
    assert result.returncode == 78
    assert "Too many levels of symbolic links" in one_line(result.stderr)


def test_a_planted_link_names_its_owner_by_uid_when_nobody_has_it(
    shared: Path, target: Path, name: str
) -> None:
    """A link of a uid with no user (a deleted account) is refused, naming the uid."""
    link = shared / "orphan"
    link.symlink_to(target)
    os.lchown(link, 54321, 54321)
    result = lockrun("--uri", f"file://{link}/locks", "-n", name, "--", "true")
    assert result.returncode == 78
    assert "that uid 54321 could have planted" in one_line(result.stderr)


# -- abstract: squatted names, spoofed markers, handed junk ------------------------------

# A marker of BASE (argv 1) saying pid argv 2 ("self": the squatter's own) holds slot 0 of 7.
SQUAT_MARKER = """
import os, socket, sys
pid = os.getpid() if sys.argv[2] == "self" else int(sys.argv[2])
marker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
marker.bind("\\0" + sys.argv[1] + "/h0.7/1700000000000/" + str(pid))
marker.listen(8)
print("ready", flush=True)
sys.stdin.read()
"""

SQUAT_SLOT = """
import os, socket, sys
slot = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
slot.bind("\\0" + sys.argv[1] + "/0")
slot.listen(64)
other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
other.bind("\\0" + sys.argv[1] + "/elsewhere")
other.listen(1)
junk = {"pipe": os.pipe()[0], "file": os.open("/etc/hostname", os.O_RDONLY),
        "socket": other.fileno()}[sys.argv[2]]
print("ready", flush=True)
while True:
    conn, _ = slot.accept()
    try:
        socket.send_fds(conn, [b"9" * 40], [junk])
    except OSError:
        pass
    conn.close()
"""


@pytest.fixture
def prefix() -> str:
    """Return an abstract: prefix of this test's own."""
    return f"hostile-{os.getpid()}-{time.monotonic_ns()}"


@contextlib.contextmanager
def planted(process: subprocess.Popen[str]) -> Iterator[None]:
    """Wait until a planted process says it is ready; kill it after the block."""
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        yield
    finally:
        process.kill()
        process.communicate()


def test_a_forged_holder_marker_neither_refuses_nor_shows(
    mallory: Runner, prefix: str, name: str
) -> None:
    """A marker claiming slot 0 of 7, with no slot held behind it: no 78, not in status."""
    base = abstract_base(prefix, "default", name)
    with planted(mallory.python(SQUAT_MARKER, base, "self", stdin=subprocess.PIPE)):
        uri = f"abstract:{prefix}"
        result = lockrun("--uri", uri, "-n", name, "--", "true")
        assert (result.returncode, result.stderr) == (0, "")
        status = lockrun("status", "--uri", uri, "--json", name)
        assert json.loads(status.stdout)[0]["holders"] == []


@pytest.mark.parametrize("who", ["root", "alice"], ids=["root", "alice-cannot-read-proc"])
def test_a_forged_marker_naming_another_process_is_no_mismatch(
    alice: Runner, mallory: Runner, prefix: str, name: str, held: Callable[..., Held], who: str
) -> None:
    """A real holder has slot 0; mallory's marker says pid 1 holds it with 7 slots: 75.

    Alice may not read root's /proc/1/fd: the kernel's SO_PEERCRED still unmasks mallory.
    """
    run = alice.lockrun if who == "alice" else lockrun
    uri = f"abstract:{prefix}"
    holder = held("--uri", uri, "-n", name)
    base = abstract_base(prefix, "default", name)
    # pid 1 holds no such socket
    with planted(mallory.python(SQUAT_MARKER, base, "1", stdin=subprocess.PIPE)):
        result = run("--uri", uri, "-n", name, "-w", "0", "--", "true")
        assert result.returncode == 75, result.stderr  # not 78: pid 1 holds no 7 slots
        assert "busy" in one_line(result.stderr)
        status = run("status", "--uri", uri, "--json", name)
        [state] = json.loads(status.stdout)
        assert [owner["pid"] for owner in state["holders"]] == [holder.process.pid]
    holder.finish()


def test_a_handed_over_slot_is_shown_as_its_new_holder_to_other_users(
    alice: Runner,
    prefix: str,
    name: str,
    held: Callable[..., Held],
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    """After a hand-over the kernel names the taker, so others still see who holds it."""
    uri = f"abstract:{prefix}"
    first = held("--uri", uri, "-n", name)
    second = spawn("--uri", uri, "-n", name, "-w", "60", "--", "sleep", "60")
    wait_for(lambda: waiter_pids(uri, name) == [second.pid], what="the second in the queue")
    first.finish()
    wait_for(lambda: holder_pids(uri, name) == [second.pid], what="the hand-over")
    status = alice.lockrun("status", "--uri", uri, "--json", name)
    assert [owner["pid"] for owner in json.loads(status.stdout)[0]["holders"]] == [second.pid]


@pytest.mark.parametrize("junk", ["pipe", "file", "socket"])
def test_a_squatter_handing_junk_instead_of_the_slot_is_busy_not_a_crash(
    mallory: Runner, prefix: str, name: str, junk: str
) -> None:
    """Mallory holds the name and hands a pipe, a file or the wrong socket: 75, one line."""
    base = abstract_base(prefix, "default", name)
    with planted(mallory.python(SQUAT_SLOT, base, junk)):
        result = lockrun("--uri", f"abstract:{prefix}", "-n", name, "-w", "1", "--", "true")
        assert result.returncode == 75, result.stderr
        assert "busy" in one_line(result.stderr)


# -- records spoofed in a shared lock directory ---------------------------------------------

SPOOFS = {
    "deep": "[" * 100_000 + "]" * 100_000,
    "types": '{"name": 1, "namespace": [], "slots": "7", "host": {}, "pid": "x", "user": null}',
    "huge": '{"name": "N", "namespace": "default", "slots": 1, "host": "h", "pid": 1e400,'
    ' "user": "u", "since": 1e308, "argv": ["' + "x" * 60000 + '"]}',
    "fence": '{"name": "N", "namespace": "default", "slots": 1, "host": "h", "pid": 1,'
    ' "user": "u", "slot": 340282366920938463463374607431768211456}',
    "other-name": '{"name": "other", "namespace": "default", "slots": 7, "host": "h",'
    ' "pid": 1, "user": "u"}',
    "binary": "\udcff\x00\x1b[2J",
}


@contextlib.contextmanager
def flocked_by(mallory: Runner, lock_file: Path, record: bytes) -> Iterator[None]:
    """Make *lock_file* mallory's, holding *record*, and hold a flock on it during the block."""
    lock_file.write_bytes(record)
    os.chown(lock_file, mallory.user.uid, mallory.user.gid)
    lock_file.chmod(0o644)
    holder = mallory.popen(["flock", str(lock_file), "sleep", "60"])
    inode = f":{os.stat(lock_file).st_ino} "  # how /proc/locks names a lock on it
    try:
        wait_for(lambda: inode in Path("/proc/locks").read_text(), what="mallory's flock")
        yield
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("spoof", sorted(SPOOFS))
def test_records_spoofed_by_a_holder_in_a_shared_directory_change_nothing(
    mallory: Runner, locks: Path, name: str, spoof: str
) -> None:
    """Mallory holds NAME.lock with junk in it: busy (75) in one line, status reads it."""
    record = SPOOFS[spoof].replace('"N"', json.dumps(name)).encode(errors="surrogateescape")
    with flocked_by(mallory, locks / f"{name}.lock", record):
        result = lockrun("--uri", f"file://{locks}", "-n", name, "-w", "0", "--", "true")
        assert result.returncode == 75, result.stderr
        assert "busy" in one_line(result.stderr)
        for args in ([name], ["--json", name], ["--json"], []):
            status = lockrun("status", "--uri", f"file://{locks}", *args)
            assert (status.returncode, status.stderr) == (0, ""), status.stderr
            assert "\x1b" not in status.stdout


def forged(name: str, **fields: object) -> bytes:
    """Return a lock file a lockrun of root's could have left: a counter line and a record."""
    record = {"name": name, "namespace": "default", "slots": 1, "host": "h", "pid": 1}
    record |= {"user": "root", "argv": ["backup"], "since": time.time()} | fields
    return b"1\n" + json.dumps(record).encode() + b"\n"


@pytest.mark.parametrize("made", ["mallory-0644", "mallory-0666", "root-0666"])
def test_a_window_another_user_could_have_written_holds_nothing(
    mallory: Runner, locks: Path, name: str, made: str
) -> None:
    """A --hold-at-least window for a day, 'root@h pid 1', in a file mallory made or may write.

    Root's run is not refused (it was for up to 366 days), -v says why, naming the file's
    real owner; status shows no holder. Root's own window in that file then holds as usual.
    """
    lock_file = locks / f"{name}.lock"
    content = forged(name, until=time.time() + 86400).decode()
    owner, mode = made.split("-")
    if owner == "mallory":
        made_it = mallory.run(["sh", "-c", f"cat > {lock_file}; chmod {mode} {lock_file}"],
                              input=content)  # fmt: skip
        assert made_it.returncode == 0
    else:
        lock_file.write_text("")
        lock_file.chmod(0o666)  # root's, and anyone's to write
        assert mallory.run(["sh", "-c", f"cat > {lock_file}"], input=content).returncode == 0
    uri = f"file://{locks}"
    result = lockrun("-v", "--uri", uri, "-n", name, "-w", "0", "--", "true")
    assert result.returncode == 0, result.stderr
    who = "user lockrun-mallory" if owner == "mallory" else "every user"
    ignored = [line for line in result.stderr.splitlines() if "not believed" in line]
    assert len(ignored) == 1, result.stderr
    assert who in ignored[0]
    assert "root@h" not in result.stderr
    status = lockrun("status", "--uri", uri, "--json", name)
    assert json.loads(status.stdout)[0]["holders"] == []
    window = lockrun("--uri", uri, "-n", name, "--hold-at-least", "1h", "--", "true")
    assert window.returncode == 0, window.stderr
    again = lockrun("--uri", uri, "-n", name, "-w", "0", "--", "true")
    assert again.returncode == 0, again.stderr  # nor do others believe it, root included


@pytest.mark.parametrize("slots", [1, 7])
def test_a_busy_line_names_the_holder_the_kernel_sees_not_the_record(
    mallory: Runner, locks: Path, name: str, slots: int
) -> None:
    """Mallory holds her NAME.lock, whose record says root@h pid 1 (with N slots): 75.

    The line and status name mallory's process, never root@h pid 1; a record of 7 slots
    she wrote is no --slots mismatch (78) either: it is not believed.
    """
    with flocked_by(mallory, locks / f"{name}.lock", forged(name, slots=slots)):
        result = lockrun("--uri", f"file://{locks}", "-n", name, "-w", "0", "--", "true")
        assert result.returncode == 75, result.stderr
        line = one_line(result.stderr)
        assert f"held by {mallory.user.name}@" in line, line
        assert "root@h" not in line
        status = lockrun("status", "--uri", f"file://{locks}", "--json", name)
        (holder,) = json.loads(status.stdout)[0]["holders"]
        assert holder["user"] == mallory.user.name


def test_records_of_our_own_file_are_believed(locks: Path, name: str) -> None:
    """Root's 0644 file with a live holder's record of 7 slots: the --slots mismatch, 78."""
    lock_file = locks / f"{name}.lock"
    lock_file.write_bytes(forged(name, slots=7))
    lock_file.chmod(0o644)
    holder = subprocess.Popen(["flock", str(lock_file), "sleep", "60"])
    inode = f":{os.stat(lock_file).st_ino} "
    try:
        wait_for(lambda: inode in Path("/proc/locks").read_text(), what="the flock")
        result = lockrun("--uri", f"file://{locks}", "-n", name, "-w", "0", "--", "true")
        assert result.returncode == 78
        assert "in use with 7 slots by root@h pid 1" in one_line(result.stderr)
    finally:
        holder.kill()
        holder.wait()


# -- file: take-over requests proven by an act, not by who a process is later ---------------

# A set-uid-root program that blocks until its stdin closes: what passwd, su or chfn do
# while they wait for a password, with root's file-system uid all along.
BLOCKER_C = """
#include <unistd.h>
int main(void) { char c; while (read(0, &c, 1) > 0) {} return 0; }
"""

# Mallory opens what she may read of the lock (NAME.lock, NAME.stop if there is one) without
# O_CLOEXEC, locks all she can through those read-only descriptors (flock LOCK_SH on
# NAME.stop; POSIX and OFD read locks over all of NAME.lock), then execs argv 3: a set-uid-root
# program inherits the descriptors and their locks, and its file-system uid is 0.
READ_ONLY_REQUEST = """
import fcntl, os, struct, sys
directory, name, program = sys.argv[1:4]
def everything(kind):
    return struct.pack("hhqqi4x", kind, 0, 0, 0, 0)
lock = os.open(f"{directory}/{name}.lock", os.O_RDONLY)
os.set_inheritable(lock, True)
for command in (fcntl.F_SETLK, fcntl.F_OFD_SETLK):
    fcntl.fcntl(lock, command, everything(fcntl.F_RDLCK))
    try:
        fcntl.fcntl(lock, command, everything(fcntl.F_WRLCK))
    except OSError:
        pass  # EBADF: a write lock needs a descriptor open for writing
if os.path.exists(f"{directory}/{name}.stop"):
    stop = os.open(f"{directory}/{name}.stop", os.O_RDONLY)
    os.set_inheritable(stop, True)
    fcntl.flock(stop, fcntl.LOCK_SH)
print("ready", flush=True)
os.execv(program, [program])
"""


@pytest.fixture(scope="module")
def setuid_blocker() -> Iterator[Path]:
    """Return a set-uid-root program, built now, that blocks until its stdin closes."""
    if shutil.which("cc") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("cc is missing: the set-uid tests build a program with it")
        pytest.skip("no cc to build a set-uid-root program with")
    directory = Path(tempfile.mkdtemp(prefix="lockrun-setuid-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        source, program = directory / "blocker.c", directory / "blocker"
        source.write_text(BLOCKER_C)
        subprocess.run(["cc", "-o", str(program), str(source)], check=True, capture_output=True)
        program.chmod(0o4755)  # root's, set-uid
        yield program
    finally:
        shutil.rmtree(directory)


@contextlib.contextmanager
def read_only_request(
    mallory: Runner, locks: Path, name: str, program: Path
) -> Iterator[subprocess.Popen[str]]:
    """Have mallory lock what she may read of *name*, then exec the set-uid *program*."""
    code = READ_ONLY_REQUEST
    process = mallory.python(code, str(locks), name, str(program), stdin=subprocess.PIPE)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        # The exec is done once the process runs the program, as root: its /proc is root's.
        wait_for(lambda: os.stat(f"/proc/{process.pid}").st_uid == 0, what="the set-uid exec")
        yield process
    finally:
        process.kill()
        process.communicate()


@pytest.mark.parametrize("stop", ["none", "left-by-root", "planted"])
def test_a_reader_who_execs_a_setuid_program_stops_no_one(
    mallory: Runner, locks: Path, name: str, setuid_blocker: Path, stop: str
) -> None:
    """Read-only locks on NAME.lock and NAME.stop, then a set-uid exec: root's jobs run on.

    NAME.stop, if any, is one a root take-over left (0644) or mallory planted (0666). A
    grant looks for requests at once, and so does a refresh, which a rung bell brings.
    """
    uri = f"file://{locks}"
    assert lockrun("--uri", uri, "-n", name, "--", "true").returncode == 0  # root's 0644 file
    stop_file = locks / f"{name}.stop"
    if stop == "left-by-root":
        stop_file.touch(mode=0o644)
    elif stop == "planted":
        assert mallory.run(["sh", "-c", f"umask 0; : > {stop_file}"]).returncode == 0
    with read_only_request(mallory, locks, name, setuid_blocker):
        result = lockrun("--uri", uri, "-n", name, "--", "true")
        assert (result.returncode, result.stderr) == (0, "")
        backend = file_backend.FileBackend(str(locks), private=False, make_below="/")
        lease = backend.acquire(Request("default", name, 1, 30.0, Holder.me(["root"])), 0)
        assert lease is not None
        lease.refresh()  # no TakenOver
        lease.release()


# Mallory read-locks all of NAME.lock (a reader may) until her stdin closes.
READ_LOCK_ALL = """
import fcntl, os, struct, sys
lock = os.open(sys.argv[1], os.O_RDONLY)
fcntl.fcntl(lock, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_RDLCK, 0, 0, 0, 0))
print("ready", flush=True)
sys.stdin.read()
"""


FORGED_REQUEST = """
import fcntl, os, struct, sys
lock = os.open(sys.argv[1], os.O_RDWR)
claim = (1 << 62) + 1  # uid 0, pid 1
fcntl.fcntl(lock, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, claim, 1, 0))
os.utime(lock)
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_request_in_a_lock_file_another_user_owns_stops_no_one(
    mallory: Runner, locks: Path, name: str, held: Callable[..., Held]
) -> None:
    """Mallory made NAME.lock, so may write it, and asks as 'root pid 1': root's job runs on.

    No request counts in a file another user could write, root's own taker's neither: it
    waits as any waiter (75 here).
    """
    lock_file = locks / f"{name}.lock"
    assert mallory.run(["sh", "-c", f"umask 022; : > {lock_file}"]).returncode == 0
    holder = held("--uri", f"file://{locks}", "-n", name)
    asking = mallory.python(FORGED_REQUEST, str(lock_file), stdin=subprocess.PIPE)
    try:
        assert asking.stdout is not None
        assert asking.stdout.readline().strip() == "ready"
        taker = lockrun("--uri", f"file://{locks}", "-n", name, "--take-over", "-w", "1",
                        "--", "true")  # fmt: skip
        assert taker.returncode == 75, taker.stderr
        assert holder.process.poll() is None
    finally:
        asking.kill()
        asking.communicate()
    assert holder.finish() == 0


def test_a_reader_who_blocks_take_over_requests_is_reported_not_obeyed(
    mallory: Runner, locks: Path, name: str, held: Callable[..., Held]
) -> None:
    """Mallory's read lock over all of NAME.lock leaves no byte to ask with: the taker says so.

    It waits as any waiter then (75 here, the holder runs on), as a flock on NAME.stop
    could make it wait before; nobody is stopped.
    """
    uri = f"file://{locks}"
    holder = held("--uri", uri, "-n", name)
    blocking = mallory.python(READ_LOCK_ALL, str(locks / f"{name}.lock"), stdin=subprocess.PIPE)
    try:
        assert blocking.stdout is not None
        assert blocking.stdout.readline().strip() == "ready"
        taker = lockrun("--uri", uri, "-n", name, "--take-over", "-w", "1", "--", "true")
        assert taker.returncode == 75, taker.stderr
        first, busy = taker.stderr.splitlines()
        assert first.startswith("lockrun: ")
        assert "cannot ask" in first
        assert "busy" in busy
        assert holder.process.poll() is None
    finally:
        blocking.kill()
        blocking.communicate()
    assert holder.finish() == 0


def _in_a_setgid_directory(mallory: Runner, locks: Path, name: str) -> Path:
    """Return NAME.lock as mallory makes it in a set-group-ID directory of root's group.

    The file gets the directory's group, root's, though she is no member: so a 2777/3777
    directory hands its group to every file made there, whoever makes it.
    """
    lock_file = locks / f"{name}.lock"
    locks.chmod(0o3777)
    os.chown(locks, 0, 0)
    made = mallory.run(["sh", "-c", f"umask 022; : > {lock_file}"])
    assert made.returncode == 0, made.stderr
    assert (lock_file.stat().st_uid, lock_file.stat().st_gid) == (mallory.user.uid, 0)
    return lock_file


def test_a_window_in_a_file_mallory_made_in_a_setgid_directory_holds_nothing(
    mallory: Runner, locks: Path, name: str
) -> None:
    """Her file of root's group, with a day's window 'root@h pid 1': root's run goes on.

    And -v names her as who could have written it.
    """
    lock_file = _in_a_setgid_directory(mallory, locks, name)
    content = forged(name, until=time.time() + 86400).decode()
    assert mallory.run(["sh", "-c", f"cat > {lock_file}"], input=content).returncode == 0
    result = lockrun("-v", "--uri", f"file://{locks}", "-n", name, "-w", "0", "--", "true")
    assert result.returncode == 0, result.stderr
    assert "root@h" not in result.stderr
    ignored = [line for line in result.stderr.splitlines() if "not believed" in line]
    assert len(ignored) == 1, result.stderr
    assert "user lockrun-mallory" in ignored[0]


def test_a_request_in_a_file_mallory_made_in_a_setgid_directory_stops_no_one(
    mallory: Runner, locks: Path, name: str, held: Callable[..., Held]
) -> None:
    """Her file of root's group, and her request as 'root pid 1': root's job runs on."""
    lock_file = _in_a_setgid_directory(mallory, locks, name)
    holder = held("--uri", f"file://{locks}", "-n", name)
    asking = mallory.python(FORGED_REQUEST, str(lock_file), stdin=subprocess.PIPE)
    try:
        assert asking.stdout is not None
        assert asking.stdout.readline().strip() == "ready"
        taker = lockrun("--uri", f"file://{locks}", "-n", name, "-w", "0", "--", "true")
        assert taker.returncode == 75, taker.stderr  # busy: the holder is still there
        assert holder.process.poll() is None
    finally:
        asking.kill()
        asking.communicate()
    assert holder.finish() == 0


def _protected_regular(real: Callable[..., int]) -> Callable[..., int]:
    """Return os.open as the kernel makes it with fs.protected_regular=1 (proc_sys_fs(5)).

    An O_CREAT open (without O_EXCL) of an existing regular file in a sticky directory every
    user may write fails with EACCES if the file is neither ours nor the directory owner's;
    the same open without O_CREAT succeeds. systemd turns it on by default; a test cannot
    turn the machine-wide sysctl on without changing every other process's opens.
    """

    def protected(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & os.O_CREAT and not flags & os.O_EXCL and dir_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                found = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
                directory = os.fstat(dir_fd)
                sticky = directory.st_mode & 0o1002 == 0o1002
                theirs = found.st_uid not in {os.geteuid(), directory.st_uid}
                if sticky and stat.S_ISREG(found.st_mode) and theirs:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(path, flags, mode, dir_fd=dir_fd)

    return protected


@pytest.mark.parametrize("mode", ["0644", "0666"])
def test_a_lock_file_planted_where_protected_regular_holds_is_locked_not_refused(
    mallory: Runner, locks: Path, name: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mallory's NAME.lock in a 1777 directory, with fs.protected_regular's rule: root locks it.

    Opening it with O_CREAT is refused there (EACCES), so root's job was refused (78)
    for as long as her file stayed: a denial of service by any co-user, on systemd's default.
    """
    lock_file = locks / f"{name}.lock"
    assert mallory.run(["sh", "-c", f": > {lock_file}; chmod {mode} {lock_file}"]).returncode == 0
    monkeypatch.setattr(os, "open", _protected_regular(os.open))
    backend = file_backend.FileBackend(str(locks), private=False, make_below="/")
    lease = backend.acquire(Request("default", name, 1, 30.0, Holder.me(["root"])), 0)
    assert lease is not None
    assert os.path.samestat(os.stat(lease.path), lock_file.stat())
    lease.release()
    missing = backend.acquire(Request("default", f"{name}-new", 1, 30.0, Holder.me(["root"])), 0)
    assert missing is not None  # and a missing one is still made
    missing.release()
