"""The production deployment with the Celery executor for tests: deploy/dagster.yaml on a fresh
instance database, a fresh warehouse, a password-protected Redis as Celery broker and result
backend, and Celery workers started the way deploy/ starts them; runs driven by
``dagster job execute`` with ``MOSTOVIK_EXECUTOR=celery``, and what the executor recorded of
them (the tasks it submitted, the worker that ran each step)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

from dagster import DagsterEventType, DagsterInstance, RunsFilter

from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.celery_workers import (
    TASK_ID_PREFIX,
    CeleryWorker,
    celery_command,
    celery_environment,
)
from mostovik_pipelines_tests.support.instances import create_instance_storage, fresh_deployment
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.processes import DAGSTER, REPO
from mostovik_pipelines_tests.support.redis import ThrowawayRedis
from mostovik_pipelines_tests.support.warehouse import table_rows

JOB = "cbr_daily_rates_job"
CBR_JOB = ("-m", "mostovik_pipelines", "-j", JOB)
PARTITION_TAG = "dagster/partition"
CASE_TAG = "mostovik_test/case"
BOOKKEEPING = {"loaded_by_run", "loaded_at", "changed_by_run", "changed_at"}
WORKERS = ("worker-a", "worker-b")
def held_fetch_settings(process_start_margin: float) -> dict[str, str]:
    """CBR fetches held at the stand-in longer than any test's wait (five run processes take a
    minute or more on a loaded 2-core machine). The worker watch is the shipped one
    (``MOSTOVIK_CELERY_WORKER_LOST_SECONDS``' default): a lost worker's run must be failed
    within a minute with the settings a team installs."""
    return {"MOSTOVIK_CBR_TIMEOUT_SECONDS": str(process_start_margin * 3)}


@contextmanager
def celery_deployment(postgres: ThrowawayPostgres, redis: ThrowawayRedis,
                      standin_server: StandinServer, work_dir: Path, name: str,
                      broker_db: int = 0) -> Iterator[tuple[Path, dict[str, str]]]:
    """:func:`~.instances.fresh_deployment` with the Celery executor: Redis database
    ``broker_db`` the broker, the next one the result backend, the op outputs and the landing
    store in directories every worker shares, and this repository importable by the workers
    (the tests' probe job lives in it)."""
    with fresh_deployment(postgres, standin_server, work_dir, name) as (home, environment):
        environment.update({
            "MOSTOVIK_EXECUTOR": "celery",
            "MOSTOVIK_CELERY_BROKER_URL": redis.url(broker_db),
            "MOSTOVIK_CELERY_BACKEND_URL": redis.url(broker_db + 1),
            "MOSTOVIK_STORAGE_DIR": str(work_dir / "shared" / "storage"),
            "MOSTOVIK_LANDING_DIR": str(work_dir / "shared" / "landing"),
            "PYTHONPATH": str(REPO),
        })
        yield home, environment


@dataclass
class Deployment:
    """The processes and settings of one production-like deployment on this machine."""

    home: Path
    work_dir: Path
    environment: dict[str, str]
    warehouse_url: str
    secrets: list[str]
    workers: dict[str, CeleryWorker] = field(default_factory=dict)
    runs: list[subprocess.Popen] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def start_worker(self, name: str, machine: tuple[Path, dict[str, str]] | None = None
                     ) -> CeleryWorker:
        """Worker ``name``, started in ``machine``'s working directory with its environment
        (the deployment's by default)."""
        cwd, environment = machine or (self.work_dir, self.environment)
        worker = CeleryWorker(name, cwd / f"{name}.log")
        self.workers[name] = worker.start(environment, cwd=cwd)
        return worker

    def start_workers(self, machines: Callable[[str], tuple[Path, dict[str, str]]] | None = None
                      ) -> None:
        """``worker-a`` and ``worker-b`` (each on its ``machines(name)``), once both are ready."""
        for name in WORKERS:
            self.start_worker(name, machines(name) if machines else None)
        for worker in self.workers.values():
            worker.wait_ready()

    def start_run(self, *args: str, settings: dict[str, str] | None = None,
                  **tags: str) -> subprocess.Popen:
        """``dagster job execute *args`` with ``tags``, in a process of its own, with the
        deployment's environment and ``settings``."""
        tag_args = ["--tags", json.dumps(tags)] if tags else []
        process = subprocess.Popen(
            [DAGSTER, "job", "execute", *args, *tag_args],
            env={**os.environ, **self.environment, **(settings or {})}, cwd=self.work_dir,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.runs.append(process)
        return process

    def finish(self, process: subprocess.Popen, timeout: float = 150) -> int:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(process)
            raise
        self.outputs.append(output)
        return process.returncode

    def stop(self) -> None:
        """Kill any run still going, then stop the workers: nothing outlives the module."""
        for process in self.runs:
            kill_session(process)
        for worker in self.workers.values():
            worker.stop()

    def celery(self, *args: str) -> str:
        """``deploy/bin/mostovik-celery *args``, as an operator runs it."""
        completed = subprocess.run(
            celery_command(*args), env=celery_environment(self.environment), cwd=self.work_dir,
            capture_output=True, text=True, timeout=60,
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        return completed.stdout

    def probe(self, case: str) -> subprocess.Popen:
        """A run of the one-step probe job that logs its Celery task id."""
        return self.start_run("-m", "mostovik_pipelines_tests.support.celery_workers",
                              "-a", "celery_probe_defs", "-j", "celery_probe_job",
                              **{CASE_TAG: case})

    def probe_task_ids(self, case: str) -> list[str]:
        """The task ids the probe runs of ``case`` logged, checked against the executor's record."""
        reported = []
        with self.instance() as instance:
            for run in instance.get_runs(RunsFilter(tags={CASE_TAG: case})):
                messages = [record.user_message for record in instance.all_logs(run.run_id)]
                (task_id,) = [m.split(TASK_ID_PREFIX, 1)[1] for m in messages
                              if TASK_ID_PREFIX in m]
                assert celery_submissions(instance, run.run_id) == [
                    ("report_celery_task", task_id)]
                reported.append(task_id)
        return reported

    @contextmanager
    def instance(self) -> Iterator[DagsterInstance]:
        with (mock.patch.dict(os.environ, self.environment),
              DagsterInstance.from_config(str(self.home)) as instance):
            yield instance


@contextmanager
def two_worker_deployment(postgres: ThrowawayPostgres, redis: ThrowawayRedis,
                          standin_server: StandinServer, work_dir: Path,
                          settings: dict[str, str] | None = None) -> Iterator[Deployment]:
    """:func:`celery_deployment` with ``settings`` added and two workers, ``worker-a`` and
    ``worker-b``, ready; the runs still going and the workers are stopped after."""
    with celery_deployment(postgres, redis, standin_server, work_dir, "celery") as (
            home, environment):
        environment.update(settings or {})
        deployment = Deployment(home, work_dir, environment,
                                environment["MOSTOVIK_DATABASE_URL"],
                                secrets=[redis.password, postgres.password])
        try:
            # No webserver or daemon runs here, which would create the tables first.
            create_instance_storage(home, deployment.environment)
            deployment.start_workers()
            yield deployment
        finally:
            deployment.stop()


def kill_session(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=30)


def load_cleanly(warehouse_url: str, standin_server: StandinServer, work_dir: Path,
                 partitions: list[str]) -> None:
    """The reference: ``partitions`` loaded in process, one run each, into ``warehouse_url``."""
    reference = code_location_for(
        warehouse_url, standin_server, work_dir, [cbr_daily_rates.SOURCE]
    ).resolve_job_def(JOB)
    with DagsterInstance.ephemeral() as ephemeral:
        for partition in partitions:
            assert reference.execute_in_process(partition_key=partition, instance=ephemeral).success


def business_rows(url: str) -> list[dict]:
    """The CBR rates in the warehouse at ``url``, without the columns saying which run loaded
    them and when."""
    return [{k: v for k, v in row.items() if k not in BOOKKEEPING}
            for row in table_rows(url, "cbr_daily_rates")]


def step_workers(instance: DagsterInstance, run_id: str) -> dict[str, str]:
    """Step key -> the Celery worker that ran it, from dagster-celery's engine events."""
    placements = {}
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        data = record.dagster_event.engine_event_data
        worker = data.metadata.get("Celery worker") if data else None
        if worker is not None:
            placements[record.step_key] = worker.value
    return placements


def celery_submissions(instance: DagsterInstance, run_id: str) -> list[tuple[str, str]]:
    """(step key, Celery task id) of every task the executor submitted, retries included."""
    submitted = []
    for record in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        data = record.dagster_event.engine_event_data
        task_id = data.metadata.get("celery_task_id") if data else None
        if task_id is not None:
            submitted.append((record.step_key, task_id.value))
    return submitted
