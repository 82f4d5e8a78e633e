"""The retention prune on a real SQLite Dagster instance after real runs of the CBR job: what an
operator reads about every partition is the same after a prune, what is removed is what the
policy says, and a prune stopped half way or run twice ends where one clean prune does. The
tests that remove files run with the stores on a local disk and on object storage mounted with
s3fs-fuse (deploy/README's other option): the same policy through the same interface."""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
)

from mostovik_pipelines.core.dagster_compat import run_event_log_dir
from mostovik_pipelines.maintenance.policy import (
    EVENT_LOG_FILES,
    LANDING,
    OP_OUTPUTS,
    RUNS,
    RetentionPolicy,
)
from mostovik_pipelines.maintenance.prune import plan_prune, prune
from mostovik_pipelines.platform.tracking import list_jobs
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.instances import runs_with_event_log_files
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.object_store import mounted_buckets, why_no_object_store
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.runs import run_partition

ASSET = AssetKey("cbr_daily_rates")
DAYS = ["2026-11-02", "2026-11-03", "2026-11-04"]
A_YEAR_AND_MORE = timedelta(days=500)


STORES = ("landing", "storage")


@pytest.fixture(params=["disk", "object storage"])
def stores(request, tmp_path):
    """Where the landing store and the op outputs live: directories of a local disk, or a bucket
    each mounted there with s3fs (then the buckets, to read the objects left behind)."""
    if request.param == "disk":
        yield None
        return
    if reason := why_no_object_store():
        pytest.skip(reason)
    with mounted_buckets(tmp_path, STORES) as buckets:
        yield buckets


@pytest.fixture
def location(sqlite_warehouse_url, standin_server, standin, tmp_path, cbr_source):
    return code_location_for(sqlite_warehouse_url, standin_server, tmp_path, [cbr_source])


def _history(location, run_storage, standin) -> dict[str, str]:
    """Each day loaded, the first one twice with changed rates, and the last one failed for
    good the second time: a run per step of a partition's life."""
    job = location.resolve_job_def("cbr_daily_rates_job")
    runs = {}
    for day in DAYS:
        runs[day] = run_partition(job, day, run_storage).run_id
    standin.change_cbr_rates(DAYS[0], set_values={"USD": "75,0000"})
    runs["changed"] = run_partition(job, DAYS[0], run_storage).run_id
    standin.fault("malformed", times=-1, match="date_req=04/11/2026")
    failed = run_partition(job, DAYS[2], run_storage)
    assert not failed.success
    runs["failed"] = failed.run_id
    standin.clear_faults()
    return runs


def _what_an_operator_reads(run_storage: DagsterInstance, location) -> dict:
    check_keys = list(location.resolve_asset_graph().asset_check_keys)
    latest = run_storage.get_latest_storage_id_by_partition(
        ASSET, DagsterEventType.ASSET_MATERIALIZATION)
    metadata = {}
    for day in DAYS:
        [record] = run_storage.fetch_materializations(
            AssetRecordsFilter(asset_key=ASSET, asset_partitions=[day]),
            limit=1).records
        materialization = record.event_log_entry.asset_materialization
        metadata[day] = (record.run_id, {k: v.value for k, v in materialization.metadata.items()})
    storage = run_storage.event_log_storage
    attempts = storage.get_latest_asset_partition_materialization_attempts_without_materializations(
        ASSET)
    checks = sorted((str(info.check_key), info.partition_key, info.latest_execution_status.value,
                     info.latest_planned_run_id)
                    for info in storage.get_asset_check_partition_info(check_keys))
    latest_jobs = {day: list_jobs(run_storage, sources=ALL_SOURCES, source="cbr_daily_rates",
                                  period_from=day, period_to=day, limit=1)[0].as_dict()
                   for day in DAYS}
    for job in latest_jobs.values():
        job.pop("duration_seconds")
    return {
        "materialized": run_storage.get_materialized_partitions(ASSET),
        "latest_storage_ids": dict(latest),
        "metadata": metadata,
        "failed_or_unloaded": {p: run for p, (run, _id) in attempts.items()},
        "checks": checks,
        "latest_jobs": latest_jobs,
    }


def _stores(tmp_path: Path, run_storage: DagsterInstance) -> tuple[set[str], set[str]]:
    files = {str(p) for folder in STORES for p in (tmp_path / folder).rglob("*") if p.is_file()}
    return files, {record.dagster_run.run_id for record in run_storage.get_run_records()}


def _objects_match_files(buckets, tmp_path: Path) -> None:
    """On object storage, the buckets hold exactly the files the mounts show: nothing renamed
    aside and never deleted, no object the prune could not see."""
    if buckets is None:
        return
    for store in STORES:
        files = {str(p.relative_to(tmp_path / store))
                 for p in (tmp_path / store).rglob("*") if p.is_file()}
        assert buckets.objects(store) == files


