"""Hold one lock across several steps: `lockrun acquire`, `release` and `renew`.

`acquire` forks a keeper before anything is opened. The keeper takes the lock as a run
would (the same wait, progress lines and statuses), so the holder record and `lockrun
status` name the keeper's own pid. It hands its token to the parent over a socket pair
and, once the parent has written it, detaches and holds the lock: it renews the lease every
ttl/3, hears take-over bells, and watches its owner's pidfd. `release` and `renew` reach it
through its door, a Linux abstract socket named by the token, which answers only the
acquiring user or root, and only with the token's secret (docs/security.md).
docs/semantics.md "Holding a lock across steps" is the contract.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import re
import secrets
import select
import signal
import socket
import stat
import struct
import time
from typing import TYPE_CHECKING, Final, NamedTuple, Self

from lockrun.backends import Request, open_backend, parse_uri, user_name
from lockrun.backends.directories import open_directory
from lockrun.errors import (
    BackendUnavailable,
    ConfigError,
    ExitCode,
    Interrupted,
    LeaseLost,
    LockrunError,
    NotYours,
    OutputError,
    TakenOver,
    TimedOut,
    UsageError,
)
from lockrun.hold import (
    INTERRUPTS,
    acquired,
    interruptible,
    make_request,
    quiet,
    release,
    report_for,
    take,
    unheard,
)
from lockrun.lock import Lease as Held
from lockrun.names import check_name
from lockrun.runner import check_options
from lockrun.supervise import FORWARDED, Stat, hung_up, readable, stat_of
from lockrun.timing import clock_time, format_duration, now

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from collections.abc import Set as AbstractSet

    from lockrun.backends import Lease
    from lockrun.runner import Options
    from lockrun.uri import LockURI

# lr1.<keeper's uid>.<keeper id: 16 hex digits>.<secret: 24 characters of base64url>:
# shell-safe, and no URI or password in it.
_TOKEN: Final = re.compile(
    r"lr1\.(0|[1-9][0-9]{0,9})\.([0-9a-f]{16})\.([A-Za-z0-9_-]{24})", re.ASCII
)
MAX_UID: Final = 2**32 - 2  # (uid_t) -1 is no user
_DOOR: Final = b"\0lockrun-keeper/"  # + the keeper id: one abstract name per keeper
_PID: Final = re.compile(r"[0-9]{1,10}", re.ASCII)
# The shells that fork subshells for `$(…)`, by executable (busybox: its ash).
_SHELL: Final = re.compile(r"(ba|da|z|k|mk|pdk|a|y|po)?sh[0-9.]*|ksh93|busybox", re.ASCII)
_VARIABLE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# Variables a shell (POSIX "Shell Variables", bash(1), zsh's zshparam(1) including its
# lower-case tied arrays, ksh), the dynamic loader (ld.so(8)), libc, Python or lockrun
# give a meaning, or keep read-only: `--var` may not name them (check_variable).
_SPECIAL: Final = frozenset(
    """_ ENV HOME IFS PATH CDPATH FCEDIT LANG LINENO MAIL MAILCHECK MAILPATH NLSPATH OLDPWD
    OPTARG OPTERR OPTIND PPID PS0 PS1 PS2 PS3 PS4 PWD SHELL SHELLOPTS TERM TMOUT TMPDIR TZ
    UID EUID GID EGID GROUPS HOST HOSTNAME HOSTTYPE MACHTYPE OSTYPE CPUTYPE VENDOR RANDOM
    SECONDS SRANDOM EPOCHREALTIME EPOCHSECONDS PROMPT_COMMAND POSIXLY_CORRECT GLOBIGNORE
    FIGNORE INPUTRC EXECIGNORE DIRSTACK FUNCNEST COLUMNS LINES FPATH MANPATH MODULE_PATH ZDOTDIR
    PROMPT PROMPT2 PROMPT3 PROMPT4 RPROMPT RPS1 SPROMPT PSVAR NULLCMD READNULLCMD TIMEFMT
    KEYTIMEOUT KEYBOARD_HACK WORDCHARS LISTMAX SAVEHIST TMPPREFIX WATCH TTY TTYIDLE ARGC
    ARGV0 ERRNO TRY_BLOCK_ERROR TRY_BLOCK_INTERRUPT USERNAME LOGNAME USER SHLVL VISUAL
    EDITOR PAGER GCONV_PATH GETCONF_DIR HOSTALIASES LOCALDOMAIN RES_OPTIONS TZDIR
    SSL_CERT_FILE SSL_CERT_DIR REQUESTS_CA_BUNDLE CREDENTIALS_DIRECTORY NOTIFY_SOCKET
    path cdpath fpath manpath mailpath module_path fignore psvar watch argv status
    pipestatus prompt histchars signals options parameters commands functions
    functions_source aliases galiases saliases builtins modules jobstates jobtexts jobdirs
    dirstack history historywords userdirs usergroups nameddirs reswords widgets keymaps
    funcstack functrace funcfiletrace funcsourcetrace zsh_eval_context zsh_scheduled_events
    patchars termcap terminfo""".split()  # noqa: SIM905 - a table of words, not 140 quoted
)
_SPECIAL_PREFIXES: Final = (
    "BASH", "ZSH", "KSH", "LD_", "LC_", "MALLOC_", "GLIBC_", "PYTHON", "LOCKRUN_", "HIST",
    "COMP_", "READLINE", "SUDO_", "PG", "MYSQL", "SYSTEMD_", "dis_",
)  # fmt: skip
MAX_REQUEST: Final = 64  # "release " + a secret, with room; anything longer is junk
MAX_REPLY: Final = 1024
_REPLIES: Final = {
    0: None,
    ExitCode.UNAVAILABLE: BackendUnavailable,
    ExitCode.LOST: LeaseLost,
    ExitCode.NOPERM: NotYours,
    ExitCode.CONFIG: ConfigError,
    ExitCode.TAKEN_OVER: TakenOver,
    ExitCode.TIMEOUT: TimedOut,
}
VERBS: Final = ("release", "renew")
ANSWER: Final = 30.0  # how long `release` waits for the keeper (a release may reach a server)
PATIENCE: Final = 2.0  # how long the keeper waits for a client's request
CLIENTS: Final = 8  # connections served at once; more are hung up on
BUSY: Final = "the keeper is busy; ask again"  # their answer: `ask` asks again
LINGER: Final = 3600.0  # how long a keeper whose lock ended waits to tell why
PID_MAX: Final = 2**22  # the kernel's PID_MAX_LIMIT
_PR_SET_PDEATHSIG: Final = 1  # prctl(2)
_PF_KTHREAD: Final = 0x00200000  # include/linux/sched.h: a kernel thread
_PR_SET_NAME: Final = 15  # prctl(2)
KEEPER_NAME: Final = b"lockrun-keeper"  # its comm, for ps(1) and so sections skip keepers
RESCAN: Final = 1.0  # how often a keeper whose owner is gone looks for new section processes
_PEERCRED: Final = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Token(NamedTuple):
    """What `acquire` prints: whose keeper, which one, and the secret it answers to.

    The uid lets a client tell the keeper from a squatter: another user who binds a gone
    keeper's name could otherwise answer root's `release` with "released".
    """

    uid: int
    keeper: str
    secret: str

    @classmethod
    def new(cls) -> Token:
        """Return a fresh token of ours (64 bits of id, 144 of secret)."""
        return cls(os.geteuid(), secrets.token_hex(8), secrets.token_urlsafe(18))

    def __str__(self) -> str:
        """Return the token as printed: ``lr1.<uid>.<id>.<secret>``."""
        return f"lr1.{self.uid}.{self.keeper}.{self.secret}"

    @property
    def door(self) -> bytes:
        """The keeper's abstract socket address."""
        return _DOOR + self.keeper.encode()


