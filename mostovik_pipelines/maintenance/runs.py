"""Run storage's retention, and the facts about runs the other stores' rules depend on.

Runs are the job tracker (ADR-016) and Dagster keeps them forever; deleting a run deletes its
events, its materialisations among them. So a run goes only when nothing an operator reads still
depends on it: the UI's partition status (materialised, failed), the latest materialisation of a
partition and its metadata, the latest check result, freshness, ``mostovik jobs list`` for the
latest run of each partition, and the run lineage of a re-execution.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from dagster import (
    AssetCheckKey,
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    RunRecord,
)

from mostovik_pipelines.core.dagster_compat import run_event_log_dir
from mostovik_pipelines.core.tags import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG
from mostovik_pipelines.maintenance.policy import (
    EVENT_LOG_FILES,
    RUNS,
    Removal,
    RetentionPolicy,
)

FINISHED = frozenset({DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE,
                      DagsterRunStatus.CANCELED})
FETCH_BATCH = 500
SHARD_SUFFIXES = ("", "-wal", "-shm")
"""A SQLite database and, while it is open, its write-ahead log and shared memory."""
INDEX_SHARD = "index"
"""The SQLite event log's index of every run (``index.db``), beside the files per run."""


@dataclass(frozen=True)
class RunFacts:
    """Every run in run storage, read once at the start of a prune."""

    records: dict[str, RunRecord]
    in_use: frozenset[str]
    """Unfinished runs and the runs they repeat (a re-execution reads its parents' outputs)."""

    @classmethod
    def read(cls, instance: DagsterInstance) -> RunFacts:
        records = {record.dagster_run.run_id: record for record in instance.get_run_records()}
        unfinished = [run_id for run_id, record in records.items()
                      if record.dagster_run.status not in FINISHED]
        return cls(records, frozenset(_with_lineage(records, unfinished)))

    def finished(self, run_id: str) -> bool:
        record = self.records.get(run_id)
        return record is not None and record.dagster_run.status in FINISHED

    def outputs_needed(self, run_id: str, policy: RetentionPolicy, now: datetime) -> bool:
        """Whether a recovery path may still use what ``run_id`` stored (its op outputs, the
        payloads it landed): it has not finished, or a live run repeats it, or it failed
        recently enough to be re-executed from its failure, or it succeeded within the grace."""
        record = self.records.get(run_id)
        if record is None:
            return False
        if run_id in self.in_use or record.dagster_run.status not in FINISHED:
            return True
        keep = (policy.grace if record.dagster_run.status is DagsterRunStatus.SUCCESS
                else policy.keep_failed_run_outputs)
        return ended_at(record) > now - keep


def ended_at(record: RunRecord) -> datetime:
    """When a finished run ended (a run marked failed without an end: its last update)."""
    if record.end_time:
        return datetime.fromtimestamp(record.end_time, UTC)
    return record.update_timestamp.astimezone(UTC)


def old_runs(instance: DagsterInstance, facts: RunFacts, policy: RetentionPolicy,
             now: datetime, check_keys: Sequence[AssetCheckKey]) -> list[Removal]:
    """Runs (with their event logs and captured logs) created longer than ``keep_runs`` ago,
    finished, that hold no partition's latest state: a year of history is what operators
    look back on, and a partition's present must read exactly as before."""
    cutoff = now - policy.keep_runs
    candidates = [run_id for run_id, record in facts.records.items()
                  if record.create_timestamp.astimezone(UTC) < cutoff
                  and facts.finished(run_id) and run_id not in facts.in_use]
    if not candidates:
        return []
    held = _with_lineage(facts.records, runs_holding_latest_state(instance, check_keys)
                         | latest_run_of_each_partition(facts))
    return [Removal(RUNS, run_id, 0, lambda run_id=run_id: delete_run(instance, run_id))
            for run_id in candidates if run_id not in held]


