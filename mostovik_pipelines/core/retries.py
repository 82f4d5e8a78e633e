"""The one retry mechanism: a classified failure becomes a bounded retry or an immediate failure.

Every op runs its work through :func:`retry_or_fail`. A transient failure raises Dagster's
``RetryRequested`` with an exponential, jittered wait (or the source's ``Retry-After``, capped);
a permanent one, or a transient one past the last attempt, becomes ``Failure(allow_retries=
False)`` with the error's class and context as metadata. Ops carry no ``RetryPolicy`` of their
own, so no exception is ever retried without passing through :func:`.errors.classify`.

The budget is per partition, not per step: every retry is recorded as an observation of the
failing partition (``mostovik/retry``: op, attempt, reason, wait), and a partition's attempts are
counted from its own records in the run's event log. Three partitions of a year-long backfill that
each fail once take one retry each, and the rest keep their full budget. The same records show an
operator every retry, per partition, in the UI.

A part we stand on being away (the warehouse or the object store restarting or failing over) is
not a failure to count: each partition's work is ridden out in place (:mod:`.outages`, the steps'
:func:`.steps.lifecycle.riding_out`), each wait recorded on the partition the same way
(:func:`outage_recorder`, ``"outage": true``), and past the store's budget the
:class:`.outages.StoreAway` it raises fails the partition here, as transient, without a retry.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dagster import (
    AssetKey,
    AssetObservation,
    DagsterEventType,
    Failure,
    MetadataValue,
    OpExecutionContext,
    RetryRequested,
)

from mostovik_pipelines.core.errors import Verdict, classify
from mostovik_pipelines.core.outages import BUDGETS, Store, first_line
from mostovik_pipelines.core.tags import ERROR_CLASS_KEY


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a step retries transient failures."""

    max_attempts: int = 4
    base_delay_seconds: float = 1.0
    max_delay_seconds: float = 60.0
    jitter: float = 0.5
    """Share of the delay drawn at random, so that parallel runs do not retry in lockstep."""
    retry_after_cap_seconds: float = 300.0
    """The longest ``Retry-After`` honoured; a source asking for more is waited on this long."""

    def wait_seconds(self, attempt: int, retry_after: float | None = None) -> float:
        """The wait before attempt ``attempt + 1``."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.retry_after_cap_seconds)
        delay = min(self.base_delay_seconds * 2 ** (attempt - 1), self.max_delay_seconds)
        return round(delay * (1 - self.jitter) + delay * self.jitter * random.random(), 3)


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True)
class StepContext:
    """Which business step failed: kept in every retry log line and failure."""

    source: str
    partition_key: str
    step: str

    def describe(self) -> str:
        return f"{self.source} [{self.partition_key}] {self.step}"


RETRY_METADATA_KEY = "mostovik/retry"


def retry_or_fail(
    context: OpExecutionContext, step: StepContext, policy: RetryPolicy, exc: Exception
) -> RetryRequested | Failure:
    """The exception that ends this attempt of the step: a retry while the failure is transient
    and the partition has attempts left (recorded, logged with reason, context and wait), else
    the final failure."""
    verdict = classify(exc)
    attempt = sum(not r.get("outage") for r in _retries_before(context, step, policy)) + 1
    if not verdict.retried_by_step or policy.max_attempts <= 1 or attempt >= policy.max_attempts:
        return failure_for(step, verdict, attempt, policy)
    wait = policy.wait_seconds(attempt, verdict.retry_after)
    message = (f"{step.describe()}: attempt {attempt} of {policy.max_attempts} failed "
               f"({verdict.kind}: {verdict.reason}); retrying in {wait:.1f}s")
    _record(context, step, message, {"attempt": attempt, "max_attempts": policy.max_attempts,
                                     "kind": verdict.kind, "reason": verdict.reason,
                                     "wait_seconds": wait, "outage": False})
    # The step restarts whole; its partitions already done are not redone (see the factory).
    return RetryRequested(max_retries=context.retry_number + 1, seconds_to_wait=wait)


def outage_recorder(context: OpExecutionContext, step: StepContext):
    """What a partition's work tells of each wait while a store is away (an ``on_wait`` of
    :func:`.outages.ride_out`): a warning in the run's log and a ``mostovik/retry`` record of
    the partition, ``"outage": true``, with the seconds ridden out so far."""
    waits = 0

    def record(store: Store, error: BaseException, seconds: float, wait: float) -> None:
        nonlocal waits
        waits += 1
        budget = BUDGETS[store]
        verdict = classify(error)
        message = (f"{step.describe()}: {budget.what} away ({first_line(error)}); retrying in "
                   f"{wait:.1f}s, {seconds + wait:.0f} s of an outage of up to "
                   f"{budget.seconds():.0f} s ridden out ({budget.setting})")
        _record(context, step, message, {"attempt": waits, "kind": verdict.kind,
                                         "reason": verdict.reason, "wait_seconds": wait,
                                         "outage": True, "store": store.value})

    return record


def _record(context: OpExecutionContext, step: StepContext, message: str, retry: dict) -> None:
    context.log.warning(message)
    context.log_event(AssetObservation(
        asset_key=AssetKey(step.source), partition=step.partition_key, description=message,
        metadata={RETRY_METADATA_KEY: MetadataValue.json({"op": step.step, **retry})},
    ))


def _retries_before(context: OpExecutionContext, step: StepContext,
                    policy: RetryPolicy) -> list[dict]:
    """The retry records of this partition's step earlier in the run."""
    if context.retry_number == 0 or policy.max_attempts <= 1:
        return []
    records = context.instance.get_records_for_run(
        context.run_id, of_type=DagsterEventType.ASSET_OBSERVATION).records
    retries = []
    for record in records:
        observation = record.event_log_entry.asset_observation
        if observation is None or observation.partition != step.partition_key:
            continue
        retry = observation.metadata.get(RETRY_METADATA_KEY)
        if retry is not None and retry.value.get("op") == step.step:
            retries.append(retry.value)
    return retries


def failure_for(step: StepContext, verdict: Verdict, attempt: int,
                policy: RetryPolicy) -> Failure:
    """The final, non-retried failure of a step, with its context as metadata."""
    if verdict.kind == "store_away":
        headline = f"{step.describe()}: gave up; nothing of this partition's work was committed"
    elif verdict.retried_by_step:
        headline = (
            f"{step.describe()}: source unavailable after {attempt} attempts"
            if verdict.kind in {"source_unavailable", "rate_limited", "timeout", "network"}
            else f"{step.describe()}: still failing after {attempt} attempts"
        )
    else:
        headline = f"{step.describe()}: {verdict.kind.replace('_', ' ')}"
    return Failure(
        description=f"{headline}: {verdict.reason}",
        metadata={
            ERROR_CLASS_KEY: verdict.label,
            "mostovik/error_kind": verdict.kind,
            "mostovik/source": step.source,
            "mostovik/partition": step.partition_key,
            "mostovik/op": step.step,
            "mostovik/attempt": MetadataValue.int(attempt),
            "mostovik/max_attempts": MetadataValue.int(policy.max_attempts),
            "mostovik/cause": verdict.reason,
        },
        allow_retries=False,
    )
