"""Declaration -> Dagster: a partitioned graph-backed asset of three ops, its job and schedule.

* ``extract_<source>`` calls the source and lands the raw bytes (retries network failures);
* ``transform_<source>`` parses the landed bytes into a typed frame and validates it (never
  retried: the same bytes parse the same way);
* ``load_<source>`` upserts each partition in a transaction of its own (retries transient
  database failures; safe because a transaction either commits whole or leaves nothing) and
  records one materialisation per partition with its figures.

A run takes one partition, or a range of them when the source's backfill policy allows it; each
op then works partition by partition. In a ranged run a partition that fails permanently is set
aside and the others go on; the run fails at the end, naming the failed partitions, with the
good ones loaded. A retried step resumes: what its run already landed or loaded is not redone.

A source that has not published a partition yet makes it "not available yet": nothing is
loaded, the partition stays unmaterialised, and a later run picks it up.
"""

from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

import pandas as pd
from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    AssetSelection,
    Config,
    DagsterEventType,
    DefaultScheduleStatus,
    Definitions,
    Failure,
    MetadataValue,
    OpExecutionContext,
    Out,
    RetryRequested,
    RunRequest,
    ScheduleEvaluationContext,
    define_asset_job,
    graph_asset,
    op,
    schedule,
)

from mostovik_pipelines.etl.errors import PermanentError
from mostovik_pipelines.etl.loading import load_partition
from mostovik_pipelines.etl.quarantine import replace_quarantine
from mostovik_pipelines.etl.retries import (
    NO_RETRY,
    RetryPolicy,
    StepContext,
    retry_or_fail,
    run_with_retries,
)
from mostovik_pipelines.etl.runs_in_flight import RunClaim, wait_for_older_runs
from mostovik_pipelines.etl.spec import (
    ExtractRequest,
    PartitionNotAvailable,
    RejectedRow,
    SourceSpec,
    TransformRequest,
)
from mostovik_pipelines.etl.tags import business_tags
from mostovik_pipelines.etl.tracking import record_step
from mostovik_pipelines.etl.validation import validate_partition
from mostovik_pipelines.resources.landing import LandedPayload

WAREHOUSE_KEY = "warehouse"
LANDING_KEY = "landing"
SHOWN_FAILURES = 5


def source_resource_key(spec: SourceSpec) -> str:
    return f"{spec.name}_source"


class ExtractConfig(Config):
    """Run config of the extract op."""

    reuse_landed: bool = False
    """Re-transform the partition's most recently landed payload instead of calling the source."""


@dataclass(frozen=True)
class TransformedPartition:
    """What transform hands to load for one partition: rows to load, rows to quarantine."""

    frame: pd.DataFrame
    landed: LandedPayload
    duplicates_dropped: int
    rejected: tuple[RejectedRow, ...]


@dataclass(frozen=True)
class PartitionSkipped:
    """A partition with nothing to load yet (the source has not published it)."""

    partition_key: str
    reason: str


@dataclass(frozen=True)
class PartitionFailure:
    """A partition of a ranged run that failed for good; the other partitions go on."""

    partition_key: str
    step: str
    message: str


def build_source_definitions(spec: SourceSpec) -> Definitions:
    """Everything Dagster needs for one source: its asset, job and schedule. The resources,
    the source's own included (:func:`source_resource_key`), are bound by the code location."""
    extract, transform, load = _extract_op(spec), _transform_op(spec), _load_op(spec)

    @graph_asset(
        name=spec.name,
        description=spec.description,
        partitions_def=spec.partitions_def,
        backfill_policy=spec.backfill_policy,
        group_name=spec.job_type.value,
        kinds={spec.job_type.value},
        metadata={
            "mostovik/table": spec.table.name,
            "mostovik/natural_key": ", ".join(spec.natural_key),
            "mostovik/load_mode": spec.load_mode.value,
        },
        tags={"mostovik/job_type": spec.job_type.value},
    )
    def source_asset():
        return load(transform(extract()))

    job = define_asset_job(
        name=f"{spec.name}_job",
        description=f"Extract, transform and load partitions of {spec.name}.",
        selection=AssetSelection.assets(source_asset),
        partitions_def=spec.partitions_def,
        tags={**business_tags(spec), "dagster/max_runtime": str(spec.max_runtime_seconds)},
    )
    schedules = [_schedule(spec, job)] if spec.schedule else []
    return Definitions(assets=[source_asset], jobs=[job], schedules=schedules)


def _op_tags(spec: SourceSpec) -> dict[str, str]:
    """Routes the source's steps to its Celery queue, when it declares one."""
    return {"dagster-celery/queue": spec.celery_queue} if spec.celery_queue else {}


