"""Recovery (ADR-016): re-run a failed job from where it failed, or a fresh job for a period.

An operator's re-run is **queued** (:func:`queue_rerun_from_failure`, :func:`queue_rerun_partition`,
what ``mostovik jobs rerun`` calls): the run is created in run storage with the code location's
origin and submitted to the instance's run coordinator, so the daemon launches it like any run,
with the queue's concurrency limits, run monitoring, run retries and the configured executor.
The in-process forms (:func:`rerun_from_failure`, :func:`rerun_partition`) execute in the calling
process, like ``dagster job execute``, for CI, a laptop and the chaos harness. Either way the new
run is linked to the run it repeats, and re-running is safe: loads are idempotent upserts, a
re-execution never takes an input older than its partition's latest load (see the factory), and
the run-status check makes a re-run wait for a run still going.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from dagster import (
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    MetadataValue,
    QueuedRunCoordinator,
    ReexecutionOptions,
    execute_job,
)

from mostovik_pipelines.core.dagster_compat import (
    AUTO_RETRY_RUN_ID_TAG,
    BACKFILL_TAGS,
    PARENT_RUN_ID_TAG,
    RESUME_RETRY_TAG,
    RETRY_NUMBER_TAG,
    ROOT_RUN_ID_TAG,
    TAGS_TO_MAYBE_OMIT_ON_RETRY,
    WILL_RETRY_TAG,
    EngineEventData,
    KnownExecutionState,
    LoadableTargetOrigin,
    ManagedGrpcPythonEnvCodeLocationOrigin,
    ReconstructableRepository,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
    create_execution_plan,
)
from mostovik_pipelines.core.tags import (
    LAUNCHED_BY_TAG,
    PARTITION_TAG,
    REASON_TAG,
    REQUESTED_BY_TAG,
    RERUN_OF_TAG,
)
from mostovik_pipelines.platform.status import without_status
from mostovik_pipelines.platform.tracking import JobNotFound, latest_job_for

CODE_LOCATION_MODULE = "mostovik_pipelines"
CODE_LOCATION_ATTRIBUTE = "defs"
CODE_LOCATION_NAME = "mostovik_pipelines"
"""The code location's name in the daemon's workspace (workspace.yaml, deploy/workspace.yaml):
a queued run names it, and the daemon launches it through that location's code server."""
REPOSITORY_NAME = "__repository__"
"""The repository name Dagster gives a ``Definitions`` object."""
LAUNCHED_BY = "mostovik jobs rerun"
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


def _finished_run(instance: DagsterInstance, run_id: str) -> DagsterRun:
    run = instance.get_run_by_id(run_id)
    if run is None:
        raise JobNotFound(f"no run {run_id} in run storage")
    if run.status not in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE,
                          DagsterRunStatus.CANCELED):
        raise ValueError(f"run {run_id} is {run.status.value}: only a finished run is re-run")
    return run


def _reexecution_tags(run: DagsterRun, tags: Mapping[str, str] | None) -> dict[str, str]:
    """The repeated run's tags, less its process, status and signature, plus ``tags``."""
    kept = {k: v for k, v in without_status(run.tags).items()
            if not k.startswith(PROCESS_TAG_PREFIXES) and k not in (REQUESTED_BY_TAG, REASON_TAG)}
    return {**kept, LAUNCHED_BY_TAG: LAUNCHED_BY, **(tags or {}), RERUN_OF_TAG: run.run_id}


def _partition_tags(instance: DagsterInstance, source: str, partition: str,
                    tags: Mapping[str, str] | None) -> dict[str, str]:
    """A fresh run's tags, linked to the latest run of the partition it repeats."""
    previous = latest_job_for(instance, source, partition)
    new_tags = {LAUNCHED_BY_TAG: LAUNCHED_BY, **(tags or {}), PARTITION_TAG: partition}
    if previous is not None:
        new_tags[RERUN_OF_TAG] = previous.run_id
    return new_tags


def _full_resync_config(source: str, full_resync: bool) -> dict[str, Any] | None:
    return {"ops": {source: {"ops": {f"extract_{source}": {
        "config": {"full_resync": True}}}}}} if full_resync else None


