"""Which partitions of a range an operator's re-run takes, and in which runs.

Each partition of the range is read as the UI's partition view shows it, from run storage
(:mod:`mostovik_pipelines.framework.automation.partition_states`):

* **missing**: never loaded, and its latest run (if any) did not fail: it skipped the partition
  (not available yet) or nobody asked for it;
* **failed**: its latest run failed (transiently or for a permanent reason), was cancelled, or
  loaded it partially (rows quarantined);
* **differing**: loaded, and its latest verification against the source (the check
  ``matches_source`` of :mod:`mostovik_pipelines.framework.verification.schedule`) failed on
  its latest load;
* **all**: every partition of the range.

A partition with a run queued or in progress, or inside a backfill that has not finished, is
never taken: it is listed as skipped, with that run or backfill. What is taken goes in as few runs
as the source's backfill policy allows, as Dagster's backfill daemon plans them: a run per
contiguous span of taken partitions, cut at the policy's ``max_partitions_per_run`` (a
single-run source: one run per span). The plan is what ``--dry-run`` prints and what the
submission sends, the same object.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, TimeWindowPartitionsDefinition

from mostovik_pipelines.core.dagster_compat import (
    AssetCheckExecutionRecordStatus,
    BulkActionsFilter,
    BulkActionStatus,
)
from mostovik_pipelines.framework.automation.partition_states import (
    Outcome,
    PartitionState,
    partition_states,
)
from mostovik_pipelines.framework.spec import SourceSpec

RUNS_BEFORE_WINDOW = timedelta(days=7)
"""A partition's runs are read from this long before its window opens (tomorrow's rates are
asked for today)."""
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class Only(enum.StrEnum):
    MISSING = "missing"
    FAILED = "failed"
    DIFFERING = "differing"
    ALL = "all"


class RangeRefused(ValueError):
    """The range names a partition the source does not have, or ends before it starts."""


@dataclass(frozen=True)
class SourcePlan:
    """What a re-run of one source's range takes, why, and in which runs."""

    source: str
    only: Only
    first: str
    last: str
    selected: dict[str, str]
    """Partition -> why it is taken, in the source's order."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Partition -> why it is not taken although it matches: a run or backfill in flight."""
    runs: list[list[str]] = field(default_factory=list)
    """The partitions of each run the daemon will launch, in order."""

    def lines(self) -> list[str]:
        """The dry run's account of the plan, one line per partition and per run."""
        head = (f"{self.source}: {len(self.selected)} partition(s) of {self.first}..{self.last} "
                f"selected ({self.only.value}) in {len(self.runs)} run(s)")
        out = [head]
        out += [f"  {key:<12} {why}" for key, why in self.selected.items()]
        out += [f"  {key:<12} skipped: {why}" for key, why in self.skipped.items()]
        for number, keys in enumerate(self.runs, 1):
            scope = keys[0] if len(keys) == 1 else f"{keys[0]}...{keys[-1]}"
            out.append(f"  run {number}: {scope} ({len(keys)} partition(s))")
        return out

    def as_dict(self) -> dict[str, object]:
        return {"source": self.source, "only": self.only.value, "from": self.first,
                "to": self.last, "selected": self.selected, "skipped": self.skipped,
                "runs": self.runs}


def plan_rerun(instance: DagsterInstance, spec: SourceSpec, first: str, last: str,
               only: Only) -> SourcePlan:
    """The partitions of ``first``..``last`` (both included) that ``only`` takes, and the runs
    that take them."""
    keys = range_keys(instance, spec, first, last)
    partitions_def = spec.partitions_def
    runs_since = (partitions_def.time_window_for_partition_key(keys[0]).start
                  - RUNS_BEFORE_WINDOW
                  if isinstance(partitions_def, TimeWindowPartitionsDefinition) else EPOCH)
    states = partition_states(instance, spec, keys, runs_since=runs_since)
    rejected = _rejected_in_latest_load(instance, spec, keys)
    differing = _differing(instance, spec, keys) if only is Only.DIFFERING else {}
    in_backfill = _in_unfinished_backfills(instance, spec)
    selected: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for key in keys:
        why = (differing.get(key) if only is Only.DIFFERING
               else _why_selected(states[key], rejected.get(key), only))
        if why is None:
            continue
        if states[key].in_flight_run:
            skipped[key] = f"{why}; run {states[key].in_flight_run} in flight"
        elif key in in_backfill:
            skipped[key] = f"{why}; backfill {in_backfill[key]} not finished"
        else:
            selected[key] = why
    runs = _runs(keys, set(selected), spec.backfill_policy.max_partitions_per_run)
    return SourcePlan(spec.name, only, first, last, selected, skipped, runs)


