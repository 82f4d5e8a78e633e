"""What the runs nobody launches by hand ask for, so that they add up to every period's data.

Each tick of a source's schedule looks at every partition in the source's lookback
(:attr:`.CatchUpPolicy.lookback`) as :mod:`.partition_states` reads it from run storage, and asks
for:

* ``newest``: the newest partition(s) the source has (``SourceSchedule.latest_partitions``),
  as the schedule always did: today's sync window, tomorrow's rates;
* ``window_closed``: a sync's window that is loaded but not final, once its close plus the
  source's settle time has passed: the ERP's first tick after midnight syncs yesterday's window
  as well as today's, so a work order changed at 23:30 is in;
* ``after_failure``: a partition not final whose latest run failed on a transient error (the
  source down through all of a day's ticks, a run past its retry budget, a lost worker);
* ``missing``: a partition never loaded (not published yet when asked, ticks missed while the
  daemon was down, a partition nobody asked for).

It never asks for a partition with a run in flight, nor for one whose latest run failed for a
permanent reason or was cancelled (it waits for an operator, :attr:`.PartitionState.
waiting_for_operator`). After a transient failure the partition is asked for again only after a
backoff that doubles with every failure in a row (:attr:`.CatchUpPolicy.backoff`), so a source
down for a week costs a handful of runs. What is asked for goes in as few runs as the source's
backfill policy allows: a single-run source (the CBR's) gets one ranged run, which re-loads the
final partitions between two asked for (``in_range``: an idempotent re-load) rather than split;
a multi-run source gets a run per contiguous span, cut at its ``max_partitions_per_run``. A
partition with a run in flight (an operator's re-run of a final day) or waiting for an operator
is never touched, bridged or not: the span is cut around it, so no second run of it starts.

Every run carries ``mostovik/requested_because``: the reason of its partition, or per reason the
partitions of a ranged run. The tick's log says what was asked for and what was held, and why.

A file source's sensor asks, the same way, for the file versions whose latest run failed on a
transient error (:func:`file_versions_to_retry`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from dagster import DagsterInstance, RunRequest, RunsFilter, TimeWindowPartitionsDefinition

from mostovik_pipelines.core.tags import (
    PARTITION_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    REQUESTED_BECAUSE_TAG,
    SOURCE_TAG,
)
from mostovik_pipelines.framework.automation.partition_states import (
    Outcome,
    PartitionState,
    partition_states,
)
from mostovik_pipelines.framework.spec import JobType, SourceSpec

RUNS_BEFORE_WINDOW = timedelta(days=7)


class Reason(enum.StrEnum):
    NEWEST = "newest"
    WINDOW_CLOSED = "window_closed"
    AFTER_FAILURE = "after_failure"
    MISSING = "missing"
    IN_RANGE = "in_range"
    """Final already, re-loaded because it lies between two partitions a single run asks for."""
    NEW_FILE = "new_file"
    """A file source's new version in the inbox."""


@dataclass(frozen=True)
class PlannedRun:
    """One run the tick asks for: its partitions (contiguous) and why each is in it."""

    reasons: dict[str, Reason]

    @property
    def keys(self) -> list[str]:
        return list(self.reasons)

    def requested_because(self) -> str:
        """The tag's value: the reason of a single partition; per reason, a range's keys."""
        if len(self.reasons) == 1:
            return next(iter(self.reasons.values())).value
        by_reason: dict[Reason, list[str]] = {}
        for key, reason in self.reasons.items():
            by_reason.setdefault(reason, []).append(key)
        return "; ".join(f"{reason.value} {_spans(keys)}" for reason, keys in by_reason.items())

    def run_request(self, tick: datetime) -> RunRequest:
        keys = self.keys
        scope = keys[0] if len(keys) == 1 else f"{keys[0]}...{keys[-1]}"
        tags = {REQUESTED_BECAUSE_TAG: self.requested_because()}
        if len(keys) == 1:
            return RunRequest(partition_key=keys[0], run_key=f"{scope}@{tick.isoformat()}",
                              tags=tags)
        return RunRequest(run_key=f"{scope}@{tick.isoformat()}", tags={
            **tags, RANGE_START_TAG: keys[0], RANGE_END_TAG: keys[-1]})


@dataclass(frozen=True)
class CatchUpPlan:
    runs: list[PlannedRun]
    held: dict[str, str] = field(default_factory=dict)
    """Partitions in the lookback not asked for although not final, and why."""

    def describe(self) -> list[str]:
        return [*(f"asking for {run.keys[0]}"
                  + (f"...{run.keys[-1]}" if len(run.keys) > 1 else "")
                  + f": {run.requested_because()}" for run in self.runs),
                *(f"not asking for {key}: {why}" for key, why in self.held.items())]


