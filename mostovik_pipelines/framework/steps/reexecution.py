"""What a re-execution (the UI's "from failure", ``mostovik jobs rerun``, a daemon run retry)
takes from the runs it repeats: the partitions they loaded, never their stored outputs, which
are history; every other partition is fetched again."""

from __future__ import annotations

from dagster import AssetKey, DagsterEventType, OpExecutionContext

from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.framework.steps.extract import extract_partition
from mostovik_pipelines.framework.steps.outcomes import LandedPages, PartitionLoaded, StepOutcomes
from mostovik_pipelines.framework.steps.transform import transform_partition
from mostovik_pipelines.resources.landing import LandedPayload


def inherited(context: OpExecutionContext, received) -> bool:
    return not (isinstance(received, StepOutcomes) and received.run_id == context.run_id)


def redo(context: OpExecutionContext, spec: SourceSpec, *, transform: bool) -> dict:
    """The first step of a re-execution: every partition the runs it repeats did not load is
    fetched again (and transformed, for the load step); their stored outputs are history."""
    loaded = partitions_loaded_by_lineage(context, AssetKey(spec.name))
    outcomes: dict = {}
    for key in context.partition_keys:
        if key in loaded:
            outcomes[key] = PartitionLoaded(key, loaded[key])
            continue
        landed = extract_partition(context, spec, key, reuse_landed=False)
        outcomes[key] = (transform_partition(context, spec, key, landed)
                         if transform and isinstance(landed, LandedPayload | LandedPages)
                         else landed)
    if loaded:
        context.log.info(f"{spec.name}: re-execution; {len(loaded)} partition(s) already loaded "
                         f"by the run it repeats, {len(outcomes) - len(loaded)} fetched again")
    return outcomes


def _materialized_partitions(context: OpExecutionContext, run_id: str,
                             asset_key: AssetKey) -> set[str]:
    records = context.instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION
    ).records
    return {
        record.event_log_entry.asset_materialization.partition for record in records
        if record.event_log_entry.asset_materialization.asset_key == asset_key
    }


def partitions_materialized_by_run(context: OpExecutionContext, asset_key: AssetKey) -> set:
    """Partitions this run already loaded (before a retry of the load step)."""
    if context.retry_number == 0:
        return set()
    return _materialized_partitions(context, context.run_id, asset_key)


def partitions_loaded_by_lineage(context: OpExecutionContext,
                                  asset_key: AssetKey) -> dict[str, str]:
    """Partition -> run, for the partitions the runs this run re-executes (its parent, its
    parent's parent, ...) loaded."""
    loaded: dict[str, str] = {}
    run_id = context.run.parent_run_id
    while run_id:
        for key in _materialized_partitions(context, run_id, asset_key):
            loaded.setdefault(key, run_id)
        parent = context.instance.get_run_by_id(run_id)
        run_id = parent.parent_run_id if parent else None
    return loaded