def parse_token(text: object) -> Token:
    """Return the token *text*; `UsageError` (64) for anything `acquire` did not print."""
    match = _TOKEN.fullmatch(text) if isinstance(text, str) else None
    if match is None or int(match[1]) > MAX_UID:
        msg = "malformed token: expected lr1.… as printed by `lockrun acquire`"
        raise UsageError(msg)
    return Token(int(match[1]), match[2], match[3])


def default_owner() -> int:
    """Return the process `acquire` belongs to: its parent, unless that is a subshell.

    A subshell is a shell's forked copy of itself, the same program with the same command
    line and environment: bash forks one for ``$(lockrun acquire … 2>/dev/null)``, dash
    and zsh for a pipeline or a function's ``$(…)``. It exits as soon as `acquire` does,
    so the owner is the shell it was forked from. Only a shell's copy is skipped: a
    worker forked by a Python master (multiprocessing, gunicorn) is a copy too, and owns
    its lock, which must end with it.
    """
    owner = os.getppid()
    while owner > 1 and (parent := _parent(owner)) > 1:
        image = _image(owner)
        if (
            image is None
            or image != _image(parent)
            or not _SHELL.fullmatch(os.path.basename(image[0]))
        ):
            break
        owner = parent
    return owner


def _parent(pid: int) -> int:
    """Return the parent of *pid* (0 if it cannot be read)."""
    info = stat_of(pid)
    return 0 if info is None else info.parent


def _image(pid: int) -> tuple[str, bytes, bytes] | None:
    """Return what *pid* runs: its executable, command line and environment at its start.

    A fork keeps all three; a shell started by a shell of the same command line (``bash``
    typed in ``bash``) was given an environment of its own (bash's SHLVL, at least).
    None if any cannot be read.
    """
    try:
        with (
            open(f"/proc/{pid}/cmdline", "rb") as cmdline,
            open(f"/proc/{pid}/environ", "rb") as environ,
        ):
            return os.readlink(f"/proc/{pid}/exe"), cmdline.read(), environ.read()
    except OSError:
        return None


def parse_owner(text: str) -> int | None:
    """Return the owner pid of ``--owner TEXT`` (None for ``none``), checked to be a pid."""
    if text == "none":
        return None
    if not _PID.fullmatch(text) or not 1 <= int(text) <= PID_MAX:
        msg = f"--owner takes a process id (1 to {PID_MAX}) or 'none', not {text!r}"
        raise UsageError(msg)
    return int(text)


def check_variable(name: str) -> str:
    """Return *name* if ``eval`` may set it (``--var``): a portable name with no other meaning.

    `acquire --export` is eval'd by a shell, and the variable is exported to every later
    step: a name that a shell, the loader, Python or lockrun itself reads (PATH, IFS,
    LD_PRELOAD, zsh's tied ``path``, a read-only ``UID``) would change what runs next.
    """
    if not _VARIABLE.fullmatch(name):
        msg = f"--var takes a shell variable name ([A-Za-z_][A-Za-z0-9_]*), not {name!r}"
        raise UsageError(msg)
    if name in _SPECIAL or (name.startswith(_SPECIAL_PREFIXES) and name != "LOCKRUN_TOKEN"):
        msg = (
            f"--var {name}: a shell, the loader or lockrun gives that variable a meaning; "
            "name one of your own (such as DEPLOY_LOCK)"
        )
        raise UsageError(msg)
    return name


