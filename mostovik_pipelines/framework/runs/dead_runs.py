"""Dead runs, on every launch path: a run that run storage says is started, whose process died.

Dagster sees only some of them. The code server that started a daemon-launched run's worker
fails the run when that worker exits, but only while the code server itself lives; its run
monitoring asks the run launcher whether a worker is healthy, and the default run launcher
cannot tell (``DefaultRunLauncher`` has no ``check_run_worker_health``); nothing at all watches
a ``dagster job execute`` process. So a worker that dies with its code server (a lost host, the
daemon's unit restarted with its control group) or a killed ``dagster job execute`` leaves its
run "started" until ``max_runtime`` (hours).

The ``dead_runs`` sensor, running in the daemon, looks at every started run of a job whose
executor holds the run's claims (:mod:`.claims`: they die with the process) and marks a run
failed once its driver claim, held by the process driving the run, is free on two looks at
least :data:`CONFIRM_SECONDS` apart, the first of them past the grace of a run just starting. A
step that process left running on a Celery worker holds the run's claim, not the driver claim:
the run is marked while that step still runs, and its retry waits for the step to end before it
touches the partitions (:mod:`.in_flight`). A live run whose claim connection the database dropped
for a moment has taken it again by the second look: it is never marked. The mark is an
infrastructure failure, ``dagster/failure_reason`` ``UNEXPECTED_TERMINATION`` with a message
naming why, so the daemon's run retries (``run_retries`` in deploy/dagster.yaml) run a
daemon-launched one again; a ``dagster job execute`` run, which Dagster does not retry, gets
``dagster/max_retries`` 0 first, so it does not claim a retry that never comes, and its alert
is sent here (``run_failure_alerts`` sees only runs launched through the code location).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRecord,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from mostovik_pipelines.framework.dagster_compat import run_failed_unexpectedly
from mostovik_pipelines.framework.runs.alerts import run_failure_alert
from mostovik_pipelines.framework.runs.status import record_failed
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.resources.notifier import AlertNotifierResource
from mostovik_pipelines.settings import setting

DEAD_RUNS_SENSOR = "dead_runs"
INTERVAL_SECONDS = int(setting("MOSTOVIK_DEAD_RUN_SENSOR_INTERVAL_SECONDS", "10"))
"""Seconds between two looks: a dead run is marked within about two of them plus the
confirmation."""
CONFIRM_SECONDS = 10.0
"""A claim must be found free twice, this far apart: a live run's keeper takes a dropped claim
again within about 3 s (:data:`.claims.KEEPER_CHECK_SECONDS` and a reconnect)."""
START_GRACE_SECONDS = 60.0
"""A started run that has not started a step may not hold its claim yet (its executor is not
running): it is looked at only this long after it started. One that started a step took its
claim before."""
MAX_RETRIES_TAG = "dagster/max_retries"


def dead_runs_sensor(sources: Sequence[SourceSpec]) -> SensorDefinition:
    @sensor(
        name=DEAD_RUNS_SENSOR,
        description="Marks failed a started run whose process died (its claim is free): "
                    "killed, out of memory or its machine lost, on any launch path. The daemon's "
                    "run retries run a daemon-launched one again.",
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=INTERVAL_SECONDS,
    )
    def dead_runs(context: SensorEvaluationContext,
                  alert_notifier: AlertNotifierResource) -> SkipReason:
        # Imported here: loading the code location imports no database driver.
        from mostovik_pipelines.framework.runs.claims import driver_claim_held

        instance = context.instance
        watched = {job.name for job in context.repository_def.get_all_jobs()
                   if _holds_run_claim(job.executor_def)}
        # The cursor: run id -> when its claim was first found free, for the runs seen so.
        free_since: dict[str, float] = json.loads(context.cursor) if context.cursor else {}
        now = time.time()
        still_free: dict[str, float] = {}
        marked = []
        for record in instance.get_run_records(RunsFilter(statuses=[DagsterRunStatus.STARTED])):
            run = record.dagster_run
            if run.job_name not in watched or not _past_start_grace(instance, record, now):
                continue
            if driver_claim_held(instance, run.run_id, taken_at=record.start_time):
                continue
            first_free = free_since.get(run.run_id, now)
            if now - first_free < CONFIRM_SECONDS:
                still_free[run.run_id] = first_free
                continue
            if _still_started(instance, run.run_id):  # not ended since the first look
                message = mark_dead(instance, record, first_free)
                if run.remote_job_origin is None:
                    alert = run_failure_alert(instance, instance.get_run_by_id(run.run_id),
                                              sources, alert_notifier, message)
                    if alert is not None:
                        alert_notifier.notify(alert, context.log)
                context.log.warning(f"run {run.run_id} of {run.job_name} is dead: marked "
                                    "failed")
                marked.append(run.run_id)
        context.update_cursor(json.dumps(still_free, sort_keys=True))
        return SkipReason(f"marked failed: {', '.join(marked)}" if marked else
                          f"no dead run ({len(still_free)} to look at again)")

    return dead_runs


def mark_dead(instance: DagsterInstance, record: RunRecord, free_since: float) -> str:
    """Fail the run as an infrastructure failure that says why (returned); only a run launched
    through the code location (the queue, the UI, a schedule, a sensor) can be retried by the
    daemon."""
    run = record.dagster_run
    if run.remote_job_origin is None:
        instance.add_run_tags(run.run_id, {MAX_RETRIES_TAG: "0"})
    record_failed(instance, run)
    gone_for = time.time() - free_since
    message = (
        "The run's process is gone: no live process has held the run's claim as the process "
        f"driving it for {gone_for:.0f} s (killed, out of memory, or its machine lost), so run "
        "storage's 'started' was not true any more. Marked failed by the dead_runs sensor; "
        + ("the daemon's run retries may run it again." if run.remote_job_origin else
           "run by the process that launched it (dagster job execute or another in-process "
           "run), it is not retried: re-run it."))
    run_failed_unexpectedly(instance, instance.get_run_by_id(run.run_id), message)
    return message


def _past_start_grace(instance: DagsterInstance, record: RunRecord, now: float) -> bool:
    """A run that started a step holds its claim (taken before the step); one that has not may
    not yet, for :data:`START_GRACE_SECONDS` after it started."""
    if record.start_time is not None and now - record.start_time >= START_GRACE_SECONDS:
        return True
    return bool(instance.get_records_for_run(record.dagster_run.run_id,
                                             of_type=DagsterEventType.STEP_START,
                                             limit=1).records)


def _still_started(instance: DagsterInstance, run_id: str) -> bool:
    run = instance.get_run_by_id(run_id)
    return run is not None and run.status is DagsterRunStatus.STARTED


def _holds_run_claim(executor_def) -> bool:
    from mostovik_pipelines.execution import holds_run_claim

    return holds_run_claim(executor_def)
