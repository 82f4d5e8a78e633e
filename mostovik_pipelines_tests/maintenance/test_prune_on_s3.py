"""The retention prune on stores in object storage reached over the S3 API (``s3://`` settings,
no mount): the same policy through the same interface as on a directory (test_prune.py), read
back from the buckets' objects as the operator's S3 console shows them."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from dagster import DagsterInstance, DagsterRun, DagsterRunStatus

from mostovik_pipelines.maintenance.policy import LANDING, OP_OUTPUTS, RUNS, RetentionPolicy
from mostovik_pipelines.maintenance.prune import prune
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines.resources.op_outputs import OpOutputStore
from mostovik_pipelines.resources.stores import store_path
from mostovik_pipelines_tests.maintenance.test_prune import (
    A_YEAR_AND_MORE,
    DAYS,
    _history,
    _what_an_operator_reads,
)
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.processes import local_dagster_home


@pytest.fixture
def urls(s3) -> dict[str, str]:
    return {"landing": s3.bucket("landing") + "/raw", "storage": s3.bucket("outputs") + "/runs"}


@pytest.fixture
def location(sqlite_warehouse_url, standin_server, standin, tmp_path, cbr_source, urls):
    return code_location_for(sqlite_warehouse_url, standin_server, tmp_path, [cbr_source],
                             landing=LandingStoreResource(base_dir=urls["landing"]),
                             io_manager=OpOutputStore(base_dir=urls["storage"]))


def _prune(dagster, location, urls, now, **kwargs):
    return prune(dagster, landing_dir=store_path(urls["landing"]),
                 op_output_dir=store_path(urls["storage"]),
                 check_keys=list(location.resolve_asset_graph().asset_check_keys),
                 policy=RetentionPolicy(), now=now, **kwargs)


def test_a_prune_a_year_on_over_the_s3_api_applies_the_directorys_policy(
    s3, urls, location, standin, tmp_path
):
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as dagster:
        runs = _history(location, dagster, standin)
        before = _what_an_operator_reads(dagster, location)
        objects_before = {name: s3.buckets.objects(name) for name in ("landing", "outputs")}
        assert {key.split("/")[1] for key in objects_before["outputs"]} == set(runs.values())
        later = datetime.now(UTC) + A_YEAR_AND_MORE

        dry = _prune(dagster, location, urls, later, dry_run=True)
        assert {name: s3.buckets.objects(name) for name in ("landing", "outputs")} == (
            objects_before)
        report = _prune(dagster, location, urls, later)
        assert report.counts == dry.counts and report.size_bytes == dry.size_bytes
        assert _what_an_operator_reads(dagster, location) == before

        # The numbers of the same history pruned on a directory (test_prune.py): every run's
        # op outputs, one run, one landed object (the first day's older record; the failed
        # day's older fetch stays, the stored rows came from it).
        assert report.counts[OP_OUTPUTS] == len(runs) and report.counts[RUNS] == 1
        assert report.counts[LANDING] == 1
        assert report.size_bytes[OP_OUTPUTS] > 0 and report.size_bytes[LANDING] > 0
        assert not s3.buckets.objects("outputs")
        landing_after = s3.buckets.objects("landing")
        assert landing_after < objects_before["landing"]
        assert len(objects_before["landing"] - landing_after) == 1
        assert not [key for key in landing_after if ".pruning-" in key]
        assert not _prune(dagster, location, urls, later).removed_anything

        # Each partition's latest payload stays whole, and reuse_landed re-transforms it.
        landing = LandingStoreResource(base_dir=urls["landing"])
        for day in DAYS:
            assert landing.is_whole(landing.latest("cbr_daily_rates", day))
        job = location.resolve_job_def("cbr_daily_rates_job")
        for day in DAYS[:2]:
            reused = job.execute_in_process(
                partition_key=day, instance=dagster, raise_on_error=False, run_config={"ops": {
                    "cbr_daily_rates": {"ops": {"extract_cbr_daily_rates": {
                        "config": {"reuse_landed": True}}}}}})
            assert reused.success


def test_a_prune_next_to_a_running_job_on_s3_keeps_what_it_uses(
    s3, urls, location, standin, tmp_path
):
    """A run still going: its op outputs in the bucket stay, however old the prune's clock."""
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as dagster:
        runs = _history(location, dagster, standin)
        running = DagsterRun(job_name="cbr_daily_rates_job", run_id=str(uuid.uuid4()),
                             status=DagsterRunStatus.STARTED)
        dagster.add_run(running)
        (store_path(urls["storage"]) / running.run_id / "extract" / "result").write_bytes(b"x")
        _prune(dagster, location, urls, datetime.now(UTC) + A_YEAR_AND_MORE)
        kept = {key.split("/")[1] for key in s3.buckets.objects("outputs")}
        assert kept == {running.run_id}
        assert runs["failed"] not in kept