def read_request(data: bytes) -> tuple[str, str] | None:
    """Return (verb, secret) of a client's request, None if it is none of ours."""
    if len(data) > MAX_REQUEST:
        return None
    verb, _, secret = data.partition(b" ")
    text = verb.decode("ascii", "replace")
    if text not in VERBS or not secret.isascii():
        return None
    return text, secret.decode()


def read_reply(data: bytes) -> tuple[int, str] | None:
    """Return (status, message) of a keeper's answer, None if it is none a keeper gives."""
    if len(data) > MAX_REPLY:
        return None
    head, _, message = data.partition(b" ")
    if not head.isdigit() or len(head) > 3 or int(head) not in _REPLIES:  # noqa: PLR2004
        return None
    return int(head), message.decode(errors="replace")


# -- the client: release and renew ----------------------------------------------------------

_GONE: Final = (
    "no keeper holds a lock for this token: it was released, its owner exited, it was "
    "stopped or killed, or it runs in another network namespace"
)


def ask(text: object, verb: str) -> str:
    """Send *verb* to the keeper of the token *text*; return its line, or raise its status.

    No keeper is `LeaseLost` (76), a keeper of another user's `NotYours` (77), a keeper
    that does not answer `BackendUnavailable` (69). A keeper with a crowd at its door
    answers `BUSY`, or hangs up unread (the kernel then resets our end, and its answer may
    be lost): both are asked again until `ANSWER` is up. A request the keeper read is
    always answered, so one asked again was never carried out.
    """
    token = parse_token(text)
    me = os.geteuid()
    if me not in {0, token.uid}:  # it would not answer us: say so without trying
        msg = f"this token is of a keeper of another user (uid {token.uid}): not yours"
        raise NotYours(msg)
    deadline = now() + ANSWER
    while (answer := _ask_once(token, verb, deadline)) in {None, (ExitCode.UNAVAILABLE, BUSY)}:
        if now() >= deadline:
            break
        time.sleep(0.01)
    if answer is None:
        msg = "the keeper hung up without an answer"
        raise BackendUnavailable(msg)
    status, message = answer
    error = _REPLIES[status]
    if error is not None:
        raise error(message)
    return message


def _ask_once(token: Token, verb: str, deadline: float) -> tuple[int, str] | None:
    """Knock, send *verb*, and return the keeper's answer (None if we could read none)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as door:
        _knock(door, token, deadline)
        _, uid, _ = _PEERCRED.unpack(
            door.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        if uid != token.uid:  # never show the secret to, nor believe, a squatter
            msg = f"{_GONE}; user {user_name(uid)} listens on its name instead, and was not asked"
            raise LeaseLost(msg)
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                # A keeper that turned us away (BUSY) has answered and hung up already:
                # its answer waits to be read.
                door.send(f"{verb} {token.secret}".encode())
            data = door.recv(MAX_REPLY + 1)
        except TimeoutError:
            msg = f"the keeper did not answer within {format_duration(ANSWER)}"
            raise BackendUnavailable(msg) from None
        except OSError as err:
            if err.errno not in {errno.ECONNRESET, errno.EPIPE}:
                raise BackendUnavailable(f"the keeper: {err.strerror or err}") from None
            return None
    if not data:  # hung up on us before we asked
        return None
    if (answer := read_reply(data)) is None:
        msg = "the keeper's answer is none a keeper gives"
        raise BackendUnavailable(msg)
    return answer


def _knock(door: socket.socket, token: Token, deadline: float) -> None:
    """Connect *door* to *token*'s keeper by *deadline*; raise its status if not."""
    door.settimeout(max(0.1, deadline - now()))
    while True:
        try:
            door.connect(token.door)
        except BlockingIOError:
            # A full backlog (a crowd at the door, maybe another user's) answers EAGAIN at
            # once, not after the timeout: ask again until the deadline.
            if now() >= deadline:
                msg = f"the keeper did not answer within {format_duration(ANSWER)}"
                raise BackendUnavailable(msg) from None
            time.sleep(0.01)
        except (ConnectionRefusedError, FileNotFoundError):
            raise LeaseLost(_GONE) from None
        except OSError as err:
            msg = f"cannot reach the keeper: {err.strerror or err}"
            raise BackendUnavailable(msg) from None
        else:
            door.settimeout(max(0.1, deadline - now()))
            return


# -- acquire: the parent ----------------------------------------------------------------------


class Grant(NamedTuple):
    """What the keeper tells its parent once it holds the lock."""

    token: Token
    fence: int | None


def open_env_file(path: str) -> int:
    """Open *path* to append to, refusing symlinks, other file types and other hard links.

    Its directory is opened as lock directories are: a symlink on the way that another
    user could have planted is refused. Made 0600 if missing. `ConfigError` (78).
    """
    absolute = os.path.abspath(path)
    directory = open_directory(os.path.dirname(absolute), what="--env-file directory")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(os.path.basename(absolute), flags | os.O_CLOEXEC, 0o600, dir_fd=directory)
    except OSError as err:
        why = "is a symlink; refusing to write through it" if err.errno == errno.ELOOP else None
        msg = f"--env-file {path}: {why or err.strerror}"
        raise ConfigError(msg) from None
    finally:
        os.close(directory)
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        problem = "not a regular file with one name"
    elif info.st_uid not in {os.geteuid(), 0}:
        # As --uri-file's rule (docs/security.md): a file another user made (in /tmp, say)
        # is theirs to read, and to feed to whoever evaluates it next.
        problem = f"owned by {user_name(info.st_uid)}, not by you or root"
    if problem is not None:
        os.close(fd)
        msg = f"--env-file {path}: {problem}; refusing to write to it"
        raise ConfigError(msg)
    return fd


