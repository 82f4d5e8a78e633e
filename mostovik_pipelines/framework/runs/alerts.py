"""Alerts, one per failed job and one per change of a source's shape, through the one notifier
(:mod:`mostovik_pipelines.resources.notifier`: a log line, the durable outbox, and a webhook when
one is set).

* ``run_failure_alerts``: a run-failure sensor, running by default, watching every job of this
  code location, the implicit asset job of UI asset backfills included (Dagster matches runs
  launched through the location: the UI, schedules, sensors, backfills, re-executions; a run of
  ``dagster job execute`` has no location and is seen by its caller). Each failed run gets one
  alert, built from the job view of :mod:`.platform.tracking` (source, period, the classified error,
  and who asked for the run and why when it carries ``mostovik/requested_by`` and
  ``mostovik/reason``), unless the daemon's run retries will run it again (its retry alerts
  if it fails too); the partitions it failed for a permanent reason are named as waiting for
  an operator (nothing asks for them again automatically, :mod:`..automation`); a run that
  died without writing its final ``mostovik/status`` (it still says ``running``, or the status
  its parent ended with) gets ``failed``, so the UI's run list filters it with the others.
  ``cancelled_runs_status`` does the same for a run an operator cancelled (no alert: someone
  chose it).
* ``source_shape_alerts``: a partition whose source sent other fields than its declaration
  expects is recorded as an observation of the partition (:mod:`..quality.shape`), by whatever
  launched its run; this sensor reads them in the order they were recorded and alerts once per
  change (its fingerprint, kept in the cursor), naming source, fields and the first partition
  that showed it. A run that failed only for such a change gets no run-failure alert of its
  own: the change is said once, not once per partition.
* ``alert_outbox``: delivers what the others wrote to the outbox and the webhook has not
  acknowledged yet, with backoff (:mod:`mostovik_pipelines.resources.notifier`): an alert is
  delivered or pending, never only in a log.

Late periods and periods that left the lookback unloaded are alerted by the deadlines' sensor
(:mod:`..automation.deadlines`), through the same notifier.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunFailureSensorContext,
    RunStatusSensorContext,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    run_failure_sensor,
    run_status_sensor,
    sensor,
)

from mostovik_pipelines.core.dagster_compat import daemon_would_retry
from mostovik_pipelines.core.errors import SourceShapeChanged
from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.core.tags import REASON_TAG, REQUESTED_BY_TAG
from mostovik_pipelines.framework.automation.partition_states import waiting_for_operator
from mostovik_pipelines.framework.quality.shape import (
    CHANGE_KEY,
    FINGERPRINT_KEY,
    OUTCOME_KEY,
    SHAPE_KEY,
)
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.platform.status import JobStatus, record_failed
from mostovik_pipelines.platform.tracking import load_job
from mostovik_pipelines.resources.notifier import Alert, AlertNotifierResource

ALERT_NOTIFIER_KEY = "alert_notifier"
ALERT_INTERVAL_SECONDS = int(setting("MOSTOVIK_ALERT_SENSOR_INTERVAL_SECONDS", "15"))
"""Seconds between two looks for failed or cancelled runs, changed shapes and pending alerts."""
WILL_RETRY_TAG = "dagster/will_retry"
"""Set by Dagster on a failed run: whether the daemon's run retries will run it again."""


SHAPE_CHANGED = SourceShapeChanged.kind
"""The error kind of a partition failed for its source's changed shape."""
SHAPE_ALERTS_KEPT = 100
"""Changes remembered per source as said: far more than a source ever goes through."""
SHAPE_OBSERVATIONS_PER_TICK = 1_000


def alert_sensors(sources: Sequence[SourceSpec]) -> list[SensorDefinition]:
    return [_run_failure_alerts(sources), _cancelled_runs_status(),
            _source_shape_alerts(sources), _alert_outbox()]


def _cancelled_runs_status() -> SensorDefinition:
    @run_status_sensor(
        name="cancelled_runs_status",
        description="A cancelled run of this code location is a failed job: its mostovik/status "
                    "tag says so in the run list (no alert: an operator chose it).",
        run_status=DagsterRunStatus.CANCELED,
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=ALERT_INTERVAL_SECONDS,
        monitor_all_code_locations=False,
    )
    def cancelled_runs_status(context: RunStatusSensorContext) -> None:
        record_failed(context.instance, context.dagster_run)

    return cancelled_runs_status


def _run_failure_alerts(sources: Sequence[SourceSpec]) -> SensorDefinition:
    @run_failure_sensor(
        name="run_failure_alerts",
        description="One alert per failed run of any job of this code location (UI asset "
                    "backfills included), through the alert notifier.",
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=ALERT_INTERVAL_SECONDS,
        monitor_all_code_locations=False,
    )
    def run_failure_alerts(context: RunFailureSensorContext,
                           alert_notifier: AlertNotifierResource) -> None:
        run = context.dagster_run
        record_failed(context.instance, run)
        if (run.tags.get(WILL_RETRY_TAG) == "true"
                or daemon_would_retry(context.instance, run)):
            # The daemon runs it again (a lost worker): the job has not failed yet. Its retry,
            # a run of its own, alerts if it fails too. A run its retry pass gave up for a code
            # server away (will_retry false) is retried by the dead_runs sensor all the same.
            context.log.info(f"run {run.run_id} failed and will be retried: no alert yet")
            return
        alert = run_failure_alert(context.instance, run, sources, alert_notifier,
                                  context.failure_event.message)
        if alert is None:
            context.log.info(f"run {run.run_id} failed for its source's changed shape: said "
                             "once by source_shape_alerts")
            return
        alert_notifier.notify(alert, context.log)

    return run_failure_alerts


