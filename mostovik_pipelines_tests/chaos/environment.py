"""Where the chaos runs happen: a warehouse and a reference database on a real PostgreSQL, the
stand-in source, a SQLite Dagster home, and the ways of starting a run of the CBR job.

* :meth:`ChaosEnvironment.start_cli_run` starts ``dagster job execute`` in a process of its own
  (in a session of its own, so a kill -9 takes all of it), configured through the environment the
  way CI and operators run it.
* :meth:`ChaosEnvironment.start_warm_run` forks this (warm) process, which has the code location
  loaded already, and runs the same job with ``execute_in_process`` in the child, for one
  partition or a range of them: the same ops, resources and instance, in a fraction of the
  start-up time, and just as killable.
* :meth:`ChaosEnvironment.start_cli_rerun` starts a re-execution of a failed run from its failure
  in a process of its own (``rerun_from_failure``: what ``mostovik jobs rerun RUN_ID`` queues for
  the daemon, executed in that process, so a kill -9 takes the run).
* :meth:`ChaosEnvironment.start_warm_reexecution` forks and re-executes a finished run in the
  child, from its failure (``rerun_from_failure``, what ``mostovik jobs rerun`` calls) or all of
  its steps (``dagster.execute_job`` with ``ReexecutionOptions``), the job reconstructed from
  ``mostovik_pipelines.defs`` as in a process started with :meth:`cli_environment`.

The parent never opens a warehouse engine through the project's resources: a forked child would
inherit its pooled connections. It reads the databases through plain psycopg connections only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import psycopg
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
from mostovik_pipelines.framework.runs.claims import hold_run_claim
from mostovik_pipelines.framework.runs.in_flight import LAUNCH_GRACE_SECONDS
from mostovik_pipelines.framework.runs.recovery import (
    CODE_LOCATION_ATTRIBUTE,
    CODE_LOCATION_MODULE,
    PROCESS_TAG_PREFIXES,
    rerun_from_failure,
)
from mostovik_pipelines.framework.runs.tags import (
    PARTITION_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    STATUS_TAG,
)
from mostovik_pipelines.framework.steps.lifecycle import CONCURRENT_RUN_POLL_SECONDS
from mostovik_pipelines.resources import HttpSourceResource
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.processes import RERUN_IN_PROCESS

SOURCE = cbr_daily_rates.SOURCE.name
JOB = f"{SOURCE}_job"
ATTEMPT_TAG = "chaos/attempt"
WARM_TIMEOUT_SECONDS = 1.0
CLI_TIMEOUT_SECONDS = 2.0
CLOCK_SLACK = timedelta(seconds=1)
"""Run storage's creation times come from the same clock, at a coarser resolution."""
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}

DAGSTER_YAML = """\
storage:
  sqlite:
    base_dir: {home}/storage
local_artifact_storage:
  module: dagster._core.storage.root
  class: LocalArtifactStorage
  config:
    base_dir: {home}
compute_logs:
  module: dagster._core.storage.noop_compute_log_manager
  class: NoOpComputeLogManager
telemetry:
  enabled: false
"""


class RunHandle:
    """One started run: its process, what finds it in run storage (its attempt tag; for a
    re-execution, being a run of its parent created since it was started), its end."""

    def __init__(self, kind: str, partitions: tuple[str, ...], attempt: str, process,
                 log_path: Path | None, run_id: str | None = None,
                 parent_run_id: str | None = None, started_at: datetime | None = None) -> None:
        self.kind = kind
        self.partitions = partitions
        self.attempt = attempt
        self.process = process
        self.log_path = log_path
        self.run_id = run_id
        self.parent_run_id = parent_run_id
        self.started_at = started_at
        self.killed = False

    @property
    def partition(self) -> str:
        """The run's first partition: the one whose landing and load lock the kill points of
        a single-partition run watch."""
        return self.partitions[0]

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        if isinstance(self.process, subprocess.Popen):
            return self.process.poll() is None
        return self.process.is_alive()

    def kill(self) -> bool:
        """kill -9 the run's process (and, for a CLI run, its whole session)."""
        if not self.alive():
            return False
        with contextlib.suppress(ProcessLookupError):
            if isinstance(self.process, subprocess.Popen):
                os.killpg(self.process.pid, signal.SIGKILL)
            else:
                os.kill(self.process.pid, signal.SIGKILL)
        self.killed = True
        return True

    def wait(self, timeout: float) -> None:
        if isinstance(self.process, subprocess.Popen):
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                self.process.wait(timeout=30)
        else:
            self.process.join(timeout)
            if self.process.is_alive():
                self.kill()
                self.process.join(30)


