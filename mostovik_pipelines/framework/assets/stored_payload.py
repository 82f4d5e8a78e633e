"""Which landed payload a partition's stored rows came from.

The load records the landed payload's content hash in the partition's materialisation
(``content_hash``, beside the figures), so the latest materialisation names the payload the
stored rows were made from, even when later fetches were rejected and never loaded. Two users:
``reuse_landed`` re-transforms that payload (so a re-run reproduces the stored rows, not a bad
fetch), and the retention prune keeps it for as long as the rows stand.
"""

from __future__ import annotations

from collections.abc import Iterable

from dagster import AssetKey, AssetRecordsFilter, DagsterEventType, DagsterInstance

CONTENT_HASH_KEY = "content_hash"
"""The materialisation metadata that names the landed payload (``steps/load.py`` writes it)."""
FETCH_BATCH = 500


def stored_payload_hashes(instance: DagsterInstance, source: str,
                          partition_keys: Iterable[str] | None = None) -> dict[str, str]:
    """Partition key -> content hash of the payload behind its stored rows, for the source's
    partitions that have been loaded (all of them, or those of ``partition_keys``)."""
    asset_key = AssetKey(source)
    latest = instance.get_latest_storage_id_by_partition(
        asset_key, DagsterEventType.ASSET_MATERIALIZATION)
    if partition_keys is not None:
        wanted = set(partition_keys)
        latest = {key: storage_id for key, storage_id in latest.items() if key in wanted}
    ids = sorted(latest.values())
    hashes: dict[str, str] = {}
    for start in range(0, len(ids), FETCH_BATCH):
        batch = ids[start:start + FETCH_BATCH]
        records = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=asset_key, storage_ids=batch), limit=len(batch)).records
        for record in records:
            materialization = record.event_log_entry.asset_materialization
            value = materialization.metadata.get(CONTENT_HASH_KEY) if materialization else None
            if value is not None and materialization.partition:
                hashes[materialization.partition] = str(value.value)
    return hashes
