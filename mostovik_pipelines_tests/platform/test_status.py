"""A run's ADR status has one writer and one reader,
:mod:`mostovik_pipelines.platform.status`: no other module of the package uses its tag, so
what the UI's run list, ``mostovik jobs`` and the alerts show of a run changes in one place."""

from __future__ import annotations

import ast
from pathlib import Path

from dagster import DagsterInstance, DagsterRunStatus

import mostovik_pipelines
from mostovik_pipelines.platform import status
from mostovik_pipelines.platform.status import (
    STATUS_TAG,
    JobStatus,
    job_status,
    record,
    record_failed,
    record_running,
    recorded,
)

PACKAGE = Path(mostovik_pipelines.__file__).parent


def test_no_module_but_the_status_module_uses_the_status_tag():
    named = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                   if path != Path(status.__file__) and _uses_the_tag(path))
    assert named == []


def _uses_the_tag(path: Path) -> bool:
    """Whether the module's code (not its prose) holds the tag or its constant."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value == STATUS_TAG:
            return True
        if isinstance(node, ast.Name | ast.alias) and "STATUS_TAG" in (
                getattr(node, "id", None), getattr(node, "name", None)):
            return True
    return False


def test_a_run_is_marked_running_then_ends_with_one_status_and_failed_is_written_once():
    with DagsterInstance.ephemeral() as instance:
        run = instance.create_run_for_job(_job(), tags={STATUS_TAG: "completed"})
        # A re-execution starts with its parent's final status: its first step says running.
        record_running(instance, run, {"mostovik/source": "cbr_daily_rates"})
        run = instance.get_run_by_id(run.run_id)
        assert recorded(run) is JobStatus.RUNNING
        assert run.tags["mostovik/source"] == "cbr_daily_rates"

        record(instance, run.run_id, JobStatus.PARTIAL)
        run = instance.get_run_by_id(run.run_id)
        instance.handle_run_event(run.run_id, _success(run))
        run = instance.get_run_by_id(run.run_id)
        assert run.status is DagsterRunStatus.SUCCESS
        assert job_status(run) == (JobStatus.PARTIAL, True)

        writes = []
        original = instance.add_run_tags
        instance.add_run_tags = lambda *args: (writes.append(args), original(*args))
        record_failed(instance, run)
        record_failed(instance, instance.get_run_by_id(run.run_id))
        assert len(writes) == 1
        assert recorded(instance.get_run_by_id(run.run_id)) is JobStatus.FAILED


def test_a_successful_run_without_its_status_is_left_to_its_figures():
    with DagsterInstance.ephemeral() as instance:
        run = instance.create_run_for_job(_job())
        instance.handle_run_event(run.run_id, _success(run))
        assert job_status(instance.get_run_by_id(run.run_id)) == (JobStatus.COMPLETED, False)


def _job():
    from dagster import job, op

    @op
    def noop() -> None:
        return None

    @job
    def nothing():
        noop()

    return nothing


def _success(run):
    from dagster import DagsterEvent, DagsterEventType

    return DagsterEvent(event_type_value=DagsterEventType.RUN_SUCCESS.value,
                        job_name=run.job_name, message="done")
