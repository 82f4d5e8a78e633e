"""`mostovik prune` killed by SIGKILL half way, as a real process, then run again, ends in the
state one clean prune reaches on a copy of the same history: the same files with the same bytes
in the landing store and the op-output storage, the same captured logs, the same runs and the
same partition state in run storage. With the landing store and the op outputs on a local disk,
and on object storage (a bucket per store, mounted with s3fs: then the buckets' objects are
exactly the files the mounts show, as test_prune.py checks).

The kill point is found by watching, not by timing: the prune removes op outputs, then old
fetch records and blobs, then runs, each run's captured logs first, then its events, then its
record (maintenance/prune.py, runs.py). The test watches the captured logs of the run the prune
deletes and kills the process the moment they are gone: every file removal is done by then, the
run's events and record are not deleted yet (SQLite writes, milliseconds; the watch sees the
directory go within microseconds). A prune stopped between any two removals in-process is
test_prune.py's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest import mock

import pytest
from dagster import AssetKey, DagsterEventType, DagsterInstance

from mostovik_pipelines.core.settings import (
    KEEP_FAILED_RUN_OUTPUTS_ENV,
    KEEP_LANDED_ENV,
    KEEP_RUNS_ENV,
    LANDING_DIR_ENV,
    RETENTION_GRACE_ENV,
    STORAGE_DIR_ENV,
)
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines_tests.support.instances import runs_with_event_log_files
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.object_store import mounted_buckets, why_no_object_store
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.runs import run_partition

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")
ASSET = AssetKey("cbr_daily_rates")
SOURCE = "cbr_daily_rates"
DAYS = ["2026-11-02", "2026-11-03"]
OLD_RECORDS_PER_DAY = 50
"""Older fetches landed per day besides the runs' own (each record and its blob a removal)."""
STORES = ("landing", "storage")
COPIES = ("killed", "clean")
NOTHING_KEPT = {KEEP_FAILED_RUN_OUTPUTS_ENV: "0", RETENTION_GRACE_ENV: "0",
                KEEP_LANDED_ENV: "0", KEEP_RUNS_ENV: "0"}


@pytest.fixture(params=["disk", "object storage"])
def buckets(request, tmp_path):
    """Where each copy's landing store and op outputs live: directories of a local disk, or a
    bucket each (``killed-landing``, ...) mounted there with s3fs."""
    if request.param == "disk":
        yield None
        return
    if reason := why_no_object_store():
        pytest.skip(reason)
    with mounted_buckets(tmp_path, tuple(f"{copy}/{store}" for copy in COPIES
                                         for store in STORES)) as mounted:
        yield mounted


def _history(work_dir: Path, location, standin) -> str:
    """The first day loaded twice (the rates changed), the second failed; older fetches of both
    days, landed by the landing store itself. Returns the run no partition's present depends on
    any more, which the prune deletes: the first load of the day loaded again."""
    home = local_dagster_home(work_dir)
    job = location.resolve_job_def("cbr_daily_rates_job")
    with DagsterInstance.from_config(str(home)) as instance:
        superseded = run_partition(job, DAYS[0], instance)
        assert superseded.success
        standin.change_cbr_rates(DAYS[0], set_values={"USD": "75,0000"})
        assert run_partition(job, DAYS[0], instance).success
        standin.fault("malformed", times=-1, match="date_req=03/11/2026")
        assert not run_partition(job, DAYS[1], instance).success
        standin.clear_faults()
    landing = LandingStoreResource(base_dir=str(work_dir / "landing"))
    long_ago = datetime.now(UTC) - timedelta(days=365)
    for day in DAYS:
        for n in range(OLD_RECORDS_PER_DAY):
            landing.land(SOURCE, day, f"<ValCurs n='{n}' date='{day}'/>".encode(),
                         content_type="application/xml", origin="cbr",
                         fetched_at=long_ago + timedelta(hours=n), durable=False)
    return superseded.run_id


def _environment(work_dir: Path, warehouse_url: str, cbr_url: str) -> dict[str, str]:
    return {**os.environ, **NOTHING_KEPT,
            "DAGSTER_HOME": str(work_dir / "dagster_home"),
            "MOSTOVIK_DATABASE_URL": warehouse_url, "MOSTOVIK_CBR_URL": cbr_url,
            "MOSTOVIK_DATA_DIR": str(work_dir / "data"),
            LANDING_DIR_ENV: str(work_dir / "landing"),
            STORAGE_DIR_ENV: str(work_dir / "storage")}


def _copy(work_dir: Path, to: Path) -> None:
    """The whole state somewhere else: instance home (its dagster.yaml names its storage by
    absolute path), SQLite run and event storage, captured logs, landing and op outputs; file
    by file, times kept, into the stores' directories or mounted buckets."""
    directories = []
    for path in sorted(work_dir.rglob("*")):
        target = to / path.relative_to(work_dir)
        if path.is_symlink():
            target.symlink_to(os.readlink(path))
        elif path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            directories.append((path, target))
        else:
            shutil.copy2(path, target)
    for path, target in reversed(directories):
        if not os.path.ismount(target):  # a bucket's mount point takes no directory metadata
            shutil.copystat(path, target)
    config = to / "dagster_home" / "dagster.yaml"
    config.write_text(config.read_text().replace(str(work_dir), str(to)))


