"""A dead run is seen on every launch path, by the real daemon on the production instance: a run
whose worker is killed with ``kill -9`` mid-run is marked failed within a minute; a
daemon-launched one is retried once by the daemon's run retries and the table ends exact; a
``dagster job execute`` one is not retried (Dagster does not retry those). A live run whose
claim connection the database drops is never marked.

Who marks it: a daemon-launched run's worker killed alone is failed by the code server that
started it (Dagster's own, naming the signal); one that dies with its code server and daemon,
and a ``dagster job execute`` run, are marked by the ``dead_runs`` sensor, as an infrastructure
failure (``dagster/failure_reason`` ``UNEXPECTED_TERMINATION``) naming why.

Each run's fetch is held at the stand-in, so the run is mid-run, in its extract step, when it
is killed or its connection is cut; the step reports its process id (the run worker's, with
the in-process executor) as an engine event, which is how the test finds what to kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo

import psycopg
import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from mostovik_pipelines.core.tags import REASON_TAG, REQUESTED_BY_TAG
from mostovik_pipelines.framework.runs.alerts import ALERT_INTERVAL_SECONDS
from mostovik_pipelines.framework.runs.dead_runs import (
    CONFIRM_SECONDS,
    DEAD_RUNS_SENSOR,
    INTERVAL_SECONDS,
)
from mostovik_pipelines.platform.claims import _postgres_dsn
from mostovik_pipelines.platform.tracking import load_job
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.graphql import RUN_LIMIT_SECONDS
from mostovik_pipelines_tests.support.instances import fresh_deployment
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, dsn_of
from mostovik_pipelines_tests.support.processes import DAGSTER
from mostovik_pipelines_tests.support.run_queue import (
    assert_retried_once,
    retries_of,
    the_one_retry,
)
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    limit_for,
    wait_for_hanging_request,
    wait_until,
)
from mostovik_pipelines_tests.support.webhook import WebhookReceiver
from mostovik_pipelines_tests.support.webserver import DagsterServices

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

JOB = "cbr_daily_rates_job"
RATES_PER_DATE = 12
MOSCOW = ZoneInfo("Europe/Moscow")
MARKED_WITHIN_SECONDS = 60.0
"""What the issue asks: a dead run is marked failed within a minute of its process's death."""
FAILURE_REASON_TAG = "dagster/failure_reason"


def _last_week(weekday: int) -> date:
    today = datetime.now(MOSCOW).date()
    return today - timedelta(days=today.weekday() + 7) + timedelta(days=weekday)


# Tuesday to Saturday of last week carry rates of their own (see standin/cbr.py).
CUT_DATE, KILLED_DATE, LOST_DATE, EXECUTE_DATE, CANCELLED_DATE = (
    _last_week(1), _last_week(2), _last_week(3), _last_week(4), _last_week(5))
BEFORE_STEP_DATE = _last_week(1) - timedelta(days=7)
WHO, WHY = "a.petrova", "the source was down on Wednesday"
SIGNED = {REQUESTED_BY_TAG: WHO, REASON_TAG: WHY}


@pytest.fixture(scope="module")
def services(postgres: ThrowawayPostgres, standin_server: StandinServer, webhook: WebhookReceiver,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterServices]:
    """Webserver and daemon on a fresh production instance (run retries on, once) and a fresh
    warehouse; a held fetch waits for the test, not for the source's 30 s timeout."""
    work_dir = tmp_path_factory.mktemp("dead_runs")
    with fresh_deployment(postgres, standin_server, work_dir, "dead") as (home, environment):
        environment.update({
            "MOSTOVIK_CBR_TIMEOUT_SECONDS": "600",
            "MOSTOVIK_ALERT_WEBHOOK_URL": webhook.url,
        })
        with DagsterServices(work_dir, home, environment) as running:
            running.graphql.wait_for_sensor_tick(DEAD_RUNS_SENSOR, INTERVAL_SECONDS)
            yield running


@pytest.fixture(scope="module")
def instance(services: DagsterServices) -> Iterator[DagsterInstance]:
    """The instance the services run on, as this process reads it (run storage)."""
    with services.instance() as opened:
        yield opened


def _query(day: date) -> str:
    return f"date_req={day:%d/%m/%Y}"


