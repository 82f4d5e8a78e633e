"""Where the chaos runs happen: a warehouse and a reference database on a real PostgreSQL, the
stand-in source, a SQLite Dagster home, and the two ways of starting a run of the CBR job.

* :meth:`ChaosEnvironment.start_cli_run` starts ``dagster job execute`` in a process of its own
  (in a session of its own, so a kill -9 takes all of it), configured through the environment the
  way CI and operators run it.
* :meth:`ChaosEnvironment.start_warm_run` forks this (warm) process, which has the code location
  loaded already, and runs the same job with ``execute_in_process`` in the child: the same ops,
  resources and instance, in a fraction of the start-up time, and just as killable.

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
import uuid
from pathlib import Path

import psycopg
from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    RunsFilter,
)

from mostovik_pipelines.etl.run_claims import hold_run_claim
from mostovik_pipelines.resources import HttpSourceResource
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

SOURCE = cbr_daily_rates.SOURCE.name
JOB = f"{SOURCE}_job"
ATTEMPT_TAG = "chaos/attempt"
WARM_TIMEOUT_SECONDS = 1.0
CLI_TIMEOUT_SECONDS = 2.0
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
    """One started run: its process, the attempt tag that finds it in run storage, its end."""

    def __init__(self, kind: str, partition: str, attempt: str, process, log_path: Path | None,
                 run_id: str | None = None) -> None:
        self.kind = kind
        self.partition = partition
        self.attempt = attempt
        self.process = process
        self.log_path = log_path
        self.run_id = run_id
        self.killed = False

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
        self.job = self._job(fast, self.url, self.data_dir)
        self.reference_job = self._job(fast, self.reference_url, self.root / "reference")

    def _job(self, source, url: str, data_dir: Path):
        location = code_location_for(
            url, self.standin_server, data_dir, [source],
            cbr_daily_rates_source=HttpSourceResource(
                base_url=self.standin_server.cbr_url, timeout_seconds=WARM_TIMEOUT_SECONDS),
        )
        return location.resolve_job_def(JOB)

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
                 "--tags", json.dumps({"dagster/partition": partition, ATTEMPT_TAG: attempt})],
                env=self.cli_environment(), cwd=self.root, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        return RunHandle("cli", partition, attempt, process, log_path)

    def start_warm_run(self, partition: str, reference: bool = False) -> RunHandle:
        attempt = uuid.uuid4().hex[:12]
        run_id = str(uuid.uuid4())
        job = self.reference_job if reference else self.job
        home = None if reference else str(self.home)
        log_path = self.logs / f"warm-{attempt}.log"
        process = multiprocessing.get_context("fork").Process(
            target=_warm_child, args=(job, home, partition, run_id, attempt, log_path),
            daemon=True)
        process.start()
        return RunHandle("warm", partition, attempt, process, log_path, run_id)

    # --- reading run storage ------------------------------------------------------------------

    def run_id_of(self, handle: RunHandle) -> str | None:
        if handle.run_id is None:
            runs = self.instance.get_run_records(
                RunsFilter(tags={ATTEMPT_TAG: handle.attempt}), limit=1)
            if runs:
                handle.run_id = runs[0].dagster_run.run_id
        return handle.run_id

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


def _warm_child(job, home: str | None, partition: str, run_id: str, attempt: str,
                log_path: Path) -> None:
    """The body of a forked warm run; its exit code is 0 when the run succeeded."""
    success = False
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        instance = DagsterInstance.from_config(home) if home else DagsterInstance.ephemeral()
        with hold_run_claim(instance, run_id):
            result = job.execute_in_process(
                partition_key=partition, instance=instance, run_id=run_id, raise_on_error=False,
                tags={ATTEMPT_TAG: attempt}, run_config=QUIET,
            )
        success = result.success
    finally:
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
