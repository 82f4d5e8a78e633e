"""The run-status check (layer 2 of :mod:`mostovik_pipelines.framework.load.lock`): before its work,
a run looks in run storage for an older run of the same source and partition that is still
alive, and waits for it or stops.

Alive means: in progress in run storage and holding its claim (:mod:`.run_claims`), or launched
so recently that it may not have taken its claim yet (:data:`LAUNCH_GRACE_SECONDS`). A run whose
process died, on this host or any other, frees its partitions within that grace.

A run that storage says failed is alive too while it holds its claim: Dagster's run monitoring
marks a ``dagster job execute`` run past ``dagster/max_runtime`` failed without being able to
stop its process, which goes on loading (:data:`FAILED_BUT_ALIVE_LOOKBACK_SECONDS`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from dagster import (
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    PartitionsDefinition,
    RunRecord,
    RunsFilter,
)

from mostovik_pipelines.core.tags import run_partitions
from mostovik_pipelines.platform.claims import run_claim_gone, run_claim_held

IN_FLIGHT = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
NOT_STARTED_GRACE_SECONDS = 120
"""A run created but not started yet counts as in progress for this long: two runs launched at
the same instant see each other even before either has started."""
FAILED_BUT_ALIVE_LOOKBACK_SECONDS = 24 * 3600
"""How far back failed runs are checked for a claim still held: a run failed by run monitoring
has run past its source's ``max_runtime`` already (hours), and every claim check is a query."""
LAUNCH_GRACE_SECONDS = 10.0
"""A run that has not started a step and holds no claim counts as alive this long after it was
created or last changed status: between its launch and the start of its executor (process
start-up, loading the code). A run that started a step took its claim before: without it for
:data:`.claims.CLAIM_GONE_SECONDS`, it is dead."""


@dataclass(frozen=True)
class RunClaim:
    """What one run is about: the source's job or asset, and its partitions."""

    run_id: str
    job_name: str
    asset_key: AssetKey
    partition_keys: frozenset[str]


def older_runs_in_flight(
    instance: DagsterInstance, claim: RunClaim, partitions_def: PartitionsDefinition
) -> list[DagsterRun]:
    """Live runs of the same source sharing a partition with ``claim`` and older than it. Runs
    are ordered by (creation time, run id), so of two runs that start at the same instant
    exactly one is older: one goes first, never both or neither."""
    now = datetime.now(UTC)
    records = [
        *instance.get_run_records(RunsFilter(statuses=IN_FLIGHT)),
        *instance.get_run_records(RunsFilter(
            statuses=[DagsterRunStatus.NOT_STARTED],
            created_after=now - timedelta(seconds=NOT_STARTED_GRACE_SECONDS),
        )),
        *instance.get_run_records(RunsFilter(
            statuses=[DagsterRunStatus.FAILURE],
            updated_after=now - timedelta(seconds=FAILED_BUT_ALIVE_LOOKBACK_SECONDS),
        )),
    ]
    mine = next((r for r in records if r.dagster_run.run_id == claim.run_id), None)
    my_order = (mine.create_timestamp.timestamp(), claim.run_id) if mine else (float("inf"), "")
    older = []
    for record in records:
        run = record.dagster_run
        if run.run_id == claim.run_id or (record.create_timestamp.timestamp(), run.run_id) >= (
            my_order
        ):
            continue
        targets_source = run.job_name == claim.job_name or (
            run.asset_selection is not None and claim.asset_key in run.asset_selection
        )
        covered = run_partitions(run.tags, partitions_def, instance)
        if targets_source and claim.partition_keys & covered and _alive(instance, record):
            older.append(run)
    return older


def _alive(instance: DagsterInstance, record: RunRecord) -> bool:
    """Holding its claim; or, in progress before its first step (no claim taken yet), launched
    recently. A failed run only while it holds its claim."""
    run_id = record.dagster_run.run_id
    if run_claim_held(instance, run_id, taken_at=record.start_time):
        return True
    if record.dagster_run.status is DagsterRunStatus.FAILURE:
        return False
    if instance.get_records_for_run(run_id, of_type=DagsterEventType.STEP_START,
                                    limit=1).records:
        # It held its claim: free now, it may be taking it again after its connection dropped
        # (the fence's grace), and only a claim that stays free is a dead run.
        return not run_claim_gone(instance, run_id, taken_at=record.start_time)
    changed = max(record.create_timestamp.timestamp(), record.update_timestamp.timestamp(),
                  record.start_time or 0.0)
    return time.time() - changed < LAUNCH_GRACE_SECONDS
