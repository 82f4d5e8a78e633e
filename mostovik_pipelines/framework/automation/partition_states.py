"""Where each partition of a source stands, read from run storage alone: loaded (and, for a sync,
final), in flight, or left by its latest run as failed, transiently or for good.

What the automation asks for (:mod:`.catch_up`), what ``mostovik jobs list`` marks as waiting
for an operator and what a failure alert says comes next are all read here, so they never
disagree. Per partition:

* **loaded**: it has a materialisation. A parser's or a file's loaded partition is final,
  unless the run that loaded it then failed it for good (a blocking check: the data stay for an
  operator to look at, and the partition waits for them like any permanent failure). A
  sync's window is final only when a sync that *started* after the window closed plus the
  source's settle time (:attr:`.CatchUpPolicy.settle`) loaded it from its first page (a sync
  that resumed an interrupted one carries pages fetched before);
* **in flight**: a run covering it is queued, starting or running;
* **its latest outcome**: what the newest finished run covering it did with it: loaded it,
  skipped it (not available yet, stopped for a concurrent run), failed on a transient error,
  or failed for a permanent reason (a contract or validation error: ADR-011's "never retried
  unconditionally") or was cancelled by a person. The last two wait for an operator;
* **failures in a row**: transient failures since its last other outcome (the backoff's count).

A ranged run that fails sets its partitions' fates apart: those it loaded are loaded, those it
set aside for a permanent reason are listed in its ``mostovik/failed_permanently`` observation,
the rest of a failed run failed transiently, as did every partition of a run that died without
classifying its failure (a lost process is an infrastructure fault).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    RunRecord,
    RunsFilter,
    TimeWindowPartitionsDefinition,
)

from mostovik_pipelines.core.tags import (
    ERROR_CLASS_KEY,
    FAILED_PERMANENTLY_KEY,
    PERMANENT,
    SOURCE_TAG,
    run_partitions,
)
from mostovik_pipelines.framework.spec import JobType, SourceSpec

IN_FLIGHT = (DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
             DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING)
FINISHED = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
MATERIALIZATIONS_PAGE = 1_000
FETCHED = "fetched:"


class Outcome(enum.StrEnum):
    """What one finished run did with one partition."""

    LOADED = "loaded"
    SKIPPED = "skipped"
    FAILED = "failed"
    FAILED_PERMANENTLY = "failed permanently"
    CANCELLED = "cancelled"


WAITS_FOR_OPERATOR = (Outcome.FAILED_PERMANENTLY, Outcome.CANCELLED)


@dataclass(frozen=True)
class PartitionState:
    """One partition of one source, as run storage tells it."""

    key: str
    loaded: bool
    final: bool
    in_flight_run: str | None
    latest_outcome: Outcome | None
    latest_run: str | None
    latest_ended_at: datetime | None
    failures_in_a_row: int

    @property
    def waiting_for_operator(self) -> bool:
        """Its latest run failed for a permanent reason or was cancelled: nothing asks for it
        again until a person has (and once a person's run loads it, it is final)."""
        return self.latest_outcome in WAITS_FOR_OPERATOR


def partition_states(instance: DagsterInstance, spec: SourceSpec, keys: Sequence[str],
                     runs_since: datetime) -> dict[str, PartitionState]:
    """The state of each of ``keys``, from the source's runs created since ``runs_since`` and
    every materialisation of those partitions."""
    wanted = set(keys)
    runs = _runs_of(instance, spec, runs_since)
    covering: dict[str, list[RunRecord]] = {key: [] for key in keys}
    for record in runs:
        for key in run_partitions(record.dagster_run.tags, spec.partitions_def, instance) & wanted:
            covering[key].append(record)
    materialized = _materializations(instance, spec, keys)
    run_starts = _run_starts(instance, runs, {run_id for found in materialized.values()
                                              for run_id, _ in found})
    fates = _RunFates(instance)
    states = {}
    for key in keys:
        newest_first = sorted(covering[key], key=lambda r: r.create_timestamp, reverse=True)
        in_flight = next((r.dagster_run.run_id for r in newest_first
                          if r.dagster_run.status in IN_FLIGHT), None)
        finished = [r for r in newest_first if r.dagster_run.status in FINISHED]
        loaded_by = {run_id for run_id, _ in materialized.get(key, ())}
        outcomes = (fates.outcome(r, key, loaded_by) for r in finished)
        latest = next(outcomes, None)
        in_a_row = 0
        if latest is Outcome.FAILED:
            in_a_row = 1 + sum(1 for _ in _while_failed(outcomes))
        # A load its own run then failed for good (a blocking check) vouches for nothing, and
        # while it is the newest load, what the table holds is its.
        loads = materialized.get(key, [])
        refuted = {r.dagster_run.run_id for r in finished
                   if r.dagster_run.run_id in loaded_by
                   and fates.outcome(r, key, loaded_by) is Outcome.FAILED_PERMANENTLY}
        states[key] = PartitionState(
            key=key, loaded=bool(loaded_by),
            final=bool(loads) and loads[0][0] not in refuted and _final(
                spec, key, [load for load in loads if load[0] not in refuted], run_starts),
            in_flight_run=in_flight, latest_outcome=latest,
            latest_run=finished[0].dagster_run.run_id if finished else None,
            latest_ended_at=_ended_at(finished[0]) if finished else None,
            failures_in_a_row=in_a_row,
        )
    return states


def _while_failed(outcomes: Iterable[Outcome]) -> Iterable[Outcome]:
    for outcome in outcomes:
        if outcome is not Outcome.FAILED:
            return
        yield outcome


def _runs_of(instance: DagsterInstance, spec: SourceSpec, since: datetime) -> list[RunRecord]:
    """The source's runs since ``since``; and, whenever created, those not started yet that do
    not carry the source's tag (a UI asset backfill's run gets it at its first step)."""
    records = {r.dagster_run.run_id: r for r in instance.get_run_records(
        RunsFilter(tags={SOURCE_TAG: spec.name}, created_after=since))}
    for record in instance.get_run_records(RunsFilter(statuses=list(IN_FLIGHT))):
        run = record.dagster_run
        if SOURCE_TAG not in run.tags and (
                run.job_name == f"{spec.name}_job"
                or AssetKey(spec.name) in (run.asset_selection or ())):
            records[run.run_id] = record
    return list(records.values())


def _materializations(instance: DagsterInstance, spec: SourceSpec,
                      keys: Sequence[str]) -> dict[str, list[tuple[str, int]]]:
    """Per partition: (run id, the page its load resumed after; 0 from the first page) of
    every materialisation, newest first. A run-less one (recorded from the warehouse's ledger
    after run storage was lost, :mod:`..runs.rebuild`) has no run: its id is
    ``fetched:<timestamp>`` of the payload its load started from, which stands for the run's
    start, else empty."""
    found: dict[str, list[tuple[str, int]]] = {}
    cursor = None
    while keys:
        result = instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey(spec.name), asset_partitions=list(keys)),
            limit=MATERIALIZATIONS_PAGE, cursor=cursor)
        for record in result.records:
            metadata = record.asset_materialization.metadata if (
                record.asset_materialization) else {}
            resumed = metadata.get("resumed_after_page")
            run_id = record.run_id
            if not run_id and "fetched_at" in metadata:
                run_id = f"{FETCHED}{metadata['fetched_at'].value}"
            found.setdefault(record.partition_key or "", []).append(
                (run_id, int(resumed.value) if resumed is not None else 0))
        if not result.has_more:
            break
        cursor = result.cursor
    return found


