"""A keeper's door and token under attack: other users, junk, floods, squatters, planted files.

The keeper listens on an abstract socket, which any local user may connect to (and, once
it is gone, bind). Each attack is made by a real other Unix user (tests/support/users.py);
the oracle is whether the lock is still held (another lockrun is busy), what the attacker
heard, and the files an attacker pointed root at (docs/security.md: a keeper's door).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockrun import UsageError
from lockrun.delivery import check_variable
from lockrun.door import parse_token
from lockrun.runner import Options
from lockrun.section import PID_MAX, parse_owner, watch_owner
from tests.support.cli import lockrun, one_line, taken, unmeasured, wait_for
from tests.support.users import Runner, needs_root

if TYPE_CHECKING:
    from collections.abc import Iterator

PRECIOUS = "precious: root's file\n"


@pytest.fixture
def owner() -> Iterator[subprocess.Popen[bytes]]:
    """Return a process to own keepers; killed at teardown, which releases what they hold."""
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def kept(file_uri: str, name: str, owner: subprocess.Popen[bytes]) -> str:
    """Return the token of a lock that a keeper of ours holds."""
    result = lockrun("acquire", "--uri", file_uri, "--owner", str(owner.pid), name)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


# Mallory at the door: the real secret, wrong ones, junk, a flood of idle connections.
ATTACK = """
import socket, sys, time
door = b"\\0lockrun-keeper/" + sys.argv[1].encode()
def ask(data):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(door)
    try:
        s.send(data)
    except OSError:  # the keeper answered at once and hung up
        pass
    try:
        return s.recv(1024)
    except OSError as err:
        return repr(err).encode()
for data in (b"release " + sys.argv[2].encode(), b"renew " + sys.argv[2].encode(),
             b"release " + b"A" * 24, b"\\xff" * 64, b"x" * 5000, b""):
    print(ask(data).decode(errors="replace"), flush=True)
crowd = []
for _ in range(200):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.setblocking(False)
    try:
        s.connect(door)
    except BlockingIOError:
        pass
    crowd.append(s)
print("crowd", flush=True)
time.sleep(30)
"""


@needs_root
def test_another_user_at_the_door_is_refused_and_cannot_block_it(
    mallory: Runner, file_uri: str, name: str, kept: str
) -> None:
    """mallory, with the secret, junk or a crowd: told not yours, and the owner's renew works."""
    token = parse_token(kept)
    attacker = mallory.python(ATTACK, token.keeper, token.secret, text=True)
    assert attacker.stdout is not None
    answers = [attacker.stdout.readline().strip() for _ in range(6)]
    # Refused at the door: told so, or reset where her request was still unread at the close.
    assert all(answer.startswith(("77 ", "ConnectionResetError")) for answer in answers), answers
    assert attacker.stdout.readline().strip() == "crowd"
    renewed = lockrun("renew", kept, timeout=15)  # while mallory's 200 connections stay open
    assert (renewed.returncode, renewed.stderr) == (0, "")
    assert taken(file_uri, name)
    refused = mallory.lockrun("release", kept)
    assert refused.returncode == 77
    assert "not yours" in one_line(refused.stderr)
    attacker.kill()
    attacker.communicate()
    assert taken(file_uri, name)
    assert lockrun("release", kept).returncode == 0


def test_a_wrong_secret_is_not_yours_and_the_lock_stays(
    file_uri: str, name: str, kept: str
) -> None:
    """A token with this keeper's id and another secret: 77, the keeper keeps the lock."""
    token = parse_token(kept)
    for secret in ("A" * 24, token.secret[:-1] + ("B" if token.secret[-1] != "B" else "C")):
        guess = f"lr1.{token.uid}.{token.keeper}.{secret}"
        result = lockrun("release", guess)
        assert result.returncode == 77
        assert "secret is wrong" in one_line(result.stderr)
    assert taken(file_uri, name)
    assert lockrun("release", kept).returncode == 0


