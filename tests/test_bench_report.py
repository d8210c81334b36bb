"""`python -m bench.report` writes a Markdown table per backend beside flock(1), and a plot (#7).

And a table of the Python API beside its peers (#11).
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
API_PEERS: Final = {"file": "portalocker.Lock", "abstract": "portalocker.Lock"}


def report(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run `python -m bench.report` from the repository root, with this interpreter."""
    command = [sys.executable, "-m", "bench.report", *args]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=90, check=False, env=env
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


@pytest.mark.slow  # half a minute of measuring
def test_quick_report(tmp_path: Path) -> None:
    """`--quick --backends file,abstract` writes both tables with flock(1), the API's, a PNG."""
    try:
        import matplotlib  # noqa: F401, ICN001
    except ImportError:
        unavailable("matplotlib is not installed (pip install -e '.[bench]')")
    installed("flock")
    out = report("--quick", "--backends", "file,abstract", "--out", str(tmp_path), env=unmeasured())
    assert out.returncode == 0, out.stdout + out.stderr
    markdown = (tmp_path / "benchmarks.md").read_text(encoding="utf-8")
    for item in HEADER:
        assert f"| {item}" in markdown
    assert "--quick --backends file,abstract --out" in markdown
    assert "`etcdctl lock`" in markdown
    found = tables(markdown)
    assert list(found) == ["file", "abstract", API]
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
    assert "file,abstract,redis,mysql,postgres" in out.stderr