def _held_run(services: DagsterServices, instance: DagsterInstance, standin, day: date,
              run_id: str | None = None) -> tuple[str, int]:
    """Once the run of ``day`` (``run_id``, or the one run of the job for it) is held at the
    stand-in inside its extract step: its id and the process id its step reported."""
    wait_for_hanging_request(standin, _query(day), limit=RUN_LIMIT_SECONDS)

    def step_pid() -> tuple[str, int] | None:
        ids = [run_id] if run_id else [run.run_id for run in instance.get_runs(RunsFilter(
            job_name=JOB, tags={"dagster/partition": day.isoformat()}))]
        for found in ids:
            processes = load_job(instance, found, ALL_SOURCES).processes
            if processes:
                return found, int(next(iter(processes.values())).rsplit(" pid ", 1)[1])
        return None

    return wait_until(step_pid, PROCESS_START_MARGIN_SECONDS, f"the step of {day} reported",
                      services.log_tails)


def _kill_and_time_the_mark(services: DagsterServices, instance: DagsterInstance,
                            run_id: str, pid: int) -> float:
    """``kill -9`` the run's process; seconds until run storage says the run failed."""
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: instance.get_run_by_id(run_id).status is DagsterRunStatus.FAILURE,
               MARKED_WITHIN_SECONDS + PROCESS_START_MARGIN_SECONDS,
               f"run {run_id} marked failed", services.log_tails, poll=0.5)
    return time.monotonic() - killed_at


def _failure_message(instance: DagsterInstance, run_id: str) -> str:
    [record] = instance.get_records_for_run(run_id, of_type=DagsterEventType.RUN_FAILURE).records
    return record.event_log_entry.dagster_event.message


def _rows(warehouse_url: str, day: date) -> int:
    with psycopg.connect(dsn_of(warehouse_url)) as connection:
        return connection.execute("SELECT count(*) FROM cbr_daily_rates WHERE partition_date = %s",
                                  (day,)).fetchone()[0]


def test_a_live_run_whose_claim_connection_is_cut_for_a_moment_is_not_marked_failed(
    services, instance, standin
):
    standin.fault("hang", seconds=600, match=_query(CUT_DATE))
    run_id = services.graphql.launch_job_run(JOB, CUT_DATE.isoformat())
    _held_run(services, instance, standin, CUT_DATE, run_id)
    dsn = _postgres_dsn(instance)
    with psycopg.connect(dsn, autocommit=True) as connection:
        cut = [pid for (pid, terminated) in connection.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
            "AND mode = 'ShareLock' AND granted AND database = (SELECT oid FROM pg_database "
            "WHERE datname = current_database())").fetchall() if terminated]
    assert cut, "the run's claim connection was found and cut"
    # Looks enough to have confirmed a free claim, had it stayed free.
    ticks = int(CONFIRM_SECONDS // INTERVAL_SECONDS) + 2
    services.graphql.wait_for_more_ticks(DEAD_RUNS_SENSOR, ticks, INTERVAL_SECONDS)
    assert instance.get_run_by_id(run_id).status is DagsterRunStatus.STARTED

    standin.clear_faults()
    standin.release_hangs()
    finished = services.graphql.wait_for_run(run_id)
    assert finished.status == "SUCCESS", services.graphql.run_errors(run_id)
    assert _rows(services.environment["MOSTOVIK_DATABASE_URL"], CUT_DATE) == RATES_PER_DATE


def _engine_messages(instance: DagsterInstance, run_id: str) -> list[str]:
    return [record.event_log_entry.dagster_event.message for record in instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ENGINE_EVENT).records]


def _retried_once_and_exact(services: DagsterServices, instance: DagsterInstance, run_id: str,
                            day: date) -> None:
    """The daemon's run retries ran the failed run again once, the retry succeeded and carries
    the run's signature, and the partition holds exactly what one clean run loads."""
    assert instance.get_run_by_id(run_id).tags["dagster/will_retry"] == "true"
    retry = the_one_retry(services, instance, run_id, (WHO, WHY))
    # Once, and only once: later looks of the sensor and the daemon add nothing.
    services.graphql.wait_for_more_ticks(DEAD_RUNS_SENSOR, 2, INTERVAL_SECONDS)
    assert_retried_once(instance, run_id, retry)
    assert _rows(services.environment["MOSTOVIK_DATABASE_URL"], day) == RATES_PER_DATE


