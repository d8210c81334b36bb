"""Sweeps that only feed a parser, run in this process: no lockrun start-up per case.

Each was a parametrization of an end-to-end test, one `python -m lockrun` per value, where
what varies reaches nothing but a URI's parser (or the messages made of its errors). The
end-to-end tests keep one case each, for the process around the parser: its exit status,
its one line, no hang (tests/hostile/test_edges.py, tests/hostile/test_redaction.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lockrun.backends import open_backend, parse_uri
from lockrun.cli.output import register_secret
from lockrun.errors import ConfigError, ExitCode
from tests.support.cli import one_line, refused_in_process
from tests.support.strategies import assert_hidden, passwords, spell, spellings

if TYPE_CHECKING:
    from pathlib import Path

# Every option that names a file a driver (or lockrun) would open and read: TLS files, a
# MySQL option file, a libpq password file.
FILE_OPTIONS: Final = (
    "rediss://127.0.0.1:1/0?ssl_ca_certs={file}",
    "redis+sentinel://127.0.0.1:1/svc?ssl_certfile={file}&ssl_keyfile={file}",
    "mysql://u@127.0.0.1:1/db?ssl_ca={file}",
    "mysql://u@127.0.0.1:1/db?read_default_file={file}",
    "postgresql://u@127.0.0.1:1/db?passfile={file}",
    "postgresql://u@127.0.0.1:1/db?sslmode=require&sslrootcert={file}",
)


@pytest.mark.parametrize("template", FILE_OPTIONS)
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_device_as_a_uris_file_is_a_config_error(
    tmp_path: Path, template: str, kind: str
) -> None:
    """A TLS, option or password file that is a FIFO or a device: refused before any read.

    Either would block its reader (or feed it forever). pytest's timeout is the hang guard:
    a FIFO opened for reading here would never return. The CLI's 78, once:
    tests/hostile/test_edges.py.
    """
    path = tmp_path / "fifo"
    if kind == "fifo":
        os.mkfifo(path)
    uri = template.format(file=path if kind == "fifo" else "/dev/zero")
    with pytest.raises(ConfigError) as refused:
        open_backend(parse_uri(uri), ttl=5.0).close()
    assert "\n" not in str(refused.value)
    assert "file" in str(refused.value)  # "no such readable file", "not a regular file …"


SPELLINGS: Final = spellings()


@given(name=st.sampled_from(sorted(SPELLINGS)), secret=passwords)
@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_status_command_says_nothing_of_a_secret(
    name: str, secret: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """`lockrun status --uri` with a secret in any spelling: a lockrun status, no secret said.

    The CLI's own handling (click's parsing, the messages of its errors, what it prints) in
    this process, as `lockrun status` runs it after its start-up; every URI names port 1, so
    none gets past a refused connect. `run` and `acquire` would fork (a guardian, a keeper):
    tests/hostile/test_redaction.py runs all three as processes, on the spellings of issue 29.
    """
    register_secret("file:")  # none: hidden only if this run registers it
    result = refused_in_process(capfd, "status", "--uri", spell(SPELLINGS[name], secret))
    said = result.stdout + result.stderr
    assert result.returncode in {ExitCode.CONFIG, ExitCode.UNAVAILABLE, ExitCode.USAGE}, said
    one_line(result.stderr)  # said, in one line
    assert "Traceback" not in said
    assert_hidden(secret, said)


# Every usage error of the run command, as `lockrun ARGS` says it (tests/test_cli.py runs a few
# as processes).
USAGE_ERRORS: Final = [
    (["--bogus", "--", "true"], "--bogus"),
    (["--wait", "5x", "--", "true"], "invalid duration '5x'"),
    (["--wait", "-1", "--", "true"], "invalid duration '-1'"),
    (["--ttl", "forever", "--", "true"], "invalid duration 'forever'"),
    (["--ttl", "0", "--", "true"], "--ttl must be at least 1s and at most 1d00h, not 0s"),
    (["--ttl", "0.001", "--", "true"], "--ttl must be at least 1s"),  # it would only kill
    (["--ttl", "2d", "--", "true"], "--ttl must be at least 1s and at most 1d00h, not 2d00h"),
    (["--max-time", "soon", "--", "true"], "invalid duration 'soon'"),
    (["--max-time", "0", "--", "true"], "--max-time must be more than 0s and at most"),
    (["--max-time", "367d", "--", "true"], "--max-time must be more than 0s and at most 366d"),
    (["--wait", "367d", "--", "true"], "--wait must be at least 0s and at most 366d00h"),
    (["--kill-after", "1e11", "--", "true"], "invalid duration '1e11'"),
    (["--kill-after", "99999999999", "--", "true"], "--kill-after must be at least 0s"),
    (["--kill-after", "", "--", "true"], "invalid duration ''"),
    (["--wait", "30m1h", "--", "true"], "'30m1h': units must come largest first, each once"),
    (["--ttl", "500ms", "--", "true"], "--ttl must be at least 1s and at most 1d00h, not 0.5s"),
    (["--ttl", "1d400ms", "--", "true"], "at most 1d00h, not 86400.4s"),  # not "not 1d00h"
    (["--hold-at-least", "366d1s", "--", "true"], "at most 366d00h, not 31622401s"),
    (["--ttl=1.5.5s", "--", "true"], "invalid duration '1.5.5s': use seconds (90, 1.5) or"),
    (["--slots", "0", "--", "true"], "0 is not in the range 1<=x<=1000"),
    (["--slots", "-1", "--", "true"], "-1 is not in the range 1<=x<=1000"),
    (["--slots", "1001", "--", "true"], "1001 is not in the range 1<=x<=1000"),
    (["--slots", "1e20", "--", "true"], "'1e20' is not a valid integer"),
    (["--slots", "9" * 30, "--", "true"], "is not in the range 1<=x<=1000"),
    (["--slots", "abc", "--", "true"], "'abc' is not a valid integer"),
    (["-E", "256", "--", "true"], "256 is not in the range 0<=x<=255"),
    ([], "no command to run"),
    (["--"], "no command to run"),
    (["-n", "", "--", "true"], "lock name must not be empty"),
    (["-n", "x" * 256, "--", "true"], "lock name is 256 bytes; at most 255"),
    (["-n", "é" * 128, "--", "true"], "lock name is 256 bytes; at most 255"),
    (["--namespace", "", "-n", "x", "--", "true"], "namespace must not be empty"),
    (["--close", "--uri", "abstract:", "--", "true"], "--close applies to the file:"),
]


@pytest.mark.parametrize(("arguments", "message"), USAGE_ERRORS)
def test_usage_errors_are_64_with_one_line(
    arguments: list[str], message: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Bad options, durations, names and missing commands: 64, one line naming what is wrong.

    Each is refused by click or by run's checks before anything is opened or started.
    """
    result = refused_in_process(capfd, *arguments)
    assert (result.returncode, result.stdout) == (ExitCode.USAGE, "")
    assert message in one_line(result.stderr)
