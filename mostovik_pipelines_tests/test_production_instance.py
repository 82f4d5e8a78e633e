"""The production instance config (deploy/dagster.yaml) on real PostgreSQL storage, driven the
way CI and operators drive it: ``dagster job execute`` in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from dagster import DagsterInstance, DagsterRunStatus, RunsFilter

from mostovik_pipelines_tests.support.warehouse import table_rows

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_dagster_job_execute_records_the_run_in_postgres_run_storage(
    production_home, postgres, pg_warehouse_url, standin_server, standin, tmp_path, monkeypatch
):
    home, environment = production_home
    environment |= {
        "MOSTOVIK_DATABASE_URL": pg_warehouse_url,
        "MOSTOVIK_CBR_URL": standin_server.cbr_url,
        "MOSTOVIK_DATA_DIR": str(tmp_path / "data"),
    }
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with DagsterInstance.from_config(str(home)):
        pass  # the instance's tables created, as on a deployed database
    sessions_before = _sessions(postgres, environment["MOSTOVIK_DAGSTER_PG_DB"])
    completed = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "job", "execute",
         "-m", "mostovik_pipelines", "-j", "cbr_daily_rates_job",
         "--tags", json.dumps({"dagster/partition": "2026-11-02"})],
        env={**os.environ, **environment}, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    # The instance storage keeps its connections (instance_storage.PooledPostgresStorage):
    # dagster-postgres alone opened one per storage call, ~100 for this run.
    opened = _sessions(postgres, environment["MOSTOVIK_DAGSTER_PG_DB"]) - sessions_before
    print(f"dagster job execute opened {opened} sessions on the instance database")
    assert 0 < opened <= 20, f"the run opened {opened} sessions on the instance database"

    with DagsterInstance.from_config(str(home)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.get_ref().storage).__name__ == "PooledPostgresStorage"
        runs = instance.get_runs(RunsFilter(job_name="cbr_daily_rates_job"))
        assert len(runs) == 1
        assert runs[0].status == DagsterRunStatus.SUCCESS
        assert runs[0].tags["dagster/partition"] == "2026-11-02"
        assert runs[0].tags["mostovik/source"] == "cbr_daily_rates"
        assert runs[0].tags["mostovik/job_type"] == "parser"
    assert len(table_rows(pg_warehouse_url, "cbr_daily_rates")) == 12


def _sessions(postgres, database: str) -> int:
    """Sessions ever established on ``database`` (PostgreSQL counts one as its backend ends)."""
    with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
        time.sleep(1.5)  # a backend reports its counters when it exits, within a second
        return int(connection.execute(
            "SELECT coalesce(sessions, 0) FROM pg_stat_database WHERE datname = %s",
            (database,)).fetchone()[0])
