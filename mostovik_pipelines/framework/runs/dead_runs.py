"""Dead runs, on every launch path: a run that run storage says is starting, started or
cancelling, whose process died. Each is marked within a minute of its death with the shipped
settings.

Dagster sees only some of them. The code server that started a daemon-launched run's worker
fails the run when that worker exits, but only while the code server itself lives; its run
monitoring asks the run launcher whether a worker is healthy, and the default run launcher
cannot tell (``DefaultRunLauncher`` has no ``check_run_worker_health``); nothing at all watches
a ``dagster job execute`` process. Run monitoring's start and cancel timeouts (300 s in
deploy/dagster.yaml) are a backstop, not a minute. So a worker that dies with its code server
(a lost host, the code server's unit restarted with its control group) or a killed ``dagster
job execute`` left its run "started" until ``max_runtime`` (hours).

The ``dead_runs`` sensor, running in the daemon, looks at the runs of the jobs whose executor
holds the run's claims (:mod:`.platform.claims`: they die with the process) and marks a run
dead once it is found without a live process on two looks at least :data:`CONFIRM_SECONDS`
apart:

* **started** (or **cancelling**, once started): its driver claim, held by the process driving
  the run from the moment its executor starts (just after the run's start is recorded), is
  free, the first look past a short grace (:data:`START_GRACE_SECONDS`) for a run that has
  started no step yet. A step that process left running on a Celery worker holds the run's
  claim, not the driver claim: the run is marked while that step still runs, and its retry waits
  for the step to end before it touches the partitions (:mod:`.platform.in_flight`). A live run
  whose claim connection the database dropped for a moment has taken it again by the second
  look;
* **starting** (or cancelled before it started): the code server that launched it no longer
  runs it (asked over gRPC, :func:`.core.dagster_compat.code_server_runs`): it is unreachable, or a
  new server that knows none of the old one's runs. A run worker dies with its code server's
  control group (deploy/systemd's ``KillMode``), so its server gone means it is gone.

A started or starting run is marked failed as an infrastructure failure,
``dagster/failure_reason`` ``UNEXPECTED_TERMINATION`` with a message naming why, so the
daemon's run retries (``run_retries`` in deploy/dagster.yaml) run a daemon-launched one again
(and, where they went past a failed run they retry, this sensor retries it:
:mod:`.missed_retries`); a
``dagster job execute`` run, which Dagster does not retry, gets ``dagster/max_retries`` 0 first,
so it does not claim a retry that never comes, and its alert is sent here
(``run_failure_alerts`` sees only runs launched through the code location). A cancelling run
is marked cancelled, as run monitoring's cancel timeout would, an operator having asked for
it: no retry, no alert. Either way its ADR status says failed (:mod:`.platform.status`).
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

from mostovik_pipelines.core.dagster_compat import code_server_runs, run_failed_unexpectedly
from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.framework.runs.alerts import run_failure_alert
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.platform.status import record_failed
from mostovik_pipelines.resources.notifier import AlertNotifierResource

DEAD_RUNS_SENSOR = "dead_runs"
INTERVAL_SECONDS = int(setting("MOSTOVIK_DEAD_RUN_SENSOR_INTERVAL_SECONDS", "10"))
"""Seconds between two looks: a dead run is marked within about two of them plus the
confirmation."""
CONFIRM_SECONDS = 10.0
"""A claim must be found free twice, this far apart: a live run's keeper takes a dropped claim
again within about 3 s (:data:`.platform.claims.KEEPER_CHECK_SECONDS` and a reconnect)."""
START_GRACE_SECONDS = 10.0
"""A started run takes its driver claim as its executor starts, right after its start is
recorded (Dagster's ``job_execution_iterator``: the start event, then the executor): a started
run that has started no step is looked at only this long after it started. (It was 60 s: a
run killed before its first step was marked 70-80 s after.) A run that started a step took
its claim before."""
WATCHED_STATUSES = [DagsterRunStatus.STARTED, DagsterRunStatus.STARTING,
                    DagsterRunStatus.CANCELING]
MAX_RETRIES_TAG = "dagster/max_retries"


def dead_runs_sensor(sources: Sequence[SourceSpec]) -> SensorDefinition:
    @sensor(
        name=DEAD_RUNS_SENSOR,
        description="Marks failed a starting or started run whose process died (its claim is "
                    "free, or its code server no longer runs it): killed, out of memory or its "
                    "machine lost, on any launch path; a cancelling one cancelled. The daemon's "
                    "run retries run a daemon-launched one again; a failed run they went past "
                    "(its code server away as they came) is retried here.",
        default_status=DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=INTERVAL_SECONDS,
    )
    def dead_runs(context: SensorEvaluationContext,
                  alert_notifier: AlertNotifierResource) -> SkipReason:
        # Imported here: loading the code location imports no database driver.
        from mostovik_pipelines.framework.runs.missed_retries import retry_missed_runs
        from mostovik_pipelines.platform.claims import driver_claim_held

        instance = context.instance
        watched = {job.name for job in context.repository_def.get_all_jobs()
                   if _holds_run_claim(job.executor_def)}
        # The cursor: run id -> when it was first found without a live process, for the runs
        # seen so.
        free_since: dict[str, float] = json.loads(context.cursor) if context.cursor else {}
        now = time.time()
        still_free: dict[str, float] = {}
        marked = []
        for record in instance.get_run_records(RunsFilter(statuses=WATCHED_STATUSES)):
            run = record.dagster_run
            if run.job_name not in watched or _alive(instance, record, now, driver_claim_held):
                continue
            first_free = free_since.get(run.run_id, now)
            if now - first_free < CONFIRM_SECONDS:
                still_free[run.run_id] = first_free
                continue
            if _status_of(instance, run.run_id) is not run.status:  # it moved on meanwhile
                continue
            if run.status is DagsterRunStatus.CANCELING:
                mark_cancelled(instance, record, first_free)
            else:
                message = mark_dead(instance, record, first_free)
                if run.remote_job_origin is None:
                    alert = run_failure_alert(instance, instance.get_run_by_id(run.run_id),
                                              sources, alert_notifier, message)
                    if alert is not None:
                        alert_notifier.notify(alert, context.log)
            context.log.warning(f"run {run.run_id} of {run.job_name} is dead "
                                f"({run.status.value.lower()}): marked")
            marked.append(run.run_id)
        context.update_cursor(json.dumps(still_free, sort_keys=True))
        retried = retry_missed_runs(
            instance, {job.name for job in context.repository_def.get_all_jobs()}, context.log)
        for failed, retry in retried:
            context.log.warning(f"run {failed}: the daemon's run retries went past it, retried "
                                f"as {retry}")
        return SkipReason((f"marked: {', '.join(marked)}" if marked else
                           f"no dead run ({len(still_free)} to look at again)")
                          + "".join(f"; retried {failed} as {retry}" for failed, retry in retried))

    return dead_runs


def _alive(instance: DagsterInstance, record: RunRecord, now: float, driver_claim_held) -> bool:
    """Whether a live process still runs the run, as far as this look can tell (see the
    module): its driver claim once it started, its code server before."""
    run = record.dagster_run
    started = record.start_time is not None
    if run.status is DagsterRunStatus.STARTING or (
            run.status is DagsterRunStatus.CANCELING and not started):
        if now - record.update_timestamp.timestamp() < START_GRACE_SECONDS:
            return True
        return code_server_runs(run) is not False
    if not _past_start_grace(instance, record, now):
        return True
    return driver_claim_held(instance, run.run_id, taken_at=record.start_time)


def mark_dead(instance: DagsterInstance, record: RunRecord, free_since: float) -> str:
    """Fail the run as an infrastructure failure that says why (returned); only a run launched
    through the code location (the queue, the UI, a schedule, a sensor) can be retried by the
    daemon."""
    run = record.dagster_run
    if run.remote_job_origin is None:
        instance.add_run_tags(run.run_id, {MAX_RETRIES_TAG: "0"})
    record_failed(instance, run)
    gone_for = time.time() - free_since
    if run.status is DagsterRunStatus.STARTING:
        why = ("The run's process is gone before it started: the code server that launched it "
               f"has not been running it for {gone_for:.0f} s (it is unreachable or was started "
               "again, and its run workers died with it), so run storage's 'starting' was not "
               "true any more. ")
    else:
        why = ("The run's process is gone: no live process has held the run's claim as the "
               f"process driving it for {gone_for:.0f} s (killed, out of memory, or its machine "
               "lost), so run storage's 'started' was not true any more. ")
    message = why + "Marked failed by the dead_runs sensor; " + (
        "the daemon's run retries may run it again." if run.remote_job_origin else
        "run by the process that launched it (dagster job execute or another in-process "
        "run), it is not retried: re-run it.")
    run_failed_unexpectedly(instance, instance.get_run_by_id(run.run_id), message)
    return message


def mark_cancelled(instance: DagsterInstance, record: RunRecord, free_since: float) -> None:
    """An operator asked to cancel the run and its process is gone: it is cancelled (what run
    monitoring's cancel timeout says, minutes later), never retried."""
    run = record.dagster_run
    record_failed(instance, run)
    instance.report_run_canceled(
        instance.get_run_by_id(run.run_id),
        f"The run's process is gone while it was being cancelled: nothing has run it for "
        f"{time.time() - free_since:.0f} s. Marked cancelled by the dead_runs sensor.")


def _past_start_grace(instance: DagsterInstance, record: RunRecord, now: float) -> bool:
    """A run that started a step holds its claim (taken before the step); one that has not may
    not yet, for :data:`START_GRACE_SECONDS` after it started."""
    if record.start_time is not None and now - record.start_time >= START_GRACE_SECONDS:
        return True
    return bool(instance.get_records_for_run(record.dagster_run.run_id,
                                             of_type=DagsterEventType.STEP_START,
                                             limit=1).records)


def _status_of(instance: DagsterInstance, run_id: str) -> DagsterRunStatus | None:
    run = instance.get_run_by_id(run_id)
    return run.status if run is not None else None


def _holds_run_claim(executor_def) -> bool:
    from mostovik_pipelines.platform.execution import holds_run_claim

    return holds_run_claim(executor_def)
