"""The one harness of every chaos suite: where runs happen, and the one way to start and kill one.

A :class:`Workspace` is a warehouse database on a PostgreSQL server, a SQLite Dagster home and a
work directory for one source, with the two ways of starting the source's job:

* :meth:`Workspace.start_warm` forks this (warm) process, which has the code location loaded
  already, and runs the job with ``execute_in_process`` in the child, for one partition or a
  range of them: the same ops, resources and instance, in a fraction of the start-up time, and
  just as killable;
* :meth:`Workspace.start_cli` starts ``dagster job execute`` in a session of its own (a kill -9
  takes all of it), configured through the environment the way CI and operators run it.

Both give a :class:`RunHandle`; :meth:`RunHandle.kill` is the one kill (-9) of every suite, and
:meth:`Workspace.finish` the one verdict on a killed run: recorded as failed (what the dead-run
sensor does within a minute) or left "started" (as run storage has it until then: the suites
run no daemon).

The parent reads the warehouse through plain psycopg connections only: a forked child would
inherit a pooled engine's connections. The parser suite (:mod:`.environment`) adds a reference
database and re-executions; the sync and file suites use a workspace as it is; the platform
suite runs its deployment over the parser suite's warehouse; the calendar suite creates its
warehouse with :func:`create_database`.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from mostovik_pipelines.core.tags import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG
from mostovik_pipelines.definitions import build_code_location
from mostovik_pipelines.framework.assets.resource_keys import (
    LANDING_KEY,
    WAREHOUSE_KEY,
    source_resource_key,
)
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.platform.claims import hold_driver_claim
from mostovik_pipelines.resources import LandingStoreResource, WarehouseResource
from mostovik_pipelines.resources.op_outputs import OpOutputStore
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

ATTEMPT_TAG = "chaos/attempt"
"""The tag that finds a started run in run storage."""
BIN = Path(sys.executable).parent
DAGSTER = str(BIN / "dagster")
MOSTOVIK = str(BIN / "mostovik")
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
UNFINISHED = [DagsterRunStatus.NOT_STARTED, DagsterRunStatus.QUEUED, DagsterRunStatus.STARTING,
              DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
RUN_TIMEOUT_SECONDS = 300.0
LEFT_STARTED_SHARE = 0.2
"""Killed runs left "started" in run storage, as it is until the dead-run sensor marks them
(the suites run no daemon); the rest are recorded as failed, as the sensor does."""
FAST_TMP = "/dev/shm"
"""Where workspaces live when it exists: Dagster's SQLite event log and the landing store
fsync every write, which costs a run a third of its time on disk and nothing on tmpfs."""

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

Wiring = Callable[[Path], tuple[Any, dict[str, str]]]
"""``wiring(root)``: the source's resource and the environment that gives a CLI run the same
one, for a workspace rooted at ``root``."""


def status_text(status: DagsterRunStatus | None) -> str:
    """A run's status as a scenario's note prints it."""
    return status.value.lower() if status else "none"


class RunHandle:
    """One started run: its process, what finds it in run storage (its attempt tag; for a
    re-execution, being a run of its parent created since it was started), its end."""

    def __init__(self, kind: str, partitions: tuple[str, ...], attempt: str, process,
                 log_path: Path | None, run_id: str | None = None,
                 parent_run_id: str | None = None, started_at=None) -> None:
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


def create_database(postgres: ThrowawayPostgres, name: str, template: str | None) -> str:
    """A warehouse database ``name``, cloned from ``template`` or migrated; its URL."""
    with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
        clone = f" TEMPLATE {template}" if template else ""
        connection.execute(f"CREATE DATABASE {name}{clone}")
    url = postgres.url(name)
    if not template:
        migrate.upgrade(url)
    return url


def drop_database(postgres: ThrowawayPostgres, name: str) -> None:
    with contextlib.suppress(Exception), psycopg.connect(
            postgres.dsn(), autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def location_of(source: SourceSpec, url: str, data_dir: Path, resource: Any):
    """The code location of ``source`` alone on the warehouse ``url``, its landing and op
    outputs under ``data_dir``."""
    return build_code_location([source], {
        WAREHOUSE_KEY: WarehouseResource(database_url=url),
        LANDING_KEY: LandingStoreResource(base_dir=str(data_dir / "landing")),
        "io_manager": OpOutputStore(base_dir=str(data_dir / "storage")),
        source_resource_key(source): resource,
    })


class Workspace:
    """A warehouse database, a SQLite Dagster home and a work directory for one source, and the
    two ways of starting the source's job; :meth:`close` removes all of it."""

    def __init__(self, postgres: ThrowawayPostgres, source: SourceSpec, wiring: Wiring,
                 template: str | None = None, keep: bool = False) -> None:
        self.postgres = postgres
        self.keep = keep
        self.root = Path(tempfile.mkdtemp(prefix=f"mostovik-chaos-{source.name}-",
                                          dir=FAST_TMP if os.access(FAST_TMP, os.W_OK) else None))
        self.database = f"chaos_{source.name[:12]}_{uuid.uuid4().hex[:8]}"
        self.instance: DagsterInstance | None = None
        self.left_started: set[str] = set()
        """Killed runs the suite left "started" on purpose, as the dead-run sensor has not
        marked them yet: any other run unfinished once its scenario is over is stuck."""
        try:
            self._create(source, wiring, template)
        except BaseException:
            self._remove()
            raise

    def _create(self, source: SourceSpec, wiring: Wiring, template: str | None) -> None:
        self.url = create_database(self.postgres, self.database, template)
        self.dsn = self.postgres.dsn(self.database)
        self.home = self.root / "dagster_home"
        self.home.mkdir()
        (self.home / "dagster.yaml").write_text(DAGSTER_YAML.format(home=self.home))
        self.data_dir = self.root / "data"
        self.logs = self.root / "logs"
        self.logs.mkdir()
        self.instance = DagsterInstance.from_config(str(self.home))
        self.source = source
        self.resource, cli_environment = wiring(self.root)
        self.job_name = f"{source.name}_job"
        self.location = location_of(source, self.url, self.data_dir, self.resource)
        self.job = self.location.resolve_job_def(self.job_name)
        self.cli_environment = {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "MOSTOVIK_DATABASE_URL": self.url,
            "MOSTOVIK_DATA_DIR": str(self.data_dir),
            "MOSTOVIK_EXECUTOR": "in_process",
            **cli_environment,
        }

    # --- starting runs ------------------------------------------------------------------------

    def start_warm(self, partitions: str | tuple[str, ...], tags: dict[str, str] | None = None,
                   ops_config: dict[str, Any] | None = None, job=None,
                   ephemeral: bool = False) -> RunHandle:
        """A run in a forked process, of one partition or of the consecutive ``partitions`` as
        one ranged run; ``ops_config``: the run config of its ops; ``job`` and ``ephemeral``:
        another job of the same code on an instance of its own (a reference run)."""
        partitions = (partitions,) if isinstance(partitions, str) else tuple(partitions)
        attempt = uuid.uuid4().hex[:12]
        run_id = str(uuid.uuid4())
        log_path = self.logs / f"warm-{attempt}.log"
        run_config = {**QUIET, **({"ops": ops_config} if ops_config else {})}
        scope = ({RANGE_START_TAG: partitions[0], RANGE_END_TAG: partitions[-1]}
                 if len(partitions) > 1 else {})
        process = multiprocessing.get_context("fork").Process(
            target=_warm_child,
            args=(job or self.job, None if ephemeral else self.instance, partitions, run_id,
                  {**(tags or {}), **scope, ATTEMPT_TAG: attempt}, run_config, log_path),
            daemon=True)
        process.start()
        return RunHandle("warm", partitions, attempt, process, log_path, run_id)

    def start_cli(self, partition: str, tags: dict[str, str] | None = None) -> RunHandle:
        """``dagster job execute`` of the partition, in a session of its own."""
        attempt = uuid.uuid4().hex[:12]
        log_path = self.logs / f"cli-{attempt}.log"
        run_tags = {**(tags or {}), PARTITION_TAG: partition, ATTEMPT_TAG: attempt}
        return RunHandle("cli", (partition,), attempt, self.start_process(
            [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", self.job_name,
             "--tags", json.dumps(run_tags, ensure_ascii=False)], log_path), log_path)

    def start_process(self, command: list[str], log_path: Path) -> subprocess.Popen:
        """A command with the CLI runs' environment, in a session of its own, its output in
        ``log_path``."""
        with log_path.open("wb") as log:
            return subprocess.Popen(command, env=self.cli_environment, cwd=self.root,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    # --- reading run storage ------------------------------------------------------------------

    def run_id_of(self, handle: RunHandle) -> str | None:
        if handle.run_id is None:
            runs = self.instance.get_run_records(
                RunsFilter(tags={ATTEMPT_TAG: handle.attempt}), limit=1)
            if runs:
                handle.run_id = runs[0].dagster_run.run_id
        return handle.run_id

    def status_of(self, handle: RunHandle) -> DagsterRunStatus | None:
        run_id = self.run_id_of(handle)
        run = self.instance.get_run_by_id(run_id) if run_id else None
        return run.status if run else None

    def has_event(self, handle: RunHandle, event_type: DagsterEventType,
                  step_prefix: str | None = None) -> bool:
        run_id = self.run_id_of(handle)
        if run_id is None:
            return False
        records = self.instance.get_records_for_run(run_id, of_type=event_type).records
        return any(step_prefix is None
                   or (record.event_log_entry.step_key or "").startswith(step_prefix)
                   for record in records)

    def mark_dead_run_failed(self, handle: RunHandle) -> None:
        """What run monitoring does for a run whose process died: record it as failed, so that
        run storage shows reality and nothing waits for it."""
        run_id = self.run_id_of(handle)
        run = self.instance.get_run_by_id(run_id) if run_id else None
        if run is not None and run.status not in FINISHED:
            self.instance.report_run_failed(run, "killed by the chaos suite (kill -9)")

    def leave_started(self, handle: RunHandle) -> None:
        """The killed run stays as its process left it in run storage, on purpose."""
        run_id = self.run_id_of(handle)
        if run_id is not None:
            self.left_started.add(run_id)

    def finish(self, handle: RunHandle, rng: random.Random) -> DagsterRunStatus | None:
        """Wait for the run's process; a killed run is recorded as failed (the dead-run
        sensor's verdict) or, sometimes, left "started" as it is until then."""
        handle.wait(timeout=RUN_TIMEOUT_SECONDS)
        if handle.killed and rng.random() >= LEFT_STARTED_SHARE:
            self.mark_dead_run_failed(handle)
        elif handle.killed:
            self.leave_started(handle)
        return self.status_of(handle)

    def stuck_runs(self) -> list[str]:
        """Runs unfinished in run storage but for those left "started" on purpose: with every
        run of the suite's scenarios over, each is a run nothing will ever finish."""
        return [record.dagster_run.run_id for record in self.instance.get_run_records(
                    RunsFilter(statuses=UNFINISHED))
                if record.dagster_run.run_id not in self.left_started]

    def close(self) -> None:
        if self.instance is not None:
            self.instance.dispose()
        self._remove()

    def _remove(self) -> None:
        drop_database(self.postgres, self.database)
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)


def _warm_child(job, instance: DagsterInstance | None, partitions: tuple[str, ...], run_id: str,
                tags: dict[str, str], run_config: dict[str, Any], log_path: Path) -> None:
    """The body of a forked warm run; its exit code is 0 when the run succeeded. It uses the
    parent's instance (its SQLite storages hold no connection between calls, and loading the
    instance again would cost the run a second), or an ephemeral one for a reference run."""
    success = False
    try:
        log_to(log_path)
        instance = instance or DagsterInstance.ephemeral()
        # execute_in_process has no executor of ours to hold the run's claims between steps.
        with hold_driver_claim(instance, run_id):
            result = job.execute_in_process(
                partition_key=None if len(partitions) > 1 else partitions[0],
                instance=instance, run_id=run_id, raise_on_error=False, tags=tags,
                run_config=run_config)
        success = result.success
    except BaseException:
        traceback.print_exc()  # os._exit below would swallow it
    finally:
        exit_child(success)


def log_to(log_path: Path) -> None:
    """A forked child's output into ``log_path``."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)


def exit_child(success: bool) -> None:
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
