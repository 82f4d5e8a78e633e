"""Each period's deadline, as the operator is told it: a check per source that is red exactly
while a due period is not final, naming it, and an alert once per late period and once per
period that left the lookback unloaded.

A time-partitioned source declares when its periods are due (``SourceSpec.deadline``, a
:class:`.PeriodDeadline`: the CBR's tomorrow's rates by 16:30 on the days it publishes, the
metals' day by 19:00, the ERP's window an hour after its close and settle time). Here:

* :func:`deadline_state`: at an instant, the source's due periods that are not final in run
  storage's terms (:mod:`.partition_states`: loaded, a sync's window synced after its close, and
  not failed by a blocking check), whatever other periods were loaded;
* the check ``period_deadlines`` of each such source (:func:`deadline_check`): not part of the
  source's job (a run does not evaluate it), executable from the UI, and recorded by
* the sensor ``period_deadlines`` (:func:`deadlines_sensor`, running by default, every
  ``MOSTOVIK_DEADLINE_SENSOR_INTERVAL_SECONDS``): on the daemon's clock it evaluates every
  source, records the check whenever its verdict or the late periods it names change, and sends
  an alert the first time a period is late (``kind: late``) and the first time one leaves the
  catch-up's lookback unloaded (``kind: aged_out``: nothing asks for it again). Each alert's
  idempotency key is its source and period, so a period alerts once whatever came after it.

Dagster's own ``FreshnessPolicy`` is not used: its evaluators read the asset's last
materialisation of any partition (``freshness_evaluator.py``), so a re-load of an older day
makes a source "fresh" while tomorrow's rates are missing.

What is watched: the periods whose window ends after the latest of the source's first period,
``MOSTOVIK_DEADLINE_WATCH_DAYS`` (31) before now, and its first run's lookback (a period older
than the automation's first run was never in its care; ``mostovik jobs rerun --only missing``
finds those). The check follows the truth within one sensor interval.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetKey,
    DagsterInstance,
    DefaultSensorStatus,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    TimeWindow,
    TimeWindowPartitionsDefinition,
    asset_check,
    sensor,
)

from mostovik_pipelines.core.dagster_compat import AssetCheckExecutionRecordStatus
from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.core.tags import SOURCE_TAG
from mostovik_pipelines.framework.automation.catch_up import RUNS_BEFORE_WINDOW
from mostovik_pipelines.framework.automation.partition_states import (
    PartitionState,
    partition_states,
)
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.resources.notifier import Alert, AlertNotifierResource

DEADLINE_CHECK = "period_deadlines"
WATCH = timedelta(days=int(setting("MOSTOVIK_DEADLINE_WATCH_DAYS", "31")))
"""How far back the deadlines look at most."""
SENSOR_INTERVAL_SECONDS = int(setting("MOSTOVIK_DEADLINE_SENSOR_INTERVAL_SECONDS", "15"))
NAMED = 20
"""Late periods a check's description names (all are in its metadata)."""
ALERTED_KEPT = 400
"""Periods per source the sensor's cursor remembers as alerted (the outbox's key is the
guarantee; the cursor spares it the writes)."""


@dataclass(frozen=True)
class LatePeriod:
    """A due period that is not final."""

    key: str
    due: datetime
    state: PartitionState
    aged_out: bool
    """Outside the catch-up's lookback: nothing asks for it again until an operator does."""

    def why(self) -> str:
        state = self.state
        if state.in_flight_run:
            return f"run {state.in_flight_run} in flight"
        if state.waiting_for_operator:
            return f"waiting for an operator: run {state.latest_run} {state.latest_outcome}"
        if state.latest_outcome is not None:
            return f"its latest run {state.latest_run} {state.latest_outcome}"
        if state.loaded:
            return "loaded before its window closed, not synced since"
        return "never loaded"


@dataclass(frozen=True)
class DeadlineState:
    """A source's deadlines at an instant."""

    source: str
    now: datetime
    late: list[LatePeriod]
    watched_from: datetime | None
    """None: nothing watched yet (the source has no run)."""

    @property
    def met(self) -> bool:
        return not self.late

    def describe(self) -> str:
        if self.met:
            return "every due period is final"
        named = ", ".join(f"{p.key} (due {p.due.isoformat(timespec='minutes')}, {p.why()})"
                          for p in self.late[:NAMED])
        more = f" and {len(self.late) - NAMED} more" if len(self.late) > NAMED else ""
        return f"{len(self.late)} due period(s) not final: {named}{more}"

    def evaluation(self, spec: SourceSpec) -> AssetCheckEvaluation:
        return AssetCheckEvaluation(
            asset_key=AssetKey(spec.name), check_name=DEADLINE_CHECK, passed=self.met,
            severity=AssetCheckSeverity.ERROR, description=self.describe(),
            metadata={"late_periods": [p.key for p in self.late],
                      "aged_out": [p.key for p in self.late if p.aged_out],
                      "evaluated_at": self.now.isoformat(timespec="seconds")})