SQUAT = """
import socket, sys
door = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
door.bind(b"\\0lockrun-keeper/" + sys.argv[1].encode())
door.listen(8)
print("squatting", flush=True)
while True:
    connection, _ = door.accept()
    print(connection.recv(1024), flush=True)
    connection.send(b"0 released, honestly")
    connection.close()
"""


@needs_root
def test_a_squatter_on_a_gone_keepers_name_is_not_believed(mallory: Runner, kept: str) -> None:
    """Mallory binds a released keeper's name: root's release says 76 and sends no secret."""
    assert lockrun("release", kept).returncode == 0
    squatter = mallory.python(SQUAT, parse_token(kept).keeper, text=True)
    assert squatter.stdout is not None
    assert squatter.stdout.readline().strip() == "squatting"
    result = lockrun("release", kept)
    squatter.kill()
    heard, _ = squatter.communicate()
    assert result.returncode == 76
    assert f"user {mallory.user.name} listens on its name" in one_line(result.stderr)
    assert parse_token(kept).secret not in heard  # root hung up before it sent the secret


MALFORMED = [
    "",
    "lr1",
    "lr2.0.0123456789abcdef.ABCDEFGHIJKLMNOPQRSTUVWX",
    "lr1.0.0123456789ABCDEF.ABCDEFGHIJKLMNOPQRSTUVWX",
    "lr1.0.0123456789abcdef.ABCDEFGHIJKLMNOPQRSTUVWX\n",
    "lr1.99999999999.0123456789abcdef.ABCDEFGHIJKLMNOPQRSTUVWX",
    "lr1.0.0123456789abcdef.ABCDEFGHIJKLMNOPQRSTUV$(id)",
    "\x1b[2J" + "x" * 5000,
]


def test_a_malformed_token_is_a_usage_error() -> None:
    """Junk from the command line or $LOCKRUN_TOKEN: 64, one line that does not echo it."""
    for token in MALFORMED:  # the parser (tests/hostile/fuzz.py reads any text too)
        with pytest.raises(UsageError, match="malformed token"):
            parse_token(token)
    for result in (
        lockrun("release", MALFORMED[-1]),
        lockrun("renew", env={**os.environ, "LOCKRUN_TOKEN": MALFORMED[4]}),
    ):
        assert result.returncode == 64
        assert "malformed token" in one_line(result.stderr)
        assert "\x1b" not in result.stderr


def test_a_token_of_no_keeper_or_of_another_user() -> None:
    """A well-formed token of no keeper is 76; one of another uid is 77 for a non-root user."""
    nobody = "lr1.0.0123456789abcdef.ABCDEFGHIJKLMNOPQRSTUVWX"
    assert lockrun("release", nobody).returncode == 76
    unset = lockrun("release", env={k: v for k, v in os.environ.items() if k != "LOCKRUN_TOKEN"})
    assert unset.returncode == 64
    assert "no token" in one_line(unset.stderr)


@needs_root
def test_another_users_token_is_not_theirs(mallory: Runner, kept: str) -> None:
    """Mallory given root's token: 77 before anything is sent."""
    result = mallory.lockrun("renew", kept)
    assert result.returncode == 77
    assert "of another user (uid 0): not yours" in one_line(result.stderr)


def test_an_owner_that_is_no_process_is_a_usage_error(file_uri: str, name: str) -> None:
    """--owner 0, -1, huge, not a number, gone, or 1 (never exits) without --max-time: 64."""
    for text in ("0", "-1", "4194305", "99999999999999999999", "me", "\x1c0", "٣"):
        with pytest.raises(UsageError, match="--owner takes a process id"):
            parse_owner(text)
    options = Options(name=name, uri=file_uri)
    for owner in (None, 1):
        with pytest.raises(UsageError, match="give --max-time too"):
            watch_owner(owner, options)
    with pytest.raises(UsageError, match="no such process"):
        watch_owner(PID_MAX, options)
    for text in ("0", "1"):
        result = lockrun("acquire", "--uri", file_uri, f"--owner={text}", name)
        assert (result.returncode, result.stdout) == (64, "")
        one_line(result.stderr)
    assert not taken(file_uri, name)


