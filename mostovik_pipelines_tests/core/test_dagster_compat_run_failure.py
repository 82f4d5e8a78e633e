"""Pins ``dagster_compat.run_failed_unexpectedly``, the dead-run sensor's mark: the run fails
with the failure reason Dagster's run retries read, and they count it as retryable (an
infrastructure failure, not a step failure) unless the run allows no retry."""

from __future__ import annotations

from dagster import DagsterInstance, DagsterRunStatus, job, op

from mostovik_pipelines.core import dagster_compat as compat
from mostovik_pipelines.platform.execution import executor_from_environment, holds_run_claim


@op
def noop() -> None:
    pass


@job
def tiny() -> None:
    noop()


def test_a_run_marked_failed_unexpectedly_is_an_infrastructure_failure_retries_take_up():
    settings = {"run_retries": {"enabled": True, "max_retries": 1,
                                "retry_on_asset_or_op_failure": False}}
    with DagsterInstance.ephemeral(settings=settings) as instance:
        retried = instance.create_run_for_job(tiny)
        compat.run_failed_unexpectedly(instance, retried, "its process is gone")
        allowed_none = instance.create_run_for_job(tiny, tags={"dagster/max_retries": "0"})
        compat.run_failed_unexpectedly(instance, allowed_none, "its process is gone")

        failed = instance.get_run_by_id(retried.run_id)
        assert failed.status is DagsterRunStatus.FAILURE
        assert failed.tags["dagster/failure_reason"] == "UNEXPECTED_TERMINATION"
        assert failed.tags["dagster/will_retry"] == "true"
        assert instance.get_run_by_id(allowed_none.run_id).tags["dagster/will_retry"] == "false"


def test_the_executors_of_the_code_location_say_they_hold_the_run_claim(monkeypatch):
    """The dead-run sensor watches only runs whose executor holds the claim."""
    from dagster import in_process_executor

    for choice in ("in_process", "multiprocess", "celery"):
        monkeypatch.setenv("MOSTOVIK_EXECUTOR", choice)
        assert holds_run_claim(executor_from_environment()), choice
    assert not holds_run_claim(in_process_executor)
