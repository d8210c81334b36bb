"""The README and docs/ against the code: statuses, URI schemes, options and every example.

The examples moved from README.md to the pages of docs/; each check follows them there.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from lockrun.errors import ExitCode
from lockrun.timing import parse_duration
from lockrun.uri import SCHEMES
from tests.support.cli import help_options
from tests.support.servers import installed

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

ROOT = Path(__file__).parent.parent
# README.md and every page of docs/, by path from the repository's top.
PAGES = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
# A word that runs lockrun: `lockrun`, `/usr/local/bin/lockrun`, `ExecStart=/…/lockrun`.
LOCKRUN = re.compile(r"(?:[A-Za-z]+=)?(?:\S*/)?lockrun")
# Words after which the shell, not lockrun, reads the line.
SHELL_WORDS = frozenset({"|", "||", "&&", ";", "&", ")", "#"})
CRON_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
CRON_LINE = re.compile(r"[\d*][\d*/,-]*\s")
YAML_KEY = re.compile(r'([\w.$-]+|"[^"]*"):(?: (.*))?')


class Block(NamedTuple):
    """A code block of README.md or docs/: its language (empty if indented) and its text."""

    language: str
    text: str
    page: str


class Invocation(NamedTuple):
    """A lockrun command line found in a code block: the words after `lockrun` itself."""

    line: str
    words: list[str]


def _page_blocks(page: str, text: str) -> list[Block]:
    """Return every fenced block (de-indented) and every indented block of one page."""
    blocks = [
        Block(language, re.sub(rf"(?m)^{indent}", "", body), page)
        for indent, language, body in FENCE.findall(text)
    ]
    outside = FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    blocks += [
        Block("", re.sub(r"(?m)^ {4}", "", match.group(1)), page)
        for match in re.finditer(r"(?m)(?<=\n\n)((?: {4,}\S.*\n)+)", outside)
    ]
    return blocks


def _blocks() -> list[Block]:
    """Return the code blocks of README.md and of every page of docs/."""
    return [block for page, text in PAGES.items() for block in _page_blocks(page, text)]


def _sections(title: str) -> dict[str, str]:
    """Return, by page, the text under the heading *title* up to the next one of its level."""
    found = {}
    for page, text in PAGES.items():
        outside = FENCE.sub("", text)  # `# comments` in code blocks are no headings
        heading = re.search(rf"^(#+) {re.escape(title)}\n", outside, re.MULTILINE)
        if heading:
            level = len(heading.group(1))
            rest = outside[heading.end() :]
            end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
            found[page] = rest[: end.start()] if end else rest
    return found


def _section(title: str, pages: Sequence[str]) -> list[str]:
    """Return the text under the heading *title* on each of *pages*, where it must be."""
    found = _sections(title)
    missing = [page for page in pages if page not in found]
    assert missing == [], f"{title!r} is missing from {missing}"
    return [found[page] for page in pages]


def _table(text: str) -> list[list[str]]:
    """Return the rows of the first table in *text*, without its header, as cells."""
    lines = re.search(r"(?m)((?:^\|.*\n)+)", text)
    assert lines, "no table"
    rows = [
        [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        for line in lines.group(1).splitlines()
    ]
    return rows[2:]


def _invocations() -> list[Invocation]:
    """Return every lockrun command line in the code blocks of README.md and docs/."""
    found: list[Invocation] = []
    for block in _blocks():
        for line in block.text.splitlines():
            for array in re.findall(r"\[[^\[\]]*\]", line):  # a YAML flow list: ["lockrun", …]
                try:
                    argv = json.loads(array)
                except json.JSONDecodeError:
                    continue
                if "lockrun" in argv:
                    found.append(Invocation(line, argv[argv.index("lockrun") + 1 :]))
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an apostrophe in SQL or prose
                words = line.split()
            found += [
                Invocation(line, words[index + 1 :])
                for index, word in enumerate(words)
                if LOCKRUN.fullmatch(word)
            ]
    return found


def _options_used(words: Sequence[str], options: Mapping[str, bool]) -> Iterator[str]:
    """Yield each option word lockrun itself reads: those before `--` or the command."""
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--" or word in SHELL_WORDS or not word.startswith("-") or word == "-":
            return
        if word.startswith("--"):
            name = word.partition("=")[0]
            yield name
            index += 2 if options.get(name) and "=" not in word else 1
            continue
        for position, letter in enumerate(word[1:], start=1):  # -q, -qv, -w5m
            yield f"-{letter}"
            if options.get(f"-{letter}"):
                index += position == len(word) - 1  # the value is the next word
                break
        index += 1


def _status_options_used(words: Sequence[str]) -> Iterator[str]:
    """Yield each option word of a `lockrun status …` (or acquire …) line, NAME anywhere."""
    for word in (word.strip("[]") for word in words):  # also a synopsis: [--uri URI]
        if word in SHELL_WORDS or word.startswith(">"):
            return
        if word.startswith("-"):
            yield word.partition("=")[0]


def _cron_field_ok(field: str, low: int, high: int) -> bool:
    """Tell whether *field* is a valid crontab time field between *low* and *high*."""
    for part in field.split(","):
        base, slash, step = part.partition("/")
        if slash and not step.isdigit():
            return False
        if base == "*":
            continue
        bounds = base.split("-")
        if len(bounds) > 2 or not all(
            bound.isdigit() and low <= int(bound) <= high for bound in bounds
        ):
            return False
    return True


def _yaml_lines(text: str) -> Iterator[tuple[int, str, str]]:
    """Yield indent, content and line of each YAML line that is not blank, a comment or text."""
    scalar_from: int | None = None  # a block scalar (`key: |`) owns every deeper line
    for line in text.splitlines():
        content = line.lstrip(" ")
        indent = len(line) - len(content)
        if not content or content.startswith("#"):
            continue
        if scalar_from is None or indent <= scalar_from:
            scalar_from = indent if re.search(r"(?:^-|:) +[|>][-+]?$", content) else None
            yield indent, content, line


def _yaml_indent_problem(open_: list[tuple[int, set[str]]], indent: int, *, may_nest: bool) -> str:
    """Move *open_* (indent, keys of each open collection) to *indent*; say what is wrong."""
    problem = ""
    if indent > open_[-1][0]:
        problem = "" if may_nest else "indented under a value"
        open_.append((indent, set()))
    while indent < open_[-1][0]:
        open_.pop()
    return problem or ("" if indent == open_[-1][0] else "dedented to no open level")


def _yaml_value_problem(value: str) -> str:
    """Say what is wrong with a value or list item: an unclosed quote, or `: ` in plain text."""
    closing = {'"': '"', "'": "'", "[": "]", "{": "}"}.get(value[:1])
    if closing:
        return "" if len(value) > 1 and value.endswith(closing) else f"unclosed {value[0]}"
    return "`: ` inside a plain value" if ": " in value else ""


def _yaml_problems(text: str) -> list[str]:
    """List what would break a block-style YAML document: tabs, stray indents, doubled keys."""
    problems = [f"a tab: {line!r}" for line in text.splitlines() if "\t" in line]
    open_: list[tuple[int, set[str]]] = [(0, set())]
    may_nest = False  # the previous line ended in `key:` or `-`, so a deeper one may follow
    for indent, content, line in _yaml_lines(text):
        found = [_yaml_indent_problem(open_, indent, may_nest=may_nest)]
        item = content.startswith("- ") or content == "-"
        if item:  # a list item: a scalar, or the first key of a mapping
            open_.append((indent + 2, set()))
        entry = content[2:] if item else content
        match = YAML_KEY.fullmatch(entry)
        value = (match.group(2) or "") if match else entry
        if match:
            found.append(f"key {match.group(1)} twice" if match.group(1) in open_[-1][1] else "")
            open_[-1][1].add(match.group(1))
        elif not item:
            found.append("not `key: value`")
        found.append(_yaml_value_problem(value))
        may_nest = not value
        problems += [f"{problem}: {line!r}" for problem in found if problem]
    return problems


def test_the_exit_status_table_lists_exactly_lockruns_statuses() -> None:
    """Each exit-status table has one row per ExitCode, plus the command's own and 128+N."""
    for text in _section("Exit status", ["README.md", "docs/semantics.md"]):
        first = [row[0] for row in _table(text)]
        numeric = [cell for cell in first if re.fullmatch(r"[\d /]+", cell)]
        statuses = sorted(int(status) for cell in numeric for status in cell.split("/"))
        assert statuses == sorted(ExitCode)
        assert [cell for cell in first if cell not in numeric] == ["the command's own", "128+N"]


