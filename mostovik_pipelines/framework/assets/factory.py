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
good ones loaded. A retried step resumes: what its run already landed or loaded is not redone,
and each partition has a retry budget of its own (:mod:`mostovik_pipelines.core.retries`).

Recovery never goes back in time:

* a step only acts on what its own run produced. A re-execution (the UI's "from failure" or
  "from selected", ``mostovik jobs rerun RUN_ID``, a daemon run retry) starts with outputs its
  parent stored; they are history, so the first step of the re-execution fetches every
  partition again, except those the original run (or any run it repeats) already loaded;
* every load records when its payload was fetched, and a load of a payload older than what the
  partition holds is refused as superseded (:class:`.load.partition.PartitionSuperseded`);
* a rejected (quarantined) row keeps what is stored under its key
  (:class:`.load.partition.KeptRows`).

A source that has not published a partition yet makes it "not available yet": nothing is
loaded, the partition stays unmaterialised, and a later run picks it up.

This module only declares; what the ops do is :mod:`.steps`, imported by an op when it runs. A
process that loads the code location and runs no step (a code server, the daemon, the webserver)
imports neither pandas nor pyarrow nor the database drivers.
"""

from datetime import UTC, datetime

from dagster import (
    AssetSelection,
    Config,
    DefaultScheduleStatus,
    Definitions,
    OpExecutionContext,
    Out,
    Output,
    ScheduleEvaluationContext,
    SkipReason,
    define_asset_job,
    graph_asset,
    op,
    schedule,
)

from mostovik_pipelines.core.tags import business_tags
from mostovik_pipelines.framework.assets.resource_keys import (
    LANDING_KEY,
    WAREHOUSE_KEY,
    source_resource_key,
)
from mostovik_pipelines.framework.assets.view import asset_kinds, asset_metadata
from mostovik_pipelines.framework.automation.catch_up import plan_catch_up
from mostovik_pipelines.framework.automation.deadlines import deadline_check
from mostovik_pipelines.framework.quality.checks import check_specs
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.framework.steps.outcomes import StepOutcomes
from mostovik_pipelines.framework.verification.check import verification_check_spec
from mostovik_pipelines.framework.verification.schedule import verification_definitions


class ExtractConfig(Config):
    """Run config of the extract op."""

    reuse_landed: bool = False
    """Re-transform the partition's most recently landed payload instead of calling the source."""
    full_resync: bool = False
    """Paged sources: sync the whole partition again, ignoring the progress committed by an
    interrupted run (a finished partition keeps no progress: its next run is a full re-sync)."""


def build_source_definitions(spec: SourceSpec) -> Definitions:
    """Everything Dagster needs for one source: its asset, job and schedule, its deadline check,
    and its scheduled verification (:mod:`..verification.schedule`). The resources, the
    source's own included (:func:`source_resource_key`), are bound by the code location."""
    # The load plans the verification's check without evaluating it: a re-load leaves no
    # verdict of an earlier load standing (.verification.schedule).
    checks = [*check_specs(spec), verification_check_spec(spec)]
    extract, transform = _extract_op(spec), _transform_op(spec)
    load = _load_op(spec, [check.get_python_identifier() for check in checks])

    @graph_asset(
        name=spec.name,
        description=spec.description,
        partitions_def=spec.partitions_def,
        backfill_policy=spec.backfill_policy,
        group_name=spec.job_type.value,
        kinds=asset_kinds(spec),
        owners=list(spec.owners) or None,
        metadata=asset_metadata(spec),
        tags={"mostovik/job_type": spec.job_type.value},
        check_specs=checks,
    )
    def source_asset():
        # The load step records the materialisation and the check results of every partition
        # it loads; its outputs only say to Dagster that it produced them.
        loaded = load(transform(extract()))
        return {name: getattr(loaded, name) for name in ("result", *(
            check.get_python_identifier() for check in checks))}

    # The deadline check is the sensor's to evaluate (it reads every period of the source), not
    # a run's: the source's job leaves it out.
    deadline_checks = [deadline_check(spec)] if spec.deadline else []
    job = define_asset_job(
        name=f"{spec.name}_job",
        description=f"Extract, transform and load partitions of {spec.name}.",
        selection=AssetSelection.assets(source_asset) - AssetSelection.checks(*deadline_checks),
        partitions_def=spec.partitions_def,
        tags={**business_tags(spec), "dagster/max_runtime": str(spec.max_runtime_seconds)},
    )
    schedules = [_schedule(spec, job)] if spec.schedule else []
    sensors = [spec.sensor(spec, job, source_resource_key(spec))] if spec.sensor else []
    return Definitions.merge(
        Definitions(assets=[source_asset], asset_checks=deadline_checks, jobs=[job],
                    schedules=schedules, sensors=sensors),
        verification_definitions(spec))


