"""`python -m bench.report` writes a Markdown table per backend beside flock(1), and a plot (#7).

And a table of the Python API beside its peers (#11), and the fleet modes' two (#12): the
hot-standby fail-overs (docs/deployment.md links to its heading) and the cost of each mode.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

from tests.support.cli import unmeasured
from tests.support.servers import installed, unavailable

ROOT: Final = Path(__file__).resolve().parent.parent  # where `python -m bench.report` runs
PNG_MAGIC: Final = b"\x89PNG\r\n\x1a\n"
# Each table's rows, by how their labels start, in order.
LOCAL_ROWS: Final = (
    "start-up, median ms",
    "start-up ratio, over the floor",
    "handoff p50, ms",
    "handoff p99, ms",
    "idle-waiter CPU, s per waiter per s",
    "acquire/release cycles per s, 8 contenders",
)
HEADER: Final = ("date", "kernel", "CPUs", "Python", "load average", "command")
API: Final = "Python API"  # the section after the backends'
STANDBY: Final = "Hot standby fail-over"  # docs/deployment.md links to its anchor
STANDBY_HEADER: Final = ["backend", "clean stop", "crash", "host cut off", "cut-off daemon stopped"]
MODES: Final = "Cost of each mode"
MODES_HEADER: Final = [
    "backend",
    "plain, median ms",
    "`--shared`, × plain",
    "`--hold-at-least 1m`, × plain",
    "`--take-over --wait 5`, × plain",
    "take-over: taker's command",
    "take-over: holder's TERM",
]
API_PEERS: Final = {"file": "portalocker.Lock"}


def report(
    *args: str, env: dict[str, str], timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """Run `python -m bench.report` from the repository root, with this interpreter."""
    command = [sys.executable, "-m", "bench.report", *args]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )


def tables(markdown: str) -> dict[str, list[list[str]]]:
    """Return each `## backend` section's table as rows of cells, the header row first."""
    found: dict[str, list[list[str]]] = {}
    section = ""
    for line in markdown.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif section and line.startswith("|") and not line.startswith("|---"):
            found.setdefault(section, []).append(
                [cell.strip() for cell in line.strip("|").split("|")]
            )
    return found


@pytest.mark.slow  # half a minute of measuring, twice that on a loaded machine
@pytest.mark.timeout(240)
def test_quick_report(tmp_path: Path) -> None:
    """`--quick --backends file` writes its table with flock(1), the API's, a PNG.

    One local backend: abstract:'s rows are the same code measuring another URI, and each
    backend costs half a minute of CPU beside the rest of the suite.
    """
    try:
        import matplotlib  # noqa: F401, ICN001
    except ImportError:
        unavailable("matplotlib is not installed (pip install -e '.[bench]')")
    installed("flock")
    arguments = ("--quick", "--backends", "file", "--out", str(tmp_path))
    out = report(*arguments, env=unmeasured(), timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    markdown = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    for item in HEADER:
        assert f"| {item}" in markdown
    assert "--quick --backends file --out" in markdown
    assert "`etcdctl lock`" in markdown
    found = tables(markdown)
    assert list(found) == ["file", API, STANDBY, MODES]
    check_standby(found.pop(STANDBY))
    check_modes(found.pop(MODES))
    api = found.pop(API)
    assert api[0][:2] == ["backend", "peer"]
    assert {backend: peer for backend, peer, *_ in api[1:]} == API_PEERS
    for _, _, *cells in api[1:]:
        assert len(cells) == len(api[0]) - 2
        assert all(float(cell) >= 0 for cell in cells), cells
    for rows in found.values():
        assert rows[0] == ["metric", "lockrun", "flock(1)"]
        assert len(rows) == 1 + len(LOCAL_ROWS)
        for label, (metric, *cells) in zip(LOCAL_ROWS, rows[1:], strict=True):
            assert metric.startswith(label)
            assert len(cells) == 2
            assert all(float(cell) >= 0 for cell in cells), (metric, cells)
    png = (tmp_path / "handoff-latency.png").read_bytes()
    assert png.startswith(PNG_MAGIC)
    assert len(png) > len(PNG_MAGIC)


def spread(text: str) -> tuple[float, float]:
    """Parse a "median / max" cell."""
    median, most = (float(part) for part in text.split(" / "))
    return median, most


def check_standby(rows: list[list[str]]) -> None:
    """Each local backend: a clean stop's and a crash's fail-over; no cut without a server."""
    assert rows[0] == STANDBY_HEADER
    assert [backend for backend, *_ in rows[1:]] == ["file"]
    for _, clean, crash, cut, stopped in rows[1:]:
        for text in (clean, crash):
            median, most = spread(text)
            assert 0 < median <= most
        assert cut == stopped == "—"


def check_modes(rows: list[list[str]]) -> None:
    """Each backend: the plain run in ms, each mode's ratio (or unsupported), take-overs in ms.

    A mode a backend does not implement yet shows as unsupported, never as broke.
    """
    assert rows[0] == MODES_HEADER
    assert [backend for backend, *_ in rows[1:]] == ["file"]
    for _, plain, *ratios, taker, notice in rows[1:]:
        assert float(plain) > 0
        assert all(cell == "unsupported" or float(cell) > 0 for cell in ratios), ratios
        if "unsupported" in (taker, notice):
            assert taker == notice
        else:
            assert 0 < spread(notice)[0] < spread(taker)[0]


def test_without_matplotlib(tmp_path: Path) -> None:
    """Without matplotlib it says how to install it, in one line, and exits 2 at once."""
    hidden = tmp_path / "hide" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    env = {**unmeasured(), "PYTHONPATH": str(hidden.parent)}
    out = report("--quick", "--out", str(tmp_path / "out"), env=env)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1
    assert "pip install -e '.[bench]'" in out.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("backends", ["nfs", "file,nfs", ""])
def test_unknown_backend(backends: str, tmp_path: Path) -> None:
    """An unknown backend in --backends is a usage error (2) naming the choices."""
    out = report("--backends", backends, "--out", str(tmp_path / "out"), env=unmeasured())
    assert out.returncode == 2
    assert "file,abstract,redis,mysql,postgres,etcd" in out.stderr