def range_keys(instance: DagsterInstance, spec: SourceSpec, first: str, last: str) -> list[str]:
    """The source's partition keys from ``first`` to ``last``, in the source's order."""
    keys = list(spec.partitions_def.get_partition_keys(dynamic_partitions_store=instance))
    for end in (first, last):
        if end not in keys:
            raise RangeRefused(f"{spec.name} has no partition {end!r}")
    start, stop = keys.index(first), keys.index(last)
    if stop < start:
        raise RangeRefused(f"{spec.name}: {last} comes before {first}")
    return keys[start:stop + 1]


def _why_selected(state: PartitionState, rejected: int | None, only: Only) -> str | None:
    latest = state.latest_run[:8] if state.latest_run else None
    outcome = state.latest_outcome
    if outcome in (Outcome.FAILED, Outcome.FAILED_PERMANENTLY):
        why = f"failed: run {latest} {outcome.value}"
    elif outcome is Outcome.CANCELLED:
        why = f"failed: run {latest} was cancelled"
    elif state.loaded and rejected:
        why = f"failed: partial, {rejected} row(s) quarantined by its latest load"
    elif not state.loaded:
        why = "missing: never loaded" + (
            f" (run {latest} skipped it)" if outcome is Outcome.SKIPPED else "")
    else:
        return "loaded: taken again (all)" if only is Only.ALL else None
    kind = Only.FAILED if why.startswith("failed") else Only.MISSING
    return why if only in (Only.ALL, kind) else None


def _differing(instance: DagsterInstance, spec: SourceSpec,
               keys: Sequence[str]) -> dict[str, str]:
    """Per partition whose latest verification verdict failed and judged its latest load:
    why it is taken."""
    from mostovik_pipelines.framework.verification.check import verification_check_key

    return {info.partition_key: "differs: its latest verification found the table differs "
                                "from the source"
            for info in instance.event_log_storage.get_asset_check_partition_info(
                [verification_check_key(spec)], partition_keys=list(keys))
            if info.partition_key is not None and info.is_current
            and info.latest_execution_status is AssetCheckExecutionRecordStatus.FAILED}


def _rejected_in_latest_load(instance: DagsterInstance, spec: SourceSpec,
                             keys: Sequence[str]) -> dict[str, int]:
    """Per loaded partition, the rows its latest load quarantined."""
    found: dict[str, int] = {}
    cursor = None
    while True:
        result = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey(spec.name), asset_partitions=list(keys)),
            limit=1_000, cursor=cursor, ascending=False)
        for record in result.records:
            key = record.partition_key or ""
            if key in found or record.asset_materialization is None:
                continue
            value = record.asset_materialization.metadata.get("rejected")
            found[key] = int(value.value) if value is not None else 0
        if not result.has_more:
            return found
        cursor = result.cursor


def _in_unfinished_backfills(instance: DagsterInstance, spec: SourceSpec) -> dict[str, str]:
    """Partitions of the source that a backfill still going targets and has not yet done:
    its runs may not exist yet."""
    asset = AssetKey(spec.name)
    found: dict[str, str] = {}
    for backfill in instance.get_backfills(filters=BulkActionsFilter(
            statuses=[BulkActionStatus.REQUESTED, BulkActionStatus.CANCELING,
                      BulkActionStatus.FAILING])):
        data = backfill.asset_backfill_data
        if data is None or asset not in data.target_subset.asset_keys:
            continue
        done = set()
        for finished in (data.materialized_subset, data.failed_and_downstream_subset):
            if asset in finished.asset_keys and spec.partitions_def is not None:
                done |= set(finished.get_partitions_subset(asset).get_partition_keys())
        for key in data.target_subset.get_partitions_subset(asset).get_partition_keys():
            if key not in done:
                found.setdefault(key, backfill.backfill_id)
    return found


def _runs(keys: Sequence[str], taken: set[str], max_per_run: int | None) -> list[list[str]]:
    """Contiguous spans of ``taken`` in ``keys``' order, each cut at ``max_per_run``."""
    spans: list[list[str]] = []
    current: list[str] = []
    for key in keys:
        if key in taken:
            current.append(key)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    runs = []
    for span in spans:
        size = max_per_run or len(span)
        runs += [span[i:i + size] for i in range(0, len(span), size)]
    return runs
