"""One run per source and partition, whatever launched it: real `dagster` processes sharing one
instance and one PostgreSQL warehouse."""

from __future__ import annotations

import os
import signal
import time
from datetime import date

import psycopg
import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from mostovik_pipelines_tests.support.postgres import backend_waiting_on_a_lock, dsn_of
from mostovik_pipelines_tests.support.processes import (
    run_environment,
    start_job_execute,
    start_range_materialize,
)
from mostovik_pipelines_tests.support.runs import load_metadata
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    wait_for_hanging_request,
    wait_until,
)
from mostovik_pipelines_tests.support.warehouse import physical_snapshot, table_rows

pytestmark = pytest.mark.slow
PARTITION = "2026-11-04"


@pytest.fixture
def env(tmp_path, pg_warehouse_url, standin_server, standin):
    return run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url)


def _instance(env) -> DagsterInstance:
    # The run's instance, opened from its home; the worker's environment keeps no DAGSTER_HOME
    # for later tests to pick up.
    return DagsterInstance.from_config(env["DAGSTER_HOME"])


def _messages(instance: DagsterInstance, run_id: str) -> list[str]:
    return [r.event_log_entry.user_message for r in instance.get_records_for_run(run_id).records]


def _wait_for_a_run_waiting(instance: DagsterInstance) -> str:
    """The run id of a run whose log says it is waiting for another run of its partition."""
    def waiting() -> str | None:
        for record in instance.get_run_records(RunsFilter(job_name="cbr_daily_rates_job")):
            run_id = record.dagster_run.run_id
            if any("waiting for run(s)" in m for m in _messages(instance, run_id)):
                return run_id
        return None
    return wait_until(waiting, PROCESS_START_MARGIN_SECONDS, "a run waiting for another")


def _finish(process, timeout: float = 180) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]
    return output


def test_two_executions_of_one_partition_load_once_and_the_younger_waits(
    env, tmp_path, pg_warehouse_url, standin, monkeypatch
):
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    # The first run to fetch is held in its fetch until the other is seen waiting for it.
    standin.fault("hang", seconds=300, times=1)
    first = start_job_execute(PARTITION, env, tmp_path)
    second = start_job_execute(PARTITION, env, tmp_path)
    instance = _instance(env)
    wait_for_hanging_request(standin)
    _wait_for_a_run_waiting(instance)
    standin.release_hangs()
    _finish(first), _finish(second)

    records = sorted(instance.get_run_records(RunsFilter(job_name="cbr_daily_rates_job")),
                     key=lambda r: r.create_timestamp)
    older, younger = (r.dagster_run for r in records)
    assert older.status == younger.status == DagsterRunStatus.SUCCESS
    assert any(f"waiting for run(s) {older.run_id}" in m
               for m in _messages(instance, younger.run_id))
    assert not any("waiting for run" in m for m in _messages(instance, older.run_id))
    assert load_metadata(instance, older.run_id)["inserted"] == 12
    assert load_metadata(instance, younger.run_id)["unchanged"] == 12
    assert len(table_rows(pg_warehouse_url, "cbr_daily_rates")) == 12


def test_a_live_run_that_run_monitoring_failed_still_holds_its_partition(
    env, tmp_path, pg_warehouse_url, standin, monkeypatch
):
    """Run monitoring marks a `dagster job execute` run past its max runtime failed without
    being able to stop it: while its process lives and loads, a duplicate must wait for it."""
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    standin.fault("hang", seconds=300, times=1)
    first = start_job_execute(PARTITION, env, tmp_path)
    wait_for_hanging_request(standin)
    instance = _instance(env)
    [live] = instance.get_runs(RunsFilter(job_name="cbr_daily_rates_job"))
    instance.report_run_failed(live, "past dagster/max_runtime")  # what run monitoring does
    assert instance.get_run_by_id(live.run_id).status == DagsterRunStatus.FAILURE

    second = start_job_execute(PARTITION, env, tmp_path)
    assert _wait_for_a_run_waiting(instance) != live.run_id
    standin.release_hangs()
    first.communicate(timeout=180)  # its own outcome is past recording: storage says failed
    _finish(second)
    younger = next(r for r in instance.get_runs() if r.run_id != live.run_id)
    assert younger.status == DagsterRunStatus.SUCCESS
    assert any(f"waiting for run(s) {live.run_id}" in m
               for m in _messages(instance, younger.run_id))
    assert load_metadata(instance, younger.run_id)["unchanged"] == 12
    assert len(table_rows(pg_warehouse_url, "cbr_daily_rates")) == 12