def _set_aside(
    context: OpExecutionContext, step: StepContext, policy: RetryPolicy, exc: Exception,
    ranged: bool,
) -> PartitionFailure:
    """Retry the step while the failure is transient; else fail the run (one partition) or set
    the partition aside (a range), logging why."""
    decision = retry_or_fail(context, step, policy, exc)
    if isinstance(decision, RetryRequested) or not ranged:
        raise decision from exc
    context.log.error(decision.description)
    return PartitionFailure(step.partition_key, step.step, decision.description or str(exc))


def _extract_op(spec: SourceSpec):
    resource_key = source_resource_key(spec)

    @op(
        name=f"extract_{spec.name}",
        description=f"Fetch partitions of {spec.name} and land the raw payloads.",
        required_resource_keys={resource_key, LANDING_KEY},
        tags=_op_tags(spec),
    )
    def extract(context: OpExecutionContext, config: ExtractConfig) -> dict:
        record_step(context, spec)
        landing = getattr(context.resources, LANDING_KEY)
        keys = context.partition_keys
        other_runs = _runs_to_give_way_to(context, spec, keys)
        if other_runs:
            reason = (f"stopped: run(s) {', '.join(other_runs)} of the same partition(s) "
                      "in progress; nothing loaded by this run")
            context.log.warning(f"{spec.name}: {reason}")
            return {key: PartitionSkipped(key, reason) for key in keys}
        outcomes: dict[str, LandedPayload | PartitionFailure] = {}
        for key in keys:
            step = StepContext(spec.name, key, "extract")
            latest = landing.latest(spec.name, key)
            if config.reuse_landed or (latest is not None and latest.run_id == context.run_id):
                if latest is None:
                    outcomes[key] = _set_aside(context, step, NO_RETRY, PermanentError(
                        "nothing landed yet to re-transform"), len(keys) > 1)
                else:
                    outcomes[key] = latest
                continue
            try:
                raw = spec.extract(ExtractRequest(
                    source=spec.name, partition_key=key,
                    resource=getattr(context.resources, resource_key),
                ))
                outcomes[key] = landing.land(
                    spec.name, key, raw.content, content_type=raw.content_type,
                    origin=raw.origin, fetched_at=datetime.now(UTC), run_id=context.run_id,
                )
            except Exception as exc:
                outcomes[key] = _set_aside(context, step, spec.extract_retry, exc, len(keys) > 1)
        landed = [o for o in outcomes.values() if isinstance(o, LandedPayload)]
        context.log.info(
            f"{spec.name}: landed {len(landed)} of {len(keys)} partitions, "
            f"{sum(o.size_bytes for o in landed)} bytes"
        )
        return outcomes

    return extract


def _runs_to_give_way_to(context: OpExecutionContext, spec: SourceSpec, keys) -> list[str]:
    """Apply the source's concurrent-run policy; the ids of the runs to stop for, if any."""
    claim = RunClaim(context.run_id, f"{spec.name}_job", AssetKey(spec.name), frozenset(keys))
    scope = keys[0] if len(keys) == 1 else f"{keys[0]}...{keys[-1]}"
    older = run_with_retries(
        context, StepContext(spec.name, scope, "extract"), NO_RETRY,
        lambda: wait_for_older_runs(
            context.instance, claim, spec.partitions_def, spec.on_concurrent_run,
            spec.concurrent_run_wait_seconds, context.log.info,
        ),
    )
    return [run.run_id for run in older]


def _transform_op(spec: SourceSpec):
    @op(
        name=f"transform_{spec.name}",
        description=f"Parse and validate the landed payloads of {spec.name}.",
        required_resource_keys={LANDING_KEY},
        tags=_op_tags(spec),
    )
    def transform(context: OpExecutionContext, extracted: dict) -> dict:
        record_step(context, spec)
        landing = getattr(context.resources, LANDING_KEY)
        outcomes: dict[str, TransformedPartition | PartitionSkipped | PartitionFailure] = {}
        for key, landed in extracted.items():
            if not isinstance(landed, LandedPayload):
                outcomes[key] = landed
                continue
            try:
                parsed = spec.transform(TransformRequest(
                    source=spec.name, partition_key=key, content=landing.read(landed),
                    content_type=landed.content_type, fetched_at=landed.fetched_at,
                ))
                validated = validate_partition(parsed, spec.load_target, key,
                                               spec.max_rejected_share)
            except PartitionNotAvailable as not_yet:
                context.log.info(f"{spec.name} [{key}] not available yet: {not_yet}; "
                                 "nothing loaded, a later run will pick it up")
                outcomes[key] = PartitionSkipped(key, f"not available yet: {not_yet}")
                continue
            except Exception as exc:
                step = StepContext(spec.name, key, "transform")
                outcomes[key] = _set_aside(context, step, NO_RETRY, exc, len(extracted) > 1)
                continue
            if validated.rejected:
                context.log.warning(
                    f"{spec.name} [{key}]: {len(validated.rejected)} rows rejected to quarantine, "
                    f"first: row {validated.rejected[0].row_number}: {validated.rejected[0].reason}"
                )
            outcomes[key] = TransformedPartition(
                validated.frame, landed, validated.duplicates_dropped, validated.rejected
            )
        return outcomes

    return transform