def plan_catch_up(instance: DagsterInstance, spec: SourceSpec, now: datetime) -> CatchUpPlan:
    """The runs a tick at ``now`` asks for (a time-partitioned source with a schedule)."""
    partitions_def = spec.partitions_def
    assert isinstance(partitions_def, TimeWindowPartitionsDefinition) and spec.schedule
    policy = spec.catch_up
    keys = partitions_def.get_partition_keys(current_time=now)
    start = now - policy.lookback
    keys = [key for key in keys if partitions_def.time_window_for_partition_key(key).end > start]
    newest = set(keys[-spec.schedule.latest_partitions:])
    if not keys:
        return CatchUpPlan([])
    # A partition's runs: from a few days before its window opens (tomorrow's rates are asked
    # for today) on; older failures no longer count for its backoff.
    runs_since = partitions_def.time_window_for_partition_key(keys[0]).start - RUNS_BEFORE_WINDOW
    states = partition_states(instance, spec, keys, runs_since=runs_since)
    asked: dict[str, Reason] = {}
    held: dict[str, str] = {}
    untouchable = {key for key, state in states.items()
                   if state.in_flight_run or state.waiting_for_operator}
    for key in keys:
        state = states[key]
        reason = _reason(spec, state, key in newest, now)
        if reason is None:
            continue
        why_not = _why_not(spec, state, now)
        if why_not:
            held[key] = why_not
        else:
            asked[key] = reason
    bridge = spec.backfill_policy.max_partitions_per_run is None
    return CatchUpPlan(_group(keys, asked, untouchable | set(held), bridge,
                              spec.backfill_policy.max_partitions_per_run), held)


def file_versions_to_retry(instance: DagsterInstance, spec: SourceSpec,
                           now: datetime) -> dict[str, str]:
    """A file source: the versions whose latest run (within the lookback) failed on a transient
    error and whose backoff has passed, each with that run's id (a sensor's run key per
    failure, so each failure is retried once)."""
    since = now - spec.catch_up.lookback
    failed = {record.dagster_run.tags[PARTITION_TAG] for record in instance.get_run_records(
        RunsFilter(tags={SOURCE_TAG: spec.name}, updated_after=since))
        if PARTITION_TAG in record.dagster_run.tags}
    states = partition_states(instance, spec, sorted(failed), runs_since=since)
    return {key: state.latest_run or "" for key, state in states.items()
            if not state.loaded and state.latest_outcome is Outcome.FAILED
            and _why_not(spec, state, now) is None}


def _reason(spec: SourceSpec, state: PartitionState, newest: bool,
            now: datetime) -> Reason | None:
    if newest:
        return Reason.NEWEST
    if state.final:
        return None
    if state.latest_outcome is Outcome.FAILED or state.waiting_for_operator:
        return Reason.AFTER_FAILURE  # held by _why_not while it waits for an operator
    if not state.loaded:
        return Reason.MISSING
    window = spec.partitions_def.time_window_for_partition_key(state.key)
    if spec.job_type is JobType.SYNC and now >= window.end + spec.catch_up.settle:
        return Reason.WINDOW_CLOSED
    return None


def _why_not(spec: SourceSpec, state: PartitionState, now: datetime) -> str | None:
    """Why a partition that needs a run is not asked for now, or None."""
    if state.in_flight_run:
        return f"run {state.in_flight_run} in flight"
    if state.waiting_for_operator:
        return f"waiting for an operator: run {state.latest_run} {state.latest_outcome}"
    if state.latest_outcome is Outcome.FAILED and state.latest_ended_at is not None:
        wait = min(spec.catch_up.backoff * 2 ** (state.failures_in_a_row - 1),
                   spec.catch_up.max_backoff)
        again = state.latest_ended_at + wait
        if now < again:
            return (f"backing off after {state.failures_in_a_row} failure(s) in a row "
                    f"(run {state.latest_run}) until {again.isoformat(timespec='seconds')}")
    return None


def _group(keys: Sequence[str], asked: dict[str, Reason], held: set[str], bridge: bool,
           max_per_run: int | None) -> list[PlannedRun]:
    """Contiguous spans of asked partitions; a single-run source (``bridge``) spans the final
    ones between them too, never one ``held`` (not asked for, in flight or waiting for an
    operator, final or not)."""
    spans: list[dict[str, Reason]] = []
    current: dict[str, Reason] = {}
    between: list[str] = []
    for key in keys:
        if key in asked:
            current.update({k: Reason.IN_RANGE for k in between})
            current[key] = asked[key]
            between = []
        elif bridge and current and key not in held:
            between.append(key)
        else:
            if current:
                spans.append(current)
            current, between = {}, []
    if current:
        spans.append(current)
    runs = []
    for span in spans:
        items = list(span.items())
        size = max_per_run or len(items)
        runs += [PlannedRun(dict(items[i:i + size])) for i in range(0, len(items), size)]
    return runs


def _spans(keys: Sequence[str]) -> str:
    """Daily keys as ``a..b`` spans of consecutive days (other keys listed)."""
    parts: list[list[str]] = []
    for key in keys:
        if parts and _next_day(parts[-1][-1]) == key:
            parts[-1].append(key)
        else:
            parts.append([key])
    return ", ".join(p[0] if len(p) == 1 else f"{p[0]}..{p[-1]}" for p in parts)


def _next_day(key: str) -> str | None:
    try:
        return (datetime.fromisoformat(key) + timedelta(days=1)).date().isoformat()
    except ValueError:
        return None
