"""The fence with two real ``dagster job execute`` processes: run 1, inside its fetch, loses its
route to the run storage (the holder alone: the warehouse, the landing and everyone else's run
storage stay up); run 2 takes the partition over and loads it; run 1, its fetch answered, writes
nothing and fails naming its lost claim once its route is back."""

from __future__ import annotations

import subprocess

import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from mostovik_pipelines_tests.support.postgres import PartitionableLink
from mostovik_pipelines_tests.support.processes import run_environment, start_job_execute
from mostovik_pipelines_tests.support.runs import step_failure_message
from mostovik_pipelines_tests.support.waiting import wait_for_hanging_request, wait_until
from mostovik_pipelines_tests.support.warehouse import table_rows

pytestmark = pytest.mark.slow
PARTITION = "2026-11-04"


def _run_with_a_step_started(instance: DagsterInstance, process: subprocess.Popen):
    def started():
        assert process.poll() is None, process.stdout.read()[-3000:]
        for record in instance.get_run_records(RunsFilter(job_name="cbr_daily_rates_job")):
            run_id = record.dagster_run.run_id
            if instance.get_records_for_run(run_id, of_type=DagsterEventType.STEP_START).records:
                return record.dagster_run
        return None

    return wait_until(started, 120, "run 1 in its first step")


def test_a_run_cut_off_from_the_run_storage_writes_nothing_after_another_took_over(
    tmp_path, pg_warehouse_url, standin_server, standin, production_home, monkeypatch
):
    home, storage_env = production_home
    for name, value in storage_env.items():
        monkeypatch.setenv(name, value)
    env = {**run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url), **storage_env}
    link = PartitionableLink(int(storage_env["MOSTOVIK_DAGSTER_PG_PORT"]))
    instance = DagsterInstance.from_config(str(home))
    standin.fault("hang", seconds=120, match="date_req=04/11/2026")
    first = start_job_execute(
        PARTITION, {**env, "MOSTOVIK_DAGSTER_PG_PORT": str(link.port)}, tmp_path)
    try:
        run_1 = _run_with_a_step_started(instance, first)
        wait_for_hanging_request(standin, "date_req=04/11/2026", limit=120)
        link.cut()

        second = start_job_execute(PARTITION, env, tmp_path)
        output, _ = second.communicate(timeout=240)
        run_2 = next(r for r in instance.get_runs(limit=2) if r.run_id != run_1.run_id)
        assert run_2.status == DagsterRunStatus.SUCCESS, output[-3000:]

        # Run 1 gets its answer now and goes on: it must write nothing.
        assert standin.release_hangs() == 1
        link.heal()
        output, _ = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
        link.cut()
    assert instance.get_run_by_id(run_1.run_id).status == DagsterRunStatus.FAILURE
    assert "lost its claim" in step_failure_message(instance, run_1.run_id), output[-3000:]
    rows = table_rows(pg_warehouse_url, "cbr_daily_rates")
    assert rows and {(r["loaded_by_run"], r["changed_by_run"]) for r in rows} == {
        (run_2.run_id, run_2.run_id)}
    landed = list((tmp_path / "data").rglob("fetches/*.json"))
    assert landed and not [f for f in landed if run_1.run_id in f.read_text()]
    assert not list((tmp_path / "data").rglob(f"{run_1.run_id}/**/*.pickle")) and not list(
        tmp_path.rglob(f"storage/{run_1.run_id}/*"))
