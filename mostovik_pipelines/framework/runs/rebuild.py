"""The job tracker rebuilt from the warehouse's ledger, after run storage was lost.

Run storage is the job tracker, and the warehouse's ledger (``partition_loads``) is the second
record of what was loaded: for every loaded partition, the run that loaded it, when, the rows'
count and digest, and the payload they came from. When run storage is gone (a lost database, a
restore from an old backup), every partition shows missing in the UI, the catch-up would fetch
the whole lookback again and ``mostovik jobs list`` is empty. :func:`rebuild_tracker` records,
for every partition the ledger names and run storage has no materialisation of, a run-less
materialisation (Dagster's public ``report_runless_asset_event``) carrying the loading run's id,
the payload's hash and the figures, and adds a file source's versions back to its dynamic
partitions. Then:

* the UI's partition status shows them materialised (Dagster counts a run-less
  materialisation like any other);
* the catch-up (:mod:`..automation.partition_states`) reads them as loaded; a sync's window as
  final when the ledger says its load started from the first page after the window closed
  (``fetched_at``), as it reads a run's start;
* ``mostovik jobs list`` shows one line per loading run (:func:`recorded_jobs`);
* ``reuse_landed`` and the retention prune find the payload behind the stored rows
  (``content_hash``).

A partition whose latest materialisation in run storage is at least as recent as its line in
the ledger is left alone, so a second rebuild records nothing; one whose latest
materialisation is older (run storage restored from an old backup) gets one describing the
ledger's load. Nothing is fetched or loaded, and the warehouse is only read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from dagster import (
    AssetKey,
    AssetMaterialization,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DynamicPartitionsDefinition,
    MetadataValue,
    RunsFilter,
)
from sqlalchemy import Engine

from mostovik_pipelines.framework.load.ledger import LedgerEntry, ledger_entries
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.platform.tracking import Job, JobStatus

RECORDED_BY_KEY = "mostovik/recorded_by"
RECORDED_BY = "mostovik tracker rebuild"
"""Metadata of a rebuilt materialisation: what recorded it (no run did)."""
LOADED_BY_RUN_KEY = "mostovik/loaded_by_run"
"""Metadata of a rebuilt materialisation: the run that loaded the partition (the ledger's)."""
FETCHED_AT_KEY = "fetched_at"
"""Metadata: when the loaded payload was fetched (a load's materialisation has it too); for a
sync's window, only when its load started from the first page."""
LAUNCHED_BY_LEDGER = "the ledger (mostovik tracker rebuild)"
PAGE = 1_000
RUNLESS_RUN_ID = ""
"""The run id Dagster stores a run-less event under."""


@dataclass
class SourceRebuild:
    """What a rebuild records (or, dry, would record) for one source."""

    source: str
    in_ledger: int = 0
    already_recorded: int = 0
    recorded: list[str] = field(default_factory=list)
    versions_added: list[str] = field(default_factory=list)
    """File versions added back to the source's dynamic partitions."""
    not_partitions: list[str] = field(default_factory=list)
    """Ledger lines the source's partitions do not include (a start date moved later)."""

    def line(self, dry_run: bool) -> str:
        verb = "would record" if dry_run else "recorded"
        return (f"{self.source}: {self.in_ledger} loaded partition(s) in the ledger, "
                f"{self.already_recorded} already in run storage, {verb} "
                f"{len(self.recorded)}"
                + (f" (and {len(self.versions_added)} file version(s) added)"
                   if self.versions_added else "")
                + (f"; not partitions of the source: {', '.join(self.not_partitions[:5])}"
                   if self.not_partitions else ""))


def rebuild_tracker(instance: DagsterInstance, engine: Engine, sources: Sequence[SourceSpec],
                    *, dry_run: bool = False) -> list[SourceRebuild]:
    """Record every partition the ledger names that run storage does not know as loaded."""
    from mostovik_pipelines.framework.verification.verify import read_only

    done = []
    for spec in sources:
        with read_only(engine) as connection:
            entries = ledger_entries(connection, spec.table.name)
        rebuild = SourceRebuild(spec.name, in_ledger=len(entries))
        asset_key = AssetKey(spec.name)
        recorded = _latest_materialised_at(instance, asset_key)
        todo = [entry for entry in entries
                if recorded.get(entry.key, 0.0) < entry.loaded_at.timestamp()]
        rebuild.already_recorded = len(entries) - len(todo)
        partitions_def = spec.partitions_def
        if isinstance(partitions_def, DynamicPartitionsDefinition):
            known = set(instance.get_dynamic_partitions(partitions_def.name))
            rebuild.versions_added = sorted({e.loaded_partition_key for e in todo
                                             if e.loaded_partition_key} - known)
            if rebuild.versions_added and not dry_run:
                instance.add_dynamic_partitions(partitions_def.name, rebuild.versions_added)
            # A load recorded before the ledger named its version names only the file.
            valid = {e.loaded_partition_key for e in todo if e.loaded_partition_key}
        else:
            valid = set(partitions_def.get_partition_keys())
        for entry in todo:
            if entry.key not in valid:
                rebuild.not_partitions.append(entry.key)
                continue
            rebuild.recorded.append(entry.key)
            if not dry_run:
                instance.report_runless_asset_event(AssetMaterialization(
                    asset_key=asset_key, partition=entry.key, metadata=_metadata(spec, entry)))
        done.append(rebuild)
    return done


def _latest_materialised_at(instance: DagsterInstance, asset_key: AssetKey) -> dict[str, float]:
    """Partition -> when its latest materialisation in run storage was recorded."""
    latest = instance.get_latest_storage_id_by_partition(
        asset_key, DagsterEventType.ASSET_MATERIALIZATION)
    ids = sorted(latest.values())
    found: dict[str, float] = {}
    for start in range(0, len(ids), PAGE):
        batch = ids[start:start + PAGE]
        for record in instance.fetch_materializations(
                AssetRecordsFilter(asset_key=asset_key, storage_ids=batch),
                limit=len(batch)).records:
            found[record.partition_key or ""] = record.timestamp
    return found


def _metadata(spec: SourceSpec, entry: LedgerEntry) -> dict:
    metadata = {
        RECORDED_BY_KEY: RECORDED_BY,
        LOADED_BY_RUN_KEY: entry.loaded_by_run,
        "dagster/row_count": MetadataValue.int(entry.row_count),
        "table": spec.table.name,
        "loaded_at": entry.loaded_at.isoformat(),
    }
    if entry.fetched_at is not None:
        metadata[FETCHED_AT_KEY] = entry.fetched_at.isoformat()
    if entry.payload_hash is not None:
        metadata["content_hash"] = entry.payload_hash
    if entry.content_digest is not None:
        metadata["content_digest"] = entry.content_digest
    return metadata


def recorded_jobs(instance: DagsterInstance, sources: Iterable[SourceSpec],
                  source: str | None = None) -> list[Job]:
    """The loads a rebuild recorded whose runs run storage does not have: one job per loading
    run, completed, newest first (what ``mostovik jobs list`` adds to the runs it lists). Only
    run-less events are read (they are stored under the empty run id), not every load's."""
    specs = {spec.name: spec for spec in sources if source in (None, spec.name)}
    by_run: dict[tuple[str, str], list[tuple[str, datetime]]] = {}
    for name, partition, metadata in _rebuilt(instance):
        if name not in specs:
            continue
        loaded_at = datetime.fromisoformat(str(metadata["loaded_at"].value))
        by_run.setdefault((name, str(metadata[LOADED_BY_RUN_KEY].value)), []).append(
            (partition, loaded_at))
    run_ids = sorted({run_id for _, run_id in by_run})
    known = {record.dagster_run.run_id for record in instance.get_run_records(
        RunsFilter(run_ids=run_ids))} if run_ids else set()
    jobs = []
    for (name, run_id), loads in by_run.items():
        if run_id in known:
            continue
        ended = max(loaded_at for _, loaded_at in loads)
        jobs.append(Job(
            run_id=run_id, source=name, job_type=specs[name].job_type.value,
            partitions=sorted(partition for partition, _ in loads),
            status=JobStatus.COMPLETED, result="success", run_status="not in run storage",
            started_at=None, ended_at=ended.astimezone(UTC), launched_by=LAUNCHED_BY_LEDGER,
            executor=None, parent_run_id=None, root_run_id=None, rerun_of=None))
    return sorted(jobs, key=lambda job: job.ended_at or datetime.min.replace(tzinfo=UTC),
                  reverse=True)


def _rebuilt(instance: DagsterInstance) -> Iterable[tuple[str, str, dict]]:
    """(asset, partition, metadata) of every materialisation a rebuild recorded."""
    cursor = None
    while True:
        result = instance.get_records_for_run(
            RUNLESS_RUN_ID, cursor=cursor, of_type=DagsterEventType.ASSET_MATERIALIZATION,
            limit=PAGE)
        for record in result.records:
            materialization = record.event_log_entry.asset_materialization
            if (materialization and materialization.partition
                    and RECORDED_BY_KEY in materialization.metadata):
                yield (materialization.asset_key.to_user_string(), materialization.partition,
                       materialization.metadata)
        if not result.has_more:
            return
        cursor = result.cursor
