"""One prune: every store's rule, applied in an order that keeps what remains consistent.

The plan is made first from one reading of run storage and the files, then applied removal by
removal in this order:

1. op outputs (whole run directories, each renamed aside before it is deleted);
2. landing fetch records, then the blobs no remaining record points to: a record is never left
   pointing to a missing blob, whatever point a prune is killed at; then stale frames;
3. runs: captured logs, events, the event log's files of the run (a local SQLite instance keeps
   one per run), then the run record, last, since the file rules read run storage to know what
   a recovery path may still use;
4. event log files of runs run storage no longer has (deleted by hand, or by an older prune);
5. claim files a killed process left (a local instance's), which no live process holds.

A prune killed half way leaves only things a complete prune would also remove or keep, so the
next one ends where one clean prune would have; a second prune finds nothing to remove. A prune
running next to jobs removes nothing they use: a run's own outputs, records and frames are kept
while it is unfinished (and its parents' while it re-executes them), and a file run storage does
not know yet (a run that started after the prune read it) is kept for the grace period.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from dagster import AssetCheckKey, DagsterInstance

from mostovik_pipelines.maintenance.claim_files import dead_claim_files
from mostovik_pipelines.maintenance.files import (
    StoredPayloads,
    old_fetch_records,
    stale_frames,
    stale_op_outputs,
    unreferenced_blobs,
)
from mostovik_pipelines.maintenance.policy import PruneReport, Removal, RetentionPolicy
from mostovik_pipelines.maintenance.runs import RunFacts, old_runs, orphaned_event_log_files
from mostovik_pipelines.resources.stores import StorePath


def plan_prune(instance: DagsterInstance, *, landing_dir: StorePath, op_output_dir: StorePath,
               check_keys: Sequence[AssetCheckKey], policy: RetentionPolicy,
               now: datetime) -> list[Removal]:
    """Everything a prune at ``now`` removes, in the order it removes it."""
    facts = RunFacts.read(instance)
    records = old_fetch_records(landing_dir, facts, policy, now, StoredPayloads(instance))
    return [
        *stale_op_outputs(op_output_dir, facts, policy, now),
        *records,
        *unreferenced_blobs(landing_dir, {removal.target for removal in records}, policy, now),
        *stale_frames(landing_dir, facts, policy, now),
        *old_runs(instance, facts, policy, now, check_keys),
        *orphaned_event_log_files(instance, facts, policy, now),
        *dead_claim_files(instance, policy, now),
    ]


def prune(instance: DagsterInstance, *, landing_dir: StorePath, op_output_dir: StorePath,
          check_keys: Sequence[AssetCheckKey], policy: RetentionPolicy | None = None,
          now: datetime | None = None, dry_run: bool = False,
          before_removal: Callable[[Removal], None] | None = None) -> PruneReport:
    """Apply the retention policy (by default the environment's) as of ``now``; ``dry_run``
    reports what it would remove and removes nothing. ``before_removal`` is called before each
    removal (the tests stop a prune half way with it)."""
    report = PruneReport(dry_run)
    for removal in plan_prune(instance, landing_dir=landing_dir, op_output_dir=op_output_dir,
                              check_keys=check_keys,
                              policy=policy or RetentionPolicy.from_environment(),
                              now=now or datetime.now(UTC)):
        if not dry_run:
            if before_removal is not None:
                before_removal(removal)
            removal.remove()
        report.add(removal)
    return report
