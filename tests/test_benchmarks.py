"""The benchmarks folder holds together: every script path the docs, scripts and tests name
exists, benchmarks/README.md maps every script, and the shared timing helpers time what
they say."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*/*") if p.suffix in (".py", ".sh"))
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCH.rglob("*.md")),
         *SCRIPTS, *sorted((ROOT / "tests").glob("*.py"))]
PATH = re.compile(r"(?:benchmarks|tests)/[\w./-]*\w")


def test_scripts_are_in_subfolders():
    assert SCRIPTS, "no benchmark scripts found"
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["__init__.py", "timing.py"]
    # One exception: the path issue 29 names for the GPU check, a two-line hand-on to figures/.
    assert [p.name for p in BENCH.glob("*.sh")] == ["gpu_check.sh"]
    assert "exec bash" in (BENCH / "gpu_check.sh").read_text() and len((BENCH / "gpu_check.sh").read_text()) < 600


@pytest.mark.parametrize("text", TEXTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_scripts_and_folders_exist(text):
    """Every benchmarks/ or tests/ script or folder a file names is there (results are
    outputs: a command may name one it is about to write)."""
    missing = []
    for m in PATH.finditer(text.read_text()):
        path = m.group(0)
        if path.startswith("benchmarks/results/") or "$" in path:
            continue
        if path.endswith((".py", ".sh", ".md")) or path.rstrip("/").count("/") <= 2:
            if not (ROOT / path).exists():
                missing.append(path)
    assert not missing, f"{text.relative_to(ROOT)} names paths that do not exist: {sorted(set(missing))}"


def test_readme_maps_every_script():
    readme = (BENCH / "README.md").read_text()
    unmapped = [p.relative_to(BENCH).as_posix() for p in SCRIPTS if f"`{p.name}`" not in readme]
    assert not unmapped, f"benchmarks/README.md does not name {unmapped}"


def test_timing_counts_warmup_and_measures_a_block():
    sys.path.insert(0, str(ROOT))
    from benchmarks.timing import Timer, call_times, command, median_ms

    calls = []
    times = call_times(lambda: calls.append(1), repeats=5, warmup=3)
    assert len(times) == 5 and len(calls) == 8 and all(t >= 0 for t in times)
    assert median_ms(lambda: None, repeats=3) >= 0
    synced = []
    with Timer(lambda: synced.append(1)) as t:
        sum(range(1000))
    assert synced == [1, 1] and t.seconds > 0 and t.ms == pytest.approx(1000 * t.seconds)
    assert command(str(BENCH / "micro" / "forward_cost.py"), ["--dtype", "bfloat16"]) == \
        "python benchmarks/micro/forward_cost.py --dtype bfloat16"