def test_the_uri_table_names_every_scheme_and_no_other() -> None:
    """The Lock URIs table covers each scheme of SCHEMES and names no scheme beyond them."""
    [text] = _section("Lock URIs", ["README.md"])
    first = [row[0] for row in _table(text)]
    named = {scheme for cell in first for scheme in re.findall(r"`([a-z][a-z\d+.-]*):", cell)}
    assert named == set(SCHEMES)


def test_the_options_table_matches_help() -> None:
    """The Options table lists every option of `lockrun --help`, with a value where it takes one."""
    listed: dict[str, bool] = {}
    [text] = _section("Options", ["docs/semantics.md"])
    for cell, *_ in _table(text):
        for group in re.findall(r"`([^`]*)`", cell):
            takes_value = re.search(r" [A-Z]+$", group) is not None
            listed.update(dict.fromkeys(re.findall(r"--?[\w-]+", group), takes_value))
    options = help_options()
    assert sorted(listed) == sorted(options)
    assert listed == options


def test_every_lockrun_line_in_a_code_block_uses_real_options() -> None:
    """Each `lockrun …` in a code block uses options that exist, up to the command it runs."""
    options = help_options()
    subcommands = {word: help_options(word) for word in ("status", "acquire", "release", "renew")}
    invocations = _invocations()
    unknown = []
    for invocation in invocations:
        if invocation.words[:1] and invocation.words[0] in subcommands:
            known = subcommands[invocation.words[0]]
            used = list(_status_options_used(invocation.words[1:]))
            unknown += [(word, invocation.line) for word in used if word not in known]
        else:
            used = list(_options_used(invocation.words, options))
            unknown += [(word, invocation.line) for word in used if word not in options]
    assert len(invocations) >= 20, "the docs' command lines were not found"
    assert any(invocation.words[:1] == ["status"] for invocation in invocations)
    assert unknown == []