def run_failure_alert(instance: DagsterInstance, run: DagsterRun,
                      sources: Sequence[SourceSpec], notifier: AlertNotifierResource,
                      failure_message: str | None) -> Alert | None:
    """The alert about a failed run: its source, period, first classified error (or the run's
    ``failure_message``), the partitions waiting for an operator, and who asked for it and why;
    ``None`` when it failed only for its source's changed shape (said by
    ``source_shape_alerts``)."""
    job = load_job(instance, run.run_id, sources)
    if job.errors and all(error.kind == SHAPE_CHANGED for error in job.errors):
        return None
    error = job.errors[0] if job.errors else None
    spec = next((spec for spec in sources if spec.name == job.source), None)
    waiting = waiting_for_operator(instance, spec, job.partitions, run.run_id) if spec else []
    return Alert(
        kind="run_failure", source=job.source, period=job.period,
        job_status=JobStatus.FAILED.value,
        error_class=error.error_class if error else "unclassified",
        error_kind=error.kind if error else None,
        message=((error.message if error and error.message else failure_message) or "")
        + _what_comes_next(job.partitions, waiting),
        link=notifier.run_link(run.run_id), run_id=run.run_id,
        requested_by=run.tags.get(REQUESTED_BY_TAG), reason=run.tags.get(REASON_TAG),
    )


def _what_comes_next(partitions: Sequence[str], waiting: Sequence[str]) -> str:
    """What the automation does next: a partition failed for good waits for a person, named;
    the others are asked for again by their schedule or sensor (:mod:`..automation`)."""
    if not waiting:
        return ""
    rest = len(partitions) - len(waiting)
    return (f" | waiting for an operator: {', '.join(waiting)}"
            + (f" (the other {rest} partition(s) are asked for again automatically)"
               if rest else ""))


def _source_shape_alerts(sources: Sequence[SourceSpec]) -> SensorDefinition:
    watched = [spec for spec in sources if spec.shape is not None]

    @sensor(
        name="source_shape_alerts",
        description="One alert per change of what a source sends (fields added, missing or of "
                    "another kind than its declaration expects), at the first partition that "
                    "shows it.",
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=ALERT_INTERVAL_SECONDS,
    )
    def source_shape_alerts(context: SensorEvaluationContext,
                            alert_notifier: AlertNotifierResource) -> SkipReason:
        # The cursor: per source, the last observation read and the changes already said.
        cursor: dict[str, dict] = json.loads(context.cursor) if context.cursor else {}
        sent = []
        for spec in watched:
            state = cursor.setdefault(spec.name, {"after": 0, "said": []})
            records = context.instance.fetch_observations(
                AssetRecordsFilter(asset_key=AssetKey(spec.name),
                                   after_storage_id=state["after"] or None),
                limit=SHAPE_OBSERVATIONS_PER_TICK, ascending=True).records
            for record in records:
                state["after"] = record.storage_id
                observation = record.asset_observation
                metadata = observation.metadata if observation else {}
                if FINGERPRINT_KEY not in metadata:
                    continue
                fingerprint = str(metadata[FINGERPRINT_KEY].value)
                if fingerprint in state["said"]:
                    continue
                alert_notifier.notify(_shape_alert(spec, observation.partition, metadata,
                                                   alert_notifier), context.log)
                state["said"] = [*state["said"], fingerprint][-SHAPE_ALERTS_KEPT:]
                sent.append(spec.name)
        context.update_cursor(json.dumps(cursor, sort_keys=True))
        return SkipReason(f"changed: {', '.join(sent)}" if sent else "no source changed shape")

    return source_shape_alerts


def _shape_alert(spec: SourceSpec, partition: str | None, metadata: dict,
                 notifier: AlertNotifierResource) -> Alert:
    failed = str(metadata[OUTCOME_KEY].value) == "failed"
    then = ("its partitions fail until the declaration accepts the change" if failed else
            f"loaded as usual under the policy '{spec.added_field_policy.value}', its "
            "partitions' check source_shape warning")
    return Alert(
        kind="source_shape", source=spec.name, period=partition,
        job_status="failed" if failed else "loaded", error_class="permanent",
        error_kind=SHAPE_CHANGED,
        message=(f"{spec.name} changed what it sends, first in partition {partition}: "
                 f"{metadata[CHANGE_KEY].value}; {then} "
                 f"(mostovik_pipelines/sources/{spec.name}/source.py). It sends now: "
                 f"{metadata[SHAPE_KEY].value}"),
        link=notifier.asset_link(spec.name), subject=str(metadata[FINGERPRINT_KEY].value),
    )


def _alert_outbox() -> SensorDefinition:
    @sensor(
        name="alert_outbox",
        description="Delivers the alerts the webhook has not acknowledged yet, oldest first, "
                    "with backoff: an alert is delivered or pending, never lost.",
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=ALERT_INTERVAL_SECONDS,
    )
    def alert_outbox(context: SensorEvaluationContext,
                     alert_notifier: AlertNotifierResource) -> SkipReason:
        sent, pending = alert_notifier.deliver_pending(context.log)
        return SkipReason(f"delivered {sent}, {pending} still pending" if sent or pending
                          else "nothing to deliver")

    return alert_outbox
