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

A Redis restart or failover (the broker and the result backend) is ridden out for
``MOSTOVIK_CELERY_OUTAGE_SECONDS`` (90 s by default; the one outage rule,
``core/outages.py``): the orchestrating process waits on its steps' results and submits the
next ones once Redis is back, the outage's start and end engine events of the run, and fails
the run naming the broker only past that budget; a worker keeps running its step and
retries storing the result until the backend is back. Queued steps survive the restart only on
a persistent Redis (``appendonly yes``, deploy/README).
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

from mostovik_pipelines.core.outages import Store, budget_seconds, ride_out, setting_of
from mostovik_pipelines.core.settings import EXECUTOR_ENV

EXECUTORS = ("in_process", "multiprocess", "celery")
BROKER_URL_ENV = "MOSTOVIK_CELERY_BROKER_URL"
BACKEND_URL_ENV = "MOSTOVIK_CELERY_BACKEND_URL"
WORKER_LOST_ENV = "MOSTOVIK_CELERY_WORKER_LOST_SECONDS"
DEFAULT_WORKER_LOST_SECONDS = 30.0
"""A worker silent to pings this long is lost: its run is failed within a minute of the worker's
death (30 s, a ping every 6 s, the executor's poll), yet a live worker is never counted lost
when Redis comes back from an outage (a worker reconnects with kombu's backoff, 2 s more per
try: within about 20 s of Redis answering after the 90 s the broker's budget rides out; while
Redis is away a failed ping is no silence)."""
OUTAGE_ENV = setting_of(Store.BROKER)


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
    """The same executor, whose orchestrating process holds the run's claim and its driver
    claim from its first step to its last (:mod:`mostovik_pipelines.platform.claims`): a
    run is alive exactly as long as the process driving it, whatever executes its steps and
    wherever."""
    create = definition.executor_creation_fn
    assert create is not None

    def create_claim_holding(init_context):
        return _ClaimHoldingExecutor(create(init_context))

    create_claim_holding.holds_run_claim = True  # kept by .configured(), read below
    return ExecutorDefinition(
        name=definition.name,
        config_schema=definition.config_schema,
        requirements=definition.get_requirements,
        executor_creation_fn=create_claim_holding,
        description=definition.description,
    )