def _prune(env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([MOSTOVIK, "prune"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _old_records(work_dir: Path) -> int:
    return sum(1 for day in DAYS
               for record in (work_dir / "landing" / SOURCE / day / "fetches").iterdir()
               if record.name.startswith(str(datetime.now(UTC).year - 1)))


def _state(work_dir: Path, copied_from: Path | None = None) -> dict:
    """What the prune may change: files (bytes, with the paths fetch records hold made
    relative), captured logs, runs and their event-log files, and what run storage says about
    each partition."""
    files = {}
    for store in ("landing", "storage"):
        for path in (work_dir / store).rglob("*"):
            if path.is_file():
                files[str(path.relative_to(work_dir))] = path.read_bytes().replace(
                    str(copied_from or work_dir).encode(), b"<work_dir>")
    logs = sorted(str(path.relative_to(work_dir))
                  for path in (work_dir / "dagster" / "logs").rglob("*"))
    home = str(work_dir / "dagster_home")
    with mock.patch.dict(os.environ, {"DAGSTER_HOME": home}), \
            DagsterInstance.from_config(home) as instance:
        storage = instance.event_log_storage
        return {
            "files": files,
            "captured_logs": logs,
            "runs": sorted(record.dagster_run.run_id for record in instance.get_run_records()),
            "event_log_files": runs_with_event_log_files(instance),
            "materialized": instance.get_materialized_partitions(ASSET),
            "latest": dict(instance.get_latest_storage_id_by_partition(
                ASSET, DagsterEventType.ASSET_MATERIALIZATION)),
            "failed_or_unloaded": dict(
                storage.get_latest_asset_partition_materialization_attempts_without_materializations(
                    ASSET)),
        }


def _kill_once_its_logs_are_gone(env: dict[str, str], work_dir: Path, run_id: str) -> None:
    """Start `mostovik prune` and SIGKILL it the moment the captured logs of ``run_id``, the
    run it deletes, are gone: its events and its record are still to be deleted."""
    logs = str(work_dir / "dagster" / "logs" / run_id)
    assert os.path.isdir(logs)
    process = subprocess.Popen([MOSTOVIK, "prune"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    try:
        while os.path.isdir(logs):
            assert process.poll() is None, process.communicate()[0].decode()
            assert time.monotonic() < deadline, "the prune deleted no run in 60 s"
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == -signal.SIGKILL


def _objects_match_files(buckets, tmp_path: Path) -> None:
    if buckets is None:
        return
    for copy in COPIES:
        for store in STORES:
            mount = tmp_path / copy / store
            files = {str(p.relative_to(mount)) for p in mount.rglob("*") if p.is_file()}
            assert buckets.objects(f"{copy}/{store}") == files, (copy, store)


def test_a_prune_killed_half_way_then_run_again_ends_where_one_clean_prune_does(
    buckets, sqlite_warehouse_url, standin_server, standin, cbr_source, tmp_path
):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    killed.mkdir(exist_ok=True)
    location = code_location_for(sqlite_warehouse_url, standin_server, killed, [cbr_source])
    superseded = _history(killed, location, standin)
    _copy(killed, clean)
    before = _state(killed)
    old = _old_records(killed)
    assert old == len(DAYS) * OLD_RECORDS_PER_DAY
    assert len(before["runs"]) == 3 and list((killed / "storage").iterdir())

    _prune(_environment(clean, sqlite_warehouse_url, standin_server.cbr_url))
    once = _state(clean, copied_from=killed)
    assert once["runs"] == sorted(set(before["runs"]) - {superseded})
    assert once["event_log_files"] == set(once["runs"])
    assert _old_records(clean) == 0 and not list((clean / "storage").iterdir())

    env = _environment(killed, sqlite_warehouse_url, standin_server.cbr_url)
    _kill_once_its_logs_are_gone(env, killed, superseded)
    half_way = _state(killed)
    # Killed in the middle: every file removal done, the run's deletion begun, not finished.
    assert not list((killed / "storage").iterdir()) and _old_records(killed) == 0
    assert superseded in half_way["runs"], "killed after the run was deleted"
    assert half_way["captured_logs"] != before["captured_logs"]
    assert {key: half_way[key] for key in ("materialized", "latest", "failed_or_unloaded")} == {
        key: before[key] for key in ("materialized", "latest", "failed_or_unloaded")}

    again = _prune(env)
    assert "runs: removed 1 runs" in again.stdout, again.stdout
    assert _state(killed) == once
    _objects_match_files(buckets, tmp_path)