def rerun_from_failure(instance: DagsterInstance, run_id: str,
                       tags: Mapping[str, str] | None = None) -> str:
    """Re-execute a run in this process, keeping its partition and tags: a failed one from its
    failed steps, a successful one whole (re-processing on purpose). Either way its partitions
    are fetched again, never replayed from the stored outputs (see the factory). ``tags`` (who
    asked and why) replace the repeated run's. Returns the new run's id; its
    ``dagster/parent_run_id`` is ``run_id``."""
    run = _finished_run(instance, run_id)
    if run.status is DagsterRunStatus.SUCCESS:
        options = ReexecutionOptions(parent_run_id=run_id)
    else:
        options = ReexecutionOptions.from_failure(run_id, instance)
    result = execute_job(_reconstructable(run.job_name), instance, reexecution_options=options,
                         tags=_reexecution_tags(run, tags))
    return result.run_id


def rerun_partition(instance: DagsterInstance, source: str, partition: str,
                    full_resync: bool = False, tags: Mapping[str, str] | None = None) -> str:
    """A fresh run of ``source`` for ``partition`` in this process, linked to the latest run it
    repeats and carrying ``tags``; ``full_resync`` makes a paged source ignore the progress of
    an interrupted sync."""
    result = execute_job(_reconstructable(f"{source}_job"), instance,
                         tags=_partition_tags(instance, source, partition, tags),
                         run_config=_full_resync_config(source, full_resync))
    return result.run_id


class NoRunQueue(ValueError):
    """The instance has no run queue for a queued re-run to wait in."""


def queue_rerun_from_failure(instance: DagsterInstance, run_id: str,
                             tags: Mapping[str, str] | None = None) -> str:
    """:func:`rerun_from_failure`, submitted to the run queue instead of executed here: the new
    run (a failed one's failed steps, a successful one's every step) is created with the steps
    it takes and what its parent left, as the UI's "Re-execute" creates one; its id."""
    _require_queue(instance)
    run = _finished_run(instance, run_id)
    new_run = _create_reexecution(instance, run, _reexecution_tags(run, tags),
                                  _remote_origin(run.job_name))
    return _submit(instance, new_run)


def queue_automatic_retry(instance: DagsterInstance, run: DagsterRun) -> str:
    """The daemon's run retry of the failed ``run``, made and queued here as Dagster's retry pass
    makes one (``retry_run``): its failed steps, its tags (less its status, process and failure
    tags; its backfill's kept, as the pass keeps them while the backfill goes on), numbered in
    its run group, announced in both event logs, and named by the failed run once queued (see
    :func:`finish_automatic_retry`), the failed run tagged ``dagster/will_retry`` true. For a
    run that pass missed (:mod:`.framework.runs.missed_retries`); its id."""
    _require_queue(instance)
    # First, so that the run's tags say a retry comes at every moment (the alerts read them):
    # the daemon's retry pass set it false where it gave the run up.
    instance.add_run_tags(run.run_id, {WILL_RETRY_TAG: "true"})
    group = instance.get_run_group(run.run_id)
    retry_number = len(list(group[1])) if group else 1
    omitted = TAGS_TO_MAYBE_OMIT_ON_RETRY - BACKFILL_TAGS
    kept = {key: value for key, value in without_status(run.tags).items()
            if key not in omitted and not key.startswith(PROCESS_TAG_PREFIXES)}
    tags = {**kept, RETRY_NUMBER_TAG: str(retry_number), RESUME_RETRY_TAG: "true",
            PARENT_RUN_ID_TAG: run.run_id, ROOT_RUN_ID_TAG: run.root_run_id or run.run_id}
    retry = _create_reexecution(instance, run, tags, run.remote_job_origin)
    instance.report_engine_event("Retrying the run", run, EngineEventData(
        {"new run": MetadataValue.dagster_run(retry.run_id)}))
    instance.report_engine_event("Launched as an automatic retry", retry, EngineEventData(
        {"failed run": MetadataValue.dagster_run(run.run_id)}))
    return finish_automatic_retry(instance, run, retry)