def _load_op(spec: SourceSpec):
    asset_key = AssetKey(spec.name)

    @op(
        name=f"load_{spec.name}",
        description=f"Upsert partitions of {spec.name} into {spec.table.name}.",
        required_resource_keys={WAREHOUSE_KEY},
        out=Out(is_required=False),
        tags=_op_tags(spec),
    )
    def load(context: OpExecutionContext, transformed: dict):
        record_step(context, spec)
        engine = getattr(context.resources, WAREHOUSE_KEY).engine()
        already_loaded = _partitions_materialized_by_run(context, asset_key)
        skipped = [o for o in transformed.values() if isinstance(o, PartitionSkipped)]
        failed = [o for o in transformed.values() if isinstance(o, PartitionFailure)]
        for key, outcome in transformed.items():
            if not isinstance(outcome, TransformedPartition) or key in already_loaded:
                continue
            step = StepContext(spec.name, key, "load")
            try:
                counts = load_partition(
                    engine, spec.load_target, outcome.frame, key, context.run_id,
                    within_transaction=partial(replace_quarantine, source=spec.name,
                                               partition_key=key, run_id=context.run_id,
                                               rejected=outcome.rejected),
                )
            except Exception as exc:
                failed.append(_set_aside(context, step, spec.load_retry, exc,
                                         len(transformed) > 1))
                continue
            context.log.info(f"{spec.name} [{key}] loaded: {counts.as_dict()}, "
                             f"rejected: {len(outcome.rejected)}")
            context.log_event(AssetMaterialization(
                asset_key=asset_key, partition=key,
                metadata={
                    **{name: MetadataValue.int(n) for name, n in counts.as_dict().items()},
                    "rejected": MetadataValue.int(len(outcome.rejected)),
                    "duplicates_dropped": MetadataValue.int(outcome.duplicates_dropped),
                    "dagster/row_count": MetadataValue.int(len(outcome.frame)),
                    "table": spec.table.name,
                    "content_hash": outcome.landed.content_hash,
                    "fetched_at": outcome.landed.fetched_at.isoformat(),
                },
            ))
        if skipped or failed:
            context.log_event(AssetObservation(asset_key=asset_key, metadata={
                "mostovik/skipped": MetadataValue.json(
                    {o.partition_key: o.reason for o in skipped}),
                "mostovik/failed": MetadataValue.json(
                    {o.partition_key: o.message for o in failed}),
            }))
        if failed:
            shown = "; ".join(f.message for f in failed[:SHOWN_FAILURES])
            raise Failure(
                description=f"{spec.name}: {len(failed)} of {len(transformed)} partitions "
                            f"failed: {shown}",
                metadata={"mostovik/failed_partitions": MetadataValue.json(
                    [f.partition_key for f in failed])},
                allow_retries=False,
            )
        # The op is a generator that yields no output: its materialisations are the explicit,
        # per-partition ones above, never one for the whole range.
        yield from ()

    return load


def _partitions_materialized_by_run(context: OpExecutionContext, asset_key: AssetKey) -> set:
    """Partitions this run already loaded (before a retry of the load step)."""
    if context.retry_number == 0:
        return set()
    records = context.instance.get_records_for_run(
        context.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION
    ).records
    return {
        record.event_log_entry.asset_materialization.partition for record in records
        if record.event_log_entry.asset_materialization.asset_key == asset_key
    }


def _schedule(spec: SourceSpec, job):
    assert spec.schedule is not None
    latest = spec.schedule.latest_partitions

    @schedule(
        name=f"{spec.name}_schedule",
        cron_schedule=spec.schedule.cron,
        execution_timezone=spec.schedule.timezone,
        job=job,
        default_status=DefaultScheduleStatus.RUNNING,
        description=f"Refresh the {latest} newest partition(s) of {spec.name}.",
    )
    def refresh_latest_partitions(context: ScheduleEvaluationContext):
        keys = spec.partitions_def.get_partition_keys(
            current_time=context.scheduled_execution_time
        )
        tick = (context.scheduled_execution_time or datetime.now(UTC)).isoformat()
        for key in keys[-latest:]:
            yield RunRequest(partition_key=key, run_key=f"{key}@{tick}")

    return refresh_latest_partitions