@needs_root
@pytest.mark.parametrize("planted", ["symlink", "fifo", "hardlink", "parent", "owned"])
def test_an_env_file_another_user_planted_is_refused(
    mallory: Runner, shared: Path, tmp_path: Path, file_uri: str, name: str, planted: str
) -> None:
    """--env-file through mallory's symlink, FIFO, directory or own file, or a 2nd link: 78."""
    precious = tmp_path / "precious"
    precious.write_text(PRECIOUS)
    env_file = shared / "env"
    if planted == "symlink":
        assert mallory.run(["ln", "-s", str(precious), str(env_file)]).returncode == 0
    elif planted == "fifo":
        assert mallory.run(["mkfifo", str(env_file)]).returncode == 0
    elif planted == "hardlink":  # mallory may not link root's files: root's own second name
        os.link(precious, env_file)
    elif planted == "owned":  # hers, writable by anyone, in the sticky directory: she reads it
        made = mallory.run(["sh", "-c", f"umask 0 && echo 'EARLIER=1' > {env_file}"])
        assert made.returncode == 0
        precious = env_file
    else:
        assert mallory.run(["ln", "-s", str(tmp_path), str(shared / "dir")]).returncode == 0
        env_file = shared / "dir" / "precious"
    before = precious.read_text()
    result = lockrun("acquire", "--uri", file_uri, "--env-file", str(env_file), name, timeout=15)
    assert (result.returncode, result.stdout) == (78, "")
    assert "--env-file" in one_line(result.stderr)
    assert precious.read_text() == before
    assert not taken(file_uri, name)


def test_the_env_file_gets_one_line_appended(
    tmp_path: Path, file_uri: str, name: str, owner: subprocess.Popen[bytes]
) -> None:
    """--env-file appends NAME=token (GitHub's format), keeps what was there, prints nothing."""
    env_file = tmp_path / "github_env"
    env_file.write_text("EARLIER=1\n")
    result = lockrun(
        *("acquire", "--uri", file_uri, "--owner", str(owner.pid)),
        *("--env-file", str(env_file), "--var", "DEPLOY_LOCK", name),
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    earlier, line = env_file.read_text().splitlines()
    assert earlier == "EARLIER=1"
    variable, token = line.split("=")
    assert variable == "DEPLOY_LOCK"
    wait_for(lambda: lockrun("release", token).returncode == 0, what="the release")


def kernel_thread() -> int:
    """Return the pid of a kernel thread other than kthreadd (pid 2)."""
    for entry in sorted(os.listdir("/proc"), key=lambda e: (len(e), e)):
        if entry.isdigit() and int(entry) > 2:  # past init and kthreadd
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_bytes()
                if int(stat.rpartition(b")")[2].split()[1]) == 2:  # kthreadd's
                    return int(entry)
    pytest.skip("no kernel thread is visible here (a pid namespace of its own)")


@contextlib.contextmanager
def namespace_init() -> Iterator[int]:
    """Yield the pid (here) of a process that is the init of a pid namespace of its own."""
    with subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "sleep", "600"], start_new_session=True
    ) as unshare:
        try:
            children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
            wait_for(lambda: children.read_text().split(), what="unshare's child")
            yield int(children.read_text().split()[0])
        finally:
            unshare.kill()


@needs_root  # unshare --pid
def test_an_owner_that_never_exits_needs_max_time(file_uri: str, name: str) -> None:
    """kthreadd, any kernel thread, a pid namespace's init: as pid 1, 64 without --max-time."""
    options = Options(name=name, uri=file_uri)
    with namespace_init() as init:
        for owner in (2, kernel_thread(), init):
            with pytest.raises(UsageError, match=f"pid {owner}, .*never exits.*give --max-time"):
                watch_owner(owner, options)
            result = lockrun("acquire", "--uri", file_uri, f"--owner={owner}", name)
            assert (result.returncode, result.stdout) == (64, ""), owner
            assert "give --max-time too" in one_line(result.stderr)
        assert not taken(file_uri, name)
        bounded = lockrun("acquire", "--uri", file_uri, f"--owner={init}", "--max-time=1m", name)
        assert bounded.returncode == 0, bounded.stderr
        assert taken(file_uri, name)
    wait_for(lambda: not taken(file_uri, name), what="the namespace's end to release it")
    assert lockrun("release", bounded.stdout.strip()).returncode == 76