def holds_run_claim(definition: ExecutorDefinition) -> bool:
    """Whether runs of a job with this executor hold their claim while they are alive (the
    dead-run sensor watches only those: a job with another executor never takes one)."""
    return getattr(definition.executor_creation_fn, "holds_run_claim", False)


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
        from mostovik_pipelines.platform.claims import hold_driver_claim

        with hold_driver_claim(plan_context.instance, plan_context.run_id):
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
    outage = budget_seconds(Store.BROKER)
    return {
        **celery_settings(),
        "broker_url": os.environ[BROKER_URL_ENV],
        "result_backend": os.environ[BACKEND_URL_ENV],
        # A step that finishes while Redis is away stores its result once it is back (otherwise
        # the result is dropped and the run waits for it until its outage budget runs out).
        # Celery counts retries, not seconds: backoff with full jitter up to 2 s, about 1 s a
        # retry, so twice the budget in retries outlasts the orchestrator's wait.
        "result_backend_always_retry": True,
        "result_backend_max_retries": int(2 * outage),
        "result_backend_max_sleep_between_retries_ms": 2000,
        # A step running when the broker connection drops goes on (the default, said aloud:
        # Celery warns that 6.0 may change it).
        "worker_cancel_long_running_tasks_on_connection_loss": False,
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
    from mostovik_pipelines.core.dagster_compat import RetryMode, celery_executor_internals

    CELERY_CONFIG, CeleryExecutor, submit_task, core_celery_execution_loop = (
        celery_executor_internals())

    class WatchedCeleryExecutor(CeleryExecutor):
        """dagster-celery's executor, with each submitted step's worker watched."""

        def __init__(self, worker_lost_seconds: float, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.worker_lost_seconds = worker_lost_seconds

        def execute(self, plan_context, execution_plan):
            liveness = _WorkerLiveness(self.worker_lost_seconds)
            outage = _BrokerOutage(plan_context)

            def submit_watched(app, context, step, queue, priority, known_state):
                result = outage.ride_out(
                    lambda: submit_task(app, context, step, queue, priority, known_state))
                context.instance.report_engine_event(
                    f'Step "{step.key}" is celery task {result.id}.',
                    context.dagster_run,
                    _engine_event_data({"celery_task_id": result.id, "queue": queue}),
                    step_key=step.key,
                )
                return _WatchedResult(app, result, step.key, liveness, outage)

            return core_celery_execution_loop(
                plan_context, execution_plan, step_execution_fn=submit_watched
            )

    @executor(
        name="celery",
        config_schema=CELERY_CONFIG,
        requirements=multiple_process_executor_requirements(),
    )
    def watched_celery_executor(init_context):
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
    from mostovik_pipelines.core.dagster_compat import EngineEventData

    return EngineEventData(dict(metadata))


class _WorkerLiveness:
    """Which workers answer a ping, asked at most every few seconds per worker."""

    def __init__(self, lost_after_seconds: float) -> None:
        self.lost_after_seconds = lost_after_seconds
        self.ping_every_seconds = max(1.0, min(10.0, lost_after_seconds / 5))
        self._last_answer: dict[str, float] = {}
        self._last_ping: dict[str, float] = {}

    def silent_for(self, app, hostname: str) -> float:
        """Seconds ``hostname`` has not answered the pings sent to it (0 while it answers).
        Silence counts only while it is asked: after a while nobody asked (Redis away, the
        executor waiting on it), it counts afresh."""
        now = time.monotonic()
        last_ping = self._last_ping.get(hostname)
        if last_ping is None or now - last_ping > 3 * self.ping_every_seconds:
            self._last_answer[hostname] = now
        if now - (last_ping or 0.0) >= self.ping_every_seconds:
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


class _BrokerOutage:
    """The run's orchestrating process riding out a Redis outage: each call that fails because
    the broker or the result backend is away is made again (:func:`.core.outages.ride_out`,
    the broker's budget, one clock for the run's calls), and the outage's start and end are
    engine events of the run."""

    def __init__(self, plan_context) -> None:
        self._context = plan_context
        self._away = False

    def ride_out(self, call):
        result = ride_out(Store.BROKER, call, target=self._target(), answers=True,
                          on_wait=self._waiting)
        if self._away:
            self._away = False
            self._report("Celery broker and result backend reachable again.")
        return result

    def _target(self) -> str:
        return os.environ.get(BROKER_URL_ENV, "")

    def _waiting(self, store: Store, error: BaseException, seconds: float, wait: float) -> None:
        if not self._away:
            self._away = True
            self._report(f"Celery broker or result backend unreachable "
                         f"({type(error).__name__}: {error}); waiting up to "
                         f"{budget_seconds(Store.BROKER):.0f} s ({OUTAGE_ENV}) for it to come "
                         "back.")

    def _report(self, message: str) -> None:
        self._context.instance.report_engine_event(message, self._context.dagster_run)


class _WatchedResult:
    """A step's Celery result that is also "ready", as a failure, once its worker is lost, and
    not ready while the broker is away.

    dagster-celery's loop only calls ``ready()``, ``get()`` and ``revoke()``."""

    def __init__(self, app, result, step_key: str, liveness: _WorkerLiveness,
                 outage: _BrokerOutage) -> None:
        self._app = app
        self._result = result
        self._step_key = step_key
        self._liveness = liveness
        self._outage = outage
        self._lost: str | None = None

    def ready(self) -> bool:
        return self._outage.ride_out(self._ready)

    def _ready(self) -> bool:
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
        return self._outage.ride_out(self._result.get)

    def revoke(self) -> None:
        self._outage.ride_out(self._result.revoke)
