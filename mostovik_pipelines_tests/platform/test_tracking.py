"""The job view over run storage, on SQLite and on PostgreSQL run storage."""

from __future__ import annotations

import pytest
from dagster import DagsterRun, DagsterRunStatus, RunsFilter
from dagster._core.remote_origin import (
    InProcessCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.utils import make_new_run_id

from mostovik_pipelines.platform.tracking import JobStatus, list_jobs, load_job, stuck_jobs
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.runs import run_partition
from mostovik_pipelines_tests.support.warehouse import quarantined_by_run

PARTITION = "2026-11-04"


@pytest.fixture
def warehouse_url(pg_warehouse_url):
    return pg_warehouse_url


def test_a_clean_run_is_a_completed_job_with_its_figures(cbr_job, run_storage):
    result = run_partition(cbr_job, PARTITION, run_storage)
    job = load_job(run_storage, result.run_id, ALL_SOURCES)
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
    job = load_job(run_storage, result.run_id, ALL_SOURCES)
    assert (job.status, job.result) == (JobStatus.PARTIAL, "partial")
    assert job.totals["rejected"] == 1 and job.totals["inserted"] == 11
    [row] = quarantined_by_run(warehouse_engine(warehouse_url), result.run_id)
    assert "Value 'broken' is not a decimal" in row["reason"]


def test_a_permanent_failure_is_a_failed_job_with_its_error(cbr_job, run_storage, standin):
    standin.fault("status", status=404)
    result = run_partition(cbr_job, PARTITION, run_storage)
    job = load_job(run_storage, result.run_id, ALL_SOURCES)
    assert (job.status, job.result) == (JobStatus.FAILED, "error")
    [error] = job.errors
    assert error.op == "extract_cbr_daily_rates"
    assert (error.error_class, error.kind) == ("permanent", "request_rejected")
    assert "cbr_daily_rates [2026-11-04] extract" in error.message and "404" in error.message
    assert any("SourceRequestRejected" in cause for cause in error.causes)


def test_retries_show_as_attempts(cbr_job, run_storage, standin):
    standin.fault("status", status=503, times=2)
    job = load_job(run_storage, run_partition(cbr_job, PARTITION, run_storage).run_id, ALL_SOURCES)
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
    job = load_job(run_storage, run.run_id, ALL_SOURCES)
    assert job.status is JobStatus.PENDING and job.result is None
    assert [j.run_id for j in jobs(run_storage, status=JobStatus.PENDING)] == [run.run_id]


def jobs(run_storage, **filters):
    """``mostovik jobs list`` as the code location's sources read it."""
    return list_jobs(run_storage, sources=ALL_SOURCES, **filters)


def test_jobs_are_listed_newest_first_and_filtered(cbr_job, run_storage, standin):
    first = run_partition(cbr_job, "2026-11-03", run_storage).run_id
    standin.fault("status", status=404)
    second = run_partition(cbr_job, PARTITION, run_storage).run_id
    assert [j.run_id for j in jobs(run_storage)] == [second, first]
    assert [j.run_id for j in jobs(run_storage, status=JobStatus.FAILED)] == [second]
    assert [j.run_id for j in jobs(run_storage, period_from="2026-11-04")] == [second]
    assert [j.run_id for j in jobs(run_storage, period_to="2026-11-03")] == [first]
    assert jobs(run_storage, job_type="sync") == []
    # The UI's run list filters by the same tags.
    tagged = run_storage.get_runs(RunsFilter(tags={"mostovik/source": "cbr_daily_rates",
                                                   "dagster/partition": PARTITION}))
    assert [r.run_id for r in tagged] == [second]


def test_a_run_started_long_ago_and_still_running_is_stuck(cbr_job, run_storage):
    run = run_storage.create_run_for_job(
        job_def=cbr_job, status=DagsterRunStatus.STARTED,
        tags={**cbr_job.tags, "dagster/partition": PARTITION, "dagster/max_runtime": "0"},
    )
    assert [j.run_id for j in stuck_jobs(run_storage, ALL_SOURCES)] == [run.run_id]


def test_a_queued_ui_asset_backfill_run_is_found_by_its_source_before_it_starts(run_storage):
    """A UI asset backfill runs the implicit asset job, without the source's tags until its
    first step: its asset selection names the source."""
    from dagster import AssetKey

    origin = RemoteJobOrigin(RemoteRepositoryOrigin(InProcessCodeLocationOrigin(
        LoadableTargetOrigin(module_name="mostovik_pipelines", attribute="defs")),
        "__repository__"), "__ASSET_JOB")
    run = run_storage.run_storage.add_run(DagsterRun(
        job_name="__ASSET_JOB", run_id=make_new_run_id(), status=DagsterRunStatus.QUEUED,
        asset_selection=frozenset({AssetKey("cbr_daily_rates")}), remote_job_origin=origin,
        tags={"dagster/backfill": "abcdefgh", "dagster/partition": PARTITION},
    ))
    found = jobs(run_storage, source="cbr_daily_rates")
    assert [j.run_id for j in found] == [run.run_id]
    assert found[0].status is JobStatus.PENDING and found[0].launched_by == "backfill abcdefgh"


def test_the_run_writes_its_adr_status_as_a_tag_and_lists_read_it(
    cbr_job, run_storage, standin
):
    clean = run_partition(cbr_job, PARTITION, run_storage)
    standin.change_cbr_rates("2026-11-05", set_values={"USD": "n/a"})
    partial = run_partition(cbr_job, "2026-11-05", run_storage)
    standin.fault("status", status=404, match="date_req=06/11/2026")
    failed = run_partition(cbr_job, "2026-11-06", run_storage)
    tags = {r.run_id: run_storage.get_run_by_id(r.run_id).tags.get("mostovik/status")
            for r in (clean, partial, failed)}
    assert tags == {clean.run_id: "completed", partial.run_id: "partial",
                    failed.run_id: "failed"}
    listed = {j.run_id: j.status.value for j in jobs(run_storage)}
    assert listed == tags


def test_a_run_started_with_its_parents_status_shows_its_own(cbr_job, run_storage, standin):
    """A re-execution (the UI's, a daemon run retry) starts with its parent's tags: while it
    runs, the run list must not show the parent's final status as its own (if it then dies, it
    would stay "completed")."""
    import threading

    # The run is held in its fetch until the watcher has seen it running.
    standin.fault("hang", seconds=300, match="date_req=06/11/2026")
    seen: list[str | None] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            runs = run_storage.get_runs(limit=1)
            if runs and runs[0].status is DagsterRunStatus.STARTED:
                seen.append(runs[0].tags.get("mostovik/status"))
                if "running" in seen and standin.hanging():
                    standin.release_hangs()
            done.wait(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = cbr_job.execute_in_process(partition_key="2026-11-06", instance=run_storage,
                                            raise_on_error=False,
                                            tags={"mostovik/status": "failed"})
    finally:
        done.set()
        watcher.join()
    assert result.success
    assert "running" in seen and "failed" not in seen[seen.index("running"):], seen
    assert run_storage.get_run_by_id(result.run_id).tags["mostovik/status"] == "completed"


def test_a_single_partition_run_stopped_for_a_concurrent_run_is_partial(
    warehouse_url, standin_server, standin, tmp_path, cbr_source, run_storage
):
    import dataclasses

    from mostovik_pipelines.framework.spec import ConcurrentRunPolicy
    from mostovik_pipelines_tests.support.locations import code_location_for

    stopping = dataclasses.replace(cbr_source, on_concurrent_run=ConcurrentRunPolicy.STOP)
    job = code_location_for(warehouse_url, standin_server, tmp_path, [stopping]).resolve_job_def(
        "cbr_daily_rates_job")
    # An older run of the partition, alive: created just now, not started (launch grace).
    older = run_storage.run_storage.add_run(DagsterRun(
        job_name=job.name, run_id=make_new_run_id(), status=DagsterRunStatus.STARTING,
        tags={**job.tags, "dagster/partition": PARTITION}))
    result = run_partition(job, PARTITION, run_storage)
    assert result.success
    stopped = load_job(run_storage, result.run_id, ALL_SOURCES)
    assert stopped.status is JobStatus.PARTIAL
    assert older.run_id in stopped.left_out[PARTITION]
    assert run_storage.get_run_by_id(result.run_id).tags["mostovik/status"] == "partial"


def test_each_step_reports_where_it_ran_as_an_event_not_a_run_tag(cbr_job, run_storage):
    import os
    import socket

    result = run_partition(cbr_job, PARTITION, run_storage)
    tags = run_storage.get_run_by_id(result.run_id).tags
    assert not [tag for tag in tags if tag.startswith(
        ("mostovik/host", "mostovik/pid", "mostovik/executor", "mostovik/celery_task"))]
    here = f"{socket.gethostname()} pid {os.getpid()}"
    for job in (load_job(run_storage, result.run_id, ALL_SOURCES), jobs(run_storage)[0]):
        assert job.processes == {op: here for op in (
            "extract_cbr_daily_rates", "transform_cbr_daily_rates", "load_cbr_daily_rates")}
        assert job.executor == "in_process" and job.celery_tasks == {}
