"""The events-only year the year's benchmark targets stand on records, per partition, as many
check results as the source the benchmark runs: a floor with fewer events would make the
targets easier to miss than they should be, and with more, easier to meet."""

from __future__ import annotations

from dagster import AssetKey, DagsterEventType, DagsterInstance, materialize

from benchmarks import year_events
from mostovik_pipelines.framework.quality.checks import partition_checks
from mostovik_pipelines.sources.cbr_daily_rates.source import SOURCE


def test_the_events_only_year_records_one_result_per_check_of_the_benchmarked_source():
    assert len(year_events.CHECKS) == len(partition_checks(SOURCE))


def test_the_events_only_year_records_a_materialisation_and_every_check_per_partition():
    asset = year_events.defs.resolve_assets_def(AssetKey("ranged_year_events"))
    with DagsterInstance.ephemeral() as instance:
        result = materialize([asset], instance=instance, tags={
            "dagster/asset_partition_range_start": "2024-01-01",
            "dagster/asset_partition_range_end": "2024-01-03"})
        assert result.success
        materialized = instance.all_logs(result.run_id,
                                         of_type=DagsterEventType.ASSET_MATERIALIZATION)
        checked = instance.all_logs(result.run_id,
                                    of_type=DagsterEventType.ASSET_CHECK_EVALUATION)
    assert sorted(entry.dagster_event.partition for entry in materialized) == [
        "2024-01-01", "2024-01-02", "2024-01-03"]
    assert len(checked) == 3 * len(partition_checks(SOURCE))
