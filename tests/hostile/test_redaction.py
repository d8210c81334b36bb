"""Every spelling of a secret (docs/security.md "Passwords in URIs") stays out of every output.

User information with or without ``@host`` or ``//``, query options under any name that
holds a secret, %-encoded names, ``=`` and ``&``, conninfo strings nested in an option,
libpq ``key=value`` strings with quoting: through the redactor, the parsers, the Python
API's exceptions, and the real CLI's stdout and stderr.
"""

from __future__ import annotations

import traceback
from typing import Final

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lockrun import ConfigError, Lock, LockrunError, UsageError
from lockrun.backends import open_backend, parse_uri
from lockrun.errors import ExitCode
from lockrun.uri import HIDDEN, option_name, redact, redacted_by_lockrun, scrub, secrets_of
from tests.support.cli import lockrun
from tests.support.strategies import assert_hidden, libpq_quoted, passwords, spell, spellings

SPELLINGS: Final = spellings()
_names = st.sampled_from(sorted(SPELLINGS))
# The three of issue 29, item 5, with a secret of its own kind.
_ISSUE: Final = (
    ("conninfo", "QQQQ hunter2"),
    ("redis: user:password, no @host", "QQQQ"),
    ("postgresql: nested conninfo in ?dbname=", "QQQQ"),
)


def _driver_words(uri: str, secret: str) -> str:
    """Return what a driver might say: the URI, and the secret in each of its forms."""
    return f'invalid dsn "{uri}": password {secret!r}, {libpq_quoted(secret)}, {secret[1:]}'


@given(name=_names, secret=passwords)
@settings(max_examples=1000)
def test_redact_hides_a_secret_in_every_spelling(name: str, secret: str) -> None:
    """redact(), and scrub() of a driver's words quoting the URI, hide it in every spelling."""
    uri = spell(SPELLINGS[name], secret)
    shown = redact(uri)
    assert_hidden(secret, shown)
    assert HIDDEN in shown
    assert redacted_by_lockrun(shown)  # a nested lockrun refuses it: no *** passes for a secret
    assert_hidden(secret, scrub(_driver_words(uri, secret), secrets_of(uri)))


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_every_spelling_is_redacted_by_name(name: str) -> None:
    """Each spelling alone, with a secret of spaces, quotes and every character parsers split at."""
    secret = "QQQQ 'a\\' b\" %41 @x:y/z?=&+;#ZZZZ ЖЖЖЖ"  # noqa: S105 - made to be found
    uri = spell(SPELLINGS[name], secret)
    assert_hidden(secret, redact(uri))
    assert_hidden(secret, scrub(_driver_words(uri, secret), secrets_of(uri)))


@given(name=_names, secret=passwords)
@settings(max_examples=300)
def test_parsers_and_backends_say_nothing_of_a_secret(name: str, secret: str) -> None:
    """parse_uri(), the backends' parsers and a parsed URI's repr() hide it in every spelling."""
    uri = spell(SPELLINGS[name], secret)
    try:
        parsed = parse_uri(uri)
        assert_hidden(secret, repr(parsed), str(parsed))
        open_backend(parsed, ttl=5.0).close()
    except (ConfigError, UsageError) as err:
        assert_hidden(secret, *_told(err))


def _told(err: BaseException) -> list[str]:
    """Return all an exception can show: its text, repr, and traceback with its causes."""
    return [str(err), repr(err), "".join(traceback.format_exception(err))]


@given(name=_names, secret=passwords)
@settings(max_examples=60)
@example(name="conninfo", secret="QQQQ hunter2")  # noqa: S106
@example(name="postgresql: user:password, no @host", secret="QQQQ")  # noqa: S106
# redis-py quoted the socket path "u:JJJJ@/…" that urlsplit made of it (a relative path)
@example(name="unix: user:password, no //, then @host", secret="JJJJ")  # noqa: S106
def test_the_api_says_nothing_of_a_secret(name: str, secret: str) -> None:
    """Lock(): its repr(), and any exception from it or acquire(), with causes, hide the secret."""
    uri = spell(SPELLINGS[name], secret)
    with pytest.raises(LockrunError) as raised:
        _lock(uri, secret)
    assert raised.value.exit_code in {ExitCode.CONFIG, ExitCode.UNAVAILABLE, ExitCode.USAGE}
    assert_hidden(secret, *_told(raised.value))


def _lock(uri: str, secret: str) -> None:
    """Describe a Lock at *uri* (its repr() without *secret*), then acquire it."""
    lock = Lock("redaction", uri=uri, wait=0, ttl=5)
    assert_hidden(secret, repr(lock))
    lock.acquire()


def _run(command: str, uri: str) -> tuple[int, str]:
    """Run lockrun's *command* against *uri*; return its status and all it printed."""
    args = {
        "run": ("-v", "--wait", "0", "--uri", uri, "-n", "redaction", "--", "true"),
        "status": ("status", "--uri", uri),
        "acquire": ("acquire", "--uri", uri, "--wait", "0", "redaction"),
    }[command]
    result = lockrun(*args)
    return result.returncode, result.stdout + result.stderr


# The sweep of every spelling through the CLI's handling runs in-process, through `status`
# (tests/unit/test_sweeps.py): a lockrun start-up per example made this the longest test of
# the fast set (31 s), for what only the parsers vary. Here, the real processes of all three
# commands on the spellings issue 29 found leaking, and one of MySQL's.
@pytest.mark.parametrize(
    ("name", "secret", "command"),
    [
        *((name, secret, "run") for name, secret in _ISSUE),
        (*_ISSUE[0], "status"),
        ("mysql: user:password, no //", "QQQQ:", "status"),
        (*_ISSUE[2], "acquire"),
    ],
)
def test_the_cli_says_nothing_of_a_secret(name: str, secret: str, command: str) -> None:
    """`lockrun -v … -- true`, `status` and `acquire`: no secret, one of lockrun's statuses."""
    status, said = _run(command, spell(SPELLINGS[name], secret))
    assert status in {ExitCode.CONFIG, ExitCode.UNAVAILABLE, ExitCode.USAGE}, said
    assert "Traceback" not in said
    assert_hidden(secret, said)


@pytest.mark.parametrize(
    "query",
    ["password=x&QQQQ=1", "p%61ss=x&QQQQ=1", "a=x%26password%3Dy&QQQQ=1", "a=u:p@h&QQQQ=1"],
)
def test_an_unknown_option_after_a_secret_is_not_named(query: str) -> None:
    """What follows a secret may be a piece of it: an unknown option there goes unnamed."""
    assert option_name("QQQQ", query) == "(not shown: it could be part of a password)"
