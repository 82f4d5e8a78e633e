"""Recovery (ADR-016): re-run a failed job from where it failed, or a fresh job for a period.

Both execute in the calling process, like ``dagster job execute``, against the instance of
``DAGSTER_HOME``; the new run is linked to the run it repeats. Re-running is always safe: loads
are idempotent upserts and the run-status check makes a re-run wait for a run still going.
"""

from __future__ import annotations

from collections.abc import Mapping

from dagster import DagsterInstance, DagsterRunStatus, ReexecutionOptions, execute_job

from mostovik_pipelines.framework.dagster_compat import ReconstructableRepository
from mostovik_pipelines.framework.runs.tags import (
    LAUNCHED_BY_TAG,
    PARTITION_TAG,
    REASON_TAG,
    REQUESTED_BY_TAG,
    RERUN_OF_TAG,
    STATUS_TAG,
)
from mostovik_pipelines.framework.runs.tracking import JobNotFound, latest_job_for

CODE_LOCATION_MODULE = "mostovik_pipelines"
CODE_LOCATION_ATTRIBUTE = "defs"
PROCESS_TAG_PREFIXES = ("mostovik/host", "mostovik/pid", "mostovik/executor",
                        "mostovik/celery_task.")
"""Process tags of runs recorded before steps reported their processes as engine events: they
describe the repeated run's processes, not the job, and are not carried over."""


def _reconstructable(job_name: str):
    """The job by name, rebuilt from the code location module's repository. Not the public
    ``build_reconstructable_job``: its repository of one job refuses the implicit asset job that
    ``dagster asset materialize`` and the UI's asset backfills run (pinned by
    ``test_dagster_compat.py``)."""
    repository = ReconstructableRepository.for_module(CODE_LOCATION_MODULE,
                                                      CODE_LOCATION_ATTRIBUTE)
    return repository.get_reconstructable_job(job_name)


def rerun_from_failure(instance: DagsterInstance, run_id: str,
                       tags: Mapping[str, str] | None = None) -> str:
    """Re-execute a run, keeping its partition and tags: a failed one from its failed steps, a
    successful one whole (re-processing on purpose). Either way its partitions are fetched
    again, never replayed from the stored outputs (see the factory). ``tags`` (who asked and
    why) replace the repeated run's. Returns the new run's id; its ``dagster/parent_run_id`` is
    ``run_id``."""
    run = instance.get_run_by_id(run_id)
    if run is None:
        raise JobNotFound(f"no run {run_id} in run storage")
    if run.status is DagsterRunStatus.SUCCESS:
        options = ReexecutionOptions(parent_run_id=run_id)
    elif run.status in (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED):
        options = ReexecutionOptions.from_failure(run_id, instance)
    else:
        raise ValueError(f"run {run_id} is {run.status.value}: only a finished run is re-run")
    kept = {k: v for k, v in run.tags.items()
            if not k.startswith(PROCESS_TAG_PREFIXES)
            and k not in (STATUS_TAG, REQUESTED_BY_TAG, REASON_TAG)}
    result = execute_job(
        _reconstructable(run.job_name), instance, reexecution_options=options,
        tags={**kept, LAUNCHED_BY_TAG: "mostovik jobs rerun", **(tags or {}),
              RERUN_OF_TAG: run_id},
    )
    return result.run_id


def rerun_partition(instance: DagsterInstance, source: str, partition: str,
                    full_resync: bool = False, tags: Mapping[str, str] | None = None) -> str:
    """A fresh run of ``source`` for ``partition``, linked to the latest run it repeats and
    carrying ``tags`` (who asked and why); ``full_resync`` makes a paged source ignore the
    progress of an interrupted sync."""
    previous = latest_job_for(instance, source, partition)
    tags = {LAUNCHED_BY_TAG: "mostovik jobs rerun", **(tags or {}), PARTITION_TAG: partition}
    if previous is not None:
        tags[RERUN_OF_TAG] = previous.run_id
    run_config = {"ops": {source: {"ops": {f"extract_{source}": {
        "config": {"full_resync": True}}}}}} if full_resync else None
    result = execute_job(_reconstructable(f"{source}_job"), instance, tags=tags,
                         run_config=run_config)
    return result.run_id