def runs_holding_latest_state(instance: DagsterInstance,
                              check_keys: Sequence[AssetCheckKey]) -> set[str]:
    """The runs whose events are a partition's present in the UI: its latest materialisation
    (status, metadata, freshness), its latest attempt that did not materialise (a failed or
    skipped partition), its latest failure to materialise, its checks' latest executions."""
    held: set[str] = set()
    storage = instance.event_log_storage
    for asset_key in instance.get_asset_keys():
        latest = instance.get_latest_storage_id_by_partition(
            asset_key, DagsterEventType.ASSET_MATERIALIZATION)
        held |= _run_ids(instance.fetch_materializations, asset_key, latest.values())
        failed = instance.get_latest_storage_id_by_partition(
            asset_key, DagsterEventType.ASSET_FAILED_TO_MATERIALIZE)
        held |= _run_ids(instance.fetch_failed_materializations, asset_key, failed.values())
        attempts = storage.get_latest_asset_partition_materialization_attempts_without_materializations(  # noqa: E501
            asset_key)
        held |= {run_id for run_id, _storage_id in attempts.values()}
        unpartitioned = instance.get_latest_materialization_event(asset_key)
        if unpartitioned is not None:
            held.add(unpartitioned.run_id)
    if check_keys:
        held |= {info.latest_planned_run_id
                 for info in storage.get_asset_check_partition_info(list(check_keys))}
    return held


def latest_run_of_each_partition(facts: RunFacts) -> set[str]:
    """The newest run of each job for each partition or range it was tagged with: what
    ``mostovik jobs list`` and the run list show as a partition's last job."""
    newest: dict[tuple[str, str, str, str], tuple[datetime, str]] = {}
    for run_id, record in facts.records.items():
        tags = record.dagster_run.tags
        key = (record.dagster_run.job_name, tags.get(PARTITION_TAG, ""),
               tags.get(RANGE_START_TAG, ""), tags.get(RANGE_END_TAG, ""))
        if key[1:] == ("", "", ""):
            continue
        created = (record.create_timestamp, run_id)
        if key not in newest or created > newest[key]:
            newest[key] = created
    return {run_id for _created, run_id in newest.values()}


def delete_run(instance: DagsterInstance, run_id: str) -> None:
    """Delete a run: its captured logs, its events, its event log's own files (SQLite), then
    the run. Killed half way, what is left is a run with fewer records that the next prune
    deletes again, never events of a run that is gone (Dagster's ``delete_run`` deletes in the
    other order, and leaves a local instance's file per run behind: 124 KiB each)."""
    with contextlib.suppress(NotImplementedError):
        instance.compute_log_manager.delete_logs(prefix=[run_id])
    instance.event_log_storage.delete_events(run_id)
    shards = run_event_log_dir(instance)
    if shards is not None:
        for path in _shard_files(shards, run_id):
            path.unlink(missing_ok=True)
    instance.run_storage.delete_run(run_id)


def orphaned_event_log_files(instance: DagsterInstance, facts: RunFacts,
                             policy: RetentionPolicy, now: datetime) -> list[Removal]:
    """A local instance's event log files of runs run storage no longer has (deleted by hand
    with ``dagster run delete``, or before prunes removed them), untouched for the grace
    period: a run created after the prune read run storage writes its file meanwhile."""
    shards = run_event_log_dir(instance)
    if shards is None or not shards.is_dir():
        return []
    cutoff = (now - policy.grace).timestamp()
    removals = []
    for path in sorted(shards.iterdir()):
        run_id, dot, suffix = path.name.partition(".db")
        if (not dot or suffix not in SHARD_SUFFIXES or run_id == INDEX_SHARD
                or run_id in facts.records):
            continue
        stat = path.stat()
        if stat.st_mtime < cutoff:
            removals.append(Removal(EVENT_LOG_FILES, str(path), stat.st_size,
                                    lambda path=path: path.unlink(missing_ok=True)))
    return removals


def _shard_files(shards: Path, run_id: str) -> list[Path]:
    return [shards / f"{run_id}.db{suffix}" for suffix in SHARD_SUFFIXES]


def _run_ids(fetch, asset_key: AssetKey, storage_ids: Iterable[int]) -> set[str]:
    ids = sorted(storage_ids)
    found: set[str] = set()
    for start in range(0, len(ids), FETCH_BATCH):
        batch = ids[start:start + FETCH_BATCH]
        result = fetch(AssetRecordsFilter(asset_key=asset_key, storage_ids=batch),
                       limit=len(batch))
        found |= {record.run_id for record in result.records}
    return found


def _with_lineage(records: dict[str, RunRecord], run_ids: Iterable[str]) -> set[str]:
    """``run_ids`` and every run they repeat (parent, its parent, ...)."""
    found: set[str] = set()
    for run_id in run_ids:
        while run_id and run_id not in found:
            found.add(run_id)
            record = records.get(run_id)
            run_id = record.dagster_run.parent_run_id if record else None
    return found
