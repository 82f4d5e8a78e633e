"""The landing store and the op outputs on object storage, natively: ``s3://`` URLs reached over
the S3 API of a real server on 127.0.0.1 (moto's), credentials from the environment only. The
same guarantees as on a directory: a reader sees an object whole or not at all, every
partition's latest payload is what ``latest`` gives, and a store that goes away for a while is
ridden out as the warehouse is."""

from __future__ import annotations

import hashlib
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from dagster import DagsterEventType, DagsterInstance, EventRecordsFilter
from s3fs.utils import FileExpired

from mostovik_pipelines.core.retries import RETRY_METADATA_KEY
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines.resources.op_outputs import OpOutputStore
from mostovik_pipelines.resources.stores import store_path, write_whole
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.object_store import s3_in_environment
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.runs import run_partition, step_failure_message
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until
from mostovik_pipelines_tests.support.warehouse import table_rows

PARTITION = "2026-11-04"
SOURCE = "cbr_daily_rates"


def test_the_landing_store_on_s3_lands_reads_and_gives_each_partitions_latest(s3):
    landing = LandingStoreResource(base_dir=s3.bucket("landing") + "/raw")
    now = datetime.now(UTC)
    first = landing.land(SOURCE, PARTITION, b"<old/>", content_type="text/xml", origin="test",
                         fetched_at=now)
    newer = landing.land(SOURCE, PARTITION, b"<new/>", content_type="text/xml", origin="test",
                         fetched_at=now + timedelta(seconds=1))
    again = landing.land(SOURCE, PARTITION, b"<old/>", content_type="text/xml", origin="test",
                         fetched_at=now + timedelta(seconds=2))
    page = landing.land(SOURCE, "2026-11-05", b'{"page": 1}', content_type="application/json",
                        origin="test", fetched_at=now, run_id="run-1", page=1, durable=False)

    assert first.blob_path.startswith("s3://landing/raw/cbr_daily_rates/2026-11-04/blobs/")
    assert landing.latest(SOURCE, PARTITION) == again
    assert landing.read(again) == b"<old/>" and landing.read(newer) == b"<new/>"
    assert landing.is_whole(first) and landing.is_whole(page)
    assert landing.pages_landed_by(SOURCE, "2026-11-05", "run-1") == [page]
    assert landing.latest(SOURCE, "2026-11-06") is None
    frame = landing.keep_frame(page, {"rows": 1})
    assert landing.read_frame(frame) == {"rows": 1}
    landing.discard_frame(frame)

    # What the operator's S3 console shows: the layout of a directory, one blob per content,
    # a record per fetch, nothing else (no temporary objects, no frame left).
    keys = s3.buckets.objects("landing")
    digest = hashlib.sha256(b"<old/>").hexdigest()
    assert f"raw/cbr_daily_rates/2026-11-04/blobs/{digest}.bin" in keys
    assert len([k for k in keys if "/blobs/" in k]) == 3
    assert len([k for k in keys if "/fetches/" in k]) == 4
    assert len(keys) == 7


def test_a_reader_sees_an_object_whole_or_not_at_all(s3):
    """A reader polling a record while a writer replaces it, 8 MiB at a time: every read is
    one of the writes, whole. (A large object is read in ranges, each asking for the version
    the first one saw: one replaced in between is refused, ``FileExpired``, never mixed.)"""
    path = store_path(s3.bucket("landing")) / "cbr_daily_rates" / "record.bin"
    versions = [bytes([n]) * (8 << 20) for n in range(1, 5)]
    seen: list[bytes | None] = []
    refused: list[Exception] = []
    failed: list[Exception] = []
    writing = threading.Event()

    def read_while_written() -> None:
        while writing.is_set() or not seen:
            try:
                seen.append(path.read_bytes())
            except FileNotFoundError:
                seen.append(None)
            except FileExpired as changed:
                refused.append(changed)
            except Exception as error:  # any other failure: reported by the assertion
                failed.append(error)
                return
            time.sleep(0.01)  # moto serves from one process: leave the writer its share

    writing.set()
    reader = threading.Thread(target=read_while_written)
    reader.start()
    try:
        for content in versions:
            write_whole(path, content)
    finally:
        writing.clear()
        reader.join(60)
    assert not failed, failed
    assert [read for read in seen if read is not None], "the reader never read the record"
    assert all(read is None or read in versions for read in seen), {
        len(read) for read in seen if read is not None}
    assert path.read_bytes() == versions[-1]
    print(f"{len(seen)} reads whole or absent, {len(refused)} refused as replaced meanwhile")


