"""A run's ADR-016 status, as the UI's run list, ``mostovik jobs`` and the alerts show it: the one
place that writes it and reads it.

Dagster's run status says whether a run is queued, started or ended and how; the ADR wants more
(a successful run that did not take everything in is *partial*). So each run carries its job
status as the run tag ``mostovik/status`` (the UI's run list shows and filters it; job lists read
it instead of whole event logs). It is written

* ``running`` by each step as it starts (a re-execution starts with its parent's final status
  among its tags, which must not show as its own);
* ``completed`` or ``partial`` by the load step as the run ends (:func:`completed_or_partial`);
* ``failed`` by the step that fails for good, and, for a run that could not say so itself, by the
  sensors that see it ended: a run failed from outside (its process killed), a cancelled run, a
  dead run marked failed.

Everything that writes it calls :func:`record`, :func:`record_running` or :func:`record_failed`;
everything that reads it calls :func:`recorded` or :func:`job_status`. A new status, or another
way of showing one, changes this module (and :mod:`.tracking`'s figures, if it derives from them).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus

STATUS_TAG = "mostovik/status"
"""The run tag of the ADR status of a job."""
NOT_AVAILABLE_YET = "not available yet"
"""How a partition the source has not published yet is left out (its reason starts so)."""


class JobStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    PARTIAL = "partial"


RUN_STATUS_TO_JOB_STATUS = {
    DagsterRunStatus.QUEUED: JobStatus.PENDING,
    DagsterRunStatus.NOT_STARTED: JobStatus.PENDING,
    DagsterRunStatus.STARTING: JobStatus.PENDING,
    DagsterRunStatus.MANAGED: JobStatus.PENDING,
    DagsterRunStatus.STARTED: JobStatus.RUNNING,
    DagsterRunStatus.CANCELING: JobStatus.RUNNING,
    DagsterRunStatus.SUCCESS: JobStatus.COMPLETED,
    DagsterRunStatus.FAILURE: JobStatus.FAILED,
    DagsterRunStatus.CANCELED: JobStatus.FAILED,
}
"""The job status each run status means, before the run's figures say partial."""


def completed_or_partial(rejected: int, left_out: Mapping[str, str], *,
                         ranged: bool) -> JobStatus:
    """The status of a job whose run succeeded: partial when it did not take everything in (rows
    quarantined; a partition stopped for a concurrent run or superseded by a newer load; any
    partition of a range left out), else completed. A single partition the source has not
    published yet is completed: the run did all there was to do."""
    if rejected or (ranged and left_out):
        return JobStatus.PARTIAL
    if any(not reason.startswith(NOT_AVAILABLE_YET) for reason in left_out.values()):
        return JobStatus.PARTIAL
    return JobStatus.COMPLETED


def record(instance: DagsterInstance, run_id: str, status: JobStatus,
           tags: Mapping[str, str] | None = None) -> None:
    """Write the run's status (with ``tags``, in the same write)."""
    instance.add_run_tags(run_id, {**(tags or {}), STATUS_TAG: status.value})


def record_running(instance: DagsterInstance, run: DagsterRun,
                   tags: Mapping[str, str] | None = None) -> None:
    """As a step starts: the run is running, with ``tags`` it lacks; nothing is written when it
    already says all that."""
    missing = {key: value for key, value in (tags or {}).items() if run.tags.get(key) != value}
    if missing or recorded(run) is not JobStatus.RUNNING:
        record(instance, run.run_id, JobStatus.RUNNING, missing)


def record_failed(instance: DagsterInstance, run: DagsterRun) -> None:
    """The run failed for good (or was cancelled, or died); nothing is written when it already
    says so."""
    if recorded(run) is not JobStatus.FAILED:
        record(instance, run.run_id, JobStatus.FAILED)


def recorded(run: DagsterRun) -> JobStatus | None:
    """The status the run carries, if any."""
    value = run.tags.get(STATUS_TAG)
    return JobStatus(value) if value in JobStatus._value2member_map_ else None


def job_status(run: DagsterRun) -> tuple[JobStatus, bool]:
    """The run's job status as far as run storage and its tag say, and whether that is final: a
    successful run tagged completed or partial is; any other successful run's figures decide
    between the two (:func:`completed_or_partial`)."""
    status = RUN_STATUS_TO_JOB_STATUS[run.status]
    tagged = recorded(run)
    if status is JobStatus.COMPLETED and tagged in (JobStatus.COMPLETED, JobStatus.PARTIAL):
        return tagged, True
    return status, status is not JobStatus.COMPLETED


def without_status(tags: Mapping[str, str]) -> dict[str, str]:
    """``tags`` less the status: what a re-run may carry over from the run it repeats."""
    return {key: value for key, value in tags.items() if key != STATUS_TAG}