def _run_starts(instance: DagsterInstance, known: Sequence[RunRecord],
                run_ids: set[str]) -> dict[str, float | None]:
    starts: dict[str, float | None] = {r.dagster_run.run_id: r.start_time for r in known}
    starts.update({run_id: datetime.fromisoformat(run_id.removeprefix(FETCHED)).timestamp()
                   for run_id in run_ids if run_id.startswith(FETCHED)})
    missing = sorted(run_id for run_id in run_ids - set(starts) if run_id)
    if missing:
        starts.update({r.dagster_run.run_id: r.start_time for r in instance.get_run_records(
            RunsFilter(run_ids=missing))})
    return starts


def _final(spec: SourceSpec, key: str, loads: Sequence[tuple[str, int]],
           run_starts: dict[str, float | None]) -> bool:
    if not loads:
        return False
    if spec.job_type is not JobType.SYNC or not isinstance(
            spec.partitions_def, TimeWindowPartitionsDefinition):
        return True
    closed = spec.partitions_def.time_window_for_partition_key(key).end + spec.catch_up.settle
    return any(resumed_after == 0 and (run_starts.get(run_id) or 0.0) >= closed.timestamp()
               for run_id, resumed_after in loads)


def _ended_at(record: RunRecord) -> datetime:
    stamp = record.end_time or record.update_timestamp.timestamp()
    return datetime.fromtimestamp(stamp, UTC)


