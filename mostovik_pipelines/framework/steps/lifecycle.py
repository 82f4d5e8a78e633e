"""Around every step of every source: the run's claim and status, the concurrent-run policy,
and what a failure does (retry, fail the run, or set a ranged run's partition aside)."""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from dagster import AssetKey, OpExecutionContext, RetryRequested

from mostovik_pipelines.core.errors import ConcurrentRunError, classify
from mostovik_pipelines.core.outages import Store, away_store, ride_out
from mostovik_pipelines.core.retries import (
    NO_RETRY,
    RetryPolicy,
    StepContext,
    failure_for,
    outage_recorder,
    retry_or_fail,
)
from mostovik_pipelines.core.settings import EXECUTOR_ENV
from mostovik_pipelines.core.tags import ERROR_CLASS_KEY, PERMANENT, business_tags
from mostovik_pipelines.framework.spec import ConcurrentRunPolicy, SourceSpec
from mostovik_pipelines.framework.steps.outcomes import (
    PartitionFailure,
    PartitionSkipped,
    StepOutcomes,
)
from mostovik_pipelines.platform.claims import hold_run_claim
from mostovik_pipelines.platform.in_flight import RunClaim, older_runs_in_flight
from mostovik_pipelines.platform.status import JobStatus, record, record_running
from mostovik_pipelines.platform.tracking import (
    STEP_CELERY_TASK,
    STEP_EXECUTOR,
    STEP_HOST,
    STEP_PID,
)

T = TypeVar("T")
CONCURRENT_RUN_POLL_SECONDS = 3.0
"""How often a run waiting for an older run of its partitions looks again. It waits between
attempts of its step, holding no worker (a Celery worker is free for the run it waits for)."""


STEP_STORES = (Store.WAREHOUSE, Store.OBJECT_STORE)
"""The stores a step's work reaches itself (the run storage's calls ride out in the instance
storage, the op outputs' in their I/O manager)."""


@contextlib.contextmanager
def running_step(context: OpExecutionContext, spec: SourceSpec) -> Iterator[None]:
    """Hold the run's claim while the step works (the run is alive: :mod:`.run_claims`), tag
    the run as a business job, and mark the job failed when the step fails for good."""
    with hold_run_claim(context.instance, context.run_id):
        record_step(context, spec)
        try:
            yield
        except RetryRequested:
            raise
        except BaseException:
            _mark_failed(context)
            raise


def riding_out(context: OpExecutionContext, step: StepContext, work: Callable[[], T]) -> T:
    """One partition's work in a step (its fetch and landing, its parse, its load, its checks),
    made again in place while the warehouse or the object store is away, up to that store's
    outage budget (:func:`.outages.ride_out`), each wait logged and recorded on the partition.
    ``work`` is whole or nothing: a fetch lands whole, a load is one transaction (a paged load
    goes on after its committed pages), a check reads."""
    return ride_out(STEP_STORES, work, on_wait=outage_recorder(context, step))


def _mark_failed(context: OpExecutionContext) -> None:
    # Written whatever the step's copy of the run says: it was read as the run started, and a
    # re-execution's carried its parent's status, which the first step replaced.
    record(context.instance, context.run_id, JobStatus.FAILED)


