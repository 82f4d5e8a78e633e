"""The operator's command line, run as a user runs it: in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from mostovik_pipelines.operator.demo import SAMPLE_FILES
from mostovik_pipelines.operator.local_runs import SUMMARY_FIGURES
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.sources.cbr_metal_prices.standin import is_working_day
from mostovik_pipelines.warehouse.migrate import head_revision

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")


def _run(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``mostovik`` with an ephemeral Dagster instance unless ``env`` names one."""
    base = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    return subprocess.run([MOSTOVIK, *args], env={**base, **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _summary(output: str) -> dict[str, dict[str, str]]:
    """``source/partition`` -> its summary line's status, figures, run and note, for every source
    the output lists (a table per source, under the source's name and job type)."""
    rows, source = {}, ""
    for line in output.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[2] == "job)":
            source = fields[0]
        elif len(fields) >= 8 and fields[0] != "partition":
            partition, status, *figures = fields[:7]
            rows[f"{source}/{partition}"] = {
                "status": status, **dict(zip(SUMMARY_FIGURES, figures, strict=True)),
                "run": fields[7], "note": " ".join(fields[8:])}
    return rows


def _tables(url: str) -> dict[str, list[tuple]]:
    """Every source table's rows, bookkeeping columns included (a rewritten row changes them),
    and the quarantined rows."""
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return {table: sorted((tuple(row) for row in connection.execute(
                text(f"SELECT * FROM {table}"))), key=repr)
                for table in [*(spec.table.name for spec in ALL_SOURCES), "quarantined_rows"]}
    finally:
        engine.dispose()


@pytest.mark.slow
def test_demo_runs_every_job_kind_and_a_second_demo_changes_nothing(tmp_path):
    (tmp_path / "home").mkdir()
    env = {"MOSTOVIK_DATA_DIR": str(tmp_path / "data"), "DAGSTER_HOME": str(tmp_path / "home")}
    url = f"sqlite:///{tmp_path / 'data' / 'warehouse.sqlite'}"
    first = _run("demo", "--days", "7", "--sync-days", "2", env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    first_rows = _summary(first.stdout)
    tables = _tables(url)

    # Every source has its table of partitions, and its rows are in the warehouse, as many as the
    # demo says it inserted: 7 days of each parser, 2 sync windows, one line per sample file.
    for spec in ALL_SOURCES:
        lines = {key: row for key, row in first_rows.items() if key.startswith(f"{spec.name}/")}
        assert len(lines) == {"parser": 7, "sync": 2, "file": 3}[spec.job_type], spec.name
        assert all(row["status"] in ("completed", "partial", "skipped") for row in lines.values())
        assert len(tables[spec.table.name]) == sum(int(row["inserted"]) for row in lines.values())
        # (Metal prices are set on working days only: none in a week of New Year holidays.)
        assert tables[spec.table.name] or spec.name == "cbr_metal_prices", spec.name
    metal_days = [key.split("/")[1] for key in first_rows if key.startswith("cbr_metal_prices/")]
    assert len(tables["cbr_metal_prices"]) == 4 * sum(
        is_working_day(date.fromisoformat(day)) for day in metal_days)

    # The sample reports: one line per file version, the bad row quarantined, not loaded.
    reports = {key.split("/")[1].split("@")[0]: row for key, row in first_rows.items()
               if key.startswith("material_deliveries/")}
    assert sorted(reports) == sorted(p.name for p in (SAMPLE_FILES / "material_deliveries")
                                     .iterdir())
    assert {name: (row["status"], row["inserted"], row["rejected"])
            for name, row in reports.items()} == {
        "msk-zhk-014_november.csv": ("completed", "6", "0"),
        "spb-bc-003_november.xlsx": ("completed", "5", "0"),
        "kzn-most-07_november_one_bad_row.csv": ("partial", "7", "1"),
    }
    [quarantined] = tables["quarantined_rows"]
    assert "kzn-most-07_november_one_bad_row.csv@" in " ".join(map(str, quarantined))
    assert "'двенадцать' is not a number" in " ".join(map(str, quarantined))
    engine = create_engine(url)
    with engine.connect() as connection:
        loaded = set(connection.execute(text(
            "SELECT waybill, line_no FROM material_deliveries "
            "WHERE source_file = 'kzn-most-07_november_one_bad_row.csv'")).all())
    engine.dispose()
    assert len(loaded) == 7 and ("НК-2026/784622", 2) not in loaded

    second = _run("demo", "--days", "7", "--sync-days", "2", env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    second_rows = _summary(second.stdout)
    assert second_rows.keys() == first_rows.keys()
    for key, row in second_rows.items():
        assert (row["inserted"], row["updated"], row["deleted"]) == ("0", "0", "0"), key
        if key.startswith("material_deliveries/"):
            # The sensor asks for the same bytes under the run key they were loaded with: the
            # daemon's skip, naming that run.
            assert row["status"] == "skipped", key
            assert row["run"] == first_rows[key]["run"], key
        else:
            assert row["status"] == first_rows[key]["status"], key
            assert row["unchanged"] == first_rows[key]["inserted"], key
    assert _tables(url) == tables


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
@pytest.mark.timeout(900)  # the daemon started for the queued re-run
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

    # A re-run is queued: the daemon launches it; --wait follows it to its end.
    from mostovik_pipelines_tests.support.run_queue import run_queue_daemon

    with run_queue_daemon(job_env, tmp_path / "daemon"):
        rerun = _jobs("rerun", failed["run_id"], "--wait", env=job_env, cwd=tmp_path)
        fresh = _jobs("rerun", "--source", "cbr_daily_rates", "--period", "2026-11-04",
                      "--wait", env=job_env, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    new_run_id, status = rerun.stdout.split()[-2:]
    assert status == "completed"
    new_job = json.loads(_jobs("show", new_run_id, "--json", env=job_env, cwd=tmp_path).stdout)
    assert new_job["parent_run_id"] == failed["run_id"]
    assert new_job["rerun_of"] == failed["run_id"]
    assert new_job["period"] == "2026-11-04"
    assert new_job["totals"]["inserted"] == 12
    assert len(table_rows(pg_warehouse_url, "cbr_daily_rates")) == 12

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


def test_prune_refuses_clearly_without_an_instance_or_with_a_bad_setting(job_env, tmp_path):
    no_home = {k: v for k, v in job_env.items() if k != "DAGSTER_HOME"}
    homeless = _run("prune", "--dry-run", env=no_home, cwd=tmp_path)
    assert homeless.returncode == 2 and "DAGSTER_HOME" in homeless.stderr
    for bad in ({"MOSTOVIK_KEEP_RUNS_DAYS": "a year"},
                {"MOSTOVIK_KEEP_RUNS_DAYS": "7", "MOSTOVIK_KEEP_FAILED_RUN_OUTPUTS_DAYS": "14"}):
        refused = _run("prune", env={**job_env, **bad}, cwd=tmp_path)
        assert refused.returncode == 2 and "MOSTOVIK_KEEP_RUNS_DAYS" in refused.stderr, bad
    dry = _run("prune", "--dry-run", env=job_env, cwd=tmp_path)
    assert dry.returncode == 0 and dry.stdout.splitlines() == [
        "op outputs: would remove 0 run directories, 0 bytes",
        "landing: would remove 0 files, 0 bytes",
        "runs: would remove 0 runs with their event logs",
        "event log files: would remove 0 files of runs no longer in run storage, 0 bytes",
        "claim files: would remove 0 files of runs whose process died, 0 bytes"]
