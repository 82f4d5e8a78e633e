"""Pins what the missed-retries pass (framework/runs/missed_retries.py) relies on in the daemon's
run retries: their pass over the run failure events (Dagster's own, one iteration at a time)
gives a run up for good when its code location does not answer, and stores its cursor past the
run's failure event; ``dagster_compat.daemon_would_retry`` still says Dagster's rule retries
that run, and no longer once the run's group holds a retry, which ``retry_made_of`` finds."""

from __future__ import annotations

import logging
import sys

from dagster import DagsterEventType, DagsterInstance, job, op
from dagster._core.events import JobFailureData, RunFailureReason
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import GrpcServerTarget
from dagster._daemon.auto_run_reexecution.event_log_consumer import EventLogConsumerDaemon

from mostovik_pipelines.core import dagster_compat as compat
from mostovik_pipelines_tests.support.postgres import free_port

LOCATION = "away"
RETRIES = {"run_retries": {"enabled": True, "max_retries": 1,
                           "retry_on_asset_or_op_failure": False}}


@op
def noop() -> None:
    pass


@job
def tiny() -> None:
    noop()


def _origin() -> compat.RemoteJobOrigin:
    target = compat.LoadableTargetOrigin(executable_path=sys.executable, module_name="m",
                                         attribute="defs")
    return compat.RemoteJobOrigin(compat.RemoteRepositoryOrigin(
        compat.ManagedGrpcPythonEnvCodeLocationOrigin(target, LOCATION), "__repository__"),
        "tiny")


def _retry_pass(instance: DagsterInstance, workspace: WorkspaceProcessContext) -> None:
    daemon = EventLogConsumerDaemon()
    daemon._logger = logging.getLogger("retry_pass")  # set by the daemon controller otherwise
    for _ in daemon.run_iteration(workspace):
        pass


def test_the_retry_pass_gives_a_run_up_for_good_when_its_code_server_does_not_answer(tmp_path):
    with (DagsterInstance.local_temp(str(tmp_path), overrides=RETRIES) as instance,
          WorkspaceProcessContext(instance, GrpcServerTarget(
              host="127.0.0.1", port=free_port(), socket=None,
              location_name=LOCATION)) as workspace):
        _retry_pass(instance, workspace)  # its first pass starts its cursor at the log's end
        run = instance.create_run_for_job(tiny, remote_job_origin=_origin())
        compat.run_failed_unexpectedly(instance, run, "its process is gone")
        assert instance.get_run_by_id(run.run_id).tags["dagster/will_retry"] == "true"
        [failure] = instance.get_records_for_run(
            run.run_id, of_type=DagsterEventType.RUN_FAILURE).records
        assert (compat.retry_pass_cursor(instance) or 0) < failure.storage_id

        _retry_pass(instance, workspace)

        failed = instance.get_run_by_id(run.run_id)
        assert failed.tags["dagster/will_retry"] == "false"
        assert compat.AUTO_RETRY_RUN_ID_TAG not in failed.tags
        engine = [entry.dagster_event.message for entry in instance.all_logs(
            run.run_id, of_type=DagsterEventType.ENGINE_EVENT)]
        assert "Failed to retry run" in engine
        assert compat.retry_pass_cursor(instance) >= failure.storage_id
        assert compat.daemon_would_retry(instance, failed)

        assert compat.retry_made_of(instance, failed) is None
        # The run group is read by the tags, the retry found by the run's own fields.
        retry = instance.create_run_for_job(tiny, root_run_id=run.run_id, parent_run_id=run.run_id,
                                            tags={compat.PARENT_RUN_ID_TAG: run.run_id,
                                                  compat.ROOT_RUN_ID_TAG: run.run_id,
                                                  compat.RETRY_NUMBER_TAG: "1"})
        assert not compat.daemon_would_retry(instance, failed)
        assert compat.retry_made_of(instance, failed).run_id == retry.run_id


def test_dagsters_rule_retries_no_step_failure_and_no_run_allowed_none():
    with DagsterInstance.ephemeral(settings=RETRIES) as instance:
        allowed_none = instance.create_run_for_job(tiny, tags={"dagster/max_retries": "0"})
        compat.run_failed_unexpectedly(instance, allowed_none, "its process is gone")
        step_failed = instance.create_run_for_job(tiny)
        instance.report_run_failed(step_failed, "a step failed", JobFailureData(
            error=None, failure_reason=RunFailureReason.STEP_FAILURE))
        for run in (allowed_none, step_failed):
            assert not compat.daemon_would_retry(instance, instance.get_run_by_id(run.run_id))