class _RunFates:
    """What a finished run did with each partition; a failed run's events are read once."""

    def __init__(self, instance: DagsterInstance) -> None:
        self._instance = instance
        self._permanent: dict[str, tuple[bool, set[str]]] = {}

    def outcome(self, record: RunRecord, key: str, loaded_by: set[str]) -> Outcome:
        run = record.dagster_run
        if run.status is DagsterRunStatus.FAILURE:
            # A partition loaded and then failed by a blocking check failed for good: its data
            # breaks an invariant, and it waits for an operator like any permanent failure.
            whole_run, set_aside = self._permanent_failures(run.run_id)
            if whole_run or key in set_aside:
                return Outcome.FAILED_PERMANENTLY
        if run.run_id in loaded_by:
            return Outcome.LOADED
        if run.status is DagsterRunStatus.SUCCESS:
            return Outcome.SKIPPED
        if run.status is DagsterRunStatus.CANCELED:
            return Outcome.CANCELLED
        return Outcome.FAILED

    def _permanent_failures(self, run_id: str) -> tuple[bool, set[str]]:
        """Whether the run's step failed for a permanent reason, and the partitions a ranged
        run set aside for one."""
        if run_id not in self._permanent:
            whole_run, set_aside = False, set()
            for record in self._instance.get_records_for_run(run_id, of_type={
                    DagsterEventType.STEP_FAILURE, DagsterEventType.ASSET_OBSERVATION}).records:
                event = record.event_log_entry.dagster_event
                if event is None:
                    continue
                if event.event_type is DagsterEventType.STEP_FAILURE:
                    data = event.step_failure_data.user_failure_data
                    error_class = data.metadata.get(ERROR_CLASS_KEY) if data else None
                    whole_run |= error_class is not None and error_class.value == PERMANENT
                else:
                    listed = event.asset_observation_data.asset_observation.metadata.get(
                        FAILED_PERMANENTLY_KEY)
                    if listed is not None:
                        set_aside.update(listed.value)
            self._permanent[run_id] = (whole_run, set_aside)
        return self._permanent[run_id]


def waiting_for_operator(instance: DagsterInstance, spec: SourceSpec, partitions: Sequence[str],
                         run_id: str) -> list[str]:
    """The partitions of run ``run_id`` that wait for an operator because of it: it is their
    latest run, and it failed for a permanent reason or was cancelled."""
    record = instance.get_run_record_by_id(run_id)
    if record is None or not partitions:
        return []
    states = partition_states(instance, spec, partitions,
                              runs_since=record.create_timestamp - timedelta(seconds=1))
    return [key for key, state in states.items()
            if state.waiting_for_operator and state.latest_run == run_id]
