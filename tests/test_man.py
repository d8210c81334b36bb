"""The man page renders cleanly and stays in step with the code (docs/design.md C10)."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Final

import click
import pytest

from lockrun import __version__
from lockrun.cli import SUBCOMMANDS, run_command
from lockrun.errors import ExitCode
from lockrun.supervise import FORWARDED
from lockrun.uri import SCHEMES
from tests.support.cli import help_options
from tests.support.servers import installed

PAGE: Final = Path(__file__).resolve().parent.parent / "man" / "lockrun.1"
REQUIRED: Final = (
    "NAME",
    "SYNOPSIS",
    "DESCRIPTION",
    "OPTIONS",
    "URIS",
    "EXIT STATUS",
    "ENVIRONMENT",
    "SIGNALS",
    "FILES",
    "EXAMPLES",
    "SEE ALSO",
)
# Besides ExitCode: the "128+N" of a killed command, and HUP while waiting (INT and TERM
# while waiting are ExitCode values already).
SIGNAL_STATUSES: Final = frozenset({128, 128 + signal.SIGHUP})
# A roff escape: \fB and \f[B], \(em, \[em], \*(xx, or one character (\-, \e, \&, \c …).
_ESCAPE: Final = re.compile(r"\\(?:f(?:\[[^]]*\]|.)|\((..)|\[([^]]*)\]|\*(?:\(..|\[[^]]*\]|.)|(.))")
_ARGUMENT: Final = re.compile(r'"((?:[^"]|"")*)"?|(\S+)')
_ALTERNATING: Final = frozenset({"BI", "BR", "IB", "IR", "RB", "RI"})
_LAYOUT: Final = frozenset({"IP", "PP", "RE", "RS", "TP", "ad", "in", "nh", "nr", "sp"})
_SPECIAL: Final = {"aq": "'", "dq": '"', "em": "\u2014", "ti": "~", "ha": "^", "ga": "`"}
_SHOWN: Final = {"-": "-", "e": "\\", "~": " ", " ": " "}  # others (\& \c \| \%) show nothing


def roff() -> str:
    """Return the page's source without its comment lines."""
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.startswith(('.\\"', "'\\\"")))


def plain(source: str) -> str:
    r"""Return roff *source* as text: macro names, quotes and escapes gone, ``\-`` as ``-``."""

    def shown(match: re.Match[str]) -> str:
        if match[3] is not None:
            return _SHOWN.get(match[3], "")
        return _SPECIAL.get(match[1] or match[2] or "", "")  # such as \(em or \[em]

    def line_text(line: str) -> str:
        request = re.match(r"[.'](\w+)[ \t]*", line)
        if request is None:
            return line
        arguments = [quoted or bare for quoted, bare in _ARGUMENT.findall(line[request.end() :])]
        if request[1] in _LAYOUT:  # indents and spacing are no text; .IP's tag is
            return " ".join(arguments[:1]) if request[1] == "IP" else ""
        # .BR, .IR, .RI …: alternating fonts, the arguments run together
        return ("" if request[1] in _ALTERNATING else " ").join(arguments)

    return _ESCAPE.sub(shown, "\n".join(map(line_text, source.splitlines())))


def section(heading: str, source: str | None = None, macro: str = "SH") -> str:
    """Return the source between the ``.SH`` (or ``.SS``) *heading* and the next one."""
    parts = re.split(
        rf"^\.{macro}[ \t]+(.*)$", roff() if source is None else source, flags=re.MULTILINE
    )
    found = {title.strip('"'): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}
    assert heading in found, f"no .{macro} {heading} in {PAGE}"
    return found[heading]


def tags(source: str) -> str:
    """Return the text of the .TP and .TQ tags in *source*: the entries a section lists."""
    lines = source.splitlines()
    return "\n".join(
        plain(tag) for line, tag in itertools.pairwise(lines) if re.match(r"\.T[PQ]\b", line)
    )


def mentions(text: str, word: str) -> bool:
    """Return whether *word* (an option, a scheme, a variable) stands alone in *text*."""
    return re.search(rf"(?<![\w+.-]){re.escape(word)}(?![\w-])", text) is not None