def test_executions_of_different_partitions_do_not_wait_for_each_other(
    env, tmp_path, pg_warehouse_url, standin, monkeypatch
):
    standin.fault("hang", seconds=300, times=1, match="date_req=04/11/2026")
    standin.fault("hang", seconds=300, times=1, match="date_req=05/11/2026")
    processes = [start_job_execute(p, env, tmp_path) for p in (PARTITION, "2026-11-05")]
    # Both inside their fetch at once: neither waited for the other to get there.
    wait_for_hanging_request(standin, "date_req=", count=2)
    standin.release_hangs()
    for process in processes:
        _finish(process)
    instance = _instance(env)
    for record in instance.get_run_records(RunsFilter(job_name="cbr_daily_rates_job")):
        assert record.dagster_run.status == DagsterRunStatus.SUCCESS
        assert not any("waiting for run" in m
                       for m in _messages(instance, record.dagster_run.run_id))
    assert len(table_rows(pg_warehouse_url, "cbr_daily_rates")) == 24


def test_a_run_during_a_backfill_over_its_partition_waits_and_the_table_is_consistent(
    env, tmp_path, pg_warehouse_url, standin
):
    standin.fault("hang", seconds=300, times=1, match="date_req=03/11/2026")
    backfill = start_range_materialize("2026-11-02", "2026-11-06", env, tmp_path)
    wait_for_hanging_request(standin, "date_req=03/11/2026")  # the backfill is under way
    single = start_job_execute(PARTITION, env, tmp_path)
    instance = _instance(env)
    _wait_for_a_run_waiting(instance)
    standin.release_hangs()
    _finish(backfill), _finish(single)

    runs = instance.get_runs()
    assert {r.status for r in runs} == {DagsterRunStatus.SUCCESS}
    single_run = next(r for r in runs if r.tags.get("dagster/partition") == PARTITION)
    assert any("waiting for run(s)" in m for m in _messages(instance, single_run.run_id))
    rows = table_rows(pg_warehouse_url, "cbr_daily_rates")
    assert len(rows) == 60
    assert len({(r["partition_date"], r["char_code"]) for r in rows}) == 60


def test_a_run_killed_while_holding_the_lock_leaves_the_partition_as_before(
    env, tmp_path, pg_warehouse_url, standin
):
    first = start_job_execute(PARTITION, env, tmp_path)
    _finish(first)
    before = physical_snapshot(pg_warehouse_url, "cbr_daily_rates")
    standin.change_cbr_rates(PARTITION, set_values={"USD": "70,0000"})

    # Block the run's UPDATE on a row lock while it holds the partition's advisory lock.
    blocker = psycopg.connect(dsn_of(pg_warehouse_url))
    blocker.execute("SELECT 1 FROM cbr_daily_rates WHERE partition_date = %s FOR UPDATE",
                    (date.fromisoformat(PARTITION),))
    observer = psycopg.connect(dsn_of(pg_warehouse_url), autocommit=True)
    doomed = start_job_execute(PARTITION, env, tmp_path)
    backend = backend_waiting_on_a_lock(observer, "UPDATE%cbr_daily_rates%")
    assert backend is not None, "the run never reached its UPDATE"
    # The partition's lock, and the table's writes lock held shared (load_ledger).
    assert _advisory_locks_held(observer, backend) == 2

    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait()
    blocker.rollback()
    blocker.close()
    _wait_until(lambda: _advisory_locks_held(observer, None) == 0)
    observer.close()
    assert physical_snapshot(pg_warehouse_url, "cbr_daily_rates") == before

    recovery = start_job_execute(PARTITION, env, tmp_path)
    _finish(recovery, timeout=60)
    instance = _instance(env)
    latest = instance.get_runs(limit=1)[0]
    assert latest.status == DagsterRunStatus.SUCCESS
    assert not any("waiting for run" in m for m in _messages(instance, latest.run_id))
    usd = next(r for r in table_rows(pg_warehouse_url, "cbr_daily_rates")
               if r["char_code"] == "USD")
    assert usd["value"] == 70
    killed = instance.get_runs(limit=2)[1]
    assert killed.status in (DagsterRunStatus.STARTED, DagsterRunStatus.FAILURE)
    assert instance.get_records_for_run(
        killed.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records == []


def _advisory_locks_held(observer, pid: int | None) -> int:
    query = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
    if pid is None:
        return observer.execute(query).fetchone()[0]
    return observer.execute(query + " AND pid = %s", (pid,)).fetchone()[0]


def _wait_until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)
