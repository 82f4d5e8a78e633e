"""Pins the private Dagster names the dead-run sensor and ``mostovik jobs rerun --wait`` read:
what a code server answers about a run it launched, and how the daemon names a run's retry."""

from __future__ import annotations

import inspect
import json

from dagster import DagsterInstance, job, op

from mostovik_pipelines.core import dagster_compat as compat
from mostovik_pipelines_tests.support.postgres import free_port


@op
def noop() -> None:
    return None


@job
def nothing():
    noop()


def test_a_run_no_code_server_launched_is_not_asked_about_and_an_unreachable_one_runs_nothing():
    with DagsterInstance.ephemeral() as instance:
        run = instance.create_run_for_job(nothing)
        assert compat.code_server_runs(run) is None
        instance.add_run_tags(run.run_id, {".dagster/grpc_info": json.dumps(
            {"host": "127.0.0.1", "port": free_port()})})
        assert compat.code_server_runs(instance.get_run_by_id(run.run_id)) is False


def test_a_code_server_tells_a_run_it_executes_by_whether_it_can_cancel_it():
    """What ``code_server_runs`` relies on: the server counts a run as its own while it holds
    the run's process (and no cancel was asked for); the launcher names the server on the run
    (``.dagster/grpc_info``) before asking it to start the run."""
    from dagster._core.launcher.default_run_launcher import DefaultRunLauncher
    from dagster._grpc.server import DagsterApiServer

    can_cancel = inspect.getsource(DagsterApiServer.CanCancelExecution)
    assert "run_id in self._executions" in can_cancel
    assert "not self._termination_events[run_id].is_set()" in can_cancel
    launch = inspect.getsource(DefaultRunLauncher.launch_run_from_grpc_client)
    assert launch.index("GRPC_INFO_TAG") < launch.index("start_run(")


def test_the_daemon_names_a_runs_retry_on_it_and_keeps_a_requested_backfills_tag_on_the_retry():
    """``rerun --wait`` follows a failed run to its retry by ``dagster/auto_retry_run_id``; the
    retry stays in the backfill (its tag) while the backfill is requested, and the backfill
    waits for a run that will be retried before it completes."""
    from dagster._core.execution.asset_backfill import backfill_runs_are_complete
    from dagster._core.instance.runs.run_domain import RunDomain
    from dagster._daemon.auto_run_reexecution.auto_run_reexecution import retry_run

    assert compat.AUTO_RETRY_RUN_ID_TAG == "dagster/auto_retry_run_id"
    assert "{AUTO_RETRY_RUN_ID_TAG: new_run.run_id}" in inspect.getsource(retry_run)
    reexecuted = inspect.getsource(RunDomain.create_reexecuted_run)
    assert "backfill.status == BulkActionStatus.REQUESTED" in reexecuted
    assert "WILL_RETRY_TAG" in inspect.getsource(backfill_runs_are_complete)
