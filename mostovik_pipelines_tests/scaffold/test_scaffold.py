"""`mostovik new-source`: what it writes for each kind of source passes its tests at once, honours
the whole contract, is verified and rebuilt from the ledger like every source, is lint-clean, its
migration imports nothing of the project, it changes no file that existed (a source is new files
only), and the calendar suite covers it without an edit of the tests' support. Run on a copy of
the repository, so the real one is never touched."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mostovik_pipelines.scaffold import ScaffoldRefused, new_source

REPO = Path(__file__).resolve().parents[2]
KINDS = {"scaffold_parser": "parser", "scaffold_sync": "sync", "scaffold_file": "file"}
COPIED = ("mostovik_pipelines", "mostovik_pipelines_tests", "pyproject.toml", "setup.cfg",
          "dagster.yaml", "workspace.yaml")


def _copy_of_the_repository(target: Path) -> Path:
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, target / name,
                            ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
        else:
            shutil.copy(source, target / name)
    return target


def _files(root: Path) -> dict[str, str]:
    """Every file under ``root`` (bytecode caches aside), by path, with its content's digest."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in root.rglob("*") if path.is_file() and "__pycache__" not in path.parts}


def _a_new_sources_own(path: str) -> bool:
    """Whether ``path`` belongs to one of the scaffolded sources: its folder, its test folder,
    its corpus or its migration."""
    return any(path.startswith((f"mostovik_pipelines/sources/{name}/",
                                f"mostovik_pipelines_tests/sources/{name}/",
                                f"mostovik_pipelines_tests/corpus/{name}/"))
               or (path.startswith("mostovik_pipelines/warehouse/migrations/versions/")
                   and path.endswith(f"_{name}.py")) for name in KINDS)


def _run(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


CALENDAR_COVERS_THEM = """
import random
from pathlib import Path

from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.chaos.calendar_steps import ROUTES, SPECS, calendar_steps
from mostovik_pipelines_tests.support.fake_clock import code_location_environment
from mostovik_pipelines_tests.support.period_truth import expected_rows
from mostovik_pipelines_tests.support.schedule_calendar import ALL_SCHEDULES, moscow

new = ("scaffold_parser", "scaffold_sync")
server = StandinServer().start()
try:
    environment = code_location_environment(Path("unused"), "sqlite://", server)
    for name in new:
        spec = SPECS[name]
        assert f"{name}_schedule" in ALL_SCHEDULES and name in ROUTES, name
        assert environment[spec.url_setting] == server.endpoint_url(name)
        assert spec.deadline is not None and spec.catch_up.settings_prefix, name
        assert [step for step in calendar_steps(1, random.Random(1), (name,))], name
        assert expected_rows(spec, "2026-11-03", server, moscow("2026-11-05", 0)) is not None
        print(name)
finally:
    server.stop()
"""
"""Run in the copy: the new parser and sync sources (scheduled) are in the calendar suite."""


@pytest.mark.servers  # runs the scaffolded sources' tests on PostgreSQL
def test_a_scaffolded_source_of_each_kind_passes_its_tests_and_the_contract(tmp_path):
    copy = _copy_of_the_repository(tmp_path / "repo")
    before = _files(copy)
    scaffold = "; ".join(f"new_source({name!r}, {kind!r})" for name, kind in KINDS.items())
    written = _run([sys.executable, "-c",
                    f"from mostovik_pipelines.scaffold import new_source; {scaffold}"],
                   copy, timeout=300)
    assert written.returncode == 0, written.stderr[-3000:]
    after = _files(copy)
    assert [path for path, digest in before.items() if after.get(path) != digest] == []
    new = sorted(set(after) - set(before))
    assert [path for path in new if not _a_new_sources_own(path)] == []
    for name in KINDS:
        assert f"mostovik_pipelines/sources/{name}/source.py" in new
        assert f"mostovik_pipelines/sources/{name}/parse.py" in new
    for name in KINDS:
        migration = next((copy / "mostovik_pipelines/warehouse/migrations/versions").glob(
            f"*_{name}.py")).read_text()
        assert "mostovik_pipelines" not in migration.split('"""')[2]
        assert f'CREATE TRIGGER "{name}_written_outside_loader"' in migration

    ruff = Path(sys.executable).parent / "ruff"
    if ruff.exists():
        linted = _run([str(ruff), "check", "--no-cache", "mostovik_pipelines",
                       "mostovik_pipelines_tests"], copy, timeout=120)
        assert linted.returncode == 0, linted.stdout[-3000:]

    # The calendar suite and its truth judge take their sources from the declarations: the
    # scheduled new sources are in them, their stand-ins wired, their periods judged, with no
    # edit of the tests' support.
    covered = _run([sys.executable, "-c", CALENDAR_COVERS_THEM], copy, timeout=300)
    assert covered.returncode == 0, covered.stderr[-3000:]
    assert covered.stdout.split() == ["scaffold_parser", "scaffold_sync"], covered.stdout

    tests = [f"mostovik_pipelines_tests/sources/{name}/test_{name}.py" for name in KINDS]
    contract = "mostovik_pipelines_tests/sources/test_source_contract.py"
    bad_input = "mostovik_pipelines_tests/sources/test_bad_input.py"  # the scaffolded corpus cases
    # Verified against its source and its landed payload, and rebuilt from the ledger.
    verification = "mostovik_pipelines_tests/framework/verification/test_every_source.py"
    selected = " or ".join(KINDS)
    tested = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
                   f"{contract}::test_every_source_honours_the_whole_contract", bad_input,
                   verification, "-k", selected], copy, timeout=600)
    assert tested.returncode == 0, tested.stdout[-5000:]
    assert " passed" in tested.stdout and "failed" not in tested.stdout


@pytest.mark.parametrize(("name", "kind", "refusal"), [
    ("CbrRates", "parser", "is not a source name"),
    ("a_source_name_longer_than_24", "parser", "at most 24 characters"),
    ("cbr_daily_rates", "parser", r"exist\(s\) already"),
    ("new_one", "scraper", "--type is one of parser, sync, file"),
])
def test_the_scaffold_refuses_what_it_cannot_write(name, kind, refusal):
    with pytest.raises(ScaffoldRefused, match=refusal):
        new_source(name, kind)