def append_line(fd: int, line: str, what: str) -> None:
    """Append *line* to the file *fd* in one write; `OutputError` (74) if it fails."""
    data = f"{line}\n".encode()
    try:
        written = os.write(fd, data)
    except OSError as err:
        msg = f"cannot write to {what}: {err.strerror}"
        raise OutputError(msg) from None
    if written != len(data):
        msg = f"cannot write to {what}: the file system took {written} of {len(data)} bytes"
        raise OutputError(msg)


def watch_owner(owner: int | None, options: Options) -> int | None:
    """Return a pidfd of the *owner* process (None for none), checking the time bound.

    Opened now, in the process that the owner started: a pidfd names that process, never
    a later one that reuses its pid. An owner that never exits bounds nothing: as
    ``--owner none``, it needs --max-time.
    """
    if owner is None:
        if options.max_time is None:
            who = "--owner none"
            raise _unbounded(who)
        return None
    try:
        pidfd = os.pidfd_open(owner)
    except ProcessLookupError:
        msg = f"--owner {owner}: no such process"
        raise UsageError(msg) from None
    except OSError as err:  # pragma: no cover - ENOSYS: Linux before 5.3
        msg = f"--owner {owner}: cannot watch it: {err.strerror}"
        raise ConfigError(msg) from None
    never = _never_exits(owner)  # read after the pidfd: still that process if it lives
    if readable([pidfd]):  # it exited already
        os.close(pidfd)
        msg = f"--owner {owner}: that process has exited"
        raise UsageError(msg)
    if never is not None and options.max_time is None:
        os.close(pidfd)
        raise _unbounded(f"the owner, pid {owner}, {never}: it")
    return pidfd


def _unbounded(who: str) -> UsageError:
    """Return the error of an acquire that only `release` would end: *who* holds it."""
    return UsageError(
        f"{who} holds the lock until it is released; give --max-time too, so that "
        "a lost token cannot hold it forever"
    )


def _never_exits(pid: int) -> str | None:
    """Say why *pid* never exits in practice (init, a kernel thread, a namespace's init).

    proc(5): a kernel thread has PF_KTHREAD in its flags and kthreadd (pid 2) or no
    parent; the last NSpid of a process is its pid in its own namespace, 1 for an init.
    """
    if pid == 1:
        return "init, which never exits"
    info = stat_of(pid)
    try:
        with open(f"/proc/{pid}/status", "rb") as status_file:
            nspids = [line.split()[1:] for line in status_file if line.startswith(b"NSpid:")]
    except OSError:
        return None  # gone: pidfd_open says so
    if info is None:
        return None
    if info.flags & _PF_KTHREAD or info.parent in {0, 2}:
        return "a kernel thread, which never exits"
    if nspids and nspids[0][-1:] == [b"1"]:
        return "the init of a pid namespace, which never exits before the namespace ends"
    return None


class Section(NamedTuple):
    """The processes a script runs under its lock, told apart once its shell is gone.

    docs/semantics.md "Holding a lock across steps": as flock(1)'s inherited descriptor, the
    lock lives while a process of the section lives. Those are the live processes started
    after the acquire (in a later clock tick) that (a) are in the owner's process group,
    where a non-interactive shell runs its foreground and ``&`` steps and subshells: if the
    owner leads that group, any of them; if the group is its starter's (a CI runner's), only
    those that init adopted, since the starter's other children may wait for this very
    lock; or (b) are our user's and carry the token in their environment, as every program
    the script ran after ``eval`` does, wherever its group. Other keepers are none of them.
    """

    group: int
    leader: bool  # whether the owner leads its group: the script's own, not its starter's
    since: int  # clock ticks after boot: when acquire started
    token: bytes  # b"=" + the token, as an environment entry ends

    @classmethod
    def of(cls, owner: int) -> Section | None:
        """Return the section of *owner* (None if it cannot be read), from acquire's process."""
        me = stat_of(os.getpid())
        try:
            group = os.getpgid(owner)
        except OSError:
            return None
        return None if me is None else cls(group, group == owner, me.start, b"")

    def members(self) -> dict[int, int]:
        """Return the live processes of the section: pid and start."""
        processes: dict[int, Stat] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (info := stat_of(int(entry))) is not None:
                processes[int(entry)] = info
        me = os.getpid()
        return {
            pid: info.start
            for pid, info in processes.items()
            if pid != me
            # After acquire's tick: /proc counts starts in ticks (10 ms), and a step forked
            # just before acquire often began in the same one; none of the section can, as
            # it starts only once acquire has printed its token and exited.
            and info.start > self.since
            and info.state not in {b"Z", b"X"}  # exited, not yet reaped
            and info.name != KEEPER_NAME
            and (
                (info.group == self.group and (self.leader or self._orphaned(info, processes)))
                or self._carries_token(pid)
            )
        }

    def _orphaned(self, info: Stat, processes: dict[int, Stat]) -> bool:
        """Whether *info*, or its oldest ancestor started since the acquire, init adopted."""
        for _ in range(len(processes)):
            parent = processes.get(info.parent)
            if parent is None or parent.start <= self.since:
                return info.parent == 1
            info = parent
        return False

    def _carries_token(self, pid: int) -> bool:
        """Whether *pid*, ours, has the token in its environment."""
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
                return False
            with open(f"/proc/{pid}/environ", "rb") as environ:
                return any(entry.endswith(self.token) for entry in environ.read().split(b"\0"))
        except OSError:
            return False


