"""Celery worker processes for the deployment tests, started the way deploy/ starts them, and a
one-op probe job that reports the Celery task id of the step it runs in.

Each worker is ``deploy/bin/mostovik-celery worker`` (``celery -A dagster_celery.app worker``
with ``deploy/celery`` on the path) in a session of its own, so that
:meth:`CeleryWorker.kill` can take the whole worker (main process and pool children) down at once,
as a lost machine would, and :meth:`CeleryWorker.stop` never leaves a child behind.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from dagster import Definitions, FilesystemIOManager, job, op

from mostovik_pipelines.core.settings import data_dir, setting
from mostovik_pipelines.platform.execution import current_celery_task_id, executor_from_environment
from mostovik_pipelines_tests.support.processes import stop_session

REPO = Path(__file__).resolve().parents[2]
MOSTOVIK_CELERY = REPO / "deploy" / "bin" / "mostovik-celery"
TASK_ID_PREFIX = "running as celery task "


def celery_command(*args: str) -> list[str]:
    """``deploy/bin/mostovik-celery *args``: what the systemd unit and the runbook run."""
    return [str(MOSTOVIK_CELERY), *args]


def celery_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """``environment`` with this venv's ``celery`` first on ``PATH``."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, **environment, "PATH": path}


class CeleryWorker:
    def __init__(self, name: str, log_path: Path, concurrency: int = 1) -> None:
        self.name = name
        self.hostname = f"{name}@{socket.gethostname()}"
        self.log_path = log_path
        self.concurrency = concurrency
        self._process: subprocess.Popen | None = None

    def start(self, environment: Mapping[str, str], cwd: Path) -> CeleryWorker:
        command = [
            "worker", "--hostname", self.hostname, "--queues", "dagster",
            "--concurrency", str(self.concurrency), "--loglevel", "INFO",
            "--without-mingle", "--without-gossip",
        ]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                celery_command(*command), env=celery_environment(environment), cwd=cwd,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while " ready." not in self.log():
            if self._process is None or self._process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.name} not ready:\n{self.log()[-3000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def succeeded_task_ids(self) -> list[str]:
        return re.findall(r"Task execute_plan\[([0-9a-f-]+)\] succeeded", self.log())

    def kill(self) -> None:
        """kill -9 the worker and its pool children, as if its machine were lost."""
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=10)

    def stop(self, timeout: float = 20) -> None:
        """Warm shutdown (TERM), then kill -9 of whatever is left of the worker's session."""
        stop_session(self._process, timeout)


@op
def report_celery_task(context) -> str:
    task_id = current_celery_task_id()
    context.log.info(f"{TASK_ID_PREFIX}{task_id}")
    return task_id or ""


@job(description="Reports the Celery task id of its one step (deployment test probe).")
def celery_probe_job():
    report_celery_task()


celery_probe_defs = Definitions(
    jobs=[celery_probe_job],
    resources={
        "io_manager": FilesystemIOManager(
            base_dir=setting("MOSTOVIK_STORAGE_DIR", str(data_dir() / "storage"))
        )
    },
    executor=executor_from_environment(),
)