def test_the_yaml_examples_parse() -> None:
    """Every YAML example parses to a mapping (needs PyYAML, which lockrun does not install)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed; the block check runs")
    blocks = [block.text for block in _blocks() if block.language == "yaml"]
    assert len(blocks) >= 3
    for text in blocks:
        assert isinstance(yaml.safe_load(text), dict), text


def test_the_yaml_examples_are_well_formed_blocks() -> None:
    """The YAML examples have no tabs, stray indents, doubled keys or unclosed quotes."""
    blocks = [block.text for block in _blocks() if block.language == "yaml"]
    assert len(blocks) >= 3
    assert [problem for text in blocks for problem in _yaml_problems(text)] == []


# Where a CI or Kubernetes YAML document keeps what it runs: shell lines, or an argv.
SHELL_KEYS = frozenset({"run", "script", "before_script", "after_script"})
ARGV_KEYS = frozenset({"command", "args"})


def _yaml_documents() -> list[dict[str, object]]:
    """Return every YAML example, parsed (PyYAML, of the dev extra)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed; the block check runs")
    documents = [yaml.safe_load(block.text) for block in _blocks() if block.language == "yaml"]
    assert all(isinstance(document, dict) for document in documents)
    return documents


def _runs(node: object) -> Iterator[list[str]]:
    """Yield the argv of each lockrun a YAML document runs, from its shell lines and argvs."""
    if isinstance(node, list):
        for item in node:
            yield from _runs(item)
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in SHELL_KEYS:
            lines = [value] if isinstance(value, str) else value
            for line in (text for each in lines for text in str(each).splitlines()):
                words = list(shlex.shlex(line, posix=True, punctuation_chars=True))
                yield from _lockruns(words)
        elif key in ARGV_KEYS and isinstance(value, list) and value[:1] == ["lockrun"]:
            yield [str(word) for word in value[1:]]
        else:
            yield from _runs(value)


def _lockruns(words: list[str]) -> Iterator[list[str]]:
    """Yield the words after each `lockrun` of a shell line, up to a shell operator."""
    for index, word in enumerate(words):
        if LOCKRUN.fullmatch(word):
            rest = words[index + 1 :]
            ends = [at for at, each in enumerate(rest) if each in SHELL_WORDS or each[0] in "|&;"]
            yield rest[: min(ends, default=len(rest))]


def _check_command_line(words: list[str]) -> None:
    """Parse *words* as lockrun's CLI does; its UsageError if they are no valid command line."""
    from lockrun import cli
    from lockrun.cli import tokens

    command, prog, args = cli.run_command, "lockrun", words
    if words[:1] and words[0] in cli.SUBCOMMANDS:
        command, prog, args = cli.SUBCOMMANDS[words[0]][0], f"lockrun {words[0]}", words[1:]
    with command.make_context(prog, list(args)) as context:
        if command is tokens.acquire_command and context.params["no_keeper"]:
            tokens._check_no_keeper(context.params["owner"], context.params["max_time"])