def acquire(
    options: Options,
    owner: int | None,
    deliver: Callable[[Grant], None],
    *,
    log: Callable[[str], None],
    live: Callable[[str], None] | None = None,
    private: Sequence[int] = (),
) -> int:
    """Take the lock of *options* in a keeper process; return the status to exit with.

    *deliver* writes the token (stdout, an env file), in this process; an `OutputError`
    from it releases the lock. *private* are descriptors of ours that the keeper closes.
    This forks: in the keeper it returns only once the keeper ends. What it raises maps to
    an exit status (docs/semantics.md "Exit status").
    """
    uri = parse_uri(options.uri)
    check_options(options)
    name = check_name(options.name or "")
    check_name(options.namespace, "namespace")
    pidfd = watch_owner(owner, options)
    section = None if owner is None else Section.of(owner)  # while the owner surely lives
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    # No handler of ours may run in the child before its own are set (_interruptible).
    saved = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    child = os.fork()
    if child == 0:  # pragma: no cover - the keeper; its coverage is saved at its exit
        ours.close()
        for fd in private:
            os.close(fd)
        keeper = _Child(options, uri, _Parent(parent, theirs, saved), owner, pidfd, section)
        return keeper.run(log=log, live=live)
    theirs.close()
    if pidfd is not None:
        os.close(pidfd)
    return _relay(ours, child, name, deliver, saved)


def _relay(
    link: socket.socket,
    child: int,
    name: str,
    deliver: Callable[[Grant], None],
    saved: AbstractSet[int],
) -> int:
    """In the parent: pass signals on to the keeper while it waits, and its token on."""
    relaying = [True]

    def forward(signo: int, _frame: object) -> None:
        if relaying[0]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signo)

    for signo in INTERRUPTS:
        if signal.getsignal(signo) is not signal.SIG_IGN:  # nohup's HUP stays ignored
            signal.signal(signo, forward)
    for signo in FORWARDED - INTERRUPTS:  # USR1, USR2: dropped while waiting, as by a run
        signal.signal(signo, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, saved)
    with link:
        grant = _read_grant(link.recv(MAX_REPLY))
        if grant is None:  # the keeper ended without the lock, and said why on stderr
            return _child_status(child, name)
        try:
            deliver(grant)
        except OutputError as err:
            with contextlib.suppress(OSError):
                link.send(b"nack")
            with contextlib.suppress(LockrunError):
                _child_status(child, name)  # it has released the lock
            raise OutputError(f"{name}: {err}; released the lock") from None
        try:
            link.send(b"ack")
            kept = link.recv(16) == b"kept"
        except OSError:
            kept = False
        relaying[0] = False
        if not kept:  # a signal or its owner's end stopped it first: it released
            return _child_status(child, name)
    return 0


def _read_grant(message: bytes) -> Grant | None:
    """Decode our keeper's ``granted TOKEN FENCE`` (None: it ended without the lock)."""
    if not message.startswith(b"granted "):
        return None
    _, token, fence = message.decode().split(" ")
    return Grant(parse_token(token), None if fence == "-" else int(fence))


def _child_status(child: int, name: str) -> int:
    """Reap the keeper that ended and return its status; `Interrupted` if a signal killed it."""
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        what = signal.Signals(-code).name
        msg = f"{name}: the keeper was killed by {what}; nothing is held"
        raise Interrupted(msg, signo=-code)
    # Ended without handing a token over, and said why on stderr: busy (-E, which may be 0),
    # or any other status of a run that never held the lock.
    return code


# -- acquire: the keeper ----------------------------------------------------------------------


class _Parent(NamedTuple):
    """The process that forked the keeper: who, the socket to it, its signal mask."""

    pid: int
    link: socket.socket
    mask: AbstractSet[int]


class _Child:  # pragma: no cover - runs in the forked keeper; its coverage is saved at exit
    """The forked keeper: wait for the lock, hand the token over, detach and hold it."""

    def __init__(
        self,
        options: Options,
        uri: LockURI,
        parent: _Parent,
        owner: int | None,
        pidfd: int | None,
        section: Section | None,
    ) -> None:
        self.options = options
        self.uri = uri
        self.parent = parent
        self.owner = owner  # the pid, for the record
        self.pidfd = pidfd
        self.section = section

    def run(self, *, log: Callable[[str], None], live: Callable[[str], None] | None) -> int:
        """Take the lock, then keep it until something ends the keeper; return its status."""
        options = self.options
        name = options.name or ""
        verbose = log if options.verbose else quiet
        os.setpgid(0, 0)  # our own group: a Ctrl-C reaches the parent, which passes it on once
        _die_with(self.parent.pid)
        _prctl(_PR_SET_NAME, KEEPER_NAME)
        _close_inherited({self.parent.link.fileno(), *([self.pidfd] if self.pidfd else [])})
        owner = "none" if self.owner is None else str(self.owner)
        holder = ("lockrun", "acquire", "--owner", owner, name)
        request = make_request(options, options.namespace, name, holder)
        report = None
        with interruptible(name, verbose):
            signal.pthread_sigmask(signal.SIG_SETMASK, self.parent.mask)  # a TERM ends the wait
            backend = open_backend(self.uri, ttl=options.ttl, warn=log, note=verbose)
            try:
                report = report_for(options, request, self.uri, log, live)
                started = now()
                lease = take(backend, request, options.wait, report)
            except BaseException:
                backend.close()
                raise
            signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # ours from here on
        try:
            if report is not None:
                report.stop()
            verbose(acquired(request, lease, started))
            try:
                keeper = _Keeper(options, request, lease, self.pidfd, verbose, self.section)
            except BaseException:  # no door: nobody could release it
                release(lease, request, now(), 0.0, verbose)
                raise
            try:
                with _Signals() as keeper.signals:
                    self._hand_over(keeper)
                    if not keeper.finished:
                        keeper.run()
            finally:
                keeper.close()
            return keeper.status
        finally:
            backend.close()

    def _hand_over(self, keeper: _Keeper) -> None:
        """Give the parent the token; detach once it says it wrote it, else release."""
        link = self.parent.link
        fence = "-" if keeper.lease.fence is None else str(keeper.lease.fence)
        link.send(f"granted {keeper.token} {fence}".encode())
        poll = select.poll()
        for fd in (link.fileno(), keeper.signals.fd, self.pidfd):
            if fd is not None:
                poll.register(fd, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poll.poll()}
            if self.pidfd in ready:
                keeper.finish()
                msg = f"{keeper.name}: its owner (pid {self.owner}) exited; released the lock"
                raise LeaseLost(msg)
            if keeper.signals.fd in ready:
                signo = keeper.end_on_signals()
                if signo:
                    what = signal.Signals(signo).name
                    msg = f"{what} before the token of {keeper.name} was handed over; released it"
                    raise Interrupted(msg, signo=signo)
            if link.fileno() in ready:
                break
        if link.recv(16) != b"ack":  # the parent could not write it (and says so), or died
            keeper.finish()
            return
        # Our group of its own (made at the fork) keeps the signals of the script's group
        # (Ctrl-C, timeout(1), a CI runner's cancel) from us: its owner's end ends us.
        _die_with(None)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the parent's stdout may be a $(…) that waits for its end
            os.dup2(null, fd)
        os.close(null)
        with contextlib.suppress(OSError):
            link.send(b"kept")
        link.close()