def older_run_stops_this_one(context: OpExecutionContext, spec: SourceSpec) -> str | None:
    """Apply the source's concurrent-run policy at the run's first step: the reason this run
    stops (policy ``stop``), or None to go on. With ``wait`` the step retries later, holding
    nothing, until the older runs are over, for at most ``concurrent_run_wait_seconds`` from the
    run's start."""
    keys = context.partition_keys
    claim = RunClaim(context.run_id, f"{spec.name}_job", AssetKey(spec.name), frozenset(keys))
    older = [run.run_id for run in older_runs_in_flight(context.instance, claim,
                                                         spec.partitions_def)]
    if not older:
        return None
    if spec.on_concurrent_run is ConcurrentRunPolicy.STOP:
        reason = (f"stopped: run(s) {', '.join(older)} of the same partition(s) in progress; "
                  "nothing loaded by this run")
        context.log.warning(f"{spec.name}: {reason}")
        return reason
    record = context.instance.get_run_record_by_id(context.run_id)
    started = (record.start_time if record and record.start_time
               else record.create_timestamp.timestamp() if record else time.time())
    waited = time.time() - started
    scope = keys[0] if len(keys) == 1 else f"{keys[0]}...{keys[-1]}"
    if waited > spec.concurrent_run_wait_seconds:
        raise failure_for(StepContext(spec.name, scope, "wait"), classify(ConcurrentRunError(
            f"run(s) {', '.join(older)} of the same partition(s) still in progress after "
            f"{waited:.0f}s")), context.retry_number + 1, NO_RETRY)
    context.log.info(f"{spec.name} [{scope}]: waiting for run(s) {', '.join(older)} of the same "
                     f"partition(s) to finish ({waited:.0f}s so far)")
    raise RetryRequested(max_retries=context.retry_number + 1,
                         seconds_to_wait=CONCURRENT_RUN_POLL_SECONDS)


def ranged_run(context: OpExecutionContext) -> bool:
    """Whether the run covers more than one partition (a ranged backfill run), read from its
    range: listing its keys builds a year of them again on every call, which each partition's
    extract and transform paid."""
    key_range = context.partition_key_range
    return key_range.start != key_range.end


def fail_or_set_aside(
    context: OpExecutionContext, step: StepContext, policy: RetryPolicy, exc: Exception,
    ranged: bool,
) -> PartitionFailure:
    """Retry the step while the failure is transient; else fail the run (one partition) or set
    the partition aside (a range), logging why. A store away is no failure of the partition:
    it is raised again for the partition's :func:`riding_out` to wait on."""
    if away_store(STEP_STORES, exc) is not None:
        raise exc
    decision = retry_or_fail(context, step, policy, exc)
    if isinstance(decision, RetryRequested) or not ranged:
        raise decision from exc
    context.log.error(decision.description)
    error_class = decision.metadata.get(ERROR_CLASS_KEY)
    return PartitionFailure(step.partition_key, step.step, decision.description or str(exc),
                            permanent=error_class is not None and error_class.value == PERMANENT)


def stopped(context: OpExecutionContext, reason: str) -> StepOutcomes:
    """Every partition of the run skipped, for ``reason`` (the concurrent-run policy)."""
    return StepOutcomes(context.run_id,
                        {key: PartitionSkipped(key, reason) for key in context.partition_keys})


def record_step(context: OpExecutionContext, spec: SourceSpec) -> None:
    """As each step starts: tag the run with its business job tags if it lacks them (a UI asset
    backfill run gets them here) and as running (its final status replaces that), and report
    the step's host, process, executor and Celery task as an engine event of the step, on the
    run page where they are read, not in the run list."""
    from mostovik_pipelines.core.dagster_compat import EngineEventData
    from mostovik_pipelines.platform.execution import current_celery_task_id

    # A re-execution (the UI's, a daemon run retry) starts with its parent's tags, the parent's
    # final status among them: the run list must not show it as this run's.
    record_running(context.instance, context.run, business_tags(spec))
    process = {STEP_HOST: socket.gethostname(), STEP_PID: str(os.getpid()),
               STEP_EXECUTOR: os.environ.get(EXECUTOR_ENV, "in_process")}
    task_id = current_celery_task_id()
    if task_id:
        process[STEP_CELERY_TASK] = task_id
    context.instance.report_engine_event(
        f"{context.op.name} on {process[STEP_HOST]}, pid {process[STEP_PID]}, "
        f"{process[STEP_EXECUTOR]} executor" + (f", celery task {task_id}" if task_id else ""),
        context.run, EngineEventData(process),
        step_key=context.get_step_execution_context().step.key,
    )