def test_a_daemon_launched_run_whose_worker_is_killed_is_failed_within_a_minute_and_retried_once(
    services, instance, standin, webhook
):
    """The worker alone dies (the out-of-memory killer): the code server that started it is
    alive and fails the run itself, naming the signal; the daemon retries it."""
    standin.fault("hang", seconds=600, match=_query(KILLED_DATE))
    run_id = services.graphql.launch_job_run(JOB, KILLED_DATE.isoformat(), SIGNED)
    _, pid = _held_run(services, instance, standin, KILLED_DATE, run_id)
    standin.clear_faults()  # the retry's fetch is answered

    seconds = _kill_and_time_the_mark(services, instance, run_id, pid)
    print(f"run {run_id} marked failed {seconds:.1f} s after the kill")
    assert seconds < MARKED_WITHIN_SECONDS, f"marked failed after {seconds:.0f} s"
    standin.release_hangs()
    killed = f"Run execution process for {run_id} was terminated by signal 9 (SIGKILL)."
    messages = _engine_messages(instance, run_id)
    assert any(killed in message for message in messages), "\n".join(messages)
    # The run list's status of the run that died says so too (set by run_failure_alerts).
    wait_until(lambda: instance.get_run_by_id(run_id).tags.get("mostovik/status") == "failed",
               limit_for(ALERT_INTERVAL_SECONDS), f"run {run_id} tagged failed",
               services.log_tails)
    assert [alert for alert in webhook.alerts if alert["run_id"] == run_id] == [], (
        "no alert for a run the daemon retries")
    _retried_once_and_exact(services, instance, run_id, KILLED_DATE)


def test_a_daemon_launched_run_whose_worker_and_daemon_die_is_marked_by_the_dead_run_sensor(
    services, instance, standin
):
    """The worker dies with the code server that started it and the daemon (a lost host,
    systemd's restart of the daemon's unit): nothing of Dagster's is left to notice, and the
    run storage says "started". Once the daemon is back, the dead-run sensor marks the run
    failed within a minute, as an infrastructure failure naming why, and it is retried once."""
    standin.fault("hang", seconds=600, match=_query(LOST_DATE))
    run_id = services.graphql.launch_job_run(JOB, LOST_DATE.isoformat(), SIGNED)
    _held_run(services, instance, standin, LOST_DATE, run_id)
    standin.clear_faults()
    services.kill_daemon(with_its_group=True)
    standin.release_hangs()
    services.start_daemon()
    back_at = time.monotonic()
    assert instance.get_run_by_id(run_id).status is DagsterRunStatus.STARTED

    wait_until(lambda: instance.get_run_by_id(run_id).status is DagsterRunStatus.FAILURE,
               MARKED_WITHIN_SECONDS + PROCESS_START_MARGIN_SECONDS,
               f"run {run_id} marked failed", services.log_tails, poll=0.5)
    seconds = time.monotonic() - back_at
    print(f"run {run_id} marked failed {seconds:.1f} s after the daemon was back")
    assert seconds < MARKED_WITHIN_SECONDS, f"marked failed {seconds:.0f} s after the restart"
    failed = instance.get_run_by_id(run_id)
    assert failed.tags[FAILURE_REASON_TAG] == "UNEXPECTED_TERMINATION"
    assert failed.tags["mostovik/status"] == "failed"
    assert "no live process has held the run's claim" in _failure_message(instance, run_id)
    _retried_once_and_exact(services, instance, run_id, LOST_DATE)


def test_a_dagster_job_execute_run_killed_mid_run_is_marked_failed_and_not_retried(
    services, instance, standin, webhook
):
    standin.fault("hang", seconds=600, match=_query(EXECUTE_DATE))
    process = subprocess.Popen(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", JOB, "--tags",
         json.dumps({"dagster/partition": EXECUTE_DATE.isoformat(), **SIGNED})],
        env=services.environment, cwd=services.work_dir, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        run_id, pid = _held_run(services, instance, standin, EXECUTE_DATE)
        seconds = _kill_and_time_the_mark(services, instance, run_id, pid)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=60)
    standin.clear_faults()
    standin.release_hangs()
    print(f"run {run_id} marked failed {seconds:.1f} s after the kill")
    assert seconds < MARKED_WITHIN_SECONDS, f"marked failed after {seconds:.0f} s"
    failed = instance.get_run_by_id(run_id)
    assert failed.tags[FAILURE_REASON_TAG] == "UNEXPECTED_TERMINATION"
    assert failed.tags["dagster/will_retry"] == "false"
    assert "not retried" in _failure_message(instance, run_id)
    services.graphql.wait_for_more_ticks(DEAD_RUNS_SENSOR, 2, INTERVAL_SECONDS)
    assert retries_of(instance, run_id) == []
    assert instance.get_run_by_id(run_id).status is DagsterRunStatus.FAILURE
    assert _rows(services.environment["MOSTOVIK_DATABASE_URL"], EXECUTE_DATE) == 0
    # Its alert, sent by the dead-run sensor (run_failure_alerts sees only runs launched
    # through the code location), once, with who asked for it and why.
    [alert] = [alert for alert in webhook.alerts if alert["run_id"] == run_id]
    assert (alert["kind"], alert["source"], alert["period"]) == (
        "run_failure", "cbr_daily_rates", EXECUTE_DATE.isoformat())
    assert (alert["requested_by"], alert["reason"]) == (WHO, WHY)
    assert "not retried" in alert["message"]