def test_the_yaml_examples_run_valid_lockrun_command_lines() -> None:
    """Each lockrun that a CI, Kubernetes or Compose example runs parses as the CLI would."""
    runs = [argv for document in _yaml_documents() for argv in _runs(document)]
    assert len(runs) >= 10
    assert {argv[0] for argv in runs} >= {"acquire", "release", "renew"}
    for argv in runs:
        _check_command_line(argv)


def test_the_cross_job_examples_pass_the_token_and_always_release() -> None:
    """The token leaves `lock` as a job output or a dotenv report; `unlock` always runs."""
    documents: list[Any] = _yaml_documents()
    github = [each for each in documents if "lock" in each.get("jobs", {})]
    gitlab = [each for each in documents if "stages" in each and "lock" in each]
    assert (len(github), len(gitlab)) == (1, 1)
    jobs = github[0]["jobs"]
    (step,) = [step for step in jobs["lock"]["steps"] if "lockrun acquire" in step.get("run", "")]
    words = shlex.split(step["run"])
    assert words[words.index("--env-file") + 1] == "$GITHUB_OUTPUT"
    output = words[words.index("--var") + 1]
    assert jobs["lock"]["outputs"] == {output: f"${{{{ steps.{step['id']}.outputs.{output} }}}}"}
    for name, job in jobs.items():
        if f"needs.lock.outputs.{output}" in json.dumps(job):
            needs = job["needs"]
            assert "lock" in ([needs] if isinstance(needs, str) else needs), name
    assert "always()" in jobs["unlock"]["if"]
    assert set(jobs["unlock"]["needs"]) == set(jobs) - {"unlock"}
    assert jobs["unlock"]["steps"][-1]["run"] == "lockrun release"
    lab = gitlab[0]
    (line,) = [line for line in lab["lock"]["script"] if "lockrun acquire" in line]
    words = shlex.split(line)
    assert words[words.index("--env-file") + 1] == lab["lock"]["artifacts"]["reports"]["dotenv"]
    assert "--var" not in words  # GitLab's dotenv makes LOCKRUN_TOKEN, which release reads
    assert lab["unlock"]["when"] == "always"
    assert lab["unlock"]["script"] == ["lockrun release"]
    assert lab["stages"][-1] == lab["unlock"]["stage"]


def test_the_kubernetes_grace_outlasts_kill_after() -> None:
    """Each pod gives lockrun more terminationGracePeriodSeconds than its --kill-after."""
    pods = [
        b.text
        for b in _blocks()
        if b.language == "yaml" and re.search(r"kind: (CronJob|Deployment)", b.text)
    ]
    assert len(pods) == 2
    for pod in pods:
        grace = re.search(r"terminationGracePeriodSeconds: (\d+)", pod)
        kill_after = re.search(r'"--kill-after", "([^"]+)"', pod)
        assert grace
        assert kill_after
        assert int(grace.group(1)) > (parse_duration(kill_after.group(1)) or 0)


def test_the_crontab_lines_have_five_time_fields() -> None:
    """Each crontab line has five valid time fields; those in crontab blocks use full paths."""
    entries = []
    for block in _blocks():
        lines = [line.strip() for line in block.text.splitlines()]
        if block.language == "crontab":
            settings = re.compile(r"#|[A-Za-z_]\w*\s*=")
            entries += [(True, line) for line in lines if line and not settings.match(line)]
        else:
            entries += [
                (False, line) for line in lines if CRON_LINE.match(line) and "lockrun" in line
            ]
    assert sum(in_crontab for in_crontab, _ in entries) >= 2
    for in_crontab, line in entries:
        fields = line.split(None, 5)
        assert len(fields) == 6, line
        times = zip(fields[:5], CRON_RANGES, strict=True)
        assert all(_cron_field_ok(field, low, high) for field, (low, high) in times), line
        # cron's PATH is /usr/bin:/bin; /bin/sh expands `~` (tests/test_install.py runs them).
        assert not in_crontab or fields[5].startswith(("/", "~/")), f"cron's PATH: {line}"


class _Unit(configparser.ConfigParser):
    """A systemd unit file, read with keys as written."""

    def __init__(self, text: str) -> None:
        """Parse *text*; `=` is the only delimiter, and no key may repeat."""
        super().__init__(interpolation=None, delimiters=("=",), strict=True)
        self.text = text
        self.read_string(text)

    def optionxform(self, optionstr: str) -> str:
        """Keep `ExecStart` as it is (ConfigParser lowers keys)."""
        return optionstr