@pytest.fixture
def restartable_s3(monkeypatch):
    """An S3 API server whose buckets outlive a stop and start, as a real store's do."""
    with s3_in_environment(monkeypatch, keeps_buckets_across_restarts=True) as server:
        yield server


def test_a_landing_store_outage_at_the_start_of_a_run_is_ridden_out(
    restartable_s3, sqlite_warehouse_url, standin_server, standin, tmp_path, cbr_source
):
    """The object store is away when a partition's run starts, and comes back once the run has
    waited on it: the fetch is retried as an outage, the run succeeds, the payload is in the
    bucket."""
    s3 = restartable_s3
    url = s3.bucket("landing")
    job = code_location_for(sqlite_warehouse_url, standin_server, tmp_path, [cbr_source],
                            landing=LandingStoreResource(base_dir=url)
                            ).resolve_job_def("cbr_daily_rates_job")
    s3.stop()
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as instance:
        back = _start_again_once(s3, lambda: _outage_retries(instance))
        result = run_partition(job, PARTITION, instance)
        back.join(PROCESS_START_MARGIN_SECONDS)
        assert result.success, step_failure_message(instance, result.run_id)
        retries = _outage_retries(instance)
    assert retries and {r["kind"] for r in retries} == {"object_store_unreachable"}, retries
    assert len(table_rows(sqlite_warehouse_url, "cbr_daily_rates")) == 12
    assert any("/fetches/" in key for key in s3.buckets.objects("landing"))


def test_an_op_output_store_outage_is_ridden_out_in_the_step(
    restartable_s3, sqlite_warehouse_url, standin_server, standin, tmp_path, cbr_source
):
    """The op outputs' bucket is away when the first step hands its output on, and back once
    the step has logged its wait: the step writes it then, and the run succeeds with every
    output in the bucket."""
    s3 = restartable_s3
    url = s3.bucket("outputs")
    job = code_location_for(sqlite_warehouse_url, standin_server, tmp_path, [cbr_source],
                            io_manager=OpOutputStore(base_dir=url + "/runs")
                            ).resolve_job_def("cbr_daily_rates_job")
    s3.stop()
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as instance:
        back = _start_again_once(s3, lambda: _ridden_out_warnings(instance))
        result = run_partition(job, PARTITION, instance)
        back.join(PROCESS_START_MARGIN_SECONDS)
        assert result.success, step_failure_message(instance, result.run_id)
        warnings = _ridden_out_warnings(instance)
    assert warnings and all("EndpointConnectionError" in w for w in warnings), warnings
    outputs = s3.buckets.objects("outputs", f"runs/{result.run_id}/")
    assert len(outputs) == 2, outputs  # the extract's and the transform's
    assert len(table_rows(sqlite_warehouse_url, "cbr_daily_rates")) == 12


def _start_again_once(s3, waited_on) -> threading.Thread:
    """A thread that starts the server again once ``waited_on()`` shows the run waiting on
    it."""
    def start_again() -> None:
        wait_until(waited_on, PROCESS_START_MARGIN_SECONDS, "the run waiting on the store")
        s3.start()

    thread = threading.Thread(target=start_again, daemon=True)
    thread.start()
    return thread


def _outage_retries(instance: DagsterInstance) -> list[dict]:
    """The retries the event log records as waits on a part being away."""
    retries = [record.event_log_entry.asset_observation.metadata.get(RETRY_METADATA_KEY)
               for record in instance.get_event_records(
                   EventRecordsFilter(DagsterEventType.ASSET_OBSERVATION))]
    return [retry.value for retry in retries if retry is not None and retry.value.get("outage")]


def _ridden_out_warnings(instance: DagsterInstance) -> list[str]:
    return [entry.user_message for record in instance.get_run_records()
            for entry in instance.all_logs(record.dagster_run.run_id)
            if "ridden out" in entry.user_message and entry.dagster_event is None]

