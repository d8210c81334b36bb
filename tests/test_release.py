"""A release: what the package index shows, the version everywhere, the release workflow."""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest
import yaml
from markdown_it import MarkdownIt

import lockrun

if TYPE_CHECKING:
    from email.message import Message

ROOT = Path(__file__).parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HOME = PYPROJECT["project"]["urls"]["Homepage"]  # https://github.com/OWNER/NAME
WORKFLOWS = ROOT / ".github" / "workflows"
PINNED = re.compile(r"[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}")
HTML_LINK = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']*)["']""", re.IGNORECASE)
CLASSIFIER = "Programming Language :: Python :: "


def workflow(name: str) -> dict[Any, Any]:
    """Return .github/workflows/NAME.yml, parsed."""
    parsed: dict[Any, Any] = yaml.safe_load((WORKFLOWS / f"{name}.yml").read_text())
    return parsed


def steps_run(job: dict[str, Any]) -> str:
    """Return the shell lines of *job*'s steps, one string."""
    return "\n".join(step.get("run", "") for step in job["steps"])


def claimed(metadata: Message) -> set[str]:
    """Return the X.Y of each Python version classifier in *metadata*."""
    found = (value.removeprefix(CLASSIFIER) for value in metadata.get_all("Classifier", []))
    return {value for value in found if re.fullmatch(r"3\.\d+", value)}


def ci_pythons() -> set[str]:
    """Return the Pythons CI tests: .venv's (3.11) and those scripts/pythons adds by default."""
    script = (ROOT / "scripts" / "pythons").read_text()
    default = re.search(r"LOCKRUN_PYTHONS-([\d. ]+)\}", script)
    assert default, "scripts/pythons: its default versions moved"
    return {"3.11", *default[1].split()}


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Message]:
    """Build the sdist and the wheel as the release workflow does; return their metadata."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-t", "wheel", "-d", out],
        cwd=ROOT, capture_output=True, check=True, timeout=240,
    )  # fmt: skip
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (entry for entry in archive.namelist() if entry.endswith(".dist-info/METADATA"))
        wheel_metadata = archive.read(name).decode()
    with tarfile.open(sdist) as archive:
        member = archive.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/PKG-INFO")
        assert member
        sdist_metadata = member.read().decode()
    parse = email.parser.Parser().parsestr
    return {str(wheel): parse(wheel_metadata), str(sdist): parse(sdist_metadata)}


def test_the_dists_claim_exactly_the_pythons_ci_tests(dists: dict[str, Message]) -> None:
    """The version classifiers are the Pythons CI runs, from requires-python's lowest up."""
    lowest = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    for metadata in dists.values():
        assert claimed(metadata) == ci_pythons()
        assert min(ci_pythons(), key=lambda version: tuple(map(int, version.split(".")))) == lowest
        assert metadata["Requires-Python"] == f">={lowest}"


def test_the_long_description_links_only_to_absolute_addresses(
    dists: dict[str, Message],
) -> None:
    """Every link and image of the index's page is absolute; README.md is otherwise whole."""
    readme = (ROOT / "README.md").read_text()
    for metadata in dists.values():
        assert metadata["Description-Content-Type"] == "text/markdown"
        description = metadata.get_payload()
        assert isinstance(description, str)
        targets = []
        for token in MarkdownIt("commonmark").parse(description):
            for child in [token, *(token.children or [])]:
                if child.type == "link_open":
                    targets.append(str(child.attrs["href"]))
                elif child.type == "image":
                    targets.append(str(child.attrs["src"]))
                elif child.type in {"html_inline", "html_block"}:
                    targets.extend(HTML_LINK.findall(child.content))
        assert len(targets) >= 25, "README.md's links: did the parse find them?"
        for target in targets:
            url = urlsplit(target)
            assert (url.scheme, bool(url.netloc)) == ("https", True), target
            # The repository's files that a link names exist in this checkout.
            prefix = f"{HOME}/blob/main/"
            if target.startswith(prefix):
                assert (ROOT / target.removeprefix(prefix).split("#")[0]).is_file(), target
        # Only the links changed: making them relative again gives back README.md.
        relative = description.replace(f"]({HOME}/blob/main/README.md#", "](#")
        relative = relative.replace(f"]({HOME}/blob/main/", "](")
        raw = HOME.replace("https://github.com/", "https://raw.githubusercontent.com/")
        relative = relative.replace(f"]({raw}/main/", "](")
        assert relative.strip() == readme.strip()


