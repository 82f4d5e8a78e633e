"""The maintenance job of the code location: the retention prune, daily, as a run like every
job (in the UI's run list, alerted on when it fails). It has no partition and no source, so the
run queue's one-run-per-partition limit and the sources' run-status check never see it."""

from collections.abc import Sequence

from dagster import (
    AssetCheckKey,
    DefaultScheduleStatus,
    Definitions,
    OpExecutionContext,
    ScheduleDefinition,
    in_process_executor,
    job,
    op,
)

from mostovik_pipelines.framework.assets.resource_keys import LANDING_KEY

PRUNE_JOB = "prune_storage_job"
PRUNED_BYTES_PREFIX = "mostovik/pruned_bytes/"
"""Metadata of the prune's engine event: the bytes it removed from each store."""
PRUNE_SCHEDULE = "prune_storage_daily"
MAX_RUNTIME_SECONDS = 3600


def maintenance_definitions(check_keys: Sequence[AssetCheckKey]) -> Definitions:
    """The prune job and its daily schedule (at night, Moscow time, when no source is due);
    ``check_keys``: the asset checks of the code location, whose latest results it keeps."""

    @op(name="prune_storage", required_resource_keys={LANDING_KEY, "io_manager"},
        description="Remove what the retention policy no longer keeps: op outputs, landed "
                    "payloads, old runs (README, 'Retention').")
    def prune_storage(context: OpExecutionContext) -> None:
        from dagster import MetadataValue

        from mostovik_pipelines.core.dagster_compat import EngineEventData
        from mostovik_pipelines.maintenance.policy import RUNS
        from mostovik_pipelines.maintenance.prune import prune
        from mostovik_pipelines.resources.stores import store_path

        report = prune(
            context.instance,
            landing_dir=store_path(getattr(context.resources, LANDING_KEY).base_dir),
            op_output_dir=store_path(context.resources.io_manager.base_dir),
            check_keys=check_keys,
        )
        for line in report.lines():
            context.log.info(line)
        # What `mostovik metrics` reads as the last prune's bytes, per store (runs are rows of
        # run storage, not counted in bytes).
        pruned_bytes = {store: size for store, size in report.size_bytes.items() if store != RUNS}
        context.instance.report_engine_event(
            "pruned " + ", ".join(f"{size} bytes of {store}"
                                  for store, size in pruned_bytes.items()),
            context.run,
            EngineEventData({f"{PRUNED_BYTES_PREFIX}{store}": MetadataValue.int(size)
                             for store, size in pruned_bytes.items()}),
            step_key=context.get_step_execution_context().step.key,
        )

    @job(name=PRUNE_JOB, executor_def=in_process_executor,
         tags={"mostovik/job_type": "maintenance",
               "dagster/max_runtime": str(MAX_RUNTIME_SECONDS)},
         description="Keep storage bounded: the retention prune of every store.")
    def prune_storage_job() -> None:
        prune_storage()

    return Definitions(jobs=[prune_storage_job], schedules=[ScheduleDefinition(
        name=PRUNE_SCHEDULE, job=prune_storage_job, cron_schedule="40 3 * * *",
        execution_timezone="Europe/Moscow", default_status=DefaultScheduleStatus.RUNNING,
        description="Apply the retention policy once a day.")])
