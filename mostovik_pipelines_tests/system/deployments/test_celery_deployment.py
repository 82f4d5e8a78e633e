"""The production deployment end to end with real parts: deploy/dagster.yaml on PostgreSQL, a
password-protected Redis as Celery broker and result backend, two Celery workers started the way
deploy/ starts them, and runs driven by ``dagster job execute`` with ``MOSTOVIK_EXECUTOR=celery``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import psycopg
import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter
from dagster._core.events import RunFailureReason
from dagster._serdes import serialize_value

from mostovik_pipelines.framework.load.lock import partition_lock_keys
from mostovik_pipelines.platform.execution import OUTAGE_ENV, current_celery_task_id
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.deployments import (
    CASE_TAG,
    CBR_JOB,
    JOB,
    PARTITION_TAG,
    Deployment,
    business_rows,
    celery_submissions,
    held_fetch_settings,
    load_cleanly,
    step_workers,
    two_worker_deployment,
)
from mostovik_pipelines_tests.support.postgres import (
    ThrowawayPostgres,
    backend_waiting_on_a_lock,
    dsn_of,
)
from mostovik_pipelines_tests.support.redis import ThrowawayRedis
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    wait_for_hanging_request,
    wait_until,
)
from mostovik_pipelines_tests.support.warehouse import table_rows

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

BACKFILL = ["2026-11-02", "2026-11-03", "2026-11-04", "2026-11-05", "2026-11-06"]
KILLED_PARTITION = "2026-11-09"
RETRIED_PARTITION = "2026-11-10"
BROKER_RESTART = ["2026-11-16", "2026-11-17", "2026-11-18", "2026-11-19", "2026-11-20"]
BROKER_DOWN_SECONDS = 60
"""The promised bound: a fault that passes within a minute is ridden out."""
OUTAGE_BUDGET_PARTITION = "2026-11-23"


@pytest.fixture(scope="module")
def deployment(
    postgres: ThrowawayPostgres, redis_server: ThrowawayRedis, standin_server: StandinServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    """deploy/dagster.yaml on a fresh instance database, a fresh warehouse, shared storage and
    landing directories, and two workers, ``worker-a`` and ``worker-b``."""
    with two_worker_deployment(postgres, redis_server, standin_server,
                               tmp_path_factory.mktemp("celery_deployment"),
                               held_fetch_settings(PROCESS_START_MARGIN_SECONDS)) as deployment:
        yield deployment


def test_a_step_on_a_worker_knows_its_celery_task_id(deployment):
    assert current_celery_task_id() is None

    process = deployment.probe("task-id")
    assert deployment.finish(process) == 0, deployment.outputs[-1][-3000:]

    (task_id,) = deployment.probe_task_ids("task-id")
    assert task_id != "None"
    assert any(task_id in worker.succeeded_task_ids() for worker in deployment.workers.values())


def test_a_drained_worker_takes_no_new_steps(deployment):
    drained, serving = deployment.workers["worker-a"], deployment.workers["worker-b"]
    deployment.celery("control", "--timeout", "20", "--destination", drained.hostname,
                      "cancel_consumer", "dagster")
    try:
        processes = [deployment.probe("drained") for _ in range(3)]
        assert [deployment.finish(process) for process in processes] == [0, 0, 0]
    finally:
        deployment.celery("control", "--timeout", "20", "--destination", drained.hostname,
                          "add_consumer", "dagster")

    task_ids = deployment.probe_task_ids("drained")
    assert len(task_ids) == 3
    assert set(task_ids) <= set(serving.succeeded_task_ids())
    assert not set(task_ids) & set(drained.succeeded_task_ids())
    assert drained.hostname in deployment.celery(
        "inspect", "--timeout", "20", "--destination", drained.hostname, "ping"
    )


def test_a_backfill_spreads_over_two_workers_and_equals_the_in_process_result(
    deployment, standin, standin_server, pg_warehouse_url, tmp_path
):
    started = time.monotonic()
    processes = [deployment.start_run(*CBR_JOB, **{PARTITION_TAG: partition})
                 for partition in BACKFILL]
    codes = [deployment.finish(process) for process in processes]
    elapsed = time.monotonic() - started
    assert codes == [0] * len(BACKFILL), "\n".join(deployment.outputs[-5:])[-5000:]

    with deployment.instance() as instance:
        runs = instance.get_runs(RunsFilter(job_name=JOB, tags={PARTITION_TAG: BACKFILL}))
        assert sorted(run.tags[PARTITION_TAG] for run in runs) == BACKFILL
        assert {run.status for run in runs} == {DagsterRunStatus.SUCCESS}
        placements = [
            placement for run in runs for placement in step_workers(instance, run.run_id).items()
        ]
        stored = [
            serialize_value(record) for run in runs for record in instance.all_logs(run.run_id)
        ] + [
            json.dumps(run.run_config) + serialize_value(instance.get_job_snapshot(
                run.job_snapshot_id)) for run in runs
        ]
    per_worker = {name: sum(1 for _, host in placements if host == worker.hostname)
                  for name, worker in deployment.workers.items()}
    print(f"backfill of {len(BACKFILL)} partitions on celery: {elapsed:.1f} s; "
          f"steps per worker: {per_worker}")
    assert len(placements) == 3 * len(BACKFILL)
    assert all(count > 0 for count in per_worker.values()), per_worker

    load_cleanly(pg_warehouse_url, standin_server, tmp_path, BACKFILL)
    assert business_rows(deployment.warehouse_url) == business_rows(pg_warehouse_url)
    assert len(business_rows(pg_warehouse_url)) == 12 * len(BACKFILL)

    texts = stored + deployment.outputs + [w.log() for w in deployment.workers.values()]
    for secret in deployment.secrets:
        assert not any(secret in text for text in texts)


def test_a_transient_failure_is_retried_as_a_new_celery_task(deployment, standin):
    standin.fault("status", status=503, times=1)

    process = deployment.start_run(*CBR_JOB, **{PARTITION_TAG: RETRIED_PARTITION,
                                                CASE_TAG: "retried"})
    assert deployment.finish(process) == 0, deployment.outputs[-1][-3000:]

    with deployment.instance() as instance:
        (run,) = instance.get_runs(RunsFilter(tags={CASE_TAG: "retried"}))
        submissions = celery_submissions(instance, run.run_id)
    extract_tasks = [task for step, task in submissions if step.endswith("extract_cbr_daily_rates")]
    assert len(extract_tasks) == 2 and len(set(extract_tasks)) == 2
    assert len(submissions) == 4
    assert sum(1 for r in table_rows(deployment.warehouse_url, "cbr_daily_rates")
               if str(r["partition_date"]) == RETRIED_PARTITION) == 12


def test_a_run_waiting_for_another_does_not_starve_it_of_the_only_worker(deployment, standin):
    """One worker, one slot: the duplicate's wait is a step retry that gives the slot back, so
    the run it waits for still gets the worker for its next steps."""
    drained, serving = deployment.workers["worker-a"], deployment.workers["worker-b"]
    partition = "2026-11-12"
    # The first run holds the only worker in its fetch until the duplicate's first step waits
    # in the queue: once the fetch answers, that step is the next the worker takes, and finds
    # the first run in flight.
    standin.fault("hang", seconds=300, match="date_req=12/11/2026")
    deployment.celery("control", "--timeout", "20", "--destination", drained.hostname,
                      "cancel_consumer", "dagster")
    try:
        first = deployment.start_run(*CBR_JOB, **{PARTITION_TAG: partition, CASE_TAG: "first"})
        wait_for_hanging_request(standin, "date_req=12/11/2026")
        second = deployment.start_run(*CBR_JOB, **{PARTITION_TAG: partition,
                                                   CASE_TAG: "duplicate"})
        with deployment.instance() as instance:
            wait_until(lambda: any(
                celery_submissions(instance, run.run_id)
                for run in instance.get_runs(RunsFilter(tags={CASE_TAG: "duplicate"}))),
                PROCESS_START_MARGIN_SECONDS, "the duplicate's first step queued")
        standin.release_hangs()
        assert deployment.finish(first, timeout=120) == 0, deployment.outputs[-1][-3000:]
        assert deployment.finish(second, timeout=120) == 0, deployment.outputs[-1][-3000:]
    finally:
        deployment.celery("control", "--timeout", "20", "--destination", drained.hostname,
                          "add_consumer", "dagster")
    with deployment.instance() as instance:
        runs = [run for case in ("first", "duplicate")
                for run in instance.get_runs(RunsFilter(tags={CASE_TAG: case}))]
        # Whichever registered its run first is the older one (process start-up varies).
        older, younger = sorted(runs, key=lambda run: instance.get_run_record_by_id(
            run.run_id).create_timestamp)
        messages = [record.user_message for record in instance.all_logs(younger.run_id)]
    assert any(f"waiting for run(s) {older.run_id}" in m for m in messages)
    assert older.status == younger.status == DagsterRunStatus.SUCCESS
    assert serving.succeeded_task_ids()


@pytest.mark.long_outage
def test_a_broker_crash_while_steps_run_and_wait_on_celery_fails_no_run_and_loses_no_step(
    deployment, redis_server, standin, standin_server, pg_warehouse_url, tmp_path
):
    """Redis, broker and result backend, killed while two runs' first steps run on the two
    workers and three runs' steps wait in its queue, and started again 60 s later: the
    orchestrating processes wait it out, each step runs once, every run succeeds."""
    # The first two fetches are held until the broker is down: their workers finish them and
    # store the results during the outage.
    standin.fault("hang", seconds=300, match="/11/2026", times=2)
    processes = [deployment.start_run(*CBR_JOB, **{PARTITION_TAG: partition,
                                                   CASE_TAG: "broker-restart"})
                 for partition in BROKER_RESTART]
    wait_for_hanging_request(standin, "/11/2026", count=2)
    with deployment.instance() as instance:
        # Every run has submitted its first step: the three not running wait in the queue.
        wait_until(lambda: sum(bool(celery_submissions(instance, run.run_id)) for run in
                               instance.get_runs(RunsFilter(tags={CASE_TAG: "broker-restart"})))
                   == len(BROKER_RESTART), PROCESS_START_MARGIN_SECONDS * 2,
                   "every run's first step submitted to Celery", lambda: _runs_and_submissions(
                       instance, "broker-restart", standin, processes))
    redis_server.crash()
    crashed_at = time.monotonic()
    standin.release_hangs()
    time.sleep(max(0.0, BROKER_DOWN_SECONDS - (time.monotonic() - crashed_at)))  # the outage
    redis_server.start()

    outputs = [(deployment.finish(process, timeout=300), deployment.outputs[-1])
               for process in processes]
    assert [code for code, _ in outputs] == [0] * len(BROKER_RESTART), "\n".join(
        f"--- run of {partition} exited {code}:\n{output[-4000:]}"
        for partition, (code, output) in zip(BROKER_RESTART, outputs, strict=True) if code)
    with deployment.instance() as instance:
        runs = instance.get_runs(RunsFilter(tags={CASE_TAG: "broker-restart"}))
        assert {run.status for run in runs} == {DagsterRunStatus.SUCCESS}
        for run in runs:
            # Each of the three steps submitted once and run once: nothing lost, nothing twice.
            submitted = [step for step, _ in celery_submissions(instance, run.run_id)]
            assert sorted(submitted) == sorted(set(submitted)) and len(submitted) == 3, submitted
            started = [record.step_key for record in instance.all_logs(
                run.run_id, of_type=DagsterEventType.STEP_START)]
            assert sorted(started) == sorted(submitted), started
            # The orchestrating process's record of the outage: two engine events.
            messages = [record.dagster_event.message or "" for record in instance.all_logs(
                run.run_id, of_type=DagsterEventType.ENGINE_EVENT)]
            assert any(message.startswith("Celery broker or result backend unreachable")
                       for message in messages), (run.tags[PARTITION_TAG], messages)
            assert any(message.startswith("Celery broker and result backend reachable again")
                       for message in messages), (run.tags[PARTITION_TAG], messages)
    loaded = [r for r in business_rows(deployment.warehouse_url)
              if str(r["partition_date"]) in BROKER_RESTART]
    load_cleanly(pg_warehouse_url, standin_server, tmp_path, BROKER_RESTART)
    assert len(loaded) == 12 * len(BROKER_RESTART)
    assert loaded == business_rows(pg_warehouse_url)


def test_a_broker_away_past_the_outage_budget_fails_the_run_naming_the_broker(
    deployment, redis_server, standin
):
    """A run with a 5 s outage budget, Redis killed while its first step runs: the run fails
    as soon as the outage outlasts the budget, saying so; a re-run once Redis is back loads."""
    match = "date_req=23/11/2026"
    standin.fault("hang", seconds=300, match=match)
    process = deployment.start_run(*CBR_JOB, settings={OUTAGE_ENV: "5"},
                                   **{PARTITION_TAG: OUTAGE_BUDGET_PARTITION,
                                      CASE_TAG: "outage-budget"})
    wait_for_hanging_request(standin, match)
    redis_server.crash()
    try:
        standin.release_hangs()
        assert deployment.finish(process, timeout=120) != 0
    finally:
        redis_server.start()
    with deployment.instance() as instance:
        (run,) = instance.get_runs(RunsFilter(tags={CASE_TAG: "outage-budget"}))
        assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.FAILURE
        (failure,) = instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_FAILURE)
    error = failure.dagster_event.event_specific_data.error.to_string()
    assert "the Celery broker or result backend away for" in error
    assert f"past the 5 s a run rides out ({OUTAGE_ENV})" in error
    assert redis_server.password not in error

    rerun = deployment.start_run(*CBR_JOB, **{PARTITION_TAG: OUTAGE_BUDGET_PARTITION})
    assert deployment.finish(rerun) == 0, deployment.outputs[-1][-3000:]
    assert sum(1 for r in table_rows(deployment.warehouse_url, "cbr_daily_rates")
               if str(r["partition_date"]) == OUTAGE_BUDGET_PARTITION) == 12


def test_a_worker_killed_in_a_load_step_fails_the_run_and_a_rerun_is_exact(
    deployment, standin, standin_server, pg_warehouse_url, tmp_path
):
    # Hold the partition's business lock, so that the load stops inside its transaction.
    table_key, partition_key = partition_lock_keys("cbr_daily_rates", KILLED_PARTITION)
    holder = psycopg.connect(dsn_of(deployment.warehouse_url),
                             autocommit=True)
    try:
        holder.execute("SELECT pg_advisory_lock(%s, %s)", (table_key, partition_key))
        process = deployment.start_run(
            *CBR_JOB, **{PARTITION_TAG: KILLED_PARTITION, CASE_TAG: "worker-killed"}
        )
        assert backend_waiting_on_a_lock(holder, "%pg_advisory_xact_lock%", timeout=90), (
            "the load never reached its lock")
        with deployment.instance() as instance:
            (run,) = instance.get_runs(RunsFilter(tags={CASE_TAG: "worker-killed"}))
            hostname = step_workers(instance, run.run_id)["cbr_daily_rates.load_cbr_daily_rates"]
        victim = next(w for w in deployment.workers.values() if w.hostname == hostname)
        victim.kill()
        killed_at = time.monotonic()
    finally:
        holder.execute("SELECT pg_advisory_unlock_all()")
        holder.close()

    assert deployment.finish(process, timeout=120) != 0
    failed_after = time.monotonic() - killed_at
    print(f"run failed {failed_after:.1f} s after {victim.name} was killed")
    with deployment.instance() as instance:
        failed = instance.get_run_by_id(run.run_id)
        assert failed.status == DagsterRunStatus.FAILURE
        failure = next(
            record for record in instance.all_logs(run.run_id, of_type=DagsterEventType.RUN_FAILURE)
        )
    failure_data = failure.dagster_event.event_specific_data
    assert f"its worker {hostname} has not answered" in failure_data.error.to_string()
    # An infrastructure failure, not a step failure: the daemon's run retries re-run it.
    assert failure_data.failure_reason == RunFailureReason.RUN_EXCEPTION
    assert [r for r in table_rows(deployment.warehouse_url, "cbr_daily_rates")
            if str(r["partition_date"]) == KILLED_PARTITION] == []

    # Recovery: a replacement worker joins, and a plain re-run of the partition completes.
    deployment.start_worker("worker-c").wait_ready()
    rerun = deployment.start_run(*CBR_JOB, **{PARTITION_TAG: KILLED_PARTITION})
    assert deployment.finish(rerun) == 0, deployment.outputs[-1][-3000:]

    load_cleanly(pg_warehouse_url, standin_server, tmp_path, [KILLED_PARTITION])
    loaded = [r for r in business_rows(deployment.warehouse_url)
              if str(r["partition_date"]) == KILLED_PARTITION]
    assert len(loaded) == 12
    assert loaded == business_rows(pg_warehouse_url)


def _runs_and_submissions(instance: DagsterInstance, case: str, standin,
                          processes: list[subprocess.Popen]) -> str:
    """For a failed wait: each run of ``case`` with its status and submitted steps, the
    requests hanging at the stand-in, and the output of any run process that has ended."""
    runs = instance.get_runs(RunsFilter(tags={CASE_TAG: case}))
    ended = [f"process {process.pid} exited {process.returncode}:\n"
             f"{process.communicate()[0][-3000:]}"
             for process in processes if process.poll() is not None]
    return "\n".join([f"{run.tags.get(PARTITION_TAG)} {run.run_id} {run.status.value}: "
                      f"{celery_submissions(instance, run.run_id)}" for run in runs]
                     + [f"hanging: {standin.hanging()}", *ended])