def _prune(run_storage, location, tmp_path, now, **kwargs):
    return prune(run_storage, landing_dir=tmp_path / "landing", op_output_dir=tmp_path / "storage",
                 check_keys=list(location.resolve_asset_graph().asset_check_keys),
                 policy=RetentionPolicy(), now=now, **kwargs)


def test_a_prune_a_year_on_keeps_every_partitions_present_and_removes_the_rest(
    stores, location, run_storage, standin, tmp_path
):
    runs = _history(location, run_storage, standin)
    before = _what_an_operator_reads(run_storage, location)
    assert before["failed_or_unloaded"] == {DAYS[2]: runs["failed"]}
    later = datetime.now(UTC) + A_YEAR_AND_MORE

    files_before, runs_before = _stores(tmp_path, run_storage)
    dry = _prune(run_storage, location, tmp_path, later, dry_run=True)
    assert _stores(tmp_path, run_storage) == (files_before, runs_before)
    assert _what_an_operator_reads(run_storage, location) == before
    report = _prune(run_storage, location, tmp_path, later)
    assert report.counts == dry.counts and report.size_bytes == dry.size_bytes
    assert _what_an_operator_reads(run_storage, location) == before

    # Every run's op outputs went; of the runs, only the one that no longer is any
    # partition's latest: the first load of the day loaded again.
    assert not [p for p in (tmp_path / "storage").iterdir()]
    files_after, runs_after = _stores(tmp_path, run_storage)
    assert runs_before - runs_after == {runs[DAYS[0]]} and files_after < files_before
    assert report.counts[RUNS] == 1 and report.counts[OP_OUTPUTS] == len(runs)
    # A local instance's event log keeps a file per run: the deleted run's went with it.
    assert runs_with_event_log_files(run_storage) in (None, runs_after)
    # Of the landed payloads, the older fetch of the first day went (its bytes stay: the newer
    # fetch got the same); the last day's stay both: the latest fetch (rejected) and the one
    # its stored rows came from, which reuse_landed re-transforms.
    assert report.counts[LANDING] == 1
    # A second prune finds nothing.
    assert not _prune(run_storage, location, tmp_path, later).removed_anything
    _objects_match_files(stores, tmp_path)
    if stores is not None:
        assert not stores.objects("storage") and stores.objects("landing")
    landing = LandingStoreResource(base_dir=str(tmp_path / "landing"))
    for day in DAYS:
        assert landing.is_whole(landing.latest("cbr_daily_rates", day))
    job = location.resolve_job_def("cbr_daily_rates_job")
    for day in DAYS:
        reused = job.execute_in_process(
            partition_key=day, instance=run_storage, raise_on_error=False, run_config={"ops": {
                "cbr_daily_rates": {"ops": {"extract_cbr_daily_rates": {
                    "config": {"reuse_landed": True}}}}}})
        assert reused.success


def test_a_prune_stopped_half_way_then_run_again_ends_where_one_clean_prune_does(
    stores, location, run_storage, standin, tmp_path
):
    _history(location, run_storage, standin)
    later = datetime.now(UTC) + A_YEAR_AND_MORE
    before = _what_an_operator_reads(run_storage, location)
    files_before, runs_before = _stores(tmp_path, run_storage)
    plan = plan_prune(run_storage, landing_dir=tmp_path / "landing",
                      op_output_dir=tmp_path / "storage",
                      check_keys=list(location.resolve_asset_graph().asset_check_keys),
                      policy=RetentionPolicy(), now=later)
    removed = {removal.target for removal in plan}
    assert {removal.store for removal in plan} == {OP_OUTPUTS, LANDING, RUNS}

    done = []

    def stop_half_way(removal):
        if len(done) == len(plan) // 2:
            raise KeyboardInterrupt("killed")
        done.append(removal)

    with pytest.raises(KeyboardInterrupt):
        _prune(run_storage, location, tmp_path, later, before_removal=stop_half_way)
    assert _what_an_operator_reads(run_storage, location) == before
    again = _prune(run_storage, location, tmp_path, later)
    assert sum(again.counts.values()) == len(plan) - len(done)

    files_after, runs_after = _stores(tmp_path, run_storage)
    assert runs_after == runs_before - removed
    assert files_after == {f for f in files_before
                           if not any(f == t or f.startswith(t + "/") for t in removed)}
    assert _what_an_operator_reads(run_storage, location) == before
    assert not _prune(run_storage, location, tmp_path, later).removed_anything
    _objects_match_files(stores, tmp_path)


