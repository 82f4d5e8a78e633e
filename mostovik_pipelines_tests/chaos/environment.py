"""The parser suite's workspace (:class:`ChaosEnvironment`): the harness's workspace of the CBR
job (:mod:`.harness`) with a reference database beside it, the stand-in source, and the
operator's re-executions:

* :meth:`ChaosEnvironment.start_cli_rerun` starts a re-execution of a failed run from its failure
  in a process of its own (``rerun_from_failure``: what ``mostovik jobs rerun RUN_ID`` queues for
  the daemon, executed in that process, so a kill -9 takes the run).
* :meth:`ChaosEnvironment.start_warm_reexecution` forks and re-executes a finished run in the
  child, from its failure (``rerun_from_failure``, what ``mostovik jobs rerun`` calls) or all of
  its steps (``dagster.execute_job`` with ``ReexecutionOptions``), the job reconstructed from
  ``mostovik_pipelines.defs`` as in a process started with the workspace's CLI environment.

Runs of one partition or a range start and die as in every suite: ``start_warm``,
``start_cli`` and :meth:`~.harness.RunHandle.kill`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import sys
import traceback
import uuid
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    ReexecutionOptions,
    RunsFilter,
    execute_job,
)
from dagster._core.definitions.reconstruct import ReconstructableJob, ReconstructableRepository

from mostovik_pipelines import definitions
from mostovik_pipelines.core.errors import OUTAGE_KINDS
from mostovik_pipelines.core.outages import StoreAway
from mostovik_pipelines.core.tags import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG
from mostovik_pipelines.framework.steps.lifecycle import CONCURRENT_RUN_POLL_SECONDS
from mostovik_pipelines.platform.in_flight import LAUNCH_GRACE_SECONDS
from mostovik_pipelines.platform.recovery import (
    CODE_LOCATION_ATTRIBUTE,
    CODE_LOCATION_MODULE,
    PROCESS_TAG_PREFIXES,
    rerun_from_failure,
)
from mostovik_pipelines.platform.status import STATUS_TAG
from mostovik_pipelines.platform.tracking import load_job
from mostovik_pipelines.resources import HttpSourceResource
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.chaos.harness import (
    ATTEMPT_TAG,
    RunHandle,
    Workspace,
    create_database,
    drop_database,
    exit_child,
    location_of,
    log_to,
)
from mostovik_pipelines_tests.support.locations import FAST_RETRY
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.processes import RERUN_IN_PROCESS

DRIVER_CONNECTION_ERRORS = ("OperationalError", "InterfaceError", "AdminShutdown",
                            "Connection refused", "server closed the connection")
"""What the warehouse's driver says of a connection it lost or could not open."""
SOURCE = cbr_daily_rates.SOURCE.name
JOB = f"{SOURCE}_job"
WARM_TIMEOUT_SECONDS = 1.0
CLI_TIMEOUT_SECONDS = 2.0
CLOCK_SLACK = timedelta(seconds=1)
"""Run storage's creation times come from the same clock, at a coarser resolution."""


