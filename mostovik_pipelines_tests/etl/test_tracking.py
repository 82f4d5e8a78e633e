"""The job view over run storage, on SQLite and on PostgreSQL run storage."""

from __future__ import annotations

import pytest
from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter
from dagster._core.remote_origin import (
    InProcessCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.utils import make_new_run_id

from mostovik_pipelines.etl.quarantine import quarantined_by_run
from mostovik_pipelines.etl.tracking import JobStatus, list_jobs, load_job, stuck_jobs
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.runs import run_partition

PARTITION = "2026-11-04"


@pytest.fixture(params=["sqlite", "postgres"])
def run_storage(request, tmp_path, monkeypatch):
    """A persistent instance on either run storage."""
    if request.param == "sqlite":
        home = local_dagster_home(tmp_path)
    else:
        home, environment = request.getfixturevalue("production_home")
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
    with DagsterInstance.from_config(str(home)) as instance:
        yield instance


@pytest.fixture
def warehouse_url(pg_warehouse_url):
    return pg_warehouse_url


def test_a_clean_run_is_a_completed_job_with_its_figures(cbr_job, run_storage):
    result = run_partition(cbr_job, PARTITION, run_storage)
    job = load_job(run_storage, result.run_id)
    assert (job.source, job.job_type, job.partitions) == ("cbr_daily_rates", "parser",
                                                         [PARTITION])
    assert (job.status, job.result, job.run_status) == (JobStatus.COMPLETED, "success", "SUCCESS")
    assert job.totals == {"inserted": 12, "updated": 0, "unchanged": 0, "deleted": 0,
                          "rejected": 0}
    assert job.attempts == {"extract_cbr_daily_rates": 1, "transform_cbr_daily_rates": 1,
                            "load_cbr_daily_rates": 1}
    assert job.started_at <= job.ended_at
    assert job.launched_by == "cli"
    assert job.executor == "in_process"
    assert job.errors == []


def test_a_run_with_quarantined_rows_is_partial(cbr_job, run_storage, standin, warehouse_url):
    standin.change_cbr_rates(PARTITION, set_values={"EUR": "broken"})
    result = run_partition(cbr_job, PARTITION, run_storage)
    job = load_job(run_storage, result.run_id)
    assert (job.status, job.result) == (JobStatus.PARTIAL, "partial")
    assert job.totals["rejected"] == 1 and job.totals["inserted"] == 11
    [row] = quarantined_by_run(warehouse_engine(warehouse_url), result.run_id)
    assert "Value 'broken' is not a decimal" in row["reason"]


def test_a_permanent_failure_is_a_failed_job_with_its_error(cbr_job, run_storage, standin):
    standin.fault("status", status=404)
    result = run_partition(cbr_job, PARTITION, run_storage)
    job = load_job(run_storage, result.run_id)
    assert (job.status, job.result) == (JobStatus.FAILED, "error")
    [error] = job.errors
    assert error.op == "extract_cbr_daily_rates"
    assert (error.error_class, error.kind) == ("permanent", "request_rejected")
    assert "cbr_daily_rates [2026-11-04] extract" in error.message and "404" in error.message
    assert any("SourceRequestRejected" in cause for cause in error.causes)


def test_retries_show_as_attempts(cbr_job, run_storage, standin):
    standin.fault("status", status=503, times=2)
    job = load_job(run_storage, run_partition(cbr_job, PARTITION, run_storage).run_id)
    assert job.status is JobStatus.COMPLETED
    assert job.attempts["extract_cbr_daily_rates"] == 3


def test_a_queued_run_is_a_pending_job(cbr_job, run_storage):
    # A run waiting in the run queue, as the queued run coordinator stores it.
    origin = RemoteJobOrigin(RemoteRepositoryOrigin(InProcessCodeLocationOrigin(
        LoadableTargetOrigin(module_name="mostovik_pipelines", attribute="defs")),
        "__repository__"), cbr_job.name)
    run = run_storage.run_storage.add_run(DagsterRun(
        job_name=cbr_job.name, run_id=make_new_run_id(), status=DagsterRunStatus.QUEUED,
        tags={**cbr_job.tags, "dagster/partition": PARTITION}, remote_job_origin=origin,
    ))
    job = load_job(run_storage, run.run_id)
    assert job.status is JobStatus.PENDING and job.result is None
    assert [j.run_id for j in list_jobs(run_storage, status=JobStatus.PENDING)] == [run.run_id]


def test_jobs_are_listed_newest_first_and_filtered(cbr_job, run_storage, standin):
    first = run_partition(cbr_job, "2026-11-03", run_storage).run_id
    standin.fault("status", status=404)
    second = run_partition(cbr_job, PARTITION, run_storage).run_id
    assert [j.run_id for j in list_jobs(run_storage)] == [second, first]
    assert [j.run_id for j in list_jobs(run_storage, status=JobStatus.FAILED)] == [second]
    assert [j.run_id for j in list_jobs(run_storage, period_from="2026-11-04")] == [second]
    assert [j.run_id for j in list_jobs(run_storage, period_to="2026-11-03")] == [first]
    assert list_jobs(run_storage, job_type="sync") == []
    # The UI's run list filters by the same tags.
    tagged = run_storage.get_runs(RunsFilter(tags={"mostovik/source": "cbr_daily_rates",
                                                   "dagster/partition": PARTITION}))
    assert [r.run_id for r in tagged] == [second]


def test_a_run_started_long_ago_and_still_running_is_stuck(cbr_job, run_storage):
    run = run_storage.create_run_for_job(
        job_def=cbr_job, status=DagsterRunStatus.STARTED,
        tags={**cbr_job.tags, "dagster/partition": PARTITION, "dagster/max_runtime": "0"},
    )
    assert [j.run_id for j in stuck_jobs(run_storage)] == [run.run_id]
