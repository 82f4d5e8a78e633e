"""The business job view over Dagster run storage (ADR-016): every run of a source is a job.

Run storage stays the one source of truth; this module only reads it (and, as a run's steps
start, records the facts run storage would not otherwise hold) and names what it finds in the
ADR's terms:

* type, source and period (partition, or a range of them) come from run tags, what operators
  filter the UI's run list by; a run launched without the source's tags (a UI asset backfill)
  gets them from its first step, so filtering by ``mostovik/source`` in the UI finds every run;
* the execution context of each step (host, process, executor, Celery task) is an engine event
  of the step, read where it is read: on the run page, and by ``mostovik jobs show``;
* status and result derive from the run's status and never contradict it; ``partial`` is a
  successful run that did not take everything in: rows quarantined, or partitions of its range
  left out (not available yet, or stopped for a concurrent run);
* figures, attempts and errors come from the run's event log.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Protocol

from dagster import (
    DagsterEvent,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    PartitionKeyRange,
    PartitionsDefinition,
    RunRecord,
    RunsFilter,
)

from mostovik_pipelines.core.tags import (
    JOB_TYPE_TAG,
    LAUNCHED_BY_TAG,
    PARTITION_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    REASON_TAG,
    REQUESTED_BY_TAG,
    RERUN_OF_TAG,
    SOURCE_TAG,
)
from mostovik_pipelines.platform.status import (
    RUN_STATUS_TO_JOB_STATUS,
    JobStatus,
    completed_or_partial,
    job_status,
)


class TrackedSource(Protocol):
    """What the tracker reads of a source's declaration (``framework/spec.py``'s
    ``SourceSpec``): the tracker sits below the declarations, so it names only these."""

    name: str
    job_type: Enum
    partitions_def: PartitionsDefinition
    max_runtime_seconds: int


LOAD_COUNT_KEYS = ("inserted", "updated", "unchanged", "deleted", "ignored_older", "tombstoned",
                   "rejected", "pages")
PARTITION_ONLY_KEYS = ("resumed_after_page",)
"""Per-partition figures that add up to nothing across partitions."""
MAX_RUNTIME_TAG = "dagster/max_runtime"
STEP_HOST = "mostovik/host"
STEP_PID = "mostovik/pid"
STEP_EXECUTOR = "mostovik/executor"
STEP_CELERY_TASK = "mostovik/celery_task"
"""Metadata of the engine event each step reports as it starts (``lifecycle.record_step``)."""


RESULTS = {JobStatus.COMPLETED: "success", JobStatus.PARTIAL: "partial", JobStatus.FAILED: "error"}
PENDING_RUN_STATUSES = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED,
                        DagsterRunStatus.STARTING]


class JobNotFound(LookupError):
    pass


@dataclass(frozen=True)
class JobError:
    """One failure of a job, as its event log tells it."""

    op: str | None
    error_class: str
    """``transient`` or ``permanent`` as the taxonomy classified it (``unclassified`` if the
    failure happened outside an op's classified work)."""
    kind: str | None
    message: str
    causes: list[str]


@dataclass(frozen=True)
class Job:
    """One business job: a run of a source, in the ADR's terms."""

    run_id: str
    source: str | None
    job_type: str | None
    partitions: list[str]
    status: JobStatus
    result: str | None
    run_status: str
    started_at: datetime | None
    ended_at: datetime | None
    launched_by: str
    executor: str | None
    parent_run_id: str | None
    root_run_id: str | None
    rerun_of: str | None
    totals: dict[str, int] = field(default_factory=dict)
    per_partition: dict[str, dict[str, int]] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    errors: list[JobError] = field(default_factory=list)
    celery_tasks: dict[str, str] = field(default_factory=dict)
    processes: dict[str, str] = field(default_factory=dict)
    """Op -> the host and process id its latest attempt ran in."""
    requested_by: str | None = None
    """Who asked for an operator's run (``mostovik/requested_by``)."""
    reason: str | None = None
    """Why they asked for it (``mostovik/reason``)."""

    @property
    def period(self) -> str:
        if len(self.partitions) > 1:
            return f"{self.partitions[0]}...{self.partitions[-1]}"
        return self.partitions[0] if self.partitions else "-"

    @property
    def duration_seconds(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.ended_at or datetime.now(UTC)
        return round((end - self.started_at).total_seconds(), 3)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(status=self.status.value, period=self.period,
                    duration_seconds=self.duration_seconds,
                    started_at=_iso(self.started_at), ended_at=_iso(self.ended_at))
        return data


def load_job(instance: DagsterInstance, run_id: str, sources: Sequence[TrackedSource]) -> Job:
    """The job behind ``run_id``; :class:`JobNotFound` if run storage has no such run.
    ``sources``: the code location's declarations (a run's source and partitions are read with
    them: a UI backfill names its source by asset and its partitions by range)."""
    records = instance.get_run_records(RunsFilter(run_ids=[run_id]), limit=1)
    if not records:
        raise JobNotFound(f"no run {run_id} in run storage")
    return _job_from_record(instance, records[0], _specs(sources))


def list_jobs(
    instance: DagsterInstance, *, source: str | None = None, job_type: str | None = None,
    status: JobStatus | None = None, period_from: str | None = None,
    period_to: str | None = None, since: datetime | None = None, limit: int = 50,
    sources: Sequence[TrackedSource],
) -> list[Job]:
    """Jobs newest first, filtered the way an administrator asks."""
    specs = _specs(sources)
    filters = RunsFilter(
        created_after=since,
        tags={SOURCE_TAG: source} if source else None,
        statuses=_run_statuses(status),
    )
    records = list(instance.get_run_records(filters, order_by="create_timestamp"))
    if source:
        # A run launched without the source's tags (a UI asset backfill) gets them from its
        # first step: before it starts, only its asset selection names the source.
        records += [
            record for record in instance.get_run_records(RunsFilter(
                created_after=since, statuses=_run_statuses(status) or PENDING_RUN_STATUSES))
            if SOURCE_TAG not in record.dagster_run.tags
            and _source_of(record.dagster_run, specs) == source
        ]
        records.sort(key=lambda r: r.create_timestamp, reverse=True)
    jobs = []
    for record in records:
        run = record.dagster_run
        if _source_of(run, specs) is None:
            continue
        job = _job_from_record(instance, record, specs, detail=False)
        if (job_type and job.job_type != job_type) or (status and job.status is not status):
            continue
        if period_from and (not job.partitions or job.partitions[-1] < period_from):
            continue
        if period_to and (not job.partitions or job.partitions[0] > period_to):
            continue
        jobs.append(job)
        if len(jobs) >= limit:
            break
    return jobs


def _run_statuses(status: JobStatus | None) -> list[DagsterRunStatus] | None:
    """The run statuses a job of ``status`` can have (a partial job is a successful run)."""
    if status is None:
        return None
    wanted = JobStatus.COMPLETED if status is JobStatus.PARTIAL else status
    return [run_status for run_status, meant in RUN_STATUS_TO_JOB_STATUS.items()
            if meant is wanted]


def stuck_jobs(instance: DagsterInstance, sources: Sequence[TrackedSource],
               now: datetime | None = None) -> list[Job]:
    """Jobs running longer than their source's expected maximum runtime."""
    specs = _specs(sources)
    now = now or datetime.now(UTC)
    stuck = []
    in_flight = [s for s, j in RUN_STATUS_TO_JOB_STATUS.items()
                 if j in (JobStatus.RUNNING, JobStatus.PENDING)
                 and s is not DagsterRunStatus.QUEUED]
    for record in instance.get_run_records(RunsFilter(statuses=in_flight)):
        run = record.dagster_run
        spec = specs.get(_source_of(run, specs) or "")
        if spec is None:
            continue
        limit = float(run.tags.get(MAX_RUNTIME_TAG, spec.max_runtime_seconds))
        started = record.start_time or record.create_timestamp.timestamp()
        if now.timestamp() - started > limit:
            stuck.append(_job_from_record(instance, record, specs))
    return stuck


def latest_job_for(instance: DagsterInstance, source: str, partition: str) -> Job | None:
    """The newest job of ``source`` for ``partition``, if any (found by its source and partition
    tags, so read without the declarations)."""
    records = instance.get_run_records(
        RunsFilter(tags={SOURCE_TAG: source, PARTITION_TAG: partition}), limit=1
    )
    return _job_from_record(instance, records[0], {}) if records else None


def _job_from_record(instance: DagsterInstance, record: RunRecord,
                     specs: dict[str, TrackedSource], detail: bool = True) -> Job:
    """The job of a run. Without ``detail`` (job lists) the event log is not read whole: the
    status comes from the run's status tag (:mod:`.status`) and the figures from its
    materialisations only."""
    run = record.dagster_run
    source = _source_of(run, specs)
    spec = specs.get(source or "")
    partitions = _partitions_of(run, spec)
    per_partition: dict[str, dict[str, int]] = {}
    left_out: dict[str, str] = {}
    attempts: dict[str, int] = {}
    errors: list[JobError] = []
    processes: dict[str, str] = {}
    celery_tasks: dict[str, str] = {}
    executor = None
    status, final = job_status(run)
    if not detail and final:
        entries = [record.event_log_entry for record in instance.get_records_for_run(
            run.run_id, of_type={DagsterEventType.ASSET_MATERIALIZATION,
                                 DagsterEventType.ENGINE_EVENT}).records]
    else:
        entries = instance.all_logs(run.run_id)
    for entry in entries:
        event = entry.dagster_event
        if event is None:
            continue
        if event.event_type is DagsterEventType.ENGINE_EVENT:
            step_process = _step_process(event)
            if step_process:
                op_name = (event.step_key or "").rsplit(".", 1)[-1]
                executor = step_process[STEP_EXECUTOR]
                processes[op_name] = f"{step_process[STEP_HOST]} pid {step_process[STEP_PID]}"
                if STEP_CELERY_TASK in step_process:
                    celery_tasks[op_name] = step_process[STEP_CELERY_TASK]
        elif event.event_type is DagsterEventType.ASSET_MATERIALIZATION:
            materialization = event.event_specific_data.materialization
            per_partition[materialization.partition or "-"] = {
                key: int(materialization.metadata[key].value)
                for key in (*LOAD_COUNT_KEYS, *PARTITION_ONLY_KEYS)
                if key in materialization.metadata
            }
        elif event.event_type is DagsterEventType.ASSET_OBSERVATION:
            metadata = event.event_specific_data.asset_observation.metadata
            for key in ("mostovik/skipped", "mostovik/failed"):
                if key in metadata:
                    left_out.update(metadata[key].value)
        elif event.event_type in (DagsterEventType.STEP_START, DagsterEventType.STEP_RESTARTED):
            op_name = (event.step_key or "").rsplit(".", 1)[-1]
            attempts[op_name] = attempts.get(op_name, 0) + 1
        elif event.event_type is DagsterEventType.STEP_FAILURE:
            errors.append(_step_error(event))
        elif event.event_type is DagsterEventType.RUN_FAILURE and not errors:
            errors.append(JobError(None, "unclassified", None, entry.user_message, []))
    totals = {key: sum(p.get(key, 0) for p in per_partition.values()) for key in LOAD_COUNT_KEYS
              if key in ("inserted", "updated", "unchanged", "deleted", "rejected")
              or any(key in p for p in per_partition.values())}
    if not final:
        status = completed_or_partial(totals["rejected"], left_out, ranged=len(partitions) > 1)
    return Job(
        run_id=run.run_id, source=source,
        job_type=run.tags.get(JOB_TYPE_TAG) or (spec.job_type.value if spec else None),
        partitions=partitions, status=status, result=RESULTS.get(status),
        run_status=run.status.value,
        started_at=_datetime(record.start_time), ended_at=_datetime(record.end_time),
        launched_by=_launched_by(run), executor=executor,
        parent_run_id=run.parent_run_id, root_run_id=run.root_run_id,
        rerun_of=run.tags.get(RERUN_OF_TAG),
        totals=totals if per_partition else {}, per_partition=per_partition,
        left_out=left_out, attempts=attempts, errors=errors, celery_tasks=celery_tasks,
        processes=processes, requested_by=run.tags.get(REQUESTED_BY_TAG),
        reason=run.tags.get(REASON_TAG),
    )


def _step_process(event: DagsterEvent) -> dict[str, str] | None:
    """The host, process, executor and Celery task a step reported (``lifecycle.record_step``)."""
    data = event.engine_event_data
    if data is None or STEP_HOST not in data.metadata:
        return None
    return {key: str(value.value) for key, value in data.metadata.items()}


def _step_error(event) -> JobError:
    data = event.step_failure_data
    metadata = data.user_failure_data.metadata if data.user_failure_data else {}
    error = data.error
    message = (data.user_failure_data.description if data.user_failure_data
               and data.user_failure_data.description else (error.message if error else ""))
    causes = []
    link = (error.cause or error.context) if error else None
    while link is not None:
        causes.append(f"{link.cls_name}: {link.message.strip()}")
        link = link.cause or link.context
    return JobError(
        op=(event.step_key or "").rsplit(".", 1)[-1],
        error_class=str(metadata["mostovik/error_class"].value)
        if "mostovik/error_class" in metadata else "unclassified",
        kind=str(metadata["mostovik/error_kind"].value) if "mostovik/error_kind" in metadata
        else None,
        message=message.strip(),
        causes=causes,
    )


def _launched_by(run: DagsterRun) -> str:
    tags = run.tags
    if LAUNCHED_BY_TAG in tags:
        return tags[LAUNCHED_BY_TAG]
    if "dagster/schedule_name" in tags:
        return f"schedule {tags['dagster/schedule_name']}"
    if "dagster/sensor_name" in tags:
        return f"sensor {tags['dagster/sensor_name']}"
    if "dagster/backfill" in tags:
        return f"backfill {tags['dagster/backfill']}"
    if run.parent_run_id:
        return "re-execution"
    # Runs launched through a code location server (UI, daemon) carry its origin; runs
    # executed by `dagster job execute` or in-process do not.
    return "ui" if run.remote_job_origin is not None else "cli"


def _source_of(run: DagsterRun, specs: dict[str, TrackedSource]) -> str | None:
    if SOURCE_TAG in run.tags:
        return run.tags[SOURCE_TAG]
    for name in specs:
        if run.job_name == f"{name}_job" or any(
            key.to_user_string() == name for key in (run.asset_selection or ())
        ):
            return name
    return None


def _partitions_of(run: DagsterRun, spec: TrackedSource | None) -> list[str]:
    if PARTITION_TAG in run.tags:
        return [run.tags[PARTITION_TAG]]
    start, end = run.tags.get(RANGE_START_TAG), run.tags.get(RANGE_END_TAG)
    if start and end:
        if spec is None:
            return [start, end]
        return list(spec.partitions_def.get_partition_keys_in_range(PartitionKeyRange(start, end)))
    return []


def _specs(sources: Iterable[TrackedSource]) -> dict[str, TrackedSource]:
    return {spec.name: spec for spec in sources}


def _datetime(timestamp: float | None) -> datetime | None:
    return datetime.fromtimestamp(timestamp, UTC) if timestamp else None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None
