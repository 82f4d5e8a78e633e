"""Pins the private backfill names of ``dagster_compat`` that ``mostovik jobs rerun`` submits
and reads an operator's backfill with: a ``PartitionBackfill`` of an asset's partitions, added
to the instance as the UI's GraphQL adds one, found by status, its partitions readable."""

from __future__ import annotations

import time

from dagster import AssetKey, DagsterInstance

from mostovik_pipelines.core import dagster_compat as compat
from mostovik_pipelines.definitions import defs

PARTITIONS = ["2026-11-02", "2026-11-03", "2026-11-05"]


def test_an_asset_backfill_is_added_found_by_status_and_read_back():
    asset = AssetKey("cbr_daily_rates")
    with DagsterInstance.ephemeral() as instance:
        instance.add_backfill(compat.PartitionBackfill.from_asset_partitions(
            backfill_id="pinned", asset_graph=defs.resolve_asset_graph(),
            partition_names=PARTITIONS, asset_selection=[asset],
            backfill_timestamp=time.time(), tags={"mostovik/reason": "pinned"},
            dynamic_partitions_store=instance, all_partitions=False, title="t",
            description="d", run_config=None))
        [found] = instance.get_backfills(filters=compat.BulkActionsFilter(
            statuses=[compat.BulkActionStatus.REQUESTED]))
        assert found.backfill_id == "pinned" and found.tags == {"mostovik/reason": "pinned"}
        data = found.asset_backfill_data
        assert data.target_subset.asset_keys == {asset}
        assert sorted(data.target_subset.get_partitions_subset(asset).get_partition_keys()) == (
            PARTITIONS)
        assert data.materialized_subset.asset_keys == set()
        assert data.failed_and_downstream_subset.asset_keys == set()
        assert instance.get_backfill("pinned").status is compat.BulkActionStatus.REQUESTED
