"""The run storage away for the promised 60 s just as the daemon launches a queued run, with the
real ``dagster-daemon`` and ``dagster-webserver`` on the production instance (deploy/dagster.yaml,
the daemon's environment from its systemd unit).

The daemon launches a queued run by asking the code server to start it (gRPC ``StartRun``) and
waits for the run's process to say it has started: that process first opens the instance and
reads the run, so while the run storage is away it waits the outage out and the daemon's call
waits with it. Past Dagster's default gRPC deadline (60 s) the daemon gave up on the call, took
the code server for unreachable and marked the run failed ("marked as failed from outside the
execution context"); the deadline the daemon's unit sets now outlasts the storage's outage
budget, so the run starts once the database is back and succeeds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import DagsterEventType

from mostovik_pipelines import definitions
from mostovik_pipelines.platform.instance_storage import DEFAULT_OUTAGE_SECONDS
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.instances import fresh_deployment
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until
from mostovik_pipelines_tests.support.webserver import (
    DagsterServices,
    daemon_unit_environment,
    processes_in_group,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

JOB = f"{cbr_daily_rates.SOURCE.name}_job"
PARTITION = "2026-11-20"
OUTAGE_SECONDS = 60.0
"""The bound the deployment promises to ride out (docs/operations.md)."""
RUN_WORKER_MARK = "spawn_main"
"""In the command line of a process the code server spawns to execute a run."""


@pytest.fixture
def deployment(postgres: ThrowawayPostgres, standin_server: StandinServer,
               tmp_path: Path) -> Iterator[tuple[DagsterServices, ThrowawayPostgres]]:
    """Webserver and daemon on a production instance whose run storage is a PostgreSQL server
    of its own (to be stopped), the warehouse a fresh clone on the tests' server."""
    run_storage = ThrowawayPostgres().start()
    try:
        with fresh_deployment(postgres, standin_server, tmp_path, "outage",
                              instance_server=run_storage) as (home, environment):
            environment.update({"MOSTOVIK_STORAGE_DIR": str(tmp_path / "storage"),
                                "MOSTOVIK_LANDING_DIR": str(tmp_path / "landing")})
            with DagsterServices(
                    tmp_path, home, environment,
                    stopped_schedules=[s.name for s in definitions.defs.schedules or ()],
            ) as services:
                yield services, run_storage
    finally:
        run_storage.stop()


def test_the_daemon_waits_out_a_longer_launch_than_the_storage_outage_budget():
    """The daemon's gRPC deadline (its unit's ``DAGSTER_GRPC_TIMEOUT_SECONDS``) outlasts a run
    process waiting out the run storage's outage budget, with room to start the process."""
    deadline = float(daemon_unit_environment()["DAGSTER_GRPC_TIMEOUT_SECONDS"])
    assert deadline >= DEFAULT_OUTAGE_SECONDS + PROCESS_START_MARGIN_SECONDS


@pytest.mark.timeout(900)
@pytest.mark.long_outage
def test_a_run_storage_outage_of_60_s_as_the_daemon_launches_a_queued_run_is_ridden_out(
        deployment):
    services, run_storage = deployment
    run_id = services.graphql.launch_job_run(JOB, PARTITION)
    daemon_group = services.daemon_group
    workers_before = _run_workers(daemon_group)

    # The daemon is inside StartRun: the code server has spawned the run's process, which has
    # not read the run storage yet (it is still importing).
    wait_until(lambda: _run_workers(daemon_group) - workers_before,
               PROCESS_START_MARGIN_SECONDS, "the run's process spawned",
               diagnostics=services.log_tails, poll=0.02)
    run_storage.down_for(OUTAGE_SECONDS)

    run = services.graphql.wait_for_run(run_id)
    assert run.status == "SUCCESS", services.graphql.run_errors(run_id)
    with services.instance() as instance:
        materialised = [
            record.event_log_entry.dagster_event.partition
            for record in instance.get_records_for_run(
                run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records]
    assert materialised == [PARTITION]


def _run_workers(group: int) -> set[int]:
    workers = set()
    for pid in processes_in_group(group):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if RUN_WORKER_MARK.encode() in command:
            workers.add(pid)
    return workers