# Names a shell or the loader reads: setting one with eval changes what the script runs next.
SPECIAL = (
    "PATH", "IFS", "HOME", "ENV", "BASH_ENV", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT",
    "PS1", "PS2", "PS3", "PS4", "SHELLOPTS", "BASHOPTS", "CDPATH", "path", "cdpath", "TMOUT",
    "PROMPT_COMMAND", "PYTHONPATH", "PYTHONSTARTUP", "LC_ALL", "LANG", "GCONV_PATH",
    "LOCKRUN_URI", "LOCKRUN_URI_FILE", "ZDOTDIR", "UID", "EUID", "PPID", "OPTIND", "_",
)  # fmt: skip


def shell_variables() -> set[str]:
    """Return the variables bash, dash and zsh set themselves at start, from a clean slate."""
    names: set[str] = set()
    for shell, listing in (
        ("bash", "compgen -v"),
        ("dash", "set | cut -d= -f1"),
        ("zsh", "print -l ${(k)parameters}"),
    ):
        found = shutil.which(shell)
        if found is None:
            missing = f"{shell} is not installed"
            if os.environ.get("CI") == "true":
                pytest.fail(missing)
            pytest.skip(missing)
        output = subprocess.run(
            ["env", "-i", found, "-fc" if shell == "zsh" else "-c", listing],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        names.update(line for line in output.split() if line.isidentifier() and line.isascii())
    return names


def test_a_var_a_shell_or_the_loader_reads_is_refused(file_uri: str, name: str) -> None:
    """--var PATH, IFS, LD_PRELOAD, and any variable the shells set themselves: 64, one line."""
    for variable in {*SPECIAL, *shell_variables()}:
        with pytest.raises(UsageError, match=f"--var {variable}: a shell"):
            check_variable(variable)
    for variable in ("PATH", "LD_PRELOAD", "path"):
        result = lockrun("acquire", "--uri", file_uri, "--export", "--var", variable, name)
        assert (result.returncode, result.stdout) == (64, "")
        assert f"--var {variable}" in one_line(result.stderr)
    assert not taken(file_uri, name)


@given(st.text() | st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True))
def test_var_takes_only_a_portable_name_of_no_meaning(text: str) -> None:
    """What --var accepts is a portable name that none of the special ones is or starts."""
    try:
        accepted = check_variable(text)
    except UsageError:
        return
    assert accepted == text
    assert text.isascii()
    assert text.isidentifier()
    assert text not in SPECIAL
    assert not text.startswith(("LD_", "BASH", "LC_", "PYTHON")) or text == "LOCKRUN_TOKEN"


@needs_root
def test_another_users_process_with_the_token_does_not_keep_the_lock(
    mallory: Runner, file_uri: str, name: str, tmp_path: Path
) -> None:
    """Mallory, with root's token in her environment, keeps nothing once root's script exits."""
    token_file, go = tmp_path / "token", tmp_path / "go"
    os.mkfifo(go)
    script = (
        f'eval "$(lockrun acquire --uri {file_uri} --owner $$ --export {name})"; '
        f'echo "$LOCKRUN_TOKEN" > {token_file}.new && mv {token_file}.new {token_file}; '
        f"read x < {go}"
    )
    env = unmeasured() | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with subprocess.Popen(["bash", "-c", script], env=env, start_new_session=True) as shell:
        wait_for(token_file.exists, what="the script's token")
        token = token_file.read_text().strip()
        holder = mallory.popen(["sleep", "600"], env=mallory.env(LOCKRUN_TOKEN=token))
        try:
            assert taken(file_uri, name)
            go.write_text("go\n")
            assert shell.wait(30) == 0
            wait_for(lambda: not taken(file_uri, name), what="the lock to be freed")
            assert holder.poll() is None
        finally:
            holder.kill()
            holder.wait()