def finish_automatic_retry(instance: DagsterInstance, run: DagsterRun, retry: DagsterRun) -> str:
    """Queue ``retry`` if it was made and not queued yet, then name it on the failed ``run``
    (``dagster/auto_retry_run_id``): a process stopped between the two leaves a retry found
    again by its number and finished here, never a second one; its id."""
    if retry.status is DagsterRunStatus.NOT_STARTED:
        _submit(instance, retry)
    if run.tags.get(AUTO_RETRY_RUN_ID_TAG) != retry.run_id:
        instance.add_run_tags(run.run_id, {AUTO_RETRY_RUN_ID_TAG: retry.run_id})
    return retry.run_id


def _create_reexecution(instance: DagsterInstance, run: DagsterRun, tags: Mapping[str, str],
                        origin: RemoteJobOrigin) -> DagsterRun:
    """A not yet started re-execution of the finished ``run`` (its failed steps, or every step
    of a successful one) linked to it, carrying ``tags``, for the daemon to launch from
    ``origin``."""
    job = _reconstructable(run.job_name)
    plan = None
    if run.status is not DagsterRunStatus.SUCCESS:
        step_keys, known_state = KnownExecutionState.build_resume_retry_reexecution(
            instance=instance, parent_run=run)
        plan = create_execution_plan(job, run.run_config, step_keys_to_execute=step_keys,
                                     known_state=known_state, tags=run.tags)
    if run.asset_selection:
        job = job.get_subset(op_selection=None, asset_selection=run.asset_selection)
    root_run_id = run.root_run_id or run.run_id
    return instance.create_run_for_job(
        job_def=job.get_definition(), execution_plan=plan, run_config=run.run_config,
        tags=tags,
        op_selection=run.op_selection, asset_selection=run.asset_selection,
        resolved_op_selection=run.resolved_op_selection, root_run_id=root_run_id,
        parent_run_id=run.run_id, status=DagsterRunStatus.NOT_STARTED, remote_job_origin=origin,
        job_code_origin=job.get_python_origin())


def queue_rerun_partition(instance: DagsterInstance, source: str, partition: str,
                          full_resync: bool = False,
                          tags: Mapping[str, str] | None = None) -> str:
    """:func:`rerun_partition`, submitted to the run queue instead of executed here; its id."""
    _require_queue(instance)
    job = _reconstructable(f"{source}_job")
    new_run = instance.create_run_for_job(
        job_def=job.get_definition(), run_config=_full_resync_config(source, full_resync),
        tags=_partition_tags(instance, source, partition, tags),
        status=DagsterRunStatus.NOT_STARTED, remote_job_origin=_remote_origin(f"{source}_job"),
        job_code_origin=job.get_python_origin())
    return _submit(instance, new_run)


def _require_queue(instance: DagsterInstance) -> None:
    if not isinstance(instance.run_coordinator, QueuedRunCoordinator):
        raise NoRunQueue(
            "the Dagster instance has no run queue (run_coordinator QueuedRunCoordinator, as in "
            "dagster.yaml): run in this process with `mostovik materialize` or "
            "`dagster job execute` instead")


def _remote_origin(job_name: str) -> RemoteJobOrigin:
    """The job as the daemon's workspace knows it: the location is found by its name."""
    target = LoadableTargetOrigin(executable_path=sys.executable,
                                  module_name=CODE_LOCATION_MODULE,
                                  attribute=CODE_LOCATION_ATTRIBUTE,
                                  working_directory=os.getcwd())
    location = ManagedGrpcPythonEnvCodeLocationOrigin(target, CODE_LOCATION_NAME)
    return RemoteJobOrigin(RemoteRepositoryOrigin(location, REPOSITORY_NAME), job_name)


def _submit(instance: DagsterInstance, run: DagsterRun) -> str:
    # The queued run coordinator only records the run as queued (the daemon launches it through
    # its own workspace): it needs no workspace here (pinned by test_dagster_compat_queue.py).
    instance.submit_run(run.run_id, workspace=None)  # type: ignore[arg-type]
    return run.run_id
