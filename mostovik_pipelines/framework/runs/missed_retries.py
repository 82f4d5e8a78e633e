"""Run retries the daemon missed: a failed run that Dagster's own rule retries, which its retry
pass has gone past without retrying, is retried here, once.

The daemon's run retries (``run_retries`` in deploy/dagster.yaml) take each run failure event
up once, from a cursor over the event log, and look at it never again. Two ways they miss a
run they should retry:

* making the retry needs the code server (to plan the re-execution); when it cannot be reached
  (its unit restarting after a crash or a lost host, or for a deploy) the pass gives the run up
  for good: an engine event "Failed to retry run" and ``dagster/will_retry`` false;
* the failure event is stored before the run's status is failed (two writes): a pass that reads
  it in between sees a run not failed and goes past it.

So the ``dead_runs`` sensor (:mod:`.dead_runs`), on each tick, looks at the runs of the code
location's jobs that failed within :data:`LOOKBACK_SECONDS`, and retries, as that pass would have
(:func:`.platform.recovery.queue_automatic_retry`), one that

* the pass has gone past: its failure event is at or before the pass's cursor, which the pass
  stores only once it is done with every event up to it, so it never makes a retry of it later;
* Dagster's rule retries (:func:`.core.dagster_compat.daemon_would_retry`: an infrastructure
  failure, a run group with fewer retries than ``max_retries``, a backfill still going on);
* has no retry: none named by ``dagster/auto_retry_run_id``, none numbered as a retry among
  its children (Dagster's own test); one made but not queued or not named yet is finished.

So a failed run Dagster's rule retries is always retried, which is what ``run_failure_alerts``
reads to hold its alert back; the failed run is tagged ``dagster/will_retry`` true again.
Exactly one retry: the retry joins the run's group (the rule then says no more) before it is
queued, the failed run names it once queued, and the sensor's ticks never overlap. Each tick
reads, for each failed run of the last day without a retry, its failure event, its run group
and (rarely) its retry: a few reads per failed run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from datetime import UTC, datetime

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

from mostovik_pipelines.core.dagster_compat import (
    AUTO_RETRY_RUN_ID_TAG,
    daemon_would_retry,
    retry_made_of,
    retry_pass_cursor,
)
from mostovik_pipelines.platform.recovery import finish_automatic_retry, queue_automatic_retry

LOOKBACK_SECONDS = 24 * 3600.0
"""How long after it failed a run is still looked at: a code server away for longer than a day
is an outage an operator re-runs after (``mostovik jobs rerun``)."""


def retry_missed_runs(instance: DagsterInstance, jobs: Collection[str],
                      log: logging.Logger) -> list[tuple[str, str]]:
    """Retry the failed runs of ``jobs`` the daemon's retry pass missed (see the module); the
    (failed run, retry) ids. A run whose retry cannot be made now (its code cannot be loaded)
    is logged and looked at again on the next tick."""
    if not instance.run_retries_enabled:
        return []
    passed = retry_pass_cursor(instance)
    if passed is None:
        return []
    retried = []
    for record in instance.get_run_records(RunsFilter(
            statuses=[DagsterRunStatus.FAILURE],
            updated_after=datetime.fromtimestamp(time.time() - LOOKBACK_SECONDS, tz=UTC))):
        run = record.dagster_run
        if (run.job_name not in jobs or run.remote_job_origin is None
                or AUTO_RETRY_RUN_ID_TAG in run.tags):
            continue
        failures = instance.get_records_for_run(run.run_id, of_type=DagsterEventType.RUN_FAILURE,
                                                ascending=False, limit=1).records
        if not failures or failures[0].storage_id > passed:
            continue  # the pass has yet to take it up
        try:
            made = retry_made_of(instance, run)
            if made is not None:
                retried.append((run.run_id, finish_automatic_retry(instance, run, made)))
            elif daemon_would_retry(instance, run):
                retried.append((run.run_id, queue_automatic_retry(instance, run)))
        except Exception:
            log.exception(f"run {run.run_id}: its missed retry could not be made now")
    return retried
