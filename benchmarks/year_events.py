"""Dagster's floor for a ranged year: an asset shaped like a source's that does no work but
records, per partition, what a source's ranged run records (its materialisation, the lookup of
it that each check result names, one result per check).

``dagster asset materialize -m benchmarks.year_events --select ranged_year_events
--partition-range 2024-01-01...2024-12-30``

Like :mod:`benchmarks.empty_job`, it does not import ``mostovik_pipelines``: what it measures is
Dagster's, with the executor and IO manager the project's jobs use.
"""

from __future__ import annotations

import warnings

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSpec,
    AssetKey,
    AssetMaterialization,
    AssetRecordsFilter,
    AssetsDefinition,
    BackfillPolicy,
    DailyPartitionsDefinition,
    Definitions,
    Out,
    Output,
    PreviewWarning,
    graph_asset,
    op,
)

from benchmarks.empty_job import executor, io_manager

CHECKS = ("natural_key_unique", "rows_in_partition", "quarantine_share", "source_shape",
          "source_check")
"""As many partitioned checks as ``cbr_daily_rates`` has (the framework's three, the shape of
what the source sent, the source's own): one result of each per partition
(``mostovik_pipelines_tests/tooling/test_benchmark_floor.py`` keeps the count equal)."""
YEAR_PARTITIONS = DailyPartitionsDefinition(start_date="2020-01-01", timezone="Europe/Moscow")


def _ranged_year_events() -> AssetsDefinition:
    """An asset shaped like a source's (three ops, daily partitions, one run per backfill,
    five partitioned checks) whose load step records per partition what ours records: the
    materialisation with a few figures, the lookup of it that each check result names, and one
    result per check. ``dagster asset materialize -m benchmarks.year_events --select
    ranged_year_events --partition-range A...B``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PreviewWarning)
        checks = [AssetCheckSpec(name, asset="ranged_year_events",
                                 partitions_def=YEAR_PARTITIONS) for name in CHECKS]

    @op
    def extract_nothing(context) -> list[str]:
        return list(context.partition_keys)

    @op
    def transform_nothing(keys: list[str]) -> list[str]:
        return keys

    outputs = [check.get_python_identifier() for check in checks]

    @op(out={"result": Out(is_required=False),
             **{name: Out(is_required=False) for name in outputs}})
    def record_events(context, keys: list[str]):
        key = AssetKey("ranged_year_events")
        for partition in keys:
            context.log_event(AssetMaterialization(asset_key=key, partition=partition, metadata={
                "inserted": 12, "updated": 0, "rejected": 0, "duration_seconds": 0.01}))
            context.instance.fetch_materializations(
                AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=1)
            for name in CHECKS:
                context.log_event(AssetCheckEvaluation(
                    asset_key=key, check_name=name, passed=True, partition=partition,
                    metadata={"check_seconds": 0.001}))
        for name in outputs:
            yield Output(None, output_name=name)

    @graph_asset(name="ranged_year_events", partitions_def=YEAR_PARTITIONS,
                 backfill_policy=BackfillPolicy.single_run(), check_specs=checks)
    def ranged_year_events():
        recorded = record_events(transform_nothing(extract_nothing()))
        return {name: getattr(recorded, name) for name in ("result", *outputs)}

    return ranged_year_events


defs = Definitions(assets=[_ranged_year_events()], executor=executor(),
                   resources={"io_manager": io_manager()})