def _start_job_execute(services: DagsterServices, day: date,
                       environment: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", JOB, "--tags",
         json.dumps({"dagster/partition": day.isoformat()})],
        env=environment or services.environment, cwd=services.work_dir,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _steps_started(instance: DagsterInstance, run_id: str) -> int:
    return len(instance.get_records_for_run(run_id, of_type=DagsterEventType.STEP_START).records)


def test_a_run_killed_before_its_first_step_is_marked_failed_within_a_minute(
    services, instance, redis_server
):
    """A ``dagster job execute`` run on Celery whose first step waits in the queue (no worker
    serves it) is killed: it started and holds no step, and its claims died with it. The
    dead-run sensor, which looked at a run that had started no step only 60 s after its start
    (marked 70-80 s after the kill), marks it within a minute of the kill."""
    on_celery = {**services.environment, "MOSTOVIK_EXECUTOR": "celery",
                 "MOSTOVIK_CELERY_BROKER_URL": redis_server.url(7),
                 "MOSTOVIK_CELERY_BACKEND_URL": redis_server.url(8)}
    process = _start_job_execute(services, BEFORE_STEP_DATE, on_celery)
    try:
        def submitted() -> str | None:
            for run in instance.get_runs(RunsFilter(job_name=JOB, tags={
                    "dagster/partition": BEFORE_STEP_DATE.isoformat()})):
                if any("is celery task" in message
                       for message in _engine_messages(instance, run.run_id)):
                    return run.run_id
            return None

        run_id = wait_until(submitted, PROCESS_START_MARGIN_SECONDS,
                            "the run's first step submitted to Celery", services.log_tails)
        os.killpg(process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=60)
    wait_until(lambda: instance.get_run_by_id(run_id).status is DagsterRunStatus.FAILURE,
               MARKED_WITHIN_SECONDS + PROCESS_START_MARGIN_SECONDS,
               f"run {run_id} marked failed", services.log_tails, poll=0.5)
    seconds = time.monotonic() - killed_at
    print(f"run {run_id}, killed before its first step, marked failed {seconds:.1f} s after "
          "the kill")
    assert seconds < MARKED_WITHIN_SECONDS, f"marked failed after {seconds:.0f} s"
    assert _steps_started(instance, run_id) == 0
    failed = instance.get_run_by_id(run_id)
    assert failed.tags[FAILURE_REASON_TAG] == "UNEXPECTED_TERMINATION"
    assert failed.tags["mostovik/status"] == "failed"


def test_a_run_killed_while_it_is_being_cancelled_is_marked_cancelled_within_a_minute(
    services, instance, standin, webhook
):
    """An operator cancels a ``dagster job execute`` run (the UI's Terminate: nothing can stop
    its process, which goes on, cancelling) and its process is then killed: the run stayed
    cancelling until run monitoring's cancel timeout (300 s). The dead-run sensor leaves it
    alone while its process lives and marks it cancelled within a minute of the kill; its job
    status says failed, and no alert goes out (someone chose to cancel it)."""
    standin.fault("hang", seconds=600, match=_query(CANCELLED_DATE))
    process = _start_job_execute(services, CANCELLED_DATE)
    try:
        run_id, pid = _held_run(services, instance, standin, CANCELLED_DATE)
        instance.run_coordinator.cancel_run(run_id)
        assert instance.get_run_by_id(run_id).status is DagsterRunStatus.CANCELING
        ticks = int(CONFIRM_SECONDS // INTERVAL_SECONDS) + 2
        services.graphql.wait_for_more_ticks(DEAD_RUNS_SENSOR, ticks, INTERVAL_SECONDS)
        assert instance.get_run_by_id(run_id).status is DagsterRunStatus.CANCELING
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: instance.get_run_by_id(run_id).status is DagsterRunStatus.CANCELED,
                   MARKED_WITHIN_SECONDS + PROCESS_START_MARGIN_SECONDS,
                   f"run {run_id} marked cancelled", services.log_tails, poll=0.5)
        seconds = time.monotonic() - killed_at
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=60)
        standin.clear_faults()
        standin.release_hangs()
    print(f"run {run_id}, killed while cancelling, marked cancelled {seconds:.1f} s after the "
          "kill")
    assert seconds < MARKED_WITHIN_SECONDS, f"marked cancelled after {seconds:.0f} s"
    assert instance.get_run_by_id(run_id).tags["mostovik/status"] == "failed"
    assert retries_of(instance, run_id) == []
    assert [alert for alert in webhook.alerts if alert["run_id"] == run_id] == []