def test_twine_check_passes(dists: dict[str, Message]) -> None:
    """`twine check --strict`: the index would take both files and render the description."""
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *dists],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_version_is_the_changelogs_top_release(dists: dict[str, Message]) -> None:
    """The wheel, the sdist, `lockrun.__version__` and CHANGELOG.md's top release agree."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    top = re.search(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", changelog, re.MULTILINE)
    assert top
    assert top[1] == lockrun.__version__
    for metadata in dists.values():
        assert metadata["Version"] == lockrun.__version__


def test_the_project_urls_and_readme_links_share_one_address() -> None:
    """Homepage is the one address: every URL and README substitution starts with it."""
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", HOME)
    for url in PYPROJECT["project"]["urls"].values():
        assert url == HOME or url.startswith(f"{HOME}/")
    raw = HOME.replace("https://github.com/", "https://raw.githubusercontent.com/")
    hook = PYPROJECT["tool"]["hatch"]["metadata"]["hooks"]["fancy-pypi-readme"]
    for substitution in hook["substitutions"]:
        assert f"]({HOME}/blob/main/" in substitution["replacement"] or (
            f"]({raw}/main/" in substitution["replacement"]
        )
    # Build once without isolation (tests, scripts/build-pyz): the dev extra has the plugin.
    build = set(PYPROJECT["build-system"]["requires"])
    assert "hatch-fancy-pypi-readme==25.1.0" in build
    assert build - {"hatchling>=1.27"} <= dev_pins()


def release_check(root: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run scripts/release-check of the tree at *root*."""
    return subprocess.run(
        [sys.executable, root / "scripts" / "release-check", *argv],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip


def release_tree(tmp_path: Path, *, confirmed: bool, unreleased: str = "") -> Path:
    """Return a copy of what scripts/release-check reads, CHANGELOG.md as if just released."""
    for part in ("scripts/release-check", "src/lockrun/__init__.py", "pyproject.toml"):
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / part, tmp_path / part)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    head, _, rest = changelog.partition("## [Unreleased]\n")
    released = rest[rest.index("\n## [") :]
    (tmp_path / "CHANGELOG.md").write_text(f"{head}## [Unreleased]\n{unreleased}{released}")
    if confirmed:
        pyproject = tmp_path / "pyproject.toml"
        pyproject.write_text(
            pyproject.read_text().replace(
                "repository-confirmed = false", "repository-confirmed = true"
            )
        )
    return tmp_path


def test_release_check_passes_only_the_versions_tag_once_confirmed(tmp_path: Path) -> None:
    """A confirmed repository, the version's tag and an empty Unreleased: the one way in."""
    tag = f"v{lockrun.__version__}"
    tree = release_tree(tmp_path, confirmed=True)
    passed = release_check(tree, tag)
    assert (passed.returncode, passed.stderr) == (0, f"release-check: {tag} may be released\n")
    wrong = release_check(tree, "v99.0.0")
    assert (wrong.returncode, wrong.stderr) == (
        1,
        f"release-check: the tag v99.0.0 is not {tag}, src/lockrun/__init__.py's version\n",
    )
    notes = release_check(tree, "--notes", tag)
    assert notes.returncode == 0
    assert notes.stdout.strip()
    assert "## [" not in notes.stdout


