"""Pins the private names of ``dagster_compat`` a queued re-run is built with (framework/runs/
recovery.py): the steps a re-execution from failure takes and the state its parent left, the
plan made of them, the origin the daemon finds the code location by, and a queued run
coordinator that records a submitted run as queued without a workspace."""

from __future__ import annotations

import sys

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    Failure,
    execute_job,
    job,
    op,
    reconstructable,
)

from mostovik_pipelines.core import dagster_compat as compat

QUEUED = {"run_coordinator": {"module": "dagster._core.run_coordinator",
                              "class": "QueuedRunCoordinator"}}


@op
def succeeds() -> int:
    return 1


@op
def fails(value: int) -> None:
    raise Failure(f"failed with {value}")


@job
def two_steps():
    fails(succeeds())


def test_a_failed_runs_reexecution_plan_takes_its_failed_step_only(tmp_path):
    recon = reconstructable(two_steps)
    with DagsterInstance.local_temp(str(tmp_path)) as instance:
        parent = execute_job(recon, instance, raise_on_error=False)
        run = instance.get_run_by_id(parent.run_id)
        assert run.status is DagsterRunStatus.FAILURE
        step_keys, known_state = compat.KnownExecutionState.build_resume_retry_reexecution(
            instance=instance, parent_run=run)
        assert list(step_keys) == ["fails"]
        plan = compat.create_execution_plan(recon, run.run_config, step_keys_to_execute=step_keys,
                                            known_state=known_state, tags=run.tags)
        assert plan.step_keys_to_execute == ["fails"]


def test_a_run_with_a_remote_origin_is_queued_without_a_workspace(tmp_path):
    recon = reconstructable(two_steps)
    target = compat.LoadableTargetOrigin(executable_path=sys.executable, module_name="m",
                                         attribute="defs", working_directory=str(tmp_path))
    origin = compat.RemoteJobOrigin(compat.RemoteRepositoryOrigin(
        compat.ManagedGrpcPythonEnvCodeLocationOrigin(target, "the_location"), "__repository__"),
        "two_steps")
    assert origin.location_name == "the_location"
    with DagsterInstance.local_temp(str(tmp_path), overrides=QUEUED) as instance:
        run = instance.create_run_for_job(
            job_def=two_steps, status=DagsterRunStatus.NOT_STARTED, remote_job_origin=origin,
            job_code_origin=recon.get_python_origin())
        instance.submit_run(run.run_id, workspace=None)
        assert instance.get_run_by_id(run.run_id).status is DagsterRunStatus.QUEUED
        assert instance.get_records_for_run(
            run.run_id, of_type=DagsterEventType.RUN_ENQUEUED).records
