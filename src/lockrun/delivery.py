"""Where `lockrun acquire` puts its token: stdout (for ``eval``) or an env file.

`--var` names the variable; a name a shell, the loader, Python or lockrun gives a meaning
is refused, since the line is evaluated and the variable exported to every later step.
`--env-file` is opened as lock directories are (docs/security.md).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import Final

from lockrun.backends import user_name
from lockrun.backends.directories import open_directory
from lockrun.errors import ConfigError, OutputError, UsageError

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


__all__ = ["append_line", "check_variable", "open_env_file"]
