"""The business job view over Dagster run storage (ADR-016): a run of a source's job is a job.

Run storage stays the one source of truth; this module only reads it and names what it finds in
the ADR's terms.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus

from mostovik_pipelines.etl.tags import JOB_TYPE_TAG, PARTITION_TAG, SOURCE_TAG

LOAD_COUNT_KEYS = ("inserted", "updated", "unchanged", "deleted", "rejected")


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


@dataclass(frozen=True)
class JobSummary:
    """One job as an operator sees it."""

    run_id: str
    source: str | None
    job_type: str | None
    partition: str | None
    status: JobStatus
    run_status: str
    counts: dict[str, int] = field(default_factory=dict)
    note: str = ""


def summarize_job(instance: DagsterInstance, run_id: str) -> JobSummary:
    """The job behind ``run_id``: status, and the load figures if it loaded anything."""
    run = instance.get_run_by_id(run_id)
    if run is None:
        raise LookupError(f"no run {run_id} in run storage")
    status = RUN_STATUS_TO_JOB_STATUS[run.status]
    counts: dict[str, int] = {}
    for record in instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION
    ).records:
        metadata = record.event_log_entry.asset_materialization.metadata
        for key in LOAD_COUNT_KEYS:
            if key in metadata:
                counts[key] = counts.get(key, 0) + int(metadata[key].value)
    note = ""
    if status is JobStatus.COMPLETED and not counts:
        note = "not available yet: nothing loaded"
    return JobSummary(
        run_id=run_id, source=run.tags.get(SOURCE_TAG), job_type=run.tags.get(JOB_TYPE_TAG),
        partition=run.tags.get(PARTITION_TAG), status=status, run_status=run.status.value,
        counts=counts, note=note,
    )
