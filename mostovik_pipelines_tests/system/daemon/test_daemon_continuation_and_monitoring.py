"""The daemon's own work, with the real ``dagster-daemon`` and ``dagster-webserver`` on the
production instance (deploy/dagster.yaml on PostgreSQL):

* a UI backfill of many runs goes on after the daemon's whole process tree was killed between
  two of its runs: the restarted daemon launches the rest, each partition once;
* run monitoring fails a live ``dagster job execute`` run past its ``dagster/max_runtime``, and
  no other run of its partition works until that process has ended.

The run queue launches one run at a time here (``max_concurrent_runs: 1``) and counts every run
in progress, the ones ``dagster job execute`` starts included: a ``dagster job execute`` run held
in its fetch keeps the backfill's other runs queued, so the daemon dies between two of them.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from datetime import date, timedelta
from pathlib import Path

import pytest
import yaml
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunRecord, RunsFilter

from mostovik_pipelines.core.tags import PARTITION_TAG, run_partitions
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.support import daily_runs_location
from mostovik_pipelines_tests.support.graphql import BACKFILL_LIMIT_SECONDS, RUN_LIMIT_SECONDS
from mostovik_pipelines_tests.support.instances import fresh_deployment, fresh_warehouse
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.processes import DAGSTER
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    limit_for,
    wait_for_hanging_request,
    wait_until,
)
from mostovik_pipelines_tests.support.warehouse import table_rows
from mostovik_pipelines_tests.support.webserver import DagsterServices

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ASSET = cbr_daily_rates.SOURCE.name
JOB = f"{ASSET}_job"
BACKFILL_ID_TAG = "dagster/backfill"
MAX_RUNTIME_TAG = "dagster/max_runtime"
MONITORING_POLL_SECONDS = 1
"""The tests' run monitoring pass (deploy/dagster.yaml: 60 s)."""
FETCH_TIMEOUT_SECONDS = 300
"""The CBR client's timeout here: a fetch held at the stand-in waits for the test, not for the
source's 30 s."""
BACKFILL_DAYS = [(date(2026, 10, 6) + timedelta(days=n)).isoformat() for n in range(6)]
BLOCKER_DAY = "2026-10-20"
"""The day of the ``dagster job execute`` run that holds the run queue's one slot."""
MONITORED_DAY = "2026-10-27"
MAX_RUNTIME_SECONDS = 5
IN_FLIGHT = {
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
    DagsterRunStatus.CANCELING,
}
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
ROW_COLUMNS = (
    "partition_date",
    "rate_date",
    "cbr_id",
    "num_code",
    "char_code",
    "nominal",
    "name",
    "value",
    "unit_rate",
)


