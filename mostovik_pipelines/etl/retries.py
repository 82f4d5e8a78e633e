"""The one retry mechanism: a classified failure becomes a bounded retry or an immediate failure.

Every op runs its work through :func:`run_with_retries`. A transient failure raises Dagster's
``RetryRequested`` with an exponential, jittered wait (or the source's ``Retry-After``, capped);
a permanent one, or a transient one on the last attempt, raises ``Failure(allow_retries=False)``
with the error's class and context as metadata. Ops carry no ``RetryPolicy`` of their own, so no
exception is ever retried without passing through :func:`.errors.classify`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dagster import Failure, MetadataValue, OpExecutionContext, RetryRequested

from mostovik_pipelines.etl.errors import Verdict, classify

T = TypeVar("T")


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


def run_with_retries(
    context: OpExecutionContext, step: StepContext, policy: RetryPolicy, work: Callable[[], T]
) -> T:
    """Run ``work`` once; turn its failure into a bounded retry or a final failure."""
    try:
        return work()
    except Exception as exc:  # every failure is classified; nothing escapes unjudged
        raise retry_or_fail(context, step, policy, exc) from exc


def retry_or_fail(
    context: OpExecutionContext, step: StepContext, policy: RetryPolicy, exc: Exception
) -> RetryRequested | Failure:
    """The exception that ends this attempt of the step: a retry while the failure is transient
    and attempts remain (logged with reason, context and wait), else the final failure."""
    verdict = classify(exc)
    attempt = context.retry_number + 1
    if verdict.transient and attempt < policy.max_attempts:
        wait = policy.wait_seconds(attempt, verdict.retry_after)
        context.log.warning(
            f"{step.describe()}: attempt {attempt} of {policy.max_attempts} failed "
            f"({verdict.kind}: {verdict.reason}); retrying in {wait:.1f}s"
        )
        return RetryRequested(max_retries=policy.max_attempts - 1, seconds_to_wait=wait)
    return failure_for(step, verdict, attempt, policy)


def failure_for(step: StepContext, verdict: Verdict, attempt: int, policy: RetryPolicy) -> Failure:
    """The final, non-retried failure of a step, with its context as metadata."""
    if verdict.transient:
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
            "mostovik/error_class": verdict.label,
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
