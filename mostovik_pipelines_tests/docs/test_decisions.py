"""docs/decisions.md stays true: every rule of ADR-011 and ADR-016 has its line, and every module
and test a line names exists, so a renamed or deleted test fails here until the line is mended."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ROOT / "docs" / "decisions.md"
PACKAGE = ROOT / "mostovik_pipelines"
TESTS = ROOT / "mostovik_pipelines_tests"
ROW = re.compile(r"^\| (0\d\d-\w+) \| (.+?) \| (.+?) \| (.+?) \|$", re.MULTILINE)

ADR_011 = (["011-1", "011-2", "011-3"] + [f"011-I{n}" for n in range(1, 8)]
           + [f"011-T{n}" for n in range(1, 6)] + [f"011-N{n}" for n in range(1, 6)]
           + [f"011-R{n}" for n in range(1, 5)] + [f"011-C{n}" for n in range(1, 5)]
           + [f"011-O{n}" for n in range(1, 5)] + [f"011-S{n}" for n in range(1, 4)]
           + ["011-P1", "011-F1", "011-F2", "011-F3"])
"""ADR-011: the three main rules; the seven means of idempotency; the five transient kinds that
are retried and the five permanent ones that are not; the four requirements of every retry; the
four levels of concurrency control in their order; the four situations of the operational
policy; the three failure scenarios of its context; partial success; the three follow-ups."""

ADR_016 = (["016-1", "016-2", "016-3", "016-4"] + [f"016-A{n}" for n in range(1, 5)]
           + [f"016-S{n}" for n in range(1, 6)] + [f"016-R{n}" for n in range(1, 5)]
           + [f"016-M{n}" for n in range(1, 5)] + [f"016-C{n}" for n in range(1, 4)])
"""ADR-016: the four execution rules; the job's properties; the five statuses; the four recovery
abilities; the four manual operations; the three rules of the Celery integration."""


def decision_rows() -> dict[str, tuple[str, str, str]]:
    return {rule: (asks, kept_by, proven_by)
            for rule, asks, kept_by, proven_by in ROW.findall(DECISIONS.read_text("utf-8"))}


def named(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def missing_test(reference: str) -> str | None:
    """Why ``file::name`` does not name a test of the suite, or None when it does."""
    path, _, name = reference.partition("::")
    test_file = TESTS / path
    if not test_file.is_file():
        return f"{reference}: no test file {path}"
    functions = {node.name for node in ast.walk(ast.parse(test_file.read_text("utf-8")))
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    return None if name in functions else f"{reference}: no test {name} in {path}"


def test_every_rule_of_both_decisions_has_its_line():
    rows = decision_rows()
    assert [rule for rule in ADR_011 + ADR_016 if rule not in rows] == []
    assert [rule for rule in rows if rule not in ADR_011 + ADR_016] == []


@pytest.mark.parametrize("rule", ADR_011 + ADR_016)
def test_the_module_and_the_test_a_rule_names_exist(rule):
    _asks, kept_by, proven_by = decision_rows()[rule]
    modules, tests = named(kept_by), named(proven_by)
    assert modules and tests, f"{rule}: names no module or no test"
    assert [m for m in modules if not (PACKAGE / m).is_file()] == []
    assert [why for why in map(missing_test, tests) if why] == []


def test_a_test_that_no_longer_exists_is_caught():
    assert missing_test("test_cli.py::test_that_was_renamed_long_ago") is not None
    assert missing_test("no_such_test_file.py::test_anything") is not None
    assert missing_test("test_cli.py::test_db_upgrade_creates_the_tables") is None
