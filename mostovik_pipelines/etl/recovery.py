"""Recovery (ADR-016): re-run a failed job from where it failed, or a fresh job for a period.

Both execute in the calling process, like ``dagster job execute``, against the instance of
``DAGSTER_HOME``; the new run is linked to the run it repeats. Re-running is always safe: loads
are idempotent upserts and the run-status check makes a re-run wait for a run still going.
"""

from __future__ import annotations

from dagster import DagsterInstance, DagsterRunStatus, ReexecutionOptions, execute_job
from dagster._core.definitions.reconstruct import ReconstructableRepository

from mostovik_pipelines.etl.tags import (
    CELERY_TASK_TAG_PREFIX,
    HOST_TAG,
    LAUNCHED_BY_TAG,
    PARTITION_TAG,
    PID_TAG,
    RERUN_OF_TAG,
)
from mostovik_pipelines.etl.tracking import JobNotFound, latest_job_for

CODE_LOCATION_MODULE = "mostovik_pipelines"
CODE_LOCATION_ATTRIBUTE = "defs"
PROCESS_TAG_PREFIXES = (HOST_TAG, PID_TAG, CELERY_TASK_TAG_PREFIX)
"""Tags that describe the repeated run's processes, not the job: not carried over."""


def _reconstructable(job_name: str):
    repository = ReconstructableRepository.for_module(CODE_LOCATION_MODULE,
                                                      CODE_LOCATION_ATTRIBUTE)
    return repository.get_reconstructable_job(job_name)


def rerun_from_failure(instance: DagsterInstance, run_id: str) -> str:
    """Re-execute a failed run from its failed steps, keeping its partition and tags. Returns the
    new run's id; its ``dagster/parent_run_id`` is ``run_id``."""
    run = instance.get_run_by_id(run_id)
    if run is None:
        raise JobNotFound(f"no run {run_id} in run storage")
    if run.status not in (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED):
        raise ValueError(f"run {run_id} is {run.status.value}, only a failed run is re-run "
                         "from failure; use --source/--period for a fresh run")
    kept = {k: v for k, v in run.tags.items() if not k.startswith(PROCESS_TAG_PREFIXES)}
    result = execute_job(
        _reconstructable(run.job_name), instance,
        reexecution_options=ReexecutionOptions.from_failure(run_id, instance),
        tags={**kept, LAUNCHED_BY_TAG: "mostovik jobs rerun", RERUN_OF_TAG: run_id},
    )
    return result.run_id


def rerun_partition(instance: DagsterInstance, source: str, partition: str) -> str:
    """A fresh run of ``source`` for ``partition``, linked to the latest run it repeats."""
    previous = latest_job_for(instance, source, partition)
    tags = {PARTITION_TAG: partition, LAUNCHED_BY_TAG: "mostovik jobs rerun"}
    if previous is not None:
        tags[RERUN_OF_TAG] = previous.run_id
    result = execute_job(_reconstructable(f"{source}_job"), instance, tags=tags)
    return result.run_id