def deadline_state(instance: DagsterInstance, spec: SourceSpec, now: datetime) -> DeadlineState:
    """The source's due periods that are not final at ``now``, oldest first."""
    partitions_def = spec.partitions_def
    assert spec.deadline is not None and isinstance(partitions_def,
                                                    TimeWindowPartitionsDefinition)
    watched_from = _watched_from(instance, spec, now)
    if watched_from is None or watched_from >= now:
        return DeadlineState(spec.name, now, [], watched_from)
    # From a month before: the period whose window holds watched_from counts too.
    keys = partitions_def.get_partition_keys_in_time_window(
        TimeWindow(max(watched_from - timedelta(days=31), partitions_def.start),
                   now + timedelta(days=7)))
    due: dict[str, tuple[datetime, datetime]] = {}
    for key in keys:
        window = partitions_def.time_window_for_partition_key(key)
        at = spec.deadline.due(window.start, window.end)
        if window.end > watched_from and at <= now:
            due[key] = (at, window.end)
    if not due:
        return DeadlineState(spec.name, now, [], watched_from)
    states = partition_states(instance, spec, list(due),
                              runs_since=watched_from - RUNS_BEFORE_WINDOW)
    horizon = now - spec.catch_up.lookback
    late = [LatePeriod(key, at, states[key], aged_out=end <= horizon)
            for key, (at, end) in due.items() if not states[key].final]
    return DeadlineState(spec.name, now, late, watched_from)


def _watched_from(instance: DagsterInstance, spec: SourceSpec, now: datetime) -> datetime | None:
    first_run = instance.get_run_records(RunsFilter(tags={SOURCE_TAG: spec.name}), limit=1,
                                         order_by="create_timestamp", ascending=True)
    if not first_run:
        return None
    created = first_run[0].create_timestamp
    created = created if created.tzinfo else created.replace(tzinfo=UTC)
    start = spec.partitions_def.start
    return max(now - WATCH, start, created - spec.catch_up.lookback)


def deadline_check(spec: SourceSpec) -> AssetChecksDefinition:
    """The source's ``period_deadlines`` check: red while a due period is not final."""
    assert spec.deadline is not None

    @asset_check(asset=spec.name, name=DEADLINE_CHECK, blocking=False,
                 description=f"Every due period is final: {spec.deadline.description}. Red "
                             "while one is not, naming it (evaluated by the period_deadlines "
                             "sensor).")
    def period_deadlines(context) -> AssetCheckResult:
        state = deadline_state(context.instance, spec, datetime.now(UTC))
        evaluation = state.evaluation(spec)
        return AssetCheckResult(passed=evaluation.passed, severity=evaluation.severity,
                                description=evaluation.description,
                                metadata=evaluation.metadata)

    return period_deadlines


def deadlines_sensor(sources: Sequence[SourceSpec]) -> SensorDefinition:
    watched = [spec for spec in sources if spec.deadline is not None]

    @sensor(
        name="period_deadlines",
        description="Each source's period_deadlines check, on the daemon's clock: red while a "
                    "due period is not final; one alert per late period and per period that "
                    "left the lookback unloaded.",
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=SENSOR_INTERVAL_SECONDS,
    )
    def period_deadlines(context: SensorEvaluationContext,
                         alert_notifier: AlertNotifierResource) -> SensorResult:
        now = datetime.now(UTC)
        cursor: dict[str, dict] = json.loads(context.cursor) if context.cursor else {}
        events, lines = [], []
        for spec in watched:
            state = deadline_state(context.instance, spec, now)
            said = cursor.setdefault(spec.name, {"check": None, "alerted": []})
            verdict = [state.met, [p.key for p in state.late]]
            if said["check"] != verdict or _recorded_verdict(context.instance, spec) != verdict:
                events.append(state.evaluation(spec))
                said["check"] = verdict
            for period in state.late:
                for kind in ("late", "aged_out") if period.aged_out else ("late",):
                    mark = f"{kind}:{period.key}"
                    if mark in said["alerted"]:
                        continue
                    alert_notifier.notify(_alert(spec, period, kind, alert_notifier),
                                          context.log)
                    said["alerted"] = [*said["alerted"], mark][-ALERTED_KEPT:]
            lines.append(f"{spec.name}: {state.describe()}")
        return SensorResult(asset_events=events, cursor=json.dumps(cursor, sort_keys=True),
                            skip_reason="; ".join(lines) or "no source has a deadline")

    return period_deadlines


def _recorded_verdict(instance: DagsterInstance, spec: SourceSpec) -> list | None:
    """What the UI shows for the check now: its latest execution's verdict, None when that is
    not an evaluation. A run that selects the whole asset (a UI backfill) plans the check too, and
    a failed one leaves it SKIPPED: the sensor records the truth again rather than let "skipped"
    or a run's older verdict stand while periods are late."""
    record = instance.get_latest_asset_check_evaluation_record(
        AssetCheckKey(AssetKey(spec.name), DEADLINE_CHECK))
    if record is None or record.event is None or record.status not in (
            AssetCheckExecutionRecordStatus.SUCCEEDED, AssetCheckExecutionRecordStatus.FAILED):
        return None
    evaluation = record.event.dagster_event.event_specific_data
    late = evaluation.metadata.get("late_periods")
    return [record.status == AssetCheckExecutionRecordStatus.SUCCEEDED,
            list(late.value) if late is not None else None]


def _alert(spec: SourceSpec, period: LatePeriod, kind: str,
           notifier: AlertNotifierResource) -> Alert:
    assert spec.deadline is not None
    due = period.due.isoformat(timespec="minutes")
    if kind == "late":
        message = (f"{spec.name} [{period.key}] is late: due {due} "
                   f"({spec.deadline.description}), not final: {period.why()}")
    else:
        message = (f"{spec.name} [{period.key}] left the {spec.catch_up.lookback.days}-day "
                   f"lookback unloaded ({period.why()}): nothing asks for it again; re-run it "
                   f"with mostovik jobs rerun --source {spec.name} --period {period.key}")
    return Alert(kind=kind, source=spec.name, period=period.key, job_status=kind,
                 error_class="deadline", error_kind=kind, message=message,
                 link=notifier.asset_link(spec.name), subject=period.key,
                 run_id=period.state.latest_run)