def _die_with(parent: int | None) -> None:  # pragma: no cover - runs in the keeper
    """Have the kernel TERM us when *parent* dies (None: no longer): prctl(2) PDEATHSIG.

    While the keeper waits, a parent killed with SIGKILL must not leave it waiting, or
    holding a lock whose token nobody received.
    """
    _prctl(_PR_SET_PDEATHSIG, 0 if parent is None else signal.SIGTERM)
    if parent is not None and os.getppid() != parent:  # it died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _prctl(option: int, argument: int | bytes) -> None:  # pragma: no cover - in the keeper
    """Call prctl(2) with one argument (bytes: a C string)."""
    import ctypes  # noqa: PLC0415 - only keepers pay for it

    ctypes.CDLL(None, use_errno=True).prctl(option, argument, 0, 0, 0)


def _close_inherited(keep: set[int]) -> None:  # pragma: no cover - runs in the keeper
    """Close what we inherited from the shell (a `flock 9`'s fd 9, a pipe's end) but *keep*.

    Inherited descriptors are the inheritable ones: Python opens its own close-on-exec.
    """
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd > 2 and fd not in keep:  # noqa: PLR2004 - past stdin, stdout and stderr
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    os.close(fd)


class _Signals:  # pragma: no cover - runs in the keeper
    """INT, TERM, HUP and QUIT as bytes on a pipe the keeper polls (signal.set_wakeup_fd)."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wakeup = -1

    def __enter__(self) -> Self:
        for signo in INTERRUPTS:
            if signal.getsignal(signo) is not signal.SIG_IGN:  # nohup's HUP stays ignored
                signal.signal(signo, _noted)
        for signo in FORWARDED - INTERRUPTS:  # USR1, USR2: there is no command to pass them
            signal.signal(signo, signal.SIG_IGN)
        self._wakeup = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # pending ones arrive now
        return self

    def __exit__(self, *_: object) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        signal.set_wakeup_fd(self._wakeup)
        os.close(self.fd)
        os.close(self._write)

    def received(self) -> set[int]:
        """Return the signals of INTERRUPTS that arrived since the last call."""
        got: set[int] = set()
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self.fd, 64):
                got.update(data)
        return got & set(INTERRUPTS)


def _noted(_signo: int, _frame: object) -> None:  # pragma: no cover - runs in the keeper
    """Do nothing: set_wakeup_fd has written the signal's number for the keeper's loop."""


class _Client(NamedTuple):
    connection: socket.socket
    deadline: float  # `now` by which it must have asked, or be hung up on


class _Keeper:  # pragma: no cover - runs in the forked keeper
    """The detached keeper: its lease, door, owner and time limit, and why it ended."""

    signals: _Signals

    def __init__(
        self,
        options: Options,
        request: Request,
        lease: Lease,
        pidfd: int | None,
        verbose: Callable[[str], None],
        section: Section | None,
    ) -> None:
        self.options = options
        self.request = request
        self.name = request.name
        self.lease = lease
        self.held_since = now()
        # The Python API's lease: its renew() and check() keep the lease arithmetic.
        self.held: Held | None = Held(lease, ("", request.namespace, request.name))
        self.pidfd = pidfd
        self.verbose = verbose
        self.deadline = None if options.max_time is None else self.held_since + options.max_time
        self.every = options.ttl / 3  # as a run's supervisor: local locks too (their file)
        self.renew_at = lease.confirmed + self.every
        self.ended: LockrunError | None = None  # why the lock is no longer held, if it is not
        self.linger = 0.0  # when a keeper whose lock ended stops waiting to say why
        self.finished = False
        self.status = 0
        self.clients: dict[int, _Client] = {}
        self.watched: dict[int, str] = {}  # fd: what it is
        self.epoll = select.epoll()
        self.token, self.door = _open_door()
        token = f"={self.token}".encode()
        self.section = None if section is None else section._replace(token=token)
        self.steps: dict[int, int] = {}  # pidfd: pid, of the section once the owner is gone
        self.rescan_at: float | None = None  # when to look for more of them

    def run(self) -> None:
        """Hold the lock and serve the door until something ends the keeper."""
        self._watch(self.door.fileno(), "door", select.EPOLLIN)
        self._watch(self.signals.fd, "signals", select.EPOLLIN)
        if self.pidfd is not None:
            self._watch(self.pidfd, "owner", select.EPOLLIN)
        for fd in self.lease.sessions:  # the server hung up: the lock is gone at once
            self._watch(fd, "session", select.EPOLLRDHUP)
        for fd in self.lease.bells:  # a take-over may have been asked: renew now
            self._watch(fd, "bell", select.EPOLLIN | select.EPOLLET)
        while not self.finished:
            for fd, _ in self.epoll.poll(self._timeout()):
                if self._on(self.watched.get(fd, "client"), fd):
                    return
            self._tick()

    def _watch(self, fd: int, what: str, events: int) -> None:
        if fd not in self.watched:
            self.epoll.register(fd, events)
            self.watched[fd] = what

    def _unwatch(self, *kinds: str) -> None:
        for fd, kind in list(self.watched.items()):
            if kind in kinds:
                del self.watched[fd]
                with contextlib.suppress(OSError):  # a lost session's socket is closed already
                    self.epoll.unregister(fd)

    def _timeout(self) -> float:
        timers = [client.deadline for client in self.clients.values()]
        if self.rescan_at is not None:
            timers.append(self.rescan_at)
        if self.held is not None:
            timers.append(self.renew_at)
            if self.deadline is not None:
                timers.append(self.deadline)
        else:
            timers.append(self.linger)
        return max(0.0, min(timers) - now())

    def _on(self, what: str, fd: int) -> bool:
        """Act on *fd*, which is *what*, turning ready; return whether the keeper is done."""
        if what == "door":
            self._accept()
        elif what == "client":
            self._serve(fd)
        elif what == "signals":
            self.end_on_signals()
        elif what == "owner":
            self._unwatch("owner")
            self._follow_section()  # the script's shell is gone: its steps may not be
        elif what == "step":
            self._unwatch_step(fd)
            if not self.steps:
                self._follow_section()
        elif what == "session" and hung_up(self.lease.sessions):
            lost = "the session holding the lock ended (the server hung up); its locks are gone"
            self._lost(LeaseLost(lost))
        elif what == "bell":
            self._check(renew=False)  # check() renews if the bell is still readable
        return self.finished

    def _follow_section(self) -> None:
        """Hold, or linger once the lock ended, while the section lives (docs/semantics.md).

        Watched through pidfds; looked for again when the last one ends (its children are
        in /proc by then) and every `RESCAN` seconds.
        """
        if self.section is None:
            self.finish()  # nobody is left to ask why
            return
        for fd in [fd for fd in self.steps if readable([fd])]:  # ended, event or not
            self._unwatch_step(fd)
        known = set(self.steps.values())
        for pid, start in self.section.members().items():
            if pid in known:
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:  # gone already
                continue
            info = stat_of(pid)  # read after the pidfd: still that process if it lives
            if info is None or info.start != start or readable([pidfd]):
                os.close(pidfd)
                continue
            self.steps[pidfd] = pid
            self.watched.pop(pidfd, None)  # a number a closed session had: not it any more
            self._watch(pidfd, "step", select.EPOLLIN)
        if self.steps:
            self.rescan_at = now() + RESCAN
        else:
            self.rescan_at = None
            self.finish()

    def _unwatch_step(self, fd: int) -> None:
        del self.steps[fd]
        del self.watched[fd]
        with contextlib.suppress(OSError):
            self.epoll.unregister(fd)
        os.close(fd)

    def _tick(self) -> None:
        current = now()
        if self.rescan_at is not None and current >= self.rescan_at and not self.finished:
            self._follow_section()
        for fd, client in list(self.clients.items()):
            if current >= client.deadline:
                self._hang_up(fd)
        if self.held is None:
            self.finished = current >= self.linger
            return
        held = self._check(renew=current >= self.renew_at)
        if held and self.deadline is not None and now() >= self.deadline:
            limit = format_duration(self.options.max_time or 0.0)
            self._lost(TimedOut(f"--max-time {limit} expired; the lock was released"))

    def _check(self, *, renew: bool) -> bool:
        """Renew if *renew*, and end the hold if the lease is gone; return whether held."""
        held = self.held
        if held is None:
            return False
        try:
            if renew:
                every = held.renew()
                due = self.every if held.ttl is None or every is None else every
                self.renew_at = now() + due
            held.check()
        except (LeaseLost, TakenOver) as err:
            self._lost(err)
            return False
        return True

    def _confirm(self) -> BackendUnavailable | None:
        """Renew with a round trip to the service; return why it is unconfirmed (None: it is).

        As `Held.renew`, but a doubt is told rather than kept: the renewals every ttl/3
        decide, as before, when an unconfirmed lease is lost.
        """
        held = self.held
        if held is None:
            return None
        err = held.confirm()  # bounded by the backend's timeouts, which fit the ttl
        if err is not None:
            return BackendUnavailable(
                f"{self.name}: the lock service did not confirm the lease now ({err}); the "
                "keeper holds on and renews, and gives the lock up if that fails for a ttl"
            )
        if held.lost is None:
            self.renew_at = held.clock.confirmed + self.every
        return None

    def _lost(self, why: LeaseLost | TakenOver | TimedOut) -> None:
        """Release what is left of the lock; stay a while to tell `release` *why*."""
        with contextlib.suppress(LockrunError):
            # A taker runs next and a lost lock is no one's: only --max-time keeps a window.
            self._give_back(keep_window=isinstance(why, TimedOut))
        self.ended = why.about(self.name)
        self.linger = now() + LINGER

    def _give_back(self, *, keep_window: bool) -> tuple[int, str]:
        """Release the lease (leaving the --hold-at-least window if *keep_window*).

        Return the status and line for `lockrun release`: 69 if the service never heard it
        (the lock then frees by itself).
        """
        if self.held is None:
            return 0, ""
        self.held = None
        self._unwatch("bell", "session")
        took = now() - self.held_since
        hold = self.options.hold_at_least if keep_window else 0.0
        if not release(self.lease, self.request, self.held_since, hold, self.verbose):
            return BackendUnavailable.exit_code, f"{self.name}: {unheard(self.name, took)}"
        left = f" (taken {format_duration(hold - took)} more: --hold-at-least)" * (hold > took)
        return 0, f"released {self.name} after {format_duration(took)}{left}"

    def finish(self) -> None:
        """Release (its window stays) and end: the owner exited, or the parent gave up."""
        self.finished = True
        with contextlib.suppress(LockrunError):
            self._give_back(keep_window=True)

    def end_on_signals(self) -> int:
        """End on INT, TERM, HUP or QUIT, releasing; return the signal (0: none came)."""
        got = self.signals.received()
        if not got:
            return 0
        signo = min(got)
        self.status = 128 + signo
        self.finish()
        return signo

    def _accept(self) -> None:
        """Take every waiting connection; hang up at once on other users and on a crowd."""
        allowed = {0, os.geteuid()}
        while True:
            try:
                connection, _ = self.door.accept()
            except OSError:  # none left (EAGAIN), the client gave up, or no fds left
                return
            connection.setblocking(False)  # noqa: FBT003 - the socket API
            _, uid, _ = _PEERCRED.unpack(
                connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
            )
            if uid not in allowed:
                _answer(connection, ExitCode.NOPERM, "this keeper is another user's: not yours")
                connection.close()
            elif len(self.clients) >= CLIENTS:
                _answer(connection, ExitCode.UNAVAILABLE, BUSY)
                connection.close()
            else:
                fd = connection.fileno()
                self.watched.pop(fd, None)  # a number a closed session had: not it any more
                self.clients[fd] = _Client(connection, now() + PATIENCE)
                self.epoll.register(fd, select.EPOLLIN)

    def _hang_up(self, fd: int) -> None:
        client = self.clients.pop(fd)
        with contextlib.suppress(OSError):
            self.epoll.unregister(fd)
        client.connection.close()

    def _serve(self, fd: int) -> None:
        """Answer one request of a client of ours, then hang up; never wait for it."""
        client = self.clients.get(fd)
        if client is None:
            return
        try:
            data = client.connection.recv(MAX_REQUEST + 1)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        request = read_request(data)
        if request is None:
            _answer(client.connection, ExitCode.USAGE, "not a request a keeper answers")
        elif not hmac.compare_digest(request[1].encode(), self.token.secret.encode()):
            _answer(client.connection, ExitCode.NOPERM, "the token's secret is wrong: not yours")
        else:
            _answer(
                client.connection, *(self._release() if request[0] == "release" else self._renew())
            )
        self._hang_up(fd)

    def _release(self) -> tuple[int, str]:
        """Release for `lockrun release`, proving the lock was still ours; the keeper ends.

        A lease that a renewal has not yet found gone (a Redis key deleted a moment ago)
        would otherwise be reported as released: 0 means held until the release.
        """
        self.finished = True
        self._check(renew=True)
        if self.ended is not None:
            return self.ended.exit_code, str(self.ended)
        try:
            return self._give_back(keep_window=True)
        except LockrunError as err:
            return err.exit_code, f"{self.name}: {err}"

    def _renew(self) -> tuple[int, str]:
        """Prove the lock ours now and count --max-time from now, for `lockrun renew`.

        A renewal on the service, now (docs/semantics.md): 0 only once it answered; 69 if
        it did not (unreachable, partitioned, slow), while the keeper holds on and renews.
        """
        doubt = self._confirm() if self.ended is None else None
        if doubt is not None:
            return doubt.exit_code, str(doubt)
        if self.ended is None and self._check(renew=False):
            if self.options.max_time is None:
                return 0, f"{self.name} is held"
            self.deadline = now() + self.options.max_time
            return 0, f"{self.name} is held, until {_clock(self.deadline)} unless renewed"
        ended = self.ended or LeaseLost(f"{self.name}: not held")
        return ended.exit_code, str(ended)

    def close(self) -> None:
        """Let go of everything: the lease if still held, the door, its clients."""
        with contextlib.suppress(LockrunError):
            self._give_back(keep_window=True)
        for fd in list(self.clients):
            self._hang_up(fd)
        for fd in list(self.steps):
            self._unwatch_step(fd)
        self.door.close()
        self.epoll.close()


def _open_door() -> tuple[Token, socket.socket]:  # pragma: no cover - runs in the keeper
    """Listen on a fresh token's abstract name (a new one if that one is taken)."""
    for _ in range(8):
        token = Token.new()
        door = socket.socket(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        try:
            door.bind(token.door)
        except OSError as err:
            door.close()
            if err.errno == errno.EADDRINUSE:  # someone squats it: 64 random bits were guessed?
                continue
            raise ConfigError(f"cannot open the keeper's door: {err.strerror}") from None
        door.listen(CLIENTS)
        return token, door
    msg = "cannot open the keeper's door: every name tried was taken"
    raise ConfigError(msg)


def _clock(deadline: float) -> str:
    """Render a `now` deadline as the wall-clock time it falls on."""
    return clock_time(time.time() + deadline - now())


def _answer(connection: socket.socket, status: int, message: str) -> None:
    """Send a keeper's answer without waiting: a client that does not read gets nothing."""
    with contextlib.suppress(OSError):
        connection.send(f"{int(status)} {message}".encode()[:MAX_REPLY], socket.MSG_DONTWAIT)


__all__ = ["Grant", "Token", "acquire", "ask", "parse_token"]
