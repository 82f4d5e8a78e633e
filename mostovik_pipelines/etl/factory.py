"""Declaration -> Dagster: a partitioned graph-backed asset of three ops, its job and schedule.

* ``extract_<source>`` calls the source and lands the raw bytes (retries network failures);
* ``transform_<source>`` parses the landed bytes into a typed frame and validates it (never
  retried: the same bytes parse the same way);
* ``load_<source>`` upserts the partition in one transaction (retries transient database
  failures; safe because the transaction either commits whole or leaves nothing).

A source that has not published a partition yet makes ``transform`` yield nothing: the load is
skipped, the asset partition stays unmaterialised, the run succeeds, and a later run picks the
partition up.
"""


from dataclasses import dataclass
from datetime import UTC, datetime

from dagster import (
    AssetSelection,
    Config,
    DefaultScheduleStatus,
    Definitions,
    Failure,
    MetadataValue,
    OpExecutionContext,
    Out,
    Output,
    RunRequest,
    ScheduleEvaluationContext,
    define_asset_job,
    graph_asset,
    op,
    schedule,
)

from mostovik_pipelines.etl.loading import load_partition
from mostovik_pipelines.etl.retries import NO_RETRY, StepContext, run_with_retries
from mostovik_pipelines.etl.spec import (
    ExtractRequest,
    PartitionNotAvailable,
    SourceSpec,
    TransformRequest,
)
from mostovik_pipelines.etl.tags import business_tags
from mostovik_pipelines.etl.validation import validate_partition_frame
from mostovik_pipelines.resources.landing import LandedPayload

WAREHOUSE_KEY = "warehouse"
LANDING_KEY = "landing"


def source_resource_key(spec: SourceSpec) -> str:
    return f"{spec.name}_source"


class ExtractConfig(Config):
    """Run config of the extract op."""

    reuse_landed: bool = False
    """Re-transform the partition's most recently landed payload instead of calling the source."""


@dataclass(frozen=True)
class TransformedPartition:
    """What transform hands to load: validated rows and the landed payload they came from."""

    frame: object
    landed: LandedPayload
    duplicates_dropped: int


def build_source_definitions(spec: SourceSpec) -> Definitions:
    """Everything Dagster needs for one source: its asset, job and schedule. The resources,
    the source's own included (:func:`source_resource_key`), are bound by the code location."""
    extract, transform, load = _extract_op(spec), _transform_op(spec), _load_op(spec)

    @graph_asset(
        name=spec.name,
        description=spec.description,
        partitions_def=spec.partitions_def,
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
        description=f"Extract, transform and load one partition of {spec.name}.",
        selection=AssetSelection.assets(source_asset),
        partitions_def=spec.partitions_def,
        tags={**business_tags(spec), "dagster/max_runtime": str(spec.max_runtime_seconds)},
    )
    schedules = [_schedule(spec, job)] if spec.schedule else []
    return Definitions(
        assets=[source_asset],
        jobs=[job],
        schedules=schedules,
    )


def _extract_op(spec: SourceSpec):
    resource_key = source_resource_key(spec)

    @op(
        name=f"extract_{spec.name}",
        description=f"Fetch one partition of {spec.name} and land the raw payload.",
        required_resource_keys={resource_key, LANDING_KEY},
    )
    def extract(context: OpExecutionContext, config: ExtractConfig) -> LandedPayload:
        partition_key = context.partition_key
        landing = getattr(context.resources, LANDING_KEY)
        if config.reuse_landed:
            landed = landing.latest(spec.name, partition_key)
            if landed is None:
                raise Failure(
                    f"{spec.name} [{partition_key}] extract: nothing landed yet to re-transform",
                    allow_retries=False,
                )
            context.log.info(f"re-using payload {landed.content_hash[:12]} landed "
                             f"{landed.fetched_at:%Y-%m-%d %H:%M:%S}")
            return landed

        def fetch_and_land() -> LandedPayload:
            raw = spec.extract(ExtractRequest(
                source=spec.name, partition_key=partition_key,
                resource=getattr(context.resources, resource_key),
            ))
            return landing.land(
                spec.name, partition_key, raw.content, content_type=raw.content_type,
                origin=raw.origin, fetched_at=datetime.now(UTC),
            )

        step = StepContext(spec.name, partition_key, "extract")
        landed = run_with_retries(context, step, spec.extract_retry, fetch_and_land)
        context.log.info(f"landed {landed.size_bytes} bytes, sha256 {landed.content_hash[:12]}, "
                         f"from {landed.origin}")
        return landed

    return extract


def _transform_op(spec: SourceSpec):
    @op(
        name=f"transform_{spec.name}",
        description=f"Parse and validate the landed payload of {spec.name}.",
        required_resource_keys={LANDING_KEY},
        out=Out(TransformedPartition, is_required=False),
    )
    def transform(context: OpExecutionContext, landed: LandedPayload):
        partition_key = context.partition_key
        landing = getattr(context.resources, LANDING_KEY)

        def parse():
            try:
                frame = spec.transform(TransformRequest(
                    source=spec.name, partition_key=partition_key,
                    content=landing.read(landed), content_type=landed.content_type,
                    fetched_at=landed.fetched_at,
                ))
            except PartitionNotAvailable as not_yet:
                return not_yet
            return validate_partition_frame(frame, spec.load_target, partition_key)

        step = StepContext(spec.name, partition_key, "transform")
        parsed = run_with_retries(context, step, NO_RETRY, parse)
        if isinstance(parsed, PartitionNotAvailable):
            context.log.info(f"{spec.name} [{partition_key}] not available yet: {parsed}; "
                             "nothing loaded, a later run will pick it up")
            return
        yield Output(
            TransformedPartition(parsed.frame, landed, parsed.duplicates_dropped),
            metadata={
                "rows": MetadataValue.int(len(parsed.frame)),
                "duplicates_dropped": MetadataValue.int(parsed.duplicates_dropped),
                "content_hash": landed.content_hash,
            },
        )

    return transform


def _load_op(spec: SourceSpec):
    @op(
        name=f"load_{spec.name}",
        description=f"Upsert one partition of {spec.name} into {spec.table.name}.",
        required_resource_keys={WAREHOUSE_KEY},
    )
    def load(context: OpExecutionContext, transformed: TransformedPartition) -> Output:
        partition_key = context.partition_key
        engine = getattr(context.resources, WAREHOUSE_KEY).engine()
        step = StepContext(spec.name, partition_key, "load")
        counts = run_with_retries(
            context, step, spec.load_retry,
            lambda: load_partition(
                engine, spec.load_target, transformed.frame, partition_key, context.run_id
            ),
        )
        context.log.info(f"{spec.name} [{partition_key}] loaded: {counts.as_dict()}")
        return Output(
            None,
            metadata={
                **{name: MetadataValue.int(value) for name, value in counts.as_dict().items()},
                "dagster/row_count": MetadataValue.int(len(transformed.frame)),
                "duplicates_dropped": MetadataValue.int(transformed.duplicates_dropped),
                "table": spec.table.name,
                "content_hash": transformed.landed.content_hash,
                "fetched_at": transformed.landed.fetched_at.isoformat(),
            },
        )

    return load


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