def test_the_systemd_units_are_a_service_and_its_timer() -> None:
    """The batch service has [Unit] and [Service], its timer [Unit], [Timer] and [Install]."""
    units = _units()
    paths = sorted((path for path in units if path.stem == "sales-batch"), key=lambda p: p.suffix)
    assert [path.suffix for path in paths] == [".service", ".timer"]
    service, timer = units[paths[0]], units[paths[1]]
    assert service.sections() == ["Unit", "Service"]
    assert {"Type", "ExecStart", "KillMode", "TimeoutStopSec"} <= set(service["Service"])
    assert timer.sections() == ["Unit", "Timer", "Install"]
    assert "OnCalendar" in timer["Timer"]
    assert timer["Install"]["WantedBy"] == "timers.target"
    _check_stop(service)


def test_the_standby_unit_waits_forever_and_restarts() -> None:
    """The hot-standby service waits forever for the lock and is restarted whatever it exits."""
    (service,) = (unit for path, unit in _units().items() if path.stem == "dispatcher")
    assert service.sections() == ["Unit", "Service", "Install"]
    assert service["Service"]["Restart"] == "always"
    command = shlex.split(service["Service"]["ExecStart"])
    assert command[command.index("--wait") + 1] == "forever"
    _check_stop(service)


def test_systemd_analyze_verify_accepts_the_units(tmp_path: Path) -> None:
    """`systemd-analyze verify` passes every unit, with a program at each ExecStart= path."""
    analyze = installed("systemd-analyze")
    if os.geteuid() != 0:
        pytest.skip("needs root: the programs are put in place in a mount namespace")
    units = _units()
    assert len(units) >= 4
    binds: dict[str, Path] = {}  # /usr/local, /opt: a directory of ours over each, unshared
    for path, unit in units.items():
        (tmp_path / path.name).write_text(unit.text)
        program = (
            Path(shlex.split(unit["Service"]["ExecStart"])[0])
            if unit.has_section("Service")
            else None
        )
        if program is None or program.exists():
            continue
        top = "/usr/local" if program.is_relative_to("/usr/local") else f"/{program.parts[1]}"
        stub = binds.setdefault(top, tmp_path / top.replace("/", "_")) / program.relative_to(top)
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    mounts = "".join(f"mount --bind {shlex.quote(str(d))} {top} && " for top, d in binds.items())
    names = [path.name for path in units]
    verify = subprocess.run(
        ["unshare", "--mount", "sh", "-c", f'{mounts}exec "$@"', "sh", analyze, "verify", *names],
        capture_output=True, text=True, check=False, cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert (verify.returncode, verify.stdout, verify.stderr) == (0, "", "")


def test_the_ci_examples_shell_lines_parse() -> None:
    """Each `run:` step and GitLab script line is valid bash (`bash -n`)."""
    lines: list[str] = []

    def collect(node: object) -> None:
        if isinstance(node, list):
            for item in node:
                collect(item)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in SHELL_KEYS:
                    lines.extend([value] if isinstance(value, str) else map(str, value))
                else:
                    collect(value)

    for document in _yaml_documents():
        collect(document)
    assert len(lines) >= 20
    for line in lines:
        checked = subprocess.run(
            ["bash", "-n", "-c", line], capture_output=True, text=True, check=False, timeout=30
        )
        assert (checked.returncode, checked.stderr) == (0, ""), line


# What an install line of the docs may install: the release by name, its extra, psycopg.
INSTALLABLE = frozenset({"lockrun-cli", "lockrun-cli[postgres]", "psycopg[binary]"})


def test_every_install_line_names_the_release() -> None:
    """Each pip and pipx line installs `lockrun-cli` by name (or psycopg): no placeholder URL."""
    found = []
    for block in _blocks():
        for line in block.text.splitlines():
            if not re.search(r"\bpipx? (install|inject)\b", line):
                continue
            words = shlex.split(re.sub(r"^\s*- (run: )?", "", line), comments=True)
            for index, word in enumerate(words[:-1]):
                if word in {"pip", "pipx"} and words[index + 1] in {"install", "inject"}:
                    if "-e" in words:  # a development install of the checkout
                        continue
                    specs = [w for w in words[index + 2 :] if not w.startswith("-")]
                    if words[index + 1] == "inject":
                        assert specs[0] == "lockrun-cli", line
                        specs = specs[1:]
                    if "--target" in words:  # pip install --target DIR: DIR is no package
                        specs = specs[1:]
                    found.append((specs[0] if specs else "", line))
    assert {spec for spec, _ in found} == INSTALLABLE, found
    text = "\n".join(PAGES.values())
    assert "git.example.com" not in text
    assert "git+" not in text


def test_the_readmes_install_lines_are_those_that_tests_run() -> None:
    """README's install commands are docs/install.md's pipx block, run by test_install.py."""
    [install] = _section("Install", ["README.md"])
    [readme] = [block.text for block in _page_blocks("README.md", install)]
    page = "docs/install.md"
    first = next(block for block in _page_blocks(page, PAGES[page]) if block.language)  # pipx's
    assert "pipx install lockrun-cli" in readme
    assert readme == first.text


def _units() -> dict[Path, _Unit]:
    return {
        Path(block.text.partition("\n")[0].removeprefix("# ")): _Unit(block.text)
        for block in _blocks()
        if block.language == "ini"
    }


def _check_stop(service: _Unit) -> None:
    """Check that systemd's grace outlasts lockrun's, and that lockrun is named by its full path."""
    command = shlex.split(service["Service"]["ExecStart"])
    assert command[0].startswith("/")
    kill_after = parse_duration(command[command.index("--kill-after") + 1]) or 0
    assert (parse_duration(service["Service"]["TimeoutStopSec"]) or 0) > kill_after


def _anchors(text: str) -> set[str]:
    """Return the anchors GitHub makes of the headings of *text*, and its ``<a id>`` ones."""
    text = FENCE.sub("", text)
    headings = [re.sub(r"<[^>]*>", "", heading) for heading in re.findall(r"(?m)^#+ (.*)$", text)]
    made = {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}
    return made | set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_every_link_between_the_pages_leads_somewhere() -> None:
    """Each relative link of README.md and docs/ names a file that exists, and its heading."""
    broken = []
    for page, text in PAGES.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            if not file.exists() or (
                anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text())
            ):
                broken.append((page, target))
    assert broken == []