def test_a_run_deleted_by_hand_leaves_a_file_that_a_prune_removes_after_the_grace(
    location, standin, tmp_path
):
    """``dagster run delete`` empties a local instance's file of the run and leaves it (124 KiB
    each): a prune removes it once it is older than the grace."""
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as run_storage:
        runs = _history(location, run_storage, standin)
        run_storage.delete_run(runs[DAYS[1]])
        left = sorted(run_event_log_dir(run_storage).glob(f"{runs[DAYS[1]]}.db*"))
        assert left
        now = datetime.now(UTC)
        assert _prune(run_storage, location, tmp_path, now).counts[EVENT_LOG_FILES] == 0
        assert all(path.exists() for path in left)
        report = _prune(run_storage, location, tmp_path, now + timedelta(days=2))
        assert report.counts[EVENT_LOG_FILES] == len(left)
        assert report.size_bytes[EVENT_LOG_FILES] > 0
        assert not any(path.exists() for path in left)
        assert runs_with_event_log_files(run_storage) == _stores(tmp_path, run_storage)[1]
        assert not _prune(run_storage, location, tmp_path, now + timedelta(days=2)).removed_anything


def test_within_the_windows_a_prune_keeps_a_failed_runs_outputs_and_every_run(
    location, run_storage, standin, tmp_path
):
    runs = _history(location, run_storage, standin)
    two_days_on = datetime.now(UTC) + timedelta(days=2)
    report = _prune(run_storage, location, tmp_path, two_days_on)
    assert report.counts[RUNS] == 0 and report.counts[LANDING] == 0
    kept = {p.name for p in (tmp_path / "storage").iterdir()}
    assert kept == {runs["failed"]}
    assert run_storage.get_run_by_id(runs["failed"]).status is DagsterRunStatus.FAILURE


def test_the_daily_prune_job_runs_as_a_job_of_the_code_location(location, run_storage, standin,
                                                                 tmp_path, monkeypatch):
    runs = _history(location, run_storage, standin)
    monkeypatch.setenv("MOSTOVIK_RETENTION_GRACE_DAYS", "0")
    result = location.resolve_job_def("prune_storage_job").execute_in_process(instance=run_storage)
    assert result.success
    logged = [entry.user_message for entry in run_storage.all_logs(result.run_id)]
    assert any(message.startswith("op outputs: removed 4 run directories") for message in logged)
    # The failed run's outputs stay for its re-execution; the prune's own run is kept.
    assert {p.name for p in (tmp_path / "storage").iterdir()} == {runs["failed"]}
    assert run_storage.get_run_by_id(result.run_id).status is DagsterRunStatus.SUCCESS
    # It is no source's job: `mostovik jobs list` shows the sources' jobs only.
    listed = list_jobs(run_storage, sources=ALL_SOURCES, limit=100)
    assert len(listed) == len(runs) and result.run_id not in {job.run_id for job in listed}


def _age(store: Path, when: datetime) -> None:
    """Everything in ``store`` last written ``when`` (the store's own directory is left: a
    mounted bucket's root has no time to set)."""
    for item in store.rglob("*"):
        os.utime(item, (when.timestamp(), when.timestamp()))


def test_a_prune_next_to_running_jobs_removes_nothing_they_use(stores, location, run_storage,
                                                              standin, tmp_path):
    """A run still going (its record says started) and a re-execution still going of an old
    failed run: their op outputs, landed pages and frames stay, however old they look."""
    runs = _history(location, run_storage, standin)
    later = datetime.now(UTC) + A_YEAR_AND_MORE
    running = DagsterRun(job_name="cbr_daily_rates_job", run_id=str(uuid.uuid4()),
                         status=DagsterRunStatus.STARTED)
    reexecuting = DagsterRun(job_name="cbr_daily_rates_job", run_id=str(uuid.uuid4()),
                             status=DagsterRunStatus.STARTED, parent_run_id=runs["failed"],
                             root_run_id=runs["failed"])
    for run in (running, reexecuting):
        run_storage.add_run(run)
    landing = LandingStoreResource(base_dir=str(tmp_path / "landing"))
    landed = landing.land("cbr_daily_rates", DAYS[1], b"<page/>", content_type="text/xml",
                          origin="test", fetched_at=datetime.now(UTC), run_id=running.run_id,
                          page=1)
    frame = Path(landing.keep_frame(landed, {"rows": 1}))
    landing.land("cbr_daily_rates", DAYS[1], b"<newer/>", content_type="text/xml",
                 origin="test", fetched_at=datetime.now(UTC) + timedelta(seconds=1))
    (tmp_path / "storage" / running.run_id / "extract").mkdir(parents=True)
    (tmp_path / "storage" / running.run_id / "extract" / "result").write_bytes(b"pickle")
    for path in (tmp_path / "storage", tmp_path / "landing"):
        _age(path, later - timedelta(days=450))

    _prune(run_storage, location, tmp_path, later)
    kept = {p.name for p in (tmp_path / "storage").iterdir()}
    assert kept == {running.run_id, runs["failed"]}
    assert landing.is_whole(landed) and frame.exists()
    assert landing.pages_landed_by("cbr_daily_rates", DAYS[1], running.run_id) == [landed]

    # Once they have finished, what they used goes too.
    for run in (running, reexecuting):
        run_storage.report_run_failed(run)
    _prune(run_storage, location, tmp_path, later)
    assert not list((tmp_path / "storage").iterdir())
    assert not landing.is_whole(landed) and not frame.exists()
    _objects_match_files(stores, tmp_path)
