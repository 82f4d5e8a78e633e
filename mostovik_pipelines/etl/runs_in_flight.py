"""The run-status check (layer 2 of :mod:`.locking`): before extract, a run looks in run storage
for an older run of the same source and partition still in progress, and waits for it or stops."""

from __future__ import annotations

import enum
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from dagster import (
    AssetKey,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    PartitionKeyRange,
    PartitionsDefinition,
    RunsFilter,
)

from mostovik_pipelines.etl.errors import ConcurrentRunError
from mostovik_pipelines.etl.tags import (
    HOST_TAG,
    PARTITION_TAG,
    PID_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
)

IN_FLIGHT = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
NOT_STARTED_GRACE_SECONDS = 120
"""A run created but not started yet counts as in progress for this long: two runs launched at
the same instant see each other even before either has started."""
POLL_SECONDS = 1.0


class ConcurrentRunPolicy(enum.StrEnum):
    """What a run does when an older run of the same source and partition is in progress."""

    WAIT = "wait"
    """Wait for it, then run: the duplicate was asked for (an operator's re-run while the
    schedule's run is going), so it should still deliver a fresh result, after the other."""

    STOP = "stop"
    """Stop at once, loading nothing, with a message naming the other run."""


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
    """Runs of the same source sharing a partition with ``claim`` that are in progress and
    older than it. Runs are ordered by (creation time, run id), so of two runs that start at the
    same instant exactly one is older: one goes first, never both or neither."""
    records = [
        *instance.get_run_records(RunsFilter(statuses=IN_FLIGHT)),
        *instance.get_run_records(RunsFilter(
            statuses=[DagsterRunStatus.NOT_STARTED],
            created_after=datetime.now(UTC) - timedelta(seconds=NOT_STARTED_GRACE_SECONDS),
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
        if targets_source and claim.partition_keys & _run_partitions(run, partitions_def):
            if _process_is_gone(run):
                continue
            older.append(run)
    return older


def wait_for_older_runs(
    instance: DagsterInstance, claim: RunClaim, partitions_def: PartitionsDefinition,
    policy: ConcurrentRunPolicy, timeout_seconds: float, log: Callable[[str], None],
) -> list[DagsterRun]:
    """Apply ``policy``: return the older runs still in progress when this run should stop
    (STOP), or ``[]`` once none is left (WAIT). Raises :class:`ConcurrentRunError` when waiting
    takes longer than ``timeout_seconds``."""
    deadline = time.monotonic() + timeout_seconds
    announced: set[str] = set()
    while True:
        older = older_runs_in_flight(instance, claim, partitions_def)
        if not older or policy is ConcurrentRunPolicy.STOP:
            return older
        fresh = [run.run_id for run in older if run.run_id not in announced]
        if fresh:
            log(f"waiting for run(s) {', '.join(fresh)} of the same partition(s) to finish")
            announced.update(fresh)
        if time.monotonic() > deadline:
            raise ConcurrentRunError(
                f"run(s) {', '.join(r.run_id for r in older)} of the same partition(s) still in "
                f"progress after {timeout_seconds:.0f}s"
            )
        time.sleep(POLL_SECONDS)


def _run_partitions(run: DagsterRun, partitions_def: PartitionsDefinition) -> set[str]:
    tags = run.tags
    if PARTITION_TAG in tags:
        return {tags[PARTITION_TAG]}
    start, end = tags.get(RANGE_START_TAG), tags.get(RANGE_END_TAG)
    if start and end:
        return set(partitions_def.get_partition_keys_in_range(PartitionKeyRange(start, end)))
    return set()


def _process_is_gone(run: DagsterRun) -> bool:
    """True when the run's last step process ran on this host and no longer exists."""
    if run.tags.get(HOST_TAG) != socket.gethostname() or PID_TAG not in run.tags:
        return False
    try:
        os.kill(int(run.tags[PID_TAG]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