def test_release_check_refuses_an_unconfirmed_repository_and_unreleased_notes(
    tmp_path: Path,
) -> None:
    """Placeholder URLs or changes left under Unreleased: one line each, status 1."""
    tag = f"v{lockrun.__version__}"
    tree = release_tree(tmp_path, confirmed=PYPROJECT["tool"]["lockrun"]["repository-confirmed"])
    refused = release_check(tree, tag)
    if not PYPROJECT["tool"]["lockrun"]["repository-confirmed"]:
        assert refused.returncode == 1
        assert refused.stderr == (
            f"release-check: pyproject.toml: {HOME} is unconfirmed: set [tool.lockrun] "
            "repository-confirmed to true once it holds this code "
            '(docs/development.md "Releasing")\n'
        )
    tree = release_tree(tmp_path, confirmed=True, unreleased="\n### Fixed\n\n- Something.\n\n")
    refused = release_check(tree, tag)
    assert (refused.returncode, refused.stderr) == (
        1,
        (
            "release-check: CHANGELOG.md has changes under Unreleased: move them to the "
            "release's section\n"
        ),
    )


def dev_pins() -> set[str]:
    """Return the dev extra's requirements, with those of the test extra it names."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert "lockrun-cli[test]" in extras["dev"]
    return set(extras["dev"]) | set(extras["test"])


def test_the_release_workflow_builds_tests_attests_and_publishes_without_a_token() -> None:
    """A v* tag: one build of the files tests/ builds, tests on each Python, then publish."""
    release = workflow("release")
    assert release[True] == {"push": {"tags": ["v*"]}}  # YAML 1.1 reads `on` as true
    assert release["permissions"] == {}
    jobs = release["jobs"]
    build = steps_run(jobs["build"])
    # What tests/test_release.py and tests/test_pyz.py build, built the same way.
    assert "python -m hatchling build -t sdist -t wheel -d dist" in build
    assert "scripts/build-pyz --out" in build
    assert "twine check --strict" in build
    assert 'scripts/release-check "$GITHUB_REF_NAME"' in build
    (install,) = (line for line in build.splitlines() if "pip install" in line)
    assert set(install.split()[4:]) <= dev_pins(), "the release builds with the dev extra's pins"
    assert set(jobs["test"]["strategy"]["matrix"]["python"]) == ci_pythons()
    assert jobs["pypi"]["needs"] == ["build", "test", "attest"]
    assert jobs["pypi"]["environment"]["name"] == "pypi"
    assert jobs["pypi"]["permissions"] == {"id-token": "write"}
    assert jobs["attest"]["permissions"] == {"id-token": "write", "attestations": "write"}
    assert jobs["github-release"]["permissions"] == {"contents": "write"}
    for name in ("build", "test"):
        assert jobs[name]["permissions"] == {"contents": "read"}
    assert "secrets." not in (WORKFLOWS / "release.yml").read_text()


def test_ci_runs_every_python_the_classifiers_claim() -> None:
    """GitHub's CI: the suite on Debian 12's 3.11 and the portable set on the others."""
    jobs = workflow("ci")["jobs"]
    assert jobs["suite"]["container"]["image"] == "debian:bookworm"  # python3 is 3.11
    assert "bash .ci/run" in steps_run(jobs["suite"])
    assert {"3.11", *jobs["portable"]["strategy"]["matrix"]["python"]} == ci_pythons()


@pytest.mark.parametrize("path", sorted(WORKFLOWS.glob("*.yml")), ids=lambda path: path.name)
def test_every_action_is_pinned_by_commit(path: Path) -> None:
    """`uses:` names a full commit hash and, in a comment, the release it is."""
    uses = re.findall(r"^\s*(?:- )?uses: (\S+)(.*)$", path.read_text(), re.MULTILINE)
    assert uses
    for action, comment in uses:
        assert PINNED.fullmatch(action), action
        assert re.fullmatch(r" # v\d+(\.\d+)*", comment), f"{action}: which release?"
