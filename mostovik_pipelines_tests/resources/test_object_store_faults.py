"""The object store's faults as the real S3 client meets them: an S3 API server (moto's) behind a
front that refuses connections, throttles (``503 SlowDown``), stops answering (the client's read
times out), vanishes mid-transfer (an answer cut half way, the connection reset) or denies the key
(``403``) (:mod:`~mostovik_pipelines_tests.support.object_store_front`). What s3fs and botocore
raise, after their own retries, is classified by the project's one classifier: each outage is
ridden out by a run within its budget, and a refusal fails the step at once, loading nothing.
"""

from __future__ import annotations

import threading
import time

import pytest
from dagster import DagsterEventType, DagsterInstance, EventRecordsFilter
from s3fs import S3FileSystem

from mostovik_pipelines.core.errors import classify
from mostovik_pipelines.core.retries import RETRY_METADATA_KEY
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines.resources.op_outputs import OpOutputStore
from mostovik_pipelines.resources.stores import OBJECT_STORE_OPTIONS, store_path, write_whole
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.object_store import why_no_s3_api
from mostovik_pipelines_tests.support.object_store_front import (
    DENYING,
    HANGING,
    REFUSING,
    THROTTLING,
    VANISHING,
    S3Front,
)
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.runs import run_partition, step_failure_message
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until
from mostovik_pipelines_tests.support.warehouse import table_rows

PARTITION = "2026-11-04"
RATES = 12
HANG_SECONDS = 20.0
"""How long the store stops answering in the run's test: longer than the client's read timeout
(15 s), so a request of the run does time out."""


@pytest.fixture
def front(monkeypatch):
    if reason := why_no_s3_api():
        pytest.skip(reason)
    server = S3Front().start()
    for name, value in server.environment.items():
        monkeypatch.setenv(name, value)
    S3FileSystem.clear_instance_cache()
    try:
        yield server
    finally:
        server.close()
        S3FileSystem.clear_instance_cache()


def _failure_of(call) -> BaseException:
    try:
        call()
    except Exception as error:  # what the client raised, whatever it is
        return error
    raise AssertionError("the call passed through the fault")


@pytest.mark.parametrize("state", [REFUSING, THROTTLING, VANISHING])
def test_an_outage_of_the_store_is_what_the_client_raises_classified_as_an_outage(front, state):
    """Refused, throttled, cut mid-transfer: the error s3fs raises once its own retries are
    spent is an outage of the object store, ridden out by the step."""
    path = store_path(front.bucket("faults") + "/payload.bin")
    write_whole(path, b"x" * 100_000)
    front.set(state)
    error = _failure_of(path.read_bytes)
    front.up()
    verdict = classify(error)
    assert (verdict.transient, verdict.outage, verdict.kind) == (
        True, True, "object_store_unreachable"), (type(error), error, verdict)
    assert state == REFUSING or front.requests.get(state), front.requests  # refused: unseen
    assert path.read_bytes() == b"x" * 100_000


def test_a_store_that_stops_answering_times_the_client_out_as_an_outage(front):
    """A store that accepts and never answers: the client's read timeout, raised by the real
    client (here with a 1 s timeout and no retries of its own, not the 15 s and five tries the
    stores use), is an outage."""
    front.bucket("faults")
    client = S3FileSystem(**OBJECT_STORE_OPTIONS, skip_instance_cache=True,
                          config_kwargs={"read_timeout": 1, "retries": {"max_attempts": 1}})
    client.retries = 1
    front.set(HANGING)
    error = _failure_of(lambda: client.cat_file("faults/absent.bin"))
    front.up()
    verdict = classify(error)
    assert (verdict.transient, verdict.outage, verdict.kind) == (
        True, True, "object_store_unreachable"), (type(error), error, verdict)


def test_a_store_that_denies_the_key_is_a_refusal_not_an_outage(front):
    path = store_path(front.bucket("faults") + "/payload.bin")
    write_whole(path, b"x")
    front.set(DENYING)
    error = _failure_of(path.read_bytes)
    front.up()
    verdict = classify(error)
    assert not verdict.transient and not verdict.outage, (type(error), error, verdict)


def _job(front: S3Front, warehouse_url, standin_server, tmp_path, cbr_source):
    landing = front.bucket("landing")
    outputs = front.bucket("outputs")
    return code_location_for(warehouse_url, standin_server, tmp_path, [cbr_source],
                             landing=LandingStoreResource(base_dir=landing + "/raw"),
                             io_manager=OpOutputStore(base_dir=outputs + "/runs")
                             ).resolve_job_def("cbr_daily_rates_job")


def _outage_retries(instance: DagsterInstance) -> list[dict]:
    retries = [record.event_log_entry.asset_observation.metadata.get(RETRY_METADATA_KEY)
               for record in instance.get_event_records(
                   EventRecordsFilter(DagsterEventType.ASSET_OBSERVATION))]
    return [retry.value for retry in retries if retry is not None and retry.value.get("outage")]


@pytest.mark.parametrize("state", [THROTTLING, VANISHING, HANGING])
def test_a_run_rides_out_each_outage_of_the_store(
    front, state, sqlite_warehouse_url, standin_server, standin, tmp_path, cbr_source
):
    """The store fails as ``state`` when the run starts, and comes back once the run waited
    on it (a retry recorded as an outage), or, for a store that stops answering, after
    :data:`HANG_SECONDS`: the run succeeds, the partition loaded once. (A store refusing
    connections: ``test_stores_on_s3.py``'s outages.)"""
    job = _job(front, sqlite_warehouse_url, standin_server, tmp_path, cbr_source)
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as instance:
        def store_back() -> None:
            if state == HANGING:
                time.sleep(HANG_SECONDS)
            else:
                wait_until(lambda: _outage_retries(instance), PROCESS_START_MARGIN_SECONDS,
                           "the run waiting on the store")
            front.up()

        front.set(state)
        back = threading.Thread(target=store_back, daemon=True)
        back.start()
        result = run_partition(job, PARTITION, instance)
        back.join(PROCESS_START_MARGIN_SECONDS)
        assert result.success, step_failure_message(instance, result.run_id)
        retries = _outage_retries(instance)
    assert state == REFUSING or front.requests.get(state), front.requests
    if state != HANGING:  # the client's own read waits out a short hang
        assert {r["kind"] for r in retries} == {"object_store_unreachable"}, retries
    assert len(table_rows(sqlite_warehouse_url, "cbr_daily_rates")) == RATES


def test_a_run_against_a_store_that_denies_the_key_fails_at_once_loading_nothing(
    front, sqlite_warehouse_url, standin_server, standin, tmp_path, cbr_source
):
    job = _job(front, sqlite_warehouse_url, standin_server, tmp_path, cbr_source)
    front.set(DENYING)
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as instance:
        started = time.monotonic()
        result = run_partition(job, PARTITION, instance)
        elapsed = time.monotonic() - started
        assert not result.success
        failures = instance.get_records_for_run(
            result.run_id, of_type=DagsterEventType.STEP_FAILURE).records
        assert not _outage_retries(instance)
    assert len(failures) == 1, "a refusal is one attempt"
    error = failures[0].event_log_entry.dagster_event.step_failure_data.error
    assert "Access Denied" in error.to_string(), error.to_string()
    assert elapsed < 60, f"{elapsed:.0f} s: a refusal is not waited on"
    assert table_rows(sqlite_warehouse_url, "cbr_daily_rates") == []