def test_the_readme_is_short_and_every_page_is_reachable() -> None:
    """README.md stays under 250 lines, links every page of docs/, and each page links back."""
    assert PAGES["README.md"].count("\n") <= 250
    for page, text in PAGES.items():
        if page.startswith("docs/") and page != "docs/benchmarks.md":
            assert f"({page})" in PAGES["README.md"], page
            assert "(../README.md)" in text, page


# What comments and docstrings cite: `docs/design.md P20`, `docs/semantics.md "Exit status"`.
CITATION = re.compile(r'docs/(\w+)\.md(?:,? (?:([A-Z]\d+)\b|"([^"]+)"))?')
# Documents that lived outside the repository; nothing may cite them any more.
OUTSIDE = re.compile(r"SPEC §|algorithms\.md|aesthetics\.md|STYLE\.md|\bpitfall \d")


def _sources() -> Iterator[Path]:
    for top in ("src", "tests", "bench", "scripts"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix not in {".pyc", ".png"}:
                yield path


def test_code_cites_documents_of_the_repository_that_exist() -> None:
    """Every docs/ page, numbered item and section that code cites exists; nothing outside."""
    # Each numbered item carries an anchor of its id, so `docs/design.md#a7` lands on it.
    labels = {
        page: {
            (anchor.upper(), "")
            for anchor, label in re.findall(r'<a id="([a-z]\d+)"></a>\**([A-Z]\d+)\.', text)
            if anchor.upper() == label
        }
        for page, text in PAGES.items()
    }
    unanchored = [
        (page, label)
        for page, text in PAGES.items()
        for label in re.findall(r"(?m)^(?:#+ |\s*- )\*{0,2}([A-Z]\d+)\.", text)
    ]
    assert unanchored == [], "numbered items without <a id> anchors"
    broken = []
    for path in _sources():
        text = path.read_text(errors="replace")
        where = path.relative_to(ROOT).as_posix()
        if path.name != "test_readme.py":
            broken += [(where, hit) for hit in OUTSIDE.findall(text)]
        for page, label, section in CITATION.findall(text):
            found = PAGES.get(f"docs/{page}.md")
            if found is None:
                broken.append((where, f"docs/{page}.md"))
            elif label and label not in {
                name for pair in labels[f"docs/{page}.md"] for name in pair
            }:
                broken.append((where, f"docs/{page}.md {label}"))
            elif section and not re.search(rf"(?m)^#+ {re.escape(section)}", found):
                broken.append((where, f'docs/{page}.md "{section}"'))
    assert broken == []