def man(*arguments: str) -> subprocess.CompletedProcess[str]:
    """Run the man command on the page at 80 columns in a UTF-8 locale, without a pager."""
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in {"MAN_KEEP_FORMATTING", "MANOPT", "MANROFFOPT", "GROFF_SGR"}
    }
    environment |= {"LC_ALL": "C.UTF-8", "MANWIDTH": "80", "MANPAGER": "cat", "PAGER": "cat"}
    return subprocess.run(
        [installed("man"), *arguments, "-l", str(PAGE)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def rendered() -> list[str]:
    """Return the page as man(1) shows it at 80 columns, overstrikes removed (as col -b)."""
    result = man()
    assert result.returncode == 0, result.stderr
    return re.sub(r".\x08", "", result.stdout).splitlines()


def test_the_page_shows_every_required_section(rendered: list[str]) -> None:
    """The rendered page shows each required section heading."""
    headings = [line for line in rendered if re.fullmatch(r"[A-Z][A-Z ]*[A-Z]", line)]
    assert [heading for heading in REQUIRED if heading not in headings] == []


def test_the_page_fits_in_80_columns(rendered: list[str]) -> None:
    """No rendered line, examples included, is wider than the 80 columns it is set for."""
    assert [line for line in rendered if len(line) > 80] == []


def test_man_renders_the_page_without_warnings() -> None:
    """The page gives man --warnings nothing to say."""
    result = man("--warnings")
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("device", ["ps", "utf8", "ascii"])
def test_groff_checks_the_page_without_warnings(device: str) -> None:
    """The page gives groff -man -ww -z no warnings or errors, for print and terminals."""
    result = subprocess.run(
        [installed("groff"), "-man", "-ww", "-z", f"-T{device}", str(PAGE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize(
    ("arguments", "subsection"),
    [
        (("status",), "lockrun status"),
        (("acquire",), "lockrun acquire, release, renew"),
        (("release",), "lockrun acquire, release, renew"),
        (("renew",), "lockrun acquire, release, renew"),
    ],
    ids=["status", "acquire", "release", "renew"],
)
def test_every_option_of_the_help_has_an_entry(arguments: tuple[str, ...], subsection: str) -> None:
    """Each short and long option --help lists has an entry in its part of OPTIONS."""
    entries = tags(section(subsection, section("OPTIONS"), macro="SS"))
    missing = {option for option in help_options(*arguments) if not mentions(entries, option)}
    assert missing == set()


@pytest.mark.parametrize("group", [heading for heading, _ in run_command.groups])
def test_the_run_options_are_grouped_as_in_the_help(group: str) -> None:
    """OPTIONS has a subsection for each heading of `lockrun --help`, with its options."""
    entries = tags(section(group, section("OPTIONS"), macro="SS"))
    names = dict(run_command.groups)[group]
    spellings = {
        spelled
        for param in run_command.params
        if isinstance(param, click.Option) and param.name in names
        for spelled in (*param.opts, *param.secondary_opts)
    } | ({"-h", "--help"} if "help" in names else set())
    assert {option for option in spellings if not mentions(entries, option)} == set()


def test_every_run_option_of_the_help_is_in_a_group() -> None:
    """Each option `lockrun --help` lists has an entry under one of the run's subsections."""
    entries = "\n".join(
        tags(section(group, section("OPTIONS"), macro="SS")) for group, _ in run_command.groups
    )
    assert {option for option in help_options() if not mentions(entries, option)} == set()


def test_description_lists_the_subcommands() -> None:
    """DESCRIPTION's Subcommands names each subcommand, one entry each, as --help does."""
    entries = tags(section("Subcommands", section("DESCRIPTION"), macro="SS")).splitlines()
    assert entries == list(SUBCOMMANDS)


def test_every_exit_code_has_an_entry_in_exit_status() -> None:
    """Each ExitCode value, the command's own status and 128+N are listed in EXIT STATUS."""
    entries = tags(section("EXIT STATUS"))
    missing = [code for code in ExitCode if not mentions(entries, str(code.value))]
    assert missing == []
    assert "the command's own" in entries
    assert "128+N" in entries


def test_exit_status_mentions_no_stale_number() -> None:
    """Every number in EXIT STATUS is a status lockrun can exit with."""
    text = re.sub(r"\(\d\)", "", plain(section("EXIT STATUS")))  # timeout(1) is no status
    numbers = set(re.findall(r"\d+(?:\.\d+)*", text))
    assert numbers - {str(status) for status in {*ExitCode, *SIGNAL_STATUSES}} == set()


def test_every_uri_scheme_has_an_entry_in_uris() -> None:
    """Each scheme lockrun.uri.SCHEMES knows has an entry in URIS."""
    entries = tags(section("URIS"))
    assert [scheme for scheme in SCHEMES if not mentions(entries, f"{scheme}:")] == []


def test_every_setting_variable_has_an_entry_in_environment() -> None:
    """ENVIRONMENT lists each LOCKRUN_<OPTION> setting and each variable the command gets."""
    settings = {
        f"LOCKRUN_{param.name.upper()}"
        for param in run_command.params
        if isinstance(param, click.Option)
        and param.name
        and param.expose_value
        and param.allow_from_autoenv
    }
    assert "LOCKRUN_WAIT" in settings  # the introspection found click's auto_envvar names
    # --uri's, read by lockrun.urifile.choose_uri in its order rather than by click
    settings |= {"LOCKRUN_URI", "LOCKRUN_URI_FILE", "CREDENTIALS_DIRECTORY"}
    told = {
        "LOCKRUN_NAME",
        "LOCKRUN_SLOT",
        "LOCKRUN_SLOTS",
        "LOCKRUN_FENCE",
    }  # docs/semantics.md G8
    others = {"LOCKRUN_DEBUG", "_LOCKRUN_COMPLETE"}
    entries = tags(section("ENVIRONMENT"))
    assert {
        variable for variable in settings | told | others if not mentions(entries, variable)
    } == set()


def test_every_forwarded_signal_is_in_signals() -> None:
    """SIGNALS names each signal lockrun forwards to the command's process group."""
    text = plain(section("SIGNALS"))
    names = {signal.Signals(signo).name.removeprefix("SIG") for signo in FORWARDED}
    assert {name for name in names if not mentions(text, name)} == set()


def test_the_title_names_lockrun_1_without_a_version() -> None:
    """The .TH line names LOCKRUN 1 and carries no version that could go stale."""
    title = re.search(r"^\.TH .*$", roff(), flags=re.MULTILINE)
    assert title is not None
    assert title[0].startswith(".TH LOCKRUN 1 ")
    assert __version__ not in title[0]
