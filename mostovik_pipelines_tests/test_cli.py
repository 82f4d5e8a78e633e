"""The operator's command line, run as a user runs it: in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mostovik_pipelines.warehouse.migrate import head_revision

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")


def _run(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``mostovik`` with an ephemeral Dagster instance unless ``env`` names one."""
    base = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    return subprocess.run([MOSTOVIK, *args], env={**base, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _summary(output: str) -> dict[str, list[str]]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("partition"))
    return {line.split()[0]: line.split()[1:] for line in lines[start + 1:] if line.strip()}


@pytest.mark.slow
def test_demo_loads_the_week_and_a_second_demo_changes_nothing(tmp_path):
    env = {"MOSTOVIK_DATA_DIR": str(tmp_path / "data")}
    first = _run("demo", "--days", "3", env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    first_rows = _summary(first.stdout)
    assert len(first_rows) == 3
    assert (tmp_path / "data" / "warehouse.sqlite").exists()

    second = _run("demo", "--days", "3", env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    for partition, (status, inserted, updated, unchanged, deleted, *_rest) in _summary(
        second.stdout
    ).items():
        assert status == "completed", partition
        assert (inserted, updated, deleted) == ("0", "0", "0")
        if first_rows[partition][1] != "0":
            assert unchanged == first_rows[partition][1]


def test_unknown_source_is_a_usage_error(tmp_path):
    result = _run("materialize", "--source", "nope", "--last", "1",
                  env={"MOSTOVIK_DATA_DIR": str(tmp_path)}, cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown source 'nope'" in result.stderr


def test_db_upgrade_creates_the_tables(tmp_path):
    url = f"sqlite:///{tmp_path / 'wh.sqlite'}"
    result = _run("db", "upgrade", env={"MOSTOVIK_DATABASE_URL": url}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"revision {head_revision()}" in result.stdout
