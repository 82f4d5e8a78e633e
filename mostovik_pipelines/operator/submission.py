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
from dataclasses import dataclass, field

from dagster import AssetKey, DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter

from mostovik_pipelines.core.dagster_compat import (
    AUTO_RETRY_RUN_ID_TAG,
    BulkActionStatus,
    PartitionBackfill,
)
from mostovik_pipelines.core.tags import run_partitions
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.operator.selection import SourcePlan

BACKFILL_TAG = "dagster/backfill"
FINISHED_BACKFILL = (BulkActionStatus.COMPLETED, BulkActionStatus.COMPLETED_SUCCESS,
                     BulkActionStatus.COMPLETED_FAILED, BulkActionStatus.FAILED,
                     BulkActionStatus.CANCELED)
FAILED_RUNS = (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
WILL_RETRY_TAG = "dagster/will_retry"
"""Set by Dagster on a failed run: whether the daemon's run retries will run it again."""


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
    """Where a submitted backfill stands: its status, its runs by status, and each partition's
    outcome so far, judged by the last run of its story (a run the daemon retried counts by its
    retry: a dead run retried to success is a success)."""

    backfill_id: str
    status: str
    runs: dict[str, str]
    """Run id -> Dagster run status."""
    outcomes: dict[str, str] = field(default_factory=dict)
    """Partition -> ``success``, ``failed`` or ``in progress`` (a run or a retry still to end)."""
    retried: dict[str, str] = field(default_factory=dict)
    """A failed run of the backfill -> the last run of its automatic retries and its status."""

    @property
    def finished(self) -> bool:
        return (self.status in {s.value for s in FINISHED_BACKFILL}
                and IN_PROGRESS not in self.outcomes.values())

    @property
    def failed_partitions(self) -> list[str]:
        return [key for key, outcome in self.outcomes.items() if outcome != SUCCESS]

    @property
    def succeeded(self) -> bool:
        return self.finished and bool(self.outcomes) and not self.failed_partitions

    def line(self) -> str:
        counts: dict[str, int] = {}
        for status in self.runs.values():
            counts[status.lower()] = counts.get(status.lower(), 0) + 1
        runs = ", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "none yet"
        return f"backfill {self.backfill_id}: {self.status.lower()}; runs: {runs}"

    def verdict(self) -> str:
        """The partitions' final outcomes, and the retries that decided them."""
        failed = self.failed_partitions
        line = (f"backfill {self.backfill_id}: {len(self.outcomes) - len(failed)} of "
                f"{len(self.outcomes)} partition(s) succeeded"
                + (f"; failed: {', '.join(failed)}" if failed else ""))
        retries = "; ".join(f"run {run[:8]} failed, its retry {last}"
                            for run, last in self.retried.items())
        return line + (f" ({retries})" if retries else "")


SUCCESS, FAILED, IN_PROGRESS = "success", "failed", "in progress"
RANK = {FAILED: 0, IN_PROGRESS: 1, SUCCESS: 2}
"""Of several runs of a partition, the best outcome counts (one success loads it)."""


def progress_of(instance: DagsterInstance, backfill_id: str, spec: SourceSpec,
                partitions: list[str]) -> Progress:
    """The backfill's progress, ``partitions`` (what it was asked for) judged by its runs."""
    backfill = instance.get_backfill(backfill_id)
    status = backfill.status.value if backfill is not None else "UNKNOWN"
    runs = instance.get_runs(RunsFilter(tags={BACKFILL_TAG: backfill_id}))
    covered: dict[str, str] = {}
    retried: dict[str, str] = {}
    retries = {run.tags.get(AUTO_RETRY_RUN_ID_TAG) for run in runs}
    for run in runs:
        if run.run_id in retries:
            continue  # judged with the run it retries
        last = last_of_retries(instance, run)
        if last.run_id != run.run_id:
            retried[run.run_id] = f"{last.run_id[:8]} {last.status.value.lower()}"
        outcome = outcome_of(last)
        for key in run_partitions(run.tags, spec.partitions_def, instance) & set(partitions):
            if RANK[outcome] > RANK.get(covered.get(key, ""), -1):
                covered[key] = outcome
    unfinished = status not in {s.value for s in FINISHED_BACKFILL}
    outcomes = {key: covered.get(key, IN_PROGRESS if unfinished else FAILED)
                for key in partitions}
    return Progress(backfill_id, status, {run.run_id: run.status.value for run in runs},
                    outcomes, retried)


def last_of_retries(instance: DagsterInstance, run: DagsterRun) -> DagsterRun:
    """The run that ends ``run``'s story: the last of its automatic retries (the daemon's run
    retries name each retry on the run they retry), or itself."""
    seen = {run.run_id}
    while run.status in FAILED_RUNS and run.tags.get(AUTO_RETRY_RUN_ID_TAG):
        retry = instance.get_run_by_id(run.tags[AUTO_RETRY_RUN_ID_TAG])
        if retry is None or retry.run_id in seen:
            break
        seen.add(retry.run_id)
        run = retry
    return run


def outcome_of(run: DagsterRun) -> str:
    """A run's outcome for its partitions: in progress while it, or a retry the daemon will
    make of it, has not ended."""
    if run.status is DagsterRunStatus.SUCCESS:
        return SUCCESS
    if run.status in FAILED_RUNS:
        awaiting_retry = (run.tags.get(WILL_RETRY_TAG) == "true"
                          and AUTO_RETRY_RUN_ID_TAG not in run.tags)
        return IN_PROGRESS if awaiting_retry else FAILED
    return IN_PROGRESS


def follow(instance: DagsterInstance, backfills: list[tuple[str, SourceSpec, list[str]]],
           report: Callable[[str], None], poll_seconds: float = 2.0) -> list[Progress]:
    """Follow the backfills (id, source, partitions) until the daemon has finished each and
    every partition's last run has ended, reporting a line whenever one's progress changes;
    their last progress."""
    last: dict[str, str] = {}
    while True:
        progress = [progress_of(instance, backfill_id, spec, partitions)
                    for backfill_id, spec, partitions in backfills]
        for item in progress:
            if last.get(item.backfill_id) != item.line():
                last[item.backfill_id] = item.line()
                report(item.line())
        if all(item.finished for item in progress):
            for item in progress:
                report(item.verdict())
            return progress
        time.sleep(poll_seconds)


def follow_run(instance: DagsterInstance, run_id: str, report: Callable[[str], None],
               poll_seconds: float = 1.0) -> str:
    """Follow a queued run until it finishes, and its automatic retries in turn, reporting each
    change of status; the id of the last run (the run, or the retry that ended its story)."""
    last = None
    while True:
        run = instance.get_run_by_id(run_id)
        status = run.status if run is not None else None
        if status is not last:
            report(f"run {run_id}: {status.value.lower() if status else 'unknown'}")
            last = status
        if run is None:
            return run_id
        if run.tags.get(AUTO_RETRY_RUN_ID_TAG):
            run_id, last = run.tags[AUTO_RETRY_RUN_ID_TAG], None
            report(f"run {run.run_id} is retried by the daemon as run {run_id}")
            continue
        if outcome_of(run) != IN_PROGRESS:
            return run_id
        time.sleep(poll_seconds)