@pytest.fixture(scope="module")
def services(
    postgres: ThrowawayPostgres,
    standin_server: StandinServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[DagsterServices]:
    """Webserver and daemon on a fresh production instance and warehouse, serving the CBR source
    backfilled one run per day, the run queue launching one run at a time, run monitoring
    passing every :data:`MONITORING_POLL_SECONDS`."""
    work_dir = tmp_path_factory.mktemp("daemon")
    with fresh_deployment(postgres, standin_server, work_dir, "daemon") as (home, environment):
        settings = yaml.safe_load((home / "dagster.yaml").read_text())
        settings["concurrency"]["runs"]["max_concurrent_runs"] = 1
        settings["run_monitoring"]["poll_interval_seconds"] = MONITORING_POLL_SECONDS
        (home / "dagster.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
        environment["MOSTOVIK_CBR_TIMEOUT_SECONDS"] = str(FETCH_TIMEOUT_SECONDS)
        with DagsterServices(
            work_dir,
            home,
            environment,
            code_location_module=daily_runs_location.__name__,
            stopped_schedules=[s.name for s in daily_runs_location.defs.schedules or ()],
        ) as running:
            yield running


@pytest.fixture
def instance(services: DagsterServices) -> Iterator[DagsterInstance]:
    """The deployment's instance, as the operator's tools open it."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in services.environment.items():
            patch.setenv(name, value)
        with DagsterInstance.from_config(str(services.dagster_home)) as opened:
            yield opened


@pytest.mark.timeout(900)
def test_a_daemon_killed_between_a_backfills_runs_launches_the_rest_each_partition_once(
    services, instance, standin, postgres, standin_server, tmp_path
):
    """A UI backfill of six runs (one per day); its first run succeeded, the five others wait in
    the queue behind a ``dagster job execute`` run, and the daemon's whole process tree (daemon,
    code server, run workers) is killed. Started again, the daemon launches the five, the
    backfill completes, each day loaded by one run, the table as a clean load."""
    # The backfill's first run is held in its fetch until the blocker holds the queue's slot;
    # the blocker fetches from a stand-in of its own, so each is let go on its own.
    standin.fault("hang", seconds=FETCH_TIMEOUT_SECONDS, match="date_req=")
    backfill_id = services.graphql.launch_partition_backfill([ASSET], BACKFILL_DAYS)
    wait_for_hanging_request(standin, "date_req=", limit=BACKFILL_LIMIT_SECONDS)
    blocker_source = StandinServer().start()
    try:
        blocker_standin = StandinClient(blocker_source.url)
        blocker_standin.fault("hang", seconds=FETCH_TIMEOUT_SECONDS)
        blocker = _job_execute(
            services,
            tmp_path,
            BLOCKER_DAY,
            environment={"MOSTOVIK_CBR_URL": blocker_source.cbr_url},
        )
        wait_for_hanging_request(blocker_standin)
        standin.release_hangs()
        at_kill = wait_until(
            lambda: _between_two_runs(instance, backfill_id),
            RUN_LIMIT_SECONDS,
            "the backfill's first run finished and the others queued",
            services.log_tails,
        )

        killed = services.kill_daemon(with_its_group=True)
        restarted_at = time.time()
        services.start_daemon()
        blocker_standin.release_hangs()
        output, _ = blocker.communicate(timeout=RUN_LIMIT_SECONDS)
        assert blocker.returncode == 0, output[-3000:]
    finally:
        blocker_source.stop()

    backfill = services.graphql.wait_for_backfill(backfill_id)
    records = _backfill_runs(instance, backfill_id)
    statuses = Counter(record.dagster_run.status for record in records)
    print(
        f"killed {len(killed)} processes of the daemon's group with the runs {dict(at_kill)}; "
        f"after the restart: {statuses}, backfill {backfill.status}"
    )
    # The daemon and the code server it started, at least.
    assert len(killed) >= 2, f"the daemon's process tree: {killed}"
    assert at_kill[DagsterRunStatus.SUCCESS] >= 1 and at_kill[DagsterRunStatus.QUEUED] >= 1
    assert backfill.status == "COMPLETED_SUCCESS", (backfill, services.log_tails())
    assert statuses == {DagsterRunStatus.SUCCESS: len(BACKFILL_DAYS)}, statuses
    runs_per_day = Counter(
        day
        for record in records
        for day in run_partitions(record.dagster_run.tags, cbr_daily_rates.SOURCE.partitions_def)
    )
    assert runs_per_day == dict.fromkeys(BACKFILL_DAYS, 1)
    # What only the restarted daemon can have done: launch the runs still queued at the kill.
    launched_after = [record for record in records if record.start_time > restarted_at]
    assert (
        len(launched_after)
        == at_kill[DagsterRunStatus.QUEUED]
        == len(BACKFILL_DAYS)
        - len([record for record in records if record.start_time < restarted_at])
    )
    assert _stored_rows(services, BACKFILL_DAYS) == _clean_load(
        postgres, standin_server, tmp_path, BACKFILL_DAYS
    )


@pytest.mark.timeout(900)
def test_run_monitoring_fails_a_live_run_past_its_max_runtime_and_no_duplicate_works_meanwhile(
    services, instance, standin, postgres, standin_server, tmp_path
):
    """A ``dagster job execute`` run tagged ``dagster/max_runtime`` 5 s is held in its fetch; the
    daemon's run monitoring marks it failed while its process lives on. A second run of the same
    day waits for it (its claim is held), works only once the first process has loaded and
    ended, and finds the day loaded: the table as a clean load."""
    standin.fault("hang", seconds=FETCH_TIMEOUT_SECONDS, match=_query(MONITORED_DAY))
    first = _job_execute(
        services, tmp_path, MONITORED_DAY, tags={MAX_RUNTIME_TAG: str(MAX_RUNTIME_SECONDS)}
    )
    try:
        wait_for_hanging_request(standin, _query(MONITORED_DAY))
        [live] = instance.get_runs(RunsFilter(tags={PARTITION_TAG: MONITORED_DAY}))
        wait_until(
            lambda: instance.get_run_by_id(live.run_id).status == DagsterRunStatus.FAILURE,
            MAX_RUNTIME_SECONDS + limit_for(MONITORING_POLL_SECONDS),
            "run monitoring failed the run past its max runtime",
            services.log_tails,
        )
        assert first.poll() is None, "the run's process ended: nothing left to prove"
        messages = _messages(instance, live.run_id)
        assert any(
            f"exceeding maximum runtime of {MAX_RUNTIME_SECONDS} seconds" in message
            for message in messages
        ), messages

        second = _job_execute(services, tmp_path, MONITORED_DAY)
        duplicate = wait_until(
            lambda: _run_waiting_for(instance, live.run_id),
            PROCESS_START_MARGIN_SECONDS,
            "the second run waiting for the first",
        )
        assert first.poll() is None
        assert _stored_rows(services, [MONITORED_DAY]) == []
        assert not _materialisations(instance, duplicate)
        standin.release_hangs()
        first_output, _ = first.communicate(timeout=RUN_LIMIT_SECONDS)
        second_output, _ = second.communicate(timeout=RUN_LIMIT_SECONDS)
    finally:
        for process in (first, *([second] if "second" in locals() else [])):
            if process.poll() is None:
                process.kill()
    assert second.returncode == 0, second_output[-3000:]

    [loaded_by_first] = _materialisations(instance, live.run_id)
    [checked_by_second] = _materialisations(instance, duplicate)
    print(
        "run monitoring on the first run:",
        [
            m
            for m in _messages(instance, live.run_id)
            if "runtime" in m or "grpc" in m or "fail" in m
        ],
    )
    print(
        f"first run {live.run_id}: {instance.get_run_by_id(live.run_id).status}, exit "
        f"{first.returncode}; second {duplicate}: {instance.get_run_by_id(duplicate).status}"
    )
    assert instance.get_run_by_id(duplicate).status == DagsterRunStatus.SUCCESS
    # No run of the day but these two: the daemon's run retries do not re-launch it either.
    assert {
        run.run_id for run in instance.get_runs(RunsFilter(tags={PARTITION_TAG: MONITORED_DAY}))
    } == {live.run_id, duplicate}
    # The second run's load came after the first's, and found nothing to change.
    assert checked_by_second.timestamp > loaded_by_first.timestamp
    metadata = checked_by_second.asset_materialization.metadata
    assert metadata["unchanged"].value == len(_stored_rows(services, [MONITORED_DAY])) > 0
    assert _stored_rows(services, [MONITORED_DAY]) == _clean_load(
        postgres, standin_server, tmp_path, [MONITORED_DAY]
    )


# --- helpers ----------------------------------------------------------------------------------


def _job_execute(
    services: DagsterServices,
    cwd: Path,
    day: str,
    tags: Mapping[str, str] | None = None,
    environment: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """``dagster job execute`` of the CBR job for ``day`` on the deployment's instance, as CI
    runs it (it does not pass through the run queue)."""
    return subprocess.Popen(
        [
            DAGSTER,
            "job",
            "execute",
            "-m",
            "mostovik_pipelines",
            "-j",
            JOB,
            "--tags",
            json.dumps({PARTITION_TAG: day, **(tags or {})}),
        ],
        env={**services.environment, **(environment or {})},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _backfill_runs(instance: DagsterInstance, backfill_id: str) -> list[RunRecord]:
    return list(instance.get_run_records(RunsFilter(tags={BACKFILL_ID_TAG: backfill_id})))


def _between_two_runs(instance: DagsterInstance, backfill_id: str) -> Counter | None:
    """The backfill's runs per status once one has succeeded, none is in flight and one or more
    wait in the queue."""
    statuses = Counter(
        record.dagster_run.status for record in _backfill_runs(instance, backfill_id)
    )
    if (
        statuses[DagsterRunStatus.SUCCESS]
        and statuses[DagsterRunStatus.QUEUED]
        and not any(statuses[status] for status in IN_FLIGHT)
    ):
        return statuses
    return None


def _messages(instance: DagsterInstance, run_id: str) -> list[str]:
    return [
        record.event_log_entry.message or ""
        for record in instance.get_records_for_run(run_id).records
    ]


def _run_waiting_for(instance: DagsterInstance, run_id: str) -> str | None:
    """The id of a run whose log says it waits for ``run_id``."""
    for record in instance.get_run_records(RunsFilter(tags={PARTITION_TAG: MONITORED_DAY})):
        other = record.dagster_run.run_id
        if other != run_id and any(
            f"waiting for run(s) {run_id}" in message for message in _messages(instance, other)
        ):
            return other
    return None


def _materialisations(instance: DagsterInstance, run_id: str) -> list:
    return [
        record.event_log_entry
        for record in instance.get_records_for_run(
            run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION
        ).records
    ]


def _stored_rows(services: DagsterServices, days: list[str]) -> list[tuple]:
    return _rows(services.environment["MOSTOVIK_DATABASE_URL"], days)


def _rows(url: str, days: list[str]) -> list[tuple]:
    wanted = {date.fromisoformat(day) for day in days}
    return [
        tuple(row[column] for column in ROW_COLUMNS)
        for row in table_rows(url, ASSET)
        if row["partition_date"] in wanted
    ]


def _clean_load(
    postgres: ThrowawayPostgres, standin_server: StandinServer, work_dir: Path, days: list[str]
) -> list[tuple]:
    """The rows one clean run per day loads into an empty warehouse, from the same stand-in."""
    database = f"wh_clean_{uuid.uuid4().hex[:8]}"
    with fresh_warehouse(postgres, database) as url:
        job = code_location_for(
            url, standin_server, work_dir / database, [cbr_daily_rates.SOURCE]
        ).resolve_job_def(JOB)
        for day in days:
            with DagsterInstance.ephemeral() as instance:
                assert job.execute_in_process(
                    partition_key=day, instance=instance, run_config=QUIET
                ).success
        return _rows(url, days)


def _query(day: str) -> str:
    """How the CBR source asks for ``day``: what a stand-in fault's ``match`` reads."""
    return f"date_req={date.fromisoformat(day):%d/%m/%Y}"