class ChaosEnvironment(Workspace):
    """The CBR job's workspace, its reference database and the stand-in; :meth:`close`
    removes all of it."""

    def __init__(self, postgres: ThrowawayPostgres | None = None,
                 standin_server: StandinServer | None = None, keep: bool = False,
                 template: str | None = None) -> None:
        """``template``: a migrated database to clone the two databases from (else both are
        migrated here)."""
        self._own_postgres = postgres is None
        self._own_standin = standin_server is None
        postgres = postgres or ThrowawayPostgres().start()
        self.standin_server = standin_server or StandinServer().start()
        self.standin = StandinClient(self.standin_server.url)
        self.reference_database = f"chaosref_{uuid.uuid4().hex[:8]}"
        fast = dataclasses.replace(cbr_daily_rates.SOURCE, extract_retry=FAST_RETRY,
                                   load_retry=FAST_RETRY)
        cbr_url = self.standin_server.cbr_url

        def wiring(_root: Path) -> tuple[HttpSourceResource, dict[str, str]]:
            return (HttpSourceResource(base_url=cbr_url, timeout_seconds=WARM_TIMEOUT_SECONDS),
                    {"MOSTOVIK_CBR_URL": cbr_url,
                     "MOSTOVIK_CBR_TIMEOUT_SECONDS": str(CLI_TIMEOUT_SECONDS)})

        try:
            super().__init__(postgres, fast, wiring, template=template, keep=keep)
            self.reference_url = create_database(postgres, self.reference_database, template)
        except BaseException:
            self._stop_servers(postgres)
            raise
        self.reference_job = location_of(
            fast, self.reference_url, self.root / "reference", self.resource,
        ).resolve_job_def(JOB)

    # --- starting runs ------------------------------------------------------------------------

    def start_reference_run(self, partitions: tuple[str, ...]) -> RunHandle:
        """A run of the partitions on the reference database, on an instance of its own."""
        return self.start_warm(partitions, job=self.reference_job, ephemeral=True)

    def start_cli_rerun(self, run_id: str) -> RunHandle:
        """The failed run re-executed from its failure, in a process of its own."""
        attempt = uuid.uuid4().hex[:12]
        log_path = self.logs / f"cli-rerun-{attempt}.log"
        started_at = datetime.now(UTC)
        process = self.start_process([sys.executable, "-c", RERUN_IN_PROCESS, run_id], log_path)
        return RunHandle("cli", self.partitions_of(run_id), attempt, process, log_path,
                         parent_run_id=run_id, started_at=started_at)

    def start_warm_reexecution(self, run_id: str, from_failure: bool) -> RunHandle:
        """The finished run re-executed in a forked child: from its failure, or all steps."""
        attempt = uuid.uuid4().hex[:12]
        log_path = self.logs / f"warm-rerun-{attempt}.log"
        started_at = datetime.now(UTC)
        process = multiprocessing.get_context("fork").Process(
            target=_reexecution_child,
            args=(self.location, self.cli_environment, str(self.home), run_id, from_failure,
                  attempt, log_path),
            daemon=True)
        process.start()
        return RunHandle("warm", self.partitions_of(run_id), attempt, process, log_path,
                         parent_run_id=run_id, started_at=started_at)

    # --- reading run storage ------------------------------------------------------------------

    def run_id_of(self, handle: RunHandle) -> str | None:
        if handle.run_id is None and handle.parent_run_id is not None:
            # A re-execution from failure carries its parent's tags, the attempt tag included;
            # it is the parent's one re-execution created since the handle's start.
            handle.run_id = next((
                record.dagster_run.run_id for record in self.instance.get_run_records(
                    RunsFilter(created_after=handle.started_at - CLOCK_SLACK))
                if record.dagster_run.parent_run_id == handle.parent_run_id), None)
            return handle.run_id
        return super().run_id_of(handle)

    def partitions_of(self, run_id: str) -> tuple[str, ...]:
        """The run's partition, or every date of its range."""
        run = self.instance.get_run_by_id(run_id)
        assert run is not None, f"no run {run_id}"
        return run_partitions(run)

    def materialized_by(self, run_id: str) -> set[str]:
        """Partitions the run loaded (its materialisations)."""
        records = self.instance.get_records_for_run(
            run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
        return {record.event_log_entry.asset_materialization.partition for record in records}

    def failure_on_the_warehouse(self, handle: RunHandle) -> str | None:
        """How the run failed on the warehouse being away, if it did: a failure classified as
        the warehouse away (or past its budget), or any failure whose error or its causes are
        the database driver's connection errors (a store access that was not ridden out)."""
        run_id = self.run_id_of(handle)
        if run_id is None:
            return None
        for error in load_job(self.instance, run_id, [self.source]).errors:
            text = " | ".join([error.message, *error.causes])
            if error.kind in (*OUTAGE_KINDS, StoreAway.kind) or any(
                    sign in text for sign in DRIVER_CONNECTION_ERRORS):
                return f"{error.op or 'run'}: {error.kind or error.error_class}: {text}"[:600]
        return None

    def loaded_by_lineage(self, run_id: str) -> set[str]:
        """Partitions the run and the runs it re-executes loaded: a re-execution of it from
        failure does not fetch them again."""
        loaded: set[str] = set()
        while run_id:
            loaded |= self.materialized_by(run_id)
            run = self.instance.get_run_by_id(run_id)
            run_id = run.parent_run_id if run else None
        return loaded

    def waited_for_older_run(self, handle: RunHandle) -> bool:
        """Whether the run logged that it waits for an older run of its partitions."""
        run_id = self.run_id_of(handle)
        return run_id is not None and any(
            "waiting for run" in (entry.user_message or "")
            for entry in self.instance.all_logs(run_id))

    def late_waits_for(self, handle: RunHandle, dead_run_ids: list[str]) -> list[str]:
        """The run's waits for a dead run past that run's launch grace: each logged "waiting for
        run(s)" naming one of ``dead_run_ids`` later than the grace after the dead run's last
        change and one poll (a wait is logged right after its check)."""
        run_id = self.run_id_of(handle)
        if run_id is None:
            return []
        bounds = {}
        for dead in dead_run_ids:
            record = self.instance.get_run_record_by_id(dead)
            if record is not None:
                changed = max(record.create_timestamp.timestamp(),
                              record.update_timestamp.timestamp(), record.start_time or 0.0)
                bounds[dead] = changed + LAUNCH_GRACE_SECONDS + CONCURRENT_RUN_POLL_SECONDS
        return [f"{dead} {entry.timestamp - bound:.0f} s past its grace"
                for entry in self.instance.all_logs(run_id)
                if "waiting for run(s)" in (entry.user_message or "")
                for dead, bound in bounds.items()
                if dead in entry.user_message and entry.timestamp > bound]

    def landed_by(self, handle: RunHandle) -> bool:
        """Whether the run has landed its payload (its extract is done)."""
        run_id = self.run_id_of(handle)
        folder = self.data_dir / "landing" / SOURCE / handle.partition / "fetches"
        if run_id is None or not folder.exists():
            return False
        for record in folder.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                if json.loads(record.read_text()).get("run_id") == run_id:
                    return True
        return False

    def close(self) -> None:
        drop_database(self.postgres, self.reference_database)
        super().close()
        self._stop_servers(self.postgres)

    def _stop_servers(self, postgres: ThrowawayPostgres) -> None:
        if self._own_standin:
            self.standin_server.stop()
        if self._own_postgres:
            postgres.stop()


def run_partitions(run: DagsterRun) -> tuple[str, ...]:
    """A run's partition, or every date of its range."""
    if PARTITION_TAG in run.tags:
        return (run.tags[PARTITION_TAG],)
    return date_range(run.tags[RANGE_START_TAG], run.tags[RANGE_END_TAG])


def date_range(first: str, last: str) -> tuple[str, ...]:
    """Every date from ``first`` to ``last``: the CBR partitions of that range (they are daily)."""
    day, end = date.fromisoformat(first), date.fromisoformat(last)
    days = []
    while day <= end:
        days.append(day.isoformat())
        day += timedelta(days=1)
    return tuple(days)


def _reexecution_child(location, environment: dict[str, str], home: str, parent_run_id: str,
                       from_failure: bool, attempt: str, log_path: Path) -> None:
    """The body of a forked re-execution; its exit code is 0 when the new run succeeded."""
    success = False
    try:
        log_to(log_path)
        os.environ.update(environment)
        # The job is reconstructed from ``mostovik_pipelines.defs``, which a fresh process
        # builds from the environment; this one imported it long ago, so it is pointed at the
        # warm runs' location (same warehouse, landing and storage, short retry delays), and
        # any definition a parent reconstructed before the fork is forgotten.
        definitions.defs = location
        ReconstructableJob.get_definition.cache_clear()
        ReconstructableJob.get_repository_definition.cache_clear()
        instance = DagsterInstance.from_config(home)
        if from_failure:
            run_id = rerun_from_failure(instance, parent_run_id)
        else:
            parent = instance.get_run_by_id(parent_run_id)
            assert parent is not None
            tags = {k: v for k, v in parent.tags.items()
                    if not k.startswith(PROCESS_TAG_PREFIXES) and k != STATUS_TAG}
            job = ReconstructableRepository.for_module(
                CODE_LOCATION_MODULE, CODE_LOCATION_ATTRIBUTE).get_reconstructable_job(JOB)
            run_id = execute_job(
                job, instance, run_config=parent.run_config, tags={**tags, ATTEMPT_TAG: attempt},
                reexecution_options=ReexecutionOptions(parent_run_id=parent_run_id),
                raise_on_error=False,
            ).run_id
        run = instance.get_run_by_id(run_id)
        success = run is not None and run.status == DagsterRunStatus.SUCCESS
    except BaseException:
        traceback.print_exc()  # os._exit below would swallow it
    finally:
        exit_child(success)
