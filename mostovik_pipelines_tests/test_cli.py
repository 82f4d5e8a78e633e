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
    """``source/partition`` -> its summary line's fields, for every source the output lists."""
    rows, source = {}, ""
    for line in output.splitlines():
        fields = line.split()
        if len(fields) == 1:
            source = fields[0]
        elif len(fields) > 5 and fields[0][:4].isdigit():
            rows[f"{source}/{fields[0]}"] = fields[1:]
    return rows


@pytest.mark.slow
def test_demo_loads_the_week_and_a_second_demo_changes_nothing(tmp_path):
    env = {"MOSTOVIK_DATA_DIR": str(tmp_path / "data")}
    first = _run("demo", "--days", "3", "--sync-days", "2", env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "erp_work_orders" in first.stdout
    first_rows = _summary(first.stdout)
    assert len(first_rows) == 5
    assert (tmp_path / "data" / "warehouse.sqlite").exists()

    second = _run("demo", "--days", "3", "--sync-days", "2", env=env, cwd=tmp_path)
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


@pytest.fixture
def job_env(tmp_path, pg_warehouse_url, standin_server, standin):
    from mostovik_pipelines_tests.support.processes import run_environment

    return run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url)


def _jobs(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([MOSTOVIK, "jobs", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_an_operator_finds_a_failed_job_reads_its_error_and_reruns_it(
    job_env, tmp_path, standin, pg_warehouse_url
):
    import json

    from mostovik_pipelines_tests.support.processes import start_job_execute
    from mostovik_pipelines_tests.support.warehouse import table_rows

    standin.fault("status", status=404)
    failed_run = start_job_execute("2026-11-04", job_env, tmp_path)
    failed_run.communicate(timeout=120)
    assert failed_run.returncode != 0

    listed = _jobs("list", "--status", "failed", "--json", env=job_env, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    [failed] = json.loads(listed.stdout)
    assert (failed["source"], failed["period"], failed["status"]) == (
        "cbr_daily_rates", "2026-11-04", "failed")

    shown = _jobs("show", failed["run_id"], env=job_env, cwd=tmp_path)
    assert shown.returncode == 0
    assert "error in extract_cbr_daily_rates (permanent, request_rejected)" in shown.stdout
    # Where each step ran: its own engine event, not a run tag.
    assert " extract_cbr_daily_rates " in shown.stdout.split("processes", 1)[1]
    assert " pid " in shown.stdout
    assert "HTTP 404" in shown.stdout

    rerun = _jobs("rerun", failed["run_id"], env=job_env, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    new_run_id, status = rerun.stdout.split()[-2:]
    assert status == "completed"
    new_job = json.loads(_jobs("show", new_run_id, "--json", env=job_env, cwd=tmp_path).stdout)
    assert new_job["parent_run_id"] == failed["run_id"]
    assert new_job["rerun_of"] == failed["run_id"]
    assert new_job["period"] == "2026-11-04"
    assert new_job["totals"]["inserted"] == 12
    assert len(table_rows(pg_warehouse_url, "cbr_daily_rates")) == 12

    fresh = _jobs("rerun", "--source", "cbr_daily_rates", "--period", "2026-11-04",
                  env=job_env, cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    fresh_job = json.loads(_jobs("show", fresh.stdout.split()[-2], "--json", env=job_env,
                                 cwd=tmp_path).stdout)
    assert fresh_job["rerun_of"] == new_run_id
    assert fresh_job["totals"]["unchanged"] == 12


def test_jobs_commands_fail_clearly_for_scripts(job_env, tmp_path):
    missing = _jobs("show", "no-such-run", env=job_env, cwd=tmp_path)
    assert missing.returncode == 3 and "no run no-such-run" in missing.stderr
    unknown = _jobs("list", "--source", "nope", env=job_env, cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown source 'nope'" in unknown.stderr
    bad_period = _jobs("rerun", "--source", "cbr_daily_rates", "--period", "1999-01-01",
                       env=job_env, cwd=tmp_path)
    assert bad_period.returncode == 2 and "no period" in bad_period.stderr
    no_home = {k: v for k, v in job_env.items() if k != "DAGSTER_HOME"}
    homeless = _jobs("list", env=no_home, cwd=tmp_path)
    assert homeless.returncode == 2 and "DAGSTER_HOME" in homeless.stderr
    assert _jobs("list", "--stuck", env=job_env, cwd=tmp_path).returncode == 0
