"""An operator's re-run goes to the instance's run queue as a Dagster asset backfill: the same
thing the UI's "Materialize selected" submits (``instance.add_backfill`` of a
``PartitionBackfill``), so the daemon launches its runs through the queue, with its concurrency
limits, run monitoring, run retries and the configured executor, and the UI lists it under
Backfills. Its tags (who asked and why) are on every run it launches.

One backfill per source, of exactly the plan's partitions; the daemon cuts them into runs by the
source's backfill policy, as :mod:`.selection` planned them.
"""

from __future__ import annotations

import secrets
import string
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dagster import AssetKey, DagsterInstance, DagsterRunStatus, RunsFilter

from mostovik_pipelines.framework.dagster_compat import BulkActionStatus, PartitionBackfill
from mostovik_pipelines.operator.selection import SourcePlan

BACKFILL_TAG = "dagster/backfill"
FINISHED_BACKFILL = (BulkActionStatus.COMPLETED, BulkActionStatus.COMPLETED_SUCCESS,
                     BulkActionStatus.COMPLETED_FAILED, BulkActionStatus.FAILED,
                     BulkActionStatus.CANCELED)
FAILED_RUNS = (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


def submit_plan(instance: DagsterInstance, plan: SourcePlan, tags: Mapping[str, str]) -> str:
    """Submit the plan's partitions as a backfill of the source's asset; its id."""
    from mostovik_pipelines.definitions import defs

    backfill_id = "".join(secrets.choice(string.ascii_lowercase) for _ in range(8))
    reason = tags.get("mostovik/reason")
    instance.add_backfill(PartitionBackfill.from_asset_partitions(
        backfill_id=backfill_id,
        asset_graph=defs.resolve_asset_graph(),
        partition_names=list(plan.selected),
        asset_selection=[AssetKey(plan.source)],
        backfill_timestamp=time.time(),
        tags=dict(tags),
        dynamic_partitions_store=instance,
        all_partitions=False,
        title=f"mostovik jobs rerun {plan.source} {plan.first}..{plan.last} ({plan.only.value})",
        description=reason,
        run_config=None,
    ))
    return backfill_id


@dataclass(frozen=True)
class Progress:
    """Where a submitted backfill stands: its status and its runs by status."""

    backfill_id: str
    status: str
    runs: dict[str, str]
    """Run id -> Dagster run status."""

    @property
    def finished(self) -> bool:
        return self.status in {s.value for s in FINISHED_BACKFILL}

    @property
    def failed_runs(self) -> list[str]:
        return [run_id for run_id, status in self.runs.items()
                if status in {s.value for s in FAILED_RUNS}]

    @property
    def succeeded(self) -> bool:
        return self.status == BulkActionStatus.COMPLETED_SUCCESS.value and not self.failed_runs

    def line(self) -> str:
        counts: dict[str, int] = {}
        for status in self.runs.values():
            counts[status.lower()] = counts.get(status.lower(), 0) + 1
        runs = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "none yet"
        return f"backfill {self.backfill_id}: {self.status.lower()}; runs: {runs}"


def progress_of(instance: DagsterInstance, backfill_id: str) -> Progress:
    backfill = instance.get_backfill(backfill_id)
    status = backfill.status.value if backfill is not None else "UNKNOWN"
    runs = {run.run_id: run.status.value
            for run in instance.get_runs(RunsFilter(tags={BACKFILL_TAG: backfill_id}))}
    return Progress(backfill_id, status, runs)


def follow(instance: DagsterInstance, backfill_ids: list[str], report: Callable[[str], None],
           poll_seconds: float = 2.0) -> list[Progress]:
    """Follow the backfills until the daemon has finished each, reporting a line whenever one's
    progress changes; their last progress."""
    last: dict[str, str] = {}
    while True:
        progress = [progress_of(instance, backfill_id) for backfill_id in backfill_ids]
        for item in progress:
            if last.get(item.backfill_id) != item.line():
                last[item.backfill_id] = item.line()
                report(item.line())
        if all(item.finished for item in progress):
            return progress
        time.sleep(poll_seconds)


def follow_run(instance: DagsterInstance, run_id: str, report: Callable[[str], None],
               poll_seconds: float = 1.0) -> str:
    """Follow a queued run until it finishes, reporting each change of its status; its last
    status."""
    last = None
    while True:
        run = instance.get_run_by_id(run_id)
        status = run.status if run is not None else None
        if status is not last:
            report(f"run {run_id}: {status.value.lower() if status else 'unknown'}")
            last = status
        if status is None or status in (DagsterRunStatus.SUCCESS, *FAILED_RUNS):
            return status.value if status else "UNKNOWN"
        time.sleep(poll_seconds)
