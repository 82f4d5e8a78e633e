"""`mostovik prune` between a failed run and its re-execution, as an operator runs them: inside
the window the re-execution is exact; once the run's op outputs are pruned it fails at once,
naming the run and the setting, and the table keeps what a later run loaded."""

from __future__ import annotations

import subprocess
import sys
from datetime import date
from decimal import Decimal
from pathlib import Path

import pytest
from dagster import DagsterInstance, DagsterRunStatus

from mostovik_pipelines.core.outages import Store, setting_of
from mostovik_pipelines.core.settings import KEEP_FAILED_RUN_OUTPUTS_ENV, RETENTION_GRACE_ENV
from mostovik_pipelines.platform.tracking import load_job
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import run_environment, start_job_execute
from mostovik_pipelines_tests.support.run_queue import run_queue_daemon
from mostovik_pipelines_tests.support.warehouse import table_rows

pytestmark = pytest.mark.slow
MOSTOVIK = str(Path(sys.executable).parent / "mostovik")


@pytest.fixture
def env(tmp_path, pg_warehouse_url, standin_server, standin, monkeypatch):
    """The runs' environment; this process reads their instance too (restored after the test,
    so no later test of the worker opens it)."""
    environment = run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url)
    monkeypatch.setenv("DAGSTER_HOME", environment["DAGSTER_HOME"])
    return environment


def _mostovik(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MOSTOVIK, *args], env=env, capture_output=True, text=True,
                          timeout=180)


def _rerun(env: dict[str, str], run_id: str) -> subprocess.CompletedProcess:
    """``mostovik jobs rerun RUN_ID --wait``: queued, launched by the daemon, followed to its
    end."""
    return subprocess.run([MOSTOVIK, "jobs", "rerun", run_id, "--wait"], env=env,
                          capture_output=True, text=True, timeout=300)


def _fail_in_load(partition: str, env: dict[str, str], tmp_path: Path) -> str:
    """A run that fetches and parses the partition, then cannot reach the warehouse."""
    unreachable = {**env, "MOSTOVIK_DATABASE_URL":
                   f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/nowhere",
                   setting_of(Store.WAREHOUSE): "3"}
    start_job_execute(partition, unreachable, tmp_path).communicate(timeout=180)
    run = DagsterInstance.get().get_runs(limit=1)[0]
    assert run.status == DagsterRunStatus.FAILURE
    return run.run_id


def _values(url: str, day: str) -> dict[str, Decimal]:
    return {r["char_code"]: Decimal(str(r["value"])) for r in table_rows(url, "cbr_daily_rates")
            if r["partition_date"] == date.fromisoformat(day)}


@pytest.mark.timeout(900)
def test_a_failed_run_reexecutes_inside_the_window_and_not_once_its_outputs_are_pruned(
    env, tmp_path, pg_warehouse_url, standin
):
    with run_queue_daemon(env, tmp_path / "daemon"):  # launches the queued re-runs
        _reexecute_inside_then_past_the_window(env, tmp_path, pg_warehouse_url, standin)


def _reexecute_inside_then_past_the_window(env, tmp_path, pg_warehouse_url, standin) -> None:
    storage = Path(env["MOSTOVIK_DATA_DIR"]) / "storage"
    failed = _fail_in_load("2026-11-04", env, tmp_path)

    # Inside the window: a prune (and its dry run, which reports the same) keeps its outputs.
    dry = _mostovik(env, "prune", "--dry-run")
    pruned = _mostovik(env, "prune")
    assert dry.returncode == pruned.returncode == 0, dry.stderr + pruned.stderr
    assert dry.stdout.replace("would remove", "removed") == pruned.stdout
    assert "op outputs: removed 0 run directories, 0 bytes" in pruned.stdout
    assert (storage / failed).is_dir()
    rerun = _rerun(env, failed)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert len(_values(pg_warehouse_url, "2026-11-04")) == 12

    # A run that failed, then a newer load of its partition, then the prune takes its outputs.
    standin.change_cbr_rates("2026-11-05", set_values={"USD": "70,0000"})
    too_old = _fail_in_load("2026-11-05", env, tmp_path)
    standin.change_cbr_rates("2026-11-05", set_values={"USD": "75,5000"})
    start_job_execute("2026-11-05", env, tmp_path).communicate(timeout=180)
    assert _values(pg_warehouse_url, "2026-11-05")["USD"] == Decimal("75.5000")
    now_expired = {**env, KEEP_FAILED_RUN_OUTPUTS_ENV: "0", RETENTION_GRACE_ENV: "0"}
    pruned = _mostovik(now_expired, "prune")
    assert pruned.returncode == 0, pruned.stderr
    assert not (storage / too_old).exists()
    assert not [path for path in storage.iterdir()], "every finished run's outputs went"

    rerun = _rerun(env, too_old)
    assert rerun.returncode == 1, rerun.stdout + rerun.stderr
    job = load_job(DagsterInstance.get(), rerun.stdout.split()[0], ALL_SOURCES)
    said = " ".join([job.errors[0].message, *job.errors[0].causes])
    assert f"run {too_old}" in said and KEEP_FAILED_RUN_OUTPUTS_ENV in said, said
    assert "OpOutputPruned" in said
    assert _values(pg_warehouse_url, "2026-11-05")["USD"] == Decimal("75.5000")

    # Nothing more to remove, and the operator's job list still reads.
    assert "op outputs: removed 0" in _mostovik(now_expired, "prune").stdout
    assert _mostovik(env, "jobs", "list").returncode == 0