class ChaosEnvironment:
    """Everything a chaos scenario needs; :meth:`close` removes all of it."""

    def __init__(self, postgres: ThrowawayPostgres | None = None,
                 standin_server: StandinServer | None = None, keep: bool = False,
                 template: str | None = None) -> None:
        """``template``: a migrated database to clone the two databases from (else both are
        migrated here)."""
        self._own_postgres = postgres is None
        self._own_standin = standin_server is None
        self.keep = keep
        self.postgres = postgres or ThrowawayPostgres().start()
        self.standin_server = standin_server or StandinServer().start()
        self.standin = StandinClient(self.standin_server.url)
        self.root = Path(tempfile.mkdtemp(prefix="mostovik-chaos-"))
        suffix = uuid.uuid4().hex[:8]
        self.database = f"chaos_{suffix}"
        self.reference_database = f"chaosref_{suffix}"
        with psycopg.connect(self.postgres.dsn(), autocommit=True) as connection:
            for name in (self.database, self.reference_database):
                clone = f" TEMPLATE {template}" if template else ""
                connection.execute(f"CREATE DATABASE {name}{clone}")
        self.url = self.postgres.url(self.database)
        self.reference_url = self.postgres.url(self.reference_database)
        if not template:
            for url in (self.url, self.reference_url):
                migrate.upgrade(url)

        self.home = self.root / "dagster_home"
        self.home.mkdir()
        (self.home / "dagster.yaml").write_text(DAGSTER_YAML.format(home=self.home))
        self.data_dir = self.root / "data"
        self.logs = self.root / "logs"
        self.logs.mkdir()
        self.instance = DagsterInstance.from_config(str(self.home))
        fast = dataclasses.replace(cbr_daily_rates.SOURCE, extract_retry=FAST_RETRY,
                                   load_retry=FAST_RETRY)
        self.location = self._location(fast, self.url, self.data_dir)
        self.job = self.location.resolve_job_def(JOB)
        self.reference_job = self._location(
            fast, self.reference_url, self.root / "reference").resolve_job_def(JOB)

    def _location(self, source, url: str, data_dir: Path):
        return code_location_for(
            url, self.standin_server, data_dir, [source],
            cbr_daily_rates_source=HttpSourceResource(
                base_url=self.standin_server.cbr_url, timeout_seconds=WARM_TIMEOUT_SECONDS),
        )

    # --- starting runs ------------------------------------------------------------------------

    def cli_environment(self) -> dict[str, str]:
        return {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "MOSTOVIK_DATABASE_URL": self.url,
            "MOSTOVIK_CBR_URL": self.standin_server.cbr_url,
            "MOSTOVIK_CBR_TIMEOUT_SECONDS": str(CLI_TIMEOUT_SECONDS),
            "MOSTOVIK_DATA_DIR": str(self.data_dir),
            "MOSTOVIK_EXECUTOR": "in_process",
        }

    def start_cli_run(self, partition: str) -> RunHandle:
        attempt = uuid.uuid4().hex[:12]
        log_path = self.logs / f"cli-{attempt}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [str(Path(sys.executable).parent / "dagster"), "job", "execute",
                 "-m", "mostovik_pipelines", "-j", JOB,
                 "--tags", json.dumps({PARTITION_TAG: partition, ATTEMPT_TAG: attempt})],
                env=self.cli_environment(), cwd=self.root, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        return RunHandle("cli", (partition,), attempt, process, log_path)

    def start_warm_run(self, partitions: tuple[str, ...], reference: bool = False) -> RunHandle:
        """A run of one partition, or of the consecutive ``partitions`` as one ranged run."""
        attempt = uuid.uuid4().hex[:12]
        run_id = str(uuid.uuid4())
        job = self.reference_job if reference else self.job
        home = None if reference else str(self.home)
        log_path = self.logs / f"warm-{attempt}.log"
        process = multiprocessing.get_context("fork").Process(
            target=_warm_child, args=(job, home, partitions, run_id, attempt, log_path),
            daemon=True)
        process.start()
        return RunHandle("warm", partitions, attempt, process, log_path, run_id)

    def start_cli_rerun(self, run_id: str) -> RunHandle:
        """The failed run re-executed from its failure, in a process of its own."""
        attempt = uuid.uuid4().hex[:12]
        log_path = self.logs / f"cli-rerun-{attempt}.log"
        started_at = datetime.now(UTC)
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-c", RERUN_IN_PROCESS, run_id], env=self.cli_environment(),
                cwd=self.root,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return RunHandle("cli", self.partitions_of(run_id), attempt, process, log_path,
                         parent_run_id=run_id, started_at=started_at)

    def start_warm_reexecution(self, run_id: str, from_failure: bool) -> RunHandle:
        """The finished run re-executed in a forked child: from its failure, or all steps."""
        attempt = uuid.uuid4().hex[:12]
        log_path = self.logs / f"warm-rerun-{attempt}.log"
        started_at = datetime.now(UTC)
        process = multiprocessing.get_context("fork").Process(
            target=_reexecution_child,
            args=(self.location, self.cli_environment(), str(self.home), run_id, from_failure,
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
        elif handle.run_id is None:
            runs = self.instance.get_run_records(
                RunsFilter(tags={ATTEMPT_TAG: handle.attempt}), limit=1)
            if runs:
                handle.run_id = runs[0].dagster_run.run_id
        return handle.run_id

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

    def run_status(self, handle: RunHandle) -> DagsterRunStatus | None:
        run_id = self.run_id_of(handle)
        run = self.instance.get_run_by_id(run_id) if run_id else None
        return run.status if run else None

    def has_event(self, handle: RunHandle, event_type: DagsterEventType,
                  step_prefix: str | None = None) -> bool:
        run_id = self.run_id_of(handle)
        if run_id is None:
            return False
        records = self.instance.get_records_for_run(run_id, of_type=event_type).records
        return any(
            step_prefix is None or (r.event_log_entry.step_key or "").startswith(step_prefix)
            for r in records
        )

    def mark_dead_run_failed(self, handle: RunHandle) -> None:
        """What run monitoring does for a run whose process died: record it as failed, so that
        run storage shows reality and nothing waits for it."""
        run_id = self.run_id_of(handle)
        run = self.instance.get_run_by_id(run_id) if run_id else None
        if run is not None and run.status not in FINISHED:
            self.instance.report_run_failed(run, "killed by the chaos suite (kill -9)")

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
        self.instance.dispose()
        with contextlib.suppress(Exception), psycopg.connect(
            self.postgres.dsn(), autocommit=True
        ) as connection:
            for name in (self.database, self.reference_database):
                connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        if self._own_standin:
            self.standin_server.stop()
        if self._own_postgres:
            self.postgres.stop()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)


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


def _warm_child(job, home: str | None, partitions: tuple[str, ...], run_id: str, attempt: str,
                log_path: Path) -> None:
    """The body of a forked warm run; its exit code is 0 when the run succeeded."""
    success = False
    try:
        _log_to(log_path)
        instance = DagsterInstance.from_config(home) if home else DagsterInstance.ephemeral()
        ranged = len(partitions) > 1
        scope = ({RANGE_START_TAG: partitions[0], RANGE_END_TAG: partitions[-1]} if ranged
                 else {})
        with hold_run_claim(instance, run_id):
            result = job.execute_in_process(
                partition_key=None if ranged else partitions[0], instance=instance,
                run_id=run_id, raise_on_error=False, tags={**scope, ATTEMPT_TAG: attempt},
                run_config=QUIET,
            )
        success = result.success
    except BaseException:
        traceback.print_exc()  # os._exit below would swallow it
    finally:
        _exit(success)


def _reexecution_child(location, environment: dict[str, str], home: str, parent_run_id: str,
                       from_failure: bool, attempt: str, log_path: Path) -> None:
    """The body of a forked re-execution; its exit code is 0 when the new run succeeded."""
    success = False
    try:
        _log_to(log_path)
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
        _exit(success)


def _log_to(log_path: Path) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)


def _exit(success: bool) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0 if success else 1)


def wait_until(condition, handle: RunHandle, timeout: float, interval: float = 0.01) -> bool:
    """Poll ``condition`` until it holds (True) or the run's process ends or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if not handle.alive():
            return False
        time.sleep(interval)
    return False


def a_load_waits_for_a_lock(observer: psycopg.Connection) -> bool:
    """Whether another session of ``observer``'s database waits for a partition's advisory lock
    (a run's load, held up by a lock the suite holds)."""
    return observer.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE '%pg_advisory_xact_lock%' AND datname = current_database() "
        "AND pid <> pg_backend_pid()"
    ).fetchone()[0] > 0
