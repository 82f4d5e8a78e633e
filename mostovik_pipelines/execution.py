"""How runs execute, chosen by ``MOSTOVIK_EXECUTOR``; one choice for every job.

* ``in_process`` (default): all three ops in the run's own process. A partition run costs ~2.5 s
  instead of ~12 s with a process per step; right for local runs, tests and CI.
* ``multiprocess``: a process per step, several partitions' steps in parallel on one machine.
* ``celery``: each step is a Celery task on a worker (see ``deploy/README.md``), for production
  across machines. The broker and result backend URLs are read from
  ``MOSTOVIK_CELERY_BROKER_URL`` / ``MOSTOVIK_CELERY_BACKEND_URL`` through dagster's
  ``{"env": ...}`` config source, so a password in them never reaches run config, the UI or logs.

dagster-celery waits for a step's task forever: a worker that dies while running a step (kill -9,
lost machine) leaves its run hanging. The executor here also watches the worker of every started
step and fails the step, and so the run, when that worker stops answering pings for
``MOSTOVIK_CELERY_WORKER_LOST_SECONDS``; a re-run is safe because loads are idempotent.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from dagster import (
    Executor,
    ExecutorDefinition,
    executor,
    in_process_executor,
    multiple_process_executor_requirements,
    multiprocess_executor,
)

from mostovik_pipelines.settings import EXECUTOR_ENV

EXECUTORS = ("in_process", "multiprocess", "celery")
BROKER_URL_ENV = "MOSTOVIK_CELERY_BROKER_URL"
BACKEND_URL_ENV = "MOSTOVIK_CELERY_BACKEND_URL"
WORKER_LOST_ENV = "MOSTOVIK_CELERY_WORKER_LOST_SECONDS"
DEFAULT_WORKER_LOST_SECONDS = 60.0


def executor_from_environment() -> ExecutorDefinition:
    choice = os.environ.get(EXECUTOR_ENV, "in_process")
    if choice == "in_process":
        return holding_run_claim(in_process_executor)
    if choice == "multiprocess":
        return holding_run_claim(multiprocess_executor)
    if choice == "celery":
        return holding_run_claim(_watched_celery_executor()).configured(
            {
                "broker": {"env": BROKER_URL_ENV},
                "backend": {"env": BACKEND_URL_ENV},
                "config_source": celery_settings(),
            },
            name="celery",
        )
    raise ValueError(f"{EXECUTOR_ENV}={choice!r}: expected one of {', '.join(EXECUTORS)}")


def holding_run_claim(definition: ExecutorDefinition) -> ExecutorDefinition:
    """The same executor, whose orchestrating process holds the run's claim from its first step
    to its last (:mod:`mostovik_pipelines.etl.run_claims`): a run is alive exactly as long as the
    process driving it, whatever executes its steps and wherever."""
    create = definition.executor_creation_fn
    assert create is not None
    return ExecutorDefinition(
        name=definition.name,
        config_schema=definition.config_schema,
        requirements=definition.get_requirements,
        executor_creation_fn=lambda init_context: _ClaimHoldingExecutor(create(init_context)),
        description=definition.description,
    )


class _ClaimHoldingExecutor(Executor):
    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        # Executors are read beyond the base interface (dagster-celery's workers ask theirs
        # for its app arguments): everything else is the wrapped executor's.
        return getattr(self.inner, name)

    @property
    def retries(self):
        return self.inner.retries

    @property
    def step_dependency_config(self):
        return self.inner.step_dependency_config

    def execute(self, plan_context, execution_plan):
        from mostovik_pipelines.etl.run_claims import hold_run_claim

        with hold_run_claim(plan_context.instance, plan_context.run_id):
            yield from self.inner.execute(plan_context, execution_plan)


def celery_settings() -> dict[str, Any]:
    """Celery settings shared by the executor and every worker (``deploy/celery``).

    * ``task_track_started``: a started step's task records its worker's hostname in the result
      backend; that is how the executor knows which worker to watch.
    * ``task_acks_late`` off: a task is acknowledged when a worker starts it, so a step whose
      worker died is failed and re-run by an operator, never silently run twice by Celery.
    * ``worker_disable_prefetch``: a worker takes a task only when it has a free slot, so a busy
      or dying worker never sits on queued steps that an idle worker could run.
    """
    return {
        "task_track_started": True,
        "task_acks_late": False,
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": True,
        "result_expires": 7 * 24 * 3600,
        "broker_connection_retry_on_startup": True,
    }


def worker_celery_settings() -> dict[str, Any]:
    """What a worker's ``dagster_celery_config`` module holds: the shared settings plus the broker
    and backend, read from the worker's own environment at start."""
    return {
        **celery_settings(),
        "broker_url": os.environ[BROKER_URL_ENV],
        "result_backend": os.environ[BACKEND_URL_ENV],
    }


