"""No module of the package or of its tests is over 450 lines: a longer one does several things,
and its seams (what it draws, what it judges, its helpers, its second subject) want modules of
their own."""

from __future__ import annotations

from pathlib import Path

import mostovik_pipelines
import mostovik_pipelines_tests

MAX_LINES = 450
ROOTS = (Path(mostovik_pipelines.__file__).parent, Path(mostovik_pipelines_tests.__file__).parent)


def modules_over(limit: int, roots: tuple[Path, ...] = ROOTS) -> dict[str, int]:
    """Every ``.py`` file under ``roots`` longer than ``limit`` lines, with its line count."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                found[str(path.relative_to(root.parent))] = lines
    return found


def test_no_module_of_the_package_or_the_tests_is_over_450_lines():
    assert modules_over(MAX_LINES) == {}


def test_the_size_rule_sees_a_long_module(tmp_path):
    package = tmp_path / "package"
    package.mkdir()
    (package / "short.py").write_text("x = 1\n" * MAX_LINES)
    (package / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert modules_over(MAX_LINES, (package,)) == {"package/long.py": MAX_LINES + 1}
