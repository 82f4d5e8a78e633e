"""The landed payload a partition's stored rows came from, when a later fetch was rejected: the
prune keeps it beside the latest fetch for as long as the rows stand, ``reuse_landed``
re-transforms it (not the rejected fetch) and reproduces the stored rows exactly, and where it
is gone ``reuse_landed`` refuses that partition, naming the source and the period, and leaves
its rows as they were."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from dagster import DagsterEventType, DagsterInstance

from mostovik_pipelines.maintenance.policy import LANDING, RetentionPolicy
from mostovik_pipelines.maintenance.prune import prune
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.runs import load_metadata, run_partition, step_failure_message
from mostovik_pipelines_tests.support.warehouse import table_rows

SOURCE = "cbr_daily_rates"
DAYS = ["2026-11-02", "2026-11-03"]
A_YEAR_AND_MORE = timedelta(days=500)
REUSE_LANDED = {"ops": {SOURCE: {"ops": {f"extract_{SOURCE}": {
    "config": {"reuse_landed": True}}}}}}


@pytest.fixture
def location(sqlite_warehouse_url, standin_server, standin, tmp_path, cbr_source):
    return code_location_for(sqlite_warehouse_url, standin_server, tmp_path, [cbr_source])


@pytest.fixture
def dagster(tmp_path):
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as instance:
        yield instance


def _loaded_then_rejected(location, dagster, standin, day: str) -> str:
    """The day loaded from a good fetch, then fetched again and rejected (not XML: the run fails
    and the rows stand). Returns the content hash of the good payload."""
    job = location.resolve_job_def(f"{SOURCE}_job")
    good = run_partition(job, day, dagster)
    assert good.success
    standin.fault("malformed", times=-1, match=f"date_req={day[8:]}/{day[5:7]}/{day[:4]}")
    rejected = run_partition(job, day, dagster)
    assert not rejected.success
    standin.clear_faults()
    return load_metadata(dagster, good.run_id)["content_hash"]


def _landed_hashes(tmp_path: Path, day: str) -> list[str]:
    landing = LandingStoreResource(base_dir=str(tmp_path / "landing"))
    folder = Path(landing.base_dir) / SOURCE / day / "fetches"
    return [path.stem.rsplit("-", 1)[1] for path in sorted(folder.glob("*.json"))]


def test_a_prune_keeps_the_payload_behind_the_stored_rows_and_reuse_landed_reproduces_them(
    location, dagster, standin, sqlite_warehouse_url, tmp_path
):
    day = DAYS[0]
    good = _loaded_then_rejected(location, dagster, standin, day)
    [good_fetch, rejected_fetch] = _landed_hashes(tmp_path, day)
    assert good_fetch == good[:12] and rejected_fetch != good_fetch
    stored = table_rows(sqlite_warehouse_url, SOURCE)
    assert stored
    # The source changes its figures meanwhile: a fetch now would not give the stored rows.
    standin.change_cbr_rates(day, set_values={"USD": "75,0000"})

    report = prune(dagster, landing_dir=tmp_path / "landing",
                   op_output_dir=tmp_path / "storage", check_keys=[],
                   policy=RetentionPolicy(), now=datetime.now(UTC) + A_YEAR_AND_MORE)
    # Nothing of the landing store goes: the latest fetch and the one the rows came from stay.
    assert report.counts[LANDING] == 0
    assert _landed_hashes(tmp_path, day) == [good_fetch, rejected_fetch]

    job = location.resolve_job_def(f"{SOURCE}_job")
    reused = job.execute_in_process(partition_key=day, instance=dagster, raise_on_error=False,
                                    run_config=REUSE_LANDED)
    assert reused.success, step_failure_message(dagster, reused.run_id)
    figures = load_metadata(dagster, reused.run_id)
    assert figures["content_hash"] == good
    assert figures["inserted"] == 0 and figures["updated"] == 0 and figures["deleted"] == 0
    assert table_rows(sqlite_warehouse_url, SOURCE) == stored

    # Once a newer fetch is loaded, the rows stand on it: the old payloads may go.
    assert run_partition(job, day, dagster).success
    report = prune(dagster, landing_dir=tmp_path / "landing",
                   op_output_dir=tmp_path / "storage", check_keys=[],
                   policy=RetentionPolicy(), now=datetime.now(UTC) + A_YEAR_AND_MORE)
    assert len(_landed_hashes(tmp_path, day)) == 1 and report.counts[LANDING] >= 2


def test_reuse_landed_refuses_a_partition_whose_stored_rows_payload_is_gone_and_loads_the_rest(
    location, dagster, standin, sqlite_warehouse_url, tmp_path
):
    gone = _loaded_then_rejected(location, dagster, standin, DAYS[0])
    job = location.resolve_job_def(f"{SOURCE}_job")
    assert run_partition(job, DAYS[1], dagster).success
    folder = tmp_path / "landing" / SOURCE / DAYS[0]
    for path in [*folder.glob(f"fetches/*-{gone[:12]}.json"), folder / "blobs" / f"{gone}.bin"]:
        path.unlink()
    stored = table_rows(sqlite_warehouse_url, SOURCE)

    reused = job.execute_in_process(
        instance=dagster, raise_on_error=False, run_config=REUSE_LANDED,
        tags={"dagster/asset_partition_range_start": DAYS[0],
              "dagster/asset_partition_range_end": DAYS[1]})
    assert not reused.success
    message = step_failure_message(dagster, reused.run_id)
    assert "1 of 2 partitions failed" in message
    assert f"reuse_landed: {SOURCE} [{DAYS[0]}]" in message
    assert "no longer in the landing store" in message and gone[:12] in message
    assert table_rows(sqlite_warehouse_url, SOURCE) == stored
    # The other day's payload is there: it was re-transformed and loaded, unchanged.
    materialized = dagster.get_records_for_run(
        reused.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    assert [record.partition_key for record in materialized] == [DAYS[1]]