def current_celery_task_id() -> str | None:
    """The id of the Celery task executing the current step; ``None`` outside a Celery worker
    (in-process and multiprocess runs, the run's orchestrating process)."""
    if "celery" not in sys.modules:
        return None
    from celery import current_task

    if not current_task:
        return None
    return current_task.request.id or None


def _watched_celery_executor() -> ExecutorDefinition:
    from dagster_celery.executor import CELERY_CONFIG, CeleryExecutor
    from dagster_celery.executor import _submit_task as submit_task

    class WatchedCeleryExecutor(CeleryExecutor):
        """dagster-celery's executor, with each submitted step's worker watched."""

        def __init__(self, worker_lost_seconds: float, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.worker_lost_seconds = worker_lost_seconds

        def execute(self, plan_context, execution_plan):
            from dagster_celery.core_execution_loop import core_celery_execution_loop

            liveness = _WorkerLiveness(self.worker_lost_seconds)

            def submit_watched(app, context, step, queue, priority, known_state):
                result = submit_task(app, context, step, queue, priority, known_state)
                context.instance.report_engine_event(
                    f'Step "{step.key}" is celery task {result.id}.',
                    context.dagster_run,
                    _engine_event_data({"celery_task_id": result.id, "queue": queue}),
                    step_key=step.key,
                )
                return _WatchedResult(app, result, step.key, liveness)

            return core_celery_execution_loop(
                plan_context, execution_plan, step_execution_fn=submit_watched
            )

    @executor(
        name="celery",
        config_schema=CELERY_CONFIG,
        requirements=multiple_process_executor_requirements(),
    )
    def watched_celery_executor(init_context):
        from dagster._core.execution.retries import RetryMode

        config = init_context.executor_config
        return WatchedCeleryExecutor(
            worker_lost_seconds=float(
                os.environ.get(WORKER_LOST_ENV) or DEFAULT_WORKER_LOST_SECONDS
            ),
            broker=config.get("broker"),
            backend=config.get("backend"),
            config_source=config.get("config_source"),
            include=config.get("include"),
            retries=RetryMode.from_config(config["retries"]),
        )

    return watched_celery_executor


def _engine_event_data(metadata: Mapping[str, str]):
    from dagster._core.events import EngineEventData

    return EngineEventData(dict(metadata))


class _WorkerLiveness:
    """Which workers answer a ping, asked at most every few seconds per worker."""

    def __init__(self, lost_after_seconds: float) -> None:
        self.lost_after_seconds = lost_after_seconds
        self.ping_every_seconds = max(1.0, min(10.0, lost_after_seconds / 5))
        self._last_answer: dict[str, float] = {}
        self._last_ping: dict[str, float] = {}

    def silent_for(self, app, hostname: str) -> float:
        """Seconds since ``hostname`` last answered (0 while it answers)."""
        now = time.monotonic()
        self._last_answer.setdefault(hostname, now)
        if now - self._last_ping.get(hostname, 0.0) >= self.ping_every_seconds:
            self._last_ping[hostname] = now
            if self._answers(app, hostname):
                self._last_answer[hostname] = time.monotonic()
        return time.monotonic() - self._last_answer[hostname]

    @staticmethod
    def _answers(app, hostname: str) -> bool:
        try:
            replies = app.control.ping(destination=[hostname], timeout=1.0, limit=1)
        except Exception:  # a broker hiccup is no evidence that a worker died
            return True
        return any(hostname in reply for reply in replies)


class _WatchedResult:
    """A step's Celery result that is also "ready", as a failure, once its worker is lost.

    dagster-celery's loop only calls ``ready()``, ``get()`` and ``revoke()``."""

    def __init__(self, app, result, step_key: str, liveness: _WorkerLiveness) -> None:
        self._app = app
        self._result = result
        self._step_key = step_key
        self._liveness = liveness
        self._lost: str | None = None

    def ready(self) -> bool:
        if self._result.ready():
            return True
        if self._result.state != "STARTED":
            return False
        # Read apart from the state: a task finishing in between turns ``info`` into its result
        # (a list of events), which names no worker.
        info = self._result.info
        hostname = info.get("hostname") if isinstance(info, dict) else None
        if not hostname:
            return False
        silent = self._liveness.silent_for(self._app, hostname)
        if silent < self._liveness.lost_after_seconds:
            return False
        self._lost = (
            f"celery task {self._result.id} running step {self._step_key} was lost: its worker "
            f"{hostname} has not answered a ping for {silent:.0f} s (killed or unreachable). "
            "Re-run the partition; the load is idempotent."
        )
        self._result.revoke()
        return True

    def get(self):
        if self._lost:
            from celery.exceptions import WorkerLostError

            raise WorkerLostError(self._lost)
        return self._result.get()

    def revoke(self) -> None:
        self._result.revoke()
