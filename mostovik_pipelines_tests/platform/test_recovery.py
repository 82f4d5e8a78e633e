"""Recovery never goes back in time and nothing dead holds a partition, on the launch paths an
operator uses: `dagster job execute`, `dagster asset materialize`, `mostovik jobs rerun` (queued:
the daemon launches it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import date
from decimal import Decimal
from pathlib import Path
from urllib.parse import unquote

import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from mostovik_pipelines.core.outages import Store, setting_of
from mostovik_pipelines.framework.steps.lifecycle import CONCURRENT_RUN_POLL_SECONDS
from mostovik_pipelines.platform.in_flight import LAUNCH_GRACE_SECONDS
from mostovik_pipelines.platform.status import STATUS_TAG
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import (
    DAGSTER,
    run_environment,
    start_job_execute,
    start_range_materialize,
)
from mostovik_pipelines_tests.support.run_queue import run_queue_daemon
from mostovik_pipelines_tests.support.warehouse import table_rows

pytestmark = pytest.mark.slow
PARTITION = "2026-11-04"
MOSTOVIK = str(Path(sys.executable).parent / "mostovik")


@pytest.fixture
def env(tmp_path, pg_warehouse_url, standin_server, standin):
    return run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url)


def _instance(env: dict[str, str]) -> DagsterInstance:
    # The run's instance, opened from its home; the worker's environment keeps no DAGSTER_HOME
    # for later tests to pick up.
    return DagsterInstance.from_config(env["DAGSTER_HOME"])


def _finish(process: subprocess.Popen, timeout: float = 180) -> str:
    output, _ = process.communicate(timeout=timeout)
    return output


def _rerun(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """``mostovik jobs rerun ... --wait``: queued, launched by the daemon, followed to its end."""
    with run_queue_daemon(env, Path(env["DAGSTER_HOME"]).parent / "daemon"):
        return subprocess.run([MOSTOVIK, "jobs", "rerun", *args, "--wait"], env=env,
                              capture_output=True, text=True, timeout=300)


def _values(url: str, day: str) -> dict[str, Decimal]:
    return {r["char_code"]: Decimal(str(r["value"])) for r in table_rows(url, "cbr_daily_rates")
            if r["partition_date"] == date.fromisoformat(day)}


def _newest_run(instance: DagsterInstance):
    return instance.get_runs(limit=1)[0]


@pytest.mark.timeout(900)  # the daemon started for the queued re-run
def test_an_old_failed_run_reexecuted_after_a_newer_load_leaves_the_newer_figures(
    env, tmp_path, pg_warehouse_url, standin
):
    # The old run fetches 70 for USD, then cannot reach the warehouse and fails in load.
    standin.change_cbr_rates(PARTITION, set_values={"USD": "70,0000"})
    # (Away for good here: the step's outage budget is cut to seconds, not the 90 s a
    # failover gets.)
    unreachable = {**env, "MOSTOVIK_DATABASE_URL":
                   f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/nowhere",
                   setting_of(Store.WAREHOUSE): "3"}
    _finish(start_job_execute(PARTITION, unreachable, tmp_path))
    instance = _instance(env)
    old = _newest_run(instance)
    assert old.status == DagsterRunStatus.FAILURE
    [failure] = instance.all_logs(old.run_id, of_type=DagsterEventType.STEP_FAILURE)
    assert f"past the 3 s a run rides out ({setting_of(Store.WAREHOUSE)})" in (
        failure.dagster_event.step_failure_data.error.message)

    # The source corrects its figures and a new run loads them.
    standin.change_cbr_rates(PARTITION, set_values={"USD": "75,5000"})
    _finish(start_job_execute(PARTITION, env, tmp_path))
    assert _values(pg_warehouse_url, PARTITION)["USD"] == Decimal("75.5000")

    # Re-executing the old run from its failure must not put its 70 back.
    rerun = _rerun(env, old.run_id)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert _values(pg_warehouse_url, PARTITION)["USD"] == Decimal("75.5000")
    again = _newest_run(instance)
    assert again.parent_run_id == old.run_id
    assert again.status == DagsterRunStatus.SUCCESS


@pytest.mark.timeout(900)  # the daemon started for the queued re-run
def test_a_failed_ranged_run_reexecuted_from_failure_reloads_exactly_its_failed_partitions(
    env, tmp_path, pg_warehouse_url, standin, postgres
):
    # Two partitions of the range fail for good: one in extract, one in transform.
    standin.fault("status", status=404, times=-1, match="date_req=03/11/2026")
    standin.fault("malformed", times=-1, match="date_req=05/11/2026")
    first = _finish(start_range_materialize("2026-11-02", "2026-11-06", env, tmp_path))
    instance = _instance(env)
    failed = _newest_run(instance)
    assert failed.status == DagsterRunStatus.FAILURE, first[-2000:]
    loaded = {r["partition_date"].isoformat() for r in table_rows(pg_warehouse_url,
                                                                  "cbr_daily_rates")}
    assert loaded == {"2026-11-02", "2026-11-04", "2026-11-06"}

    standin.clear_faults()
    standin.forget_requests()
    rerun = _rerun(env, failed.run_id)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    asked = sorted(unquote(r["query"]) for r in standin.requests("cbr"))
    assert asked == ["date_req=03/11/2026", "date_req=05/11/2026"], asked
    rows = table_rows(pg_warehouse_url, "cbr_daily_rates")
    assert len(rows) == 5 * 12
    assert len({(r["partition_date"], r["char_code"]) for r in rows}) == 5 * 12
    assert _newest_run(instance).tags.get(STATUS_TAG) == "completed"


def test_a_rejected_rate_keeps_the_stored_one_and_the_job_is_partial(
    env, tmp_path, pg_warehouse_url, standin
):
    _finish(start_job_execute(PARTITION, env, tmp_path))
    before = _values(pg_warehouse_url, PARTITION)
    standin.change_cbr_rates(PARTITION, set_values={"USD": "n/a", "EUR": "101,0000"},
                             remove=["JPY"])
    _finish(start_job_execute(PARTITION, env, tmp_path))
    after = _values(pg_warehouse_url, PARTITION)
    assert after["USD"] == before["USD"], "a garbled reply erased a good rate"
    assert after["EUR"] == Decimal("101.0000")
    assert "JPY" not in after, "a currency the source no longer sends must go"
    run = _newest_run(_instance(env))
    assert run.status == DagsterRunStatus.SUCCESS
    assert run.tags[STATUS_TAG] == "partial"
    shown = subprocess.run([MOSTOVIK, "jobs", "show", run.run_id, "--json"], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert json.loads(shown)["totals"]["rejected"] == 1


KILL_POINTS = {
    "run_start": (DagsterEventType.RUN_START, None),
    "step_start": (DagsterEventType.STEP_START, None),
    "extract": (DagsterEventType.STEP_START, "hang"),
}


@pytest.mark.parametrize(("kill_at", "instance_kind"), [
    ("run_start", "sqlite"), ("step_start", "sqlite"), ("extract", "sqlite"),
    ("run_start", "postgres"), ("extract", "postgres"),
])
def test_a_killed_run_frees_its_partition_within_seconds_wherever_it_ran(
    kill_at, instance_kind, env, tmp_path, pg_warehouse_url, standin, production_home,
    monkeypatch
):
    if instance_kind == "postgres":
        env = {**env, **production_home[1]}
        for name, value in production_home[1].items():
            monkeypatch.setenv(name, value)
    event_type, fault = KILL_POINTS[kill_at]
    if fault:
        standin.fault("hang", seconds=60, match="date_req=04/11/2026")
    doomed = subprocess.Popen(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", "cbr_daily_rates_job",
         "--tags", json.dumps({"dagster/partition": PARTITION})],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    instance = _instance(env)
    try:
        dead = _wait_for_event(instance, event_type, doomed)
    finally:
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
    # What it said about its host and process says nothing about whether it lives.
    instance.add_run_tags(dead.run_id, {"mostovik/host": "another-host", "mostovik/pid": "1"})
    assert instance.get_run_by_id(dead.run_id).status in (
        DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED)
    standin.clear_faults()

    dead_record = instance.get_run_record_by_id(dead.run_id)
    last_changed = max(dead_record.create_timestamp.timestamp(),
                       dead_record.update_timestamp.timestamp(), dead_record.start_time or 0.0)

    output = _finish(start_job_execute(PARTITION, env, tmp_path), timeout=120)
    follower = next(r for r in instance.get_runs(limit=2) if r.run_id != dead.run_id)
    assert follower.status == DagsterRunStatus.SUCCESS, output[-3000:]
    # The follower's own record of each time it found the dead run alive: a run that started a
    # step is dead at once; one killed before it only within the launch grace after its last
    # change (a wait is logged right after its check, within a poll).
    waits = [entry.timestamp for entry in instance.all_logs(follower.run_id)
             if f"waiting for run(s) {dead.run_id}" in (entry.user_message or "")]
    if kill_at == "run_start":
        bound = last_changed + LAUNCH_GRACE_SECONDS + CONCURRENT_RUN_POLL_SECONDS
        assert all(at <= bound for at in waits), (
            f"the dead run held its partition {max(waits) - last_changed:.0f} s after its last "
            f"change, past the {LAUNCH_GRACE_SECONDS:.0f} s launch grace")
    else:
        assert waits == [], "a run killed after its first step held its partition"
    assert len(_values(pg_warehouse_url, PARTITION)) == 12


def _wait_for_event(instance: DagsterInstance, event_type: DagsterEventType,
                    process: subprocess.Popen, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the run ended before it could be killed"
        for record in instance.get_run_records(RunsFilter(job_name="cbr_daily_rates_job")):
            if instance.get_records_for_run(record.dagster_run.run_id,
                                            of_type=event_type).records:
                return record.dagster_run
        time.sleep(0.02)
    raise AssertionError(f"no {event_type.value} within {timeout}s")