def _op_tags(spec: SourceSpec) -> dict[str, str]:
    """Routes the source's steps to its Celery queue, when it declares one."""
    return {"dagster-celery/queue": spec.celery_queue} if spec.celery_queue else {}


# --- the three ops: declared here, their bodies in .steps.ops ----------------------------------


def _extract_op(spec: SourceSpec):
    @op(
        name=f"extract_{spec.name}",
        description=f"Fetch partitions of {spec.name} and land the raw payloads.",
        required_resource_keys={source_resource_key(spec), LANDING_KEY, WAREHOUSE_KEY},
        tags=_op_tags(spec),
    )
    def extract(context: OpExecutionContext, config: ExtractConfig) -> StepOutcomes:
        from mostovik_pipelines.framework.steps import ops  # step code: see the module docstring

        return ops.extract(context, spec, config.reuse_landed, config.full_resync)

    return extract


def _transform_op(spec: SourceSpec):
    @op(
        name=f"transform_{spec.name}",
        description=f"Parse and validate the landed payloads of {spec.name}.",
        required_resource_keys={source_resource_key(spec), LANDING_KEY, WAREHOUSE_KEY},
        tags=_op_tags(spec),
    )
    def transform(context: OpExecutionContext, extracted) -> StepOutcomes:
        from mostovik_pipelines.framework.steps import ops  # step code: see the module docstring

        return ops.transform(context, spec, extracted)

    return transform


def _load_op(spec: SourceSpec, check_outputs: list[str]):
    @op(
        name=f"load_{spec.name}",
        description=f"Upsert partitions of {spec.name} into {spec.table.name} and check them.",
        required_resource_keys={WAREHOUSE_KEY, source_resource_key(spec), LANDING_KEY},
        out={"result": Out(is_required=False),
             **{name: Out(is_required=False) for name in check_outputs}},
        tags=_op_tags(spec),
    )
    def load(context: OpExecutionContext, transformed):
        from mostovik_pipelines.framework.steps import ops  # step code: see the module docstring

        summary = ops.load(context, spec, transformed)
        # The materialisations and check results are the explicit, per-partition ones the load
        # records, never one for the whole range: no asset output. The checks' outputs say they
        # ran.
        for name in check_outputs:
            if name in context.selected_output_names:
                yield Output(None, output_name=name)
        context.log.info(summary)  # the job's ADR status and figures, last on the run page

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
        description=f"Refresh the {latest} newest partition(s) of {spec.name} and catch up on "
                    f"every partition of the last {spec.catch_up.lookback.days} days that is not "
                    "final (see mostovik/requested_because on each run).",
    )
    def refresh_and_catch_up(context: ScheduleEvaluationContext):
        now = context.scheduled_execution_time or datetime.now(UTC)
        plan = plan_catch_up(context.instance, spec, now)
        for line in plan.describe():
            context.log.info(line)
        if not plan.runs:
            return SkipReason(f"nothing to ask for: {len(plan.held)} partition(s) held")
        return [run.run_request(now) for run in plan.runs]

    return refresh_and_catch_up
