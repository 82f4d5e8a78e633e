"""Retries against real failures: the stand-in's HTTP faults and a killed database backend."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import uuid

import psycopg
import pytest
from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    EventRecordsFilter,
)

from mostovik_pipelines.core.retries import RETRY_METADATA_KEY, RetryPolicy
from mostovik_pipelines.framework.load.lock import partition_lock_keys
from mostovik_pipelines.framework.quality.checks import partition_checks
from mostovik_pipelines.framework.spec import CheckRequest, CheckResult, PartitionCheck
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines.resources.op_outputs import OpOutputStore
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.support.disk import (
    fill,
    free,
    mount_small_disk,
    unmount_small_disk,
    why_no_small_disk,
)
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.postgres import (
    ThrowawayPostgres,
    backend_waiting_on_a_lock,
    dsn_of,
)
from mostovik_pipelines_tests.support.processes import run_environment, start_job_execute
from mostovik_pipelines_tests.support.runs import (
    load_metadata,
    run_partition,
    step_attempts,
    step_failure_message,
)
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until
from mostovik_pipelines_tests.support.warehouse import physical_snapshot, table_rows

PARTITION = "2026-11-04"
OUTAGE_SECONDS = 60


@pytest.fixture
def warehouse_url(pg_warehouse_url):
    """Retries are about a real server: these tests run on PostgreSQL."""
    return pg_warehouse_url


def test_two_503s_then_success_takes_three_extract_attempts_and_loads_once(
    cbr_job, instance, standin, warehouse_url
):
    standin.fault("status", status=503, times=2)
    result = run_partition(cbr_job, PARTITION, instance)
    assert result.success
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == 3
    assert step_attempts(instance, result.run_id, "load_cbr_daily_rates") == 1
    assert load_metadata(instance, result.run_id)["inserted"] == 12
    assert len(table_rows(warehouse_url, "cbr_daily_rates")) == 12


def test_429_with_retry_after_waits_as_long_as_the_source_asks(cbr_job, instance, standin):
    standin.fault("status", status=429, retry_after=2)
    result = run_partition(cbr_job, PARTITION, instance)
    assert result.success
    served = standin.requests("cbr")
    assert [r["status"] for r in served] == [429, 200]
    assert served[1]["at"] - served[0]["at"] >= 2.0


def test_a_source_that_stays_down_fails_after_the_configured_attempts(
    cbr_job, instance, standin
):
    standin.fault("status", status=503, times=-1)
    result = run_partition(cbr_job, PARTITION, instance)
    assert not result.success
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == 3
    message = step_failure_message(instance, result.run_id)
    assert "cbr_daily_rates [2026-11-04] extract: source unavailable after 3 attempts" in message
    assert "HTTP 503" in message


@pytest.mark.parametrize(
    ("fault", "options", "defect", "failing_step_attempts"),
    [
        ("status", {"status": 404}, "request rejected: SourceRequestRejected: HTTP 404",
         [1, 0, 0]),
        ("malformed", {}, "not well-formed XML", [1, 1, 0]),
        ("rename_element", {"element": "CharCode", "renamed_to": "Code"},
         "missing field Valute/CharCode", [1, 1, 0]),
    ],
)
def test_permanent_failures_take_one_attempt_and_keep_the_loaded_rows(
    cbr_job, instance, standin, warehouse_url, fault, options, defect, failing_step_attempts
):
    assert run_partition(cbr_job, PARTITION, instance).success
    before = physical_snapshot(warehouse_url, "cbr_daily_rates")

    standin.fault(fault, **options)
    result = run_partition(cbr_job, PARTITION, instance)
    assert not result.success
    assert [step_attempts(instance, result.run_id, op) for op in (
        "extract_cbr_daily_rates", "transform_cbr_daily_rates", "load_cbr_daily_rates"
    )] == failing_step_attempts
    message = step_failure_message(instance, result.run_id)
    assert "cbr_daily_rates [2026-11-04]" in message
    assert defect in message
    assert physical_snapshot(warehouse_url, "cbr_daily_rates") == before


def test_a_configuration_error_is_not_retried(
    warehouse_url, standin_server, standin, tmp_path, cbr_source, instance
):
    from mostovik_pipelines.resources import HttpSourceResource

    location = code_location_for(
        warehouse_url, standin_server, tmp_path, [cbr_source],
        cbr_daily_rates_source=HttpSourceResource(base_url="not a url"),
    )
    result = run_partition(location.resolve_job_def("cbr_daily_rates_job"), PARTITION, instance)
    assert not result.success
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == 1
    assert "configuration error" in step_failure_message(instance, result.run_id)


def test_a_load_whose_connection_is_killed_is_retried_to_an_exact_table(
    cbr_job, instance, standin, warehouse_url
):
    assert run_partition(cbr_job, PARTITION, instance).success
    standin.change_cbr_rates(PARTITION, set_values={"USD": "70,0000"}, remove=["EUR", "JPY"])

    # Hold the partition's lock so that the load stops inside its transaction, then kill it there.
    table_key, partition_key = partition_lock_keys("cbr_daily_rates", PARTITION)
    holder = psycopg.connect(dsn_of(warehouse_url), autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s, %s)", (table_key, partition_key))
    outcome = {}
    runner = threading.Thread(
        target=lambda: outcome.setdefault("result", run_partition(cbr_job, PARTITION, instance))
    )
    runner.start()
    waiting = backend_waiting_on_a_lock(holder, "%pg_advisory_xact_lock%")
    killed = waiting is not None and holder.execute(
        "SELECT pg_terminate_backend(%s)", (waiting,)).fetchone()[0]
    holder.execute("SELECT pg_advisory_unlock(%s, %s)", (table_key, partition_key))
    holder.close()
    runner.join(timeout=60)

    result = outcome["result"]
    assert killed
    assert result.success
    # Its connection lost: the partition's load transaction is made again in place, one wait
    # recorded on the partition, no second attempt of the step.
    assert step_attempts(instance, result.run_id, "load_cbr_daily_rates") == 1
    waits = [retry for retry in _retries(instance) if retry["op"] == "load"]
    assert waits and all(r["outage"] and r["kind"] == "database_connection_lost"
                         for r in waits), waits
    rows = table_rows(warehouse_url, "cbr_daily_rates")
    assert len(rows) == 10
    assert len({(r["partition_date"], r["char_code"]) for r in rows}) == 10
    assert next(r for r in rows if r["char_code"] == "USD")["value"] == 70


def test_retry_policy_backs_off_exponentially_with_bounded_jitter():
    policy = RetryPolicy(base_delay_seconds=1.0, max_delay_seconds=5.0, jitter=0.5)
    waits = [policy.wait_seconds(attempt) for attempt in range(1, 6)]
    for attempt, wait in enumerate(waits, 1):
        full = min(2 ** (attempt - 1), 5.0)
        assert full * 0.5 <= wait <= full
    assert policy.wait_seconds(1, retry_after=1000) == policy.retry_after_cap_seconds




def test_the_retry_budget_is_per_partition_in_a_ranged_run(cbr_job, instance, standin,
                                                          warehouse_url):
    """Three partitions failing twice each: six transient failures in one step, while each
    partition stays within its own three attempts."""
    days = ["2026-11-03", "2026-11-04", "2026-11-05"]
    for day in days:
        standin.fault("status", status=503, times=2,
                      match=f"date_req={day[8:]}/{day[5:7]}/{day[:4]}")
    result = cbr_job.execute_in_process(
        instance=instance, raise_on_error=False,
        tags={"dagster/asset_partition_range_start": days[0],
              "dagster/asset_partition_range_end": days[-1]})
    assert result.success, step_failure_message(instance, result.run_id)
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == 7
    retries = [r.event_log_entry.asset_observation for r in instance.get_records_for_run(
        result.run_id).records if r.event_log_entry.asset_observation is not None
        and "mostovik/retry" in r.event_log_entry.asset_observation.metadata]
    assert sorted((o.partition, o.metadata["mostovik/retry"].value["attempt"])
                  for o in retries) == [(d, n) for d in days for n in (1, 2)]
    assert len(table_rows(warehouse_url, "cbr_daily_rates")) == 36


@pytest.mark.parametrize(("header", "seconds"), [
    ("7", 7.0),
    ("Sun, 06 Nov 1994 08:49:37 GMT", 37.0),
    ("Sunday, 06-Nov-94 08:49:37 GMT", 37.0),
    ("Sun Nov  6 08:49:37 1994", 37.0),
    ("Sun, 06 Nov 1994 11:49:37 +0300", 37.0),
    ("Sun, 06 Nov 1994 08:49:37 UTC", 37.0),
    ("Sun, 06 Nov 1994 08:49:37", 37.0),
    ("Sun, 06 Nov 1994 08:48:00 GMT", 0.0),
    ("soon", None), ("-5", None), ("1.5", None), ("", None),
])
def test_retry_after_is_read_in_every_form_rfc_9110_allows(header, seconds):
    from datetime import UTC, datetime

    from mostovik_pipelines.resources.http import parse_retry_after

    assert parse_retry_after(header, now=datetime(1994, 11, 6, 8, 49, tzinfo=UTC)) == seconds


@pytest.mark.parametrize("header", ["Sun, 06 Nov 1994 08:49:37", "garbage", "1.5"])
def test_a_429_with_an_odd_retry_after_is_retried_with_backoff(cbr_job, instance, standin,
                                                                header):
    standin.fault("status", status=429, retry_after=header, match="date_req=04/11/2026")
    result = run_partition(cbr_job, PARTITION, instance)
    assert result.success, step_failure_message(instance, result.run_id)
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == 2


@pytest.fixture
def outage_warehouse():
    """A warehouse server of its own, so that stopping it disturbs no other test."""
    server = ThrowawayPostgres().start()
    try:
        migrate.upgrade(server.url())
        yield server
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.long_outage
def test_a_warehouse_outage_of_a_minute_at_the_start_of_a_run_is_ridden_out(
    outage_warehouse, standin_server, standin, tmp_path
):
    """The warehouse crashes (``pg_ctl -m immediate``) before a `dagster job execute` run of a
    partition and comes back once the run has ridden out 60 s of it (the promised bound): the run
    succeeds with the partition loaded once, each wait logged with its reason (a failover takes
    10 to 60 s; the load step's three attempts used to fail the run within 2 s)."""
    env = run_environment(tmp_path, outage_warehouse.url(), standin_server.cbr_url)
    outage_warehouse.pause()
    run = start_job_execute(PARTITION, env, tmp_path)
    instance = DagsterInstance.from_config(env["DAGSTER_HOME"])

    def ridden_out() -> float:
        assert run.poll() is None, f"the run ended during the outage:\n{run.stdout.read()[-3000:]}"
        waits = [retry["wait_seconds"] for retry in _retries(instance) if retry.get("outage")]
        return sum(waits) >= OUTAGE_SECONDS and sum(waits)
    wait_until(ridden_out, PROCESS_START_MARGIN_SECONDS + 3 * OUTAGE_SECONDS,
               "the run riding out the warehouse's outage")
    outage_warehouse.resume()
    output, _ = run.communicate(timeout=PROCESS_START_MARGIN_SECONDS + 120)
    assert run.returncode == 0, output[-3000:]

    [record] = instance.get_run_records()
    assert record.dagster_run.status == DagsterRunStatus.SUCCESS
    retries = _retries(instance)
    assert retries and all(r["kind"] == "database_connection_lost" for r in retries), retries
    assert len(table_rows(outage_warehouse.url(), "cbr_daily_rates")) == 12
    instance.dispose()


CHECK_CRASH_SECONDS = 3.0


def test_a_warehouse_crash_under_a_committed_partitions_checks_is_ridden_out(
    outage_warehouse, standin_server, standin, tmp_path, cbr_source, instance
):
    """The warehouse crashes just after a partition's load committed, while its checks run
    (a check of the source's own stops the server, as ``pg_ctl -m immediate`` does, and it is
    back 3 s later): the checks' statements and their new connection meet it, and the load
    step rides it out, evaluating the checks again once it answers. It used to fail the step at
    once (the checks' ``engine.connect()`` refused), or record a check that "could not run" as
    a failed blocking check."""
    crashed = threading.Event()

    def crash_once(request: CheckRequest) -> CheckResult:
        if not crashed.is_set():
            crashed.set()
            outage_warehouse.pause()
            threading.Timer(CHECK_CRASH_SECONDS, outage_warehouse.resume).start()
        return CheckResult(True, "the warehouse was crashed once, here")

    source = dataclasses.replace(cbr_source, checks=(
        *cbr_source.checks, PartitionCheck("crash_once", "crashes the warehouse", crash_once,
                                           blocking=False)))
    job = code_location_for(outage_warehouse.url(), standin_server, tmp_path,
                            [source]).resolve_job_def("cbr_daily_rates_job")
    result = run_partition(job, PARTITION, instance)

    assert crashed.is_set()
    assert result.success, step_failure_message(instance, result.run_id)
    assert step_attempts(instance, result.run_id, "load_cbr_daily_rates") == 1
    evaluations = [record.event_log_entry.dagster_event.event_specific_data
                   for record in instance.get_records_for_run(
                       result.run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records]
    names = [evaluation.check_name for evaluation in evaluations]
    assert sorted(names) == sorted({check.name for check in partition_checks(source)})
    assert all(evaluation.passed for evaluation in evaluations), evaluations
    waits = [retry for retry in _retries(instance) if retry["op"] == "check"]
    assert waits and all(r["outage"] for r in waits), waits
    assert len(table_rows(outage_warehouse.url(), "cbr_daily_rates")) == 12


def _retries(instance: DagsterInstance) -> list[dict]:
    return [record.event_log_entry.asset_observation.metadata[RETRY_METADATA_KEY].value
            for record in instance.get_event_records(EventRecordsFilter(
                DagsterEventType.ASSET_OBSERVATION))
            if RETRY_METADATA_KEY in record.event_log_entry.asset_observation.metadata]


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB file system of its own (tmpfs), for the landing store to fill."""
    if reason := why_no_small_disk():
        pytest.skip(reason)
    mount_point = tmp_path / "small_disk"
    try:
        mount_small_disk(mount_point)
    except OSError as error:
        pytest.skip(str(error))
    try:
        yield mount_point
    finally:
        unmount_small_disk(mount_point)


def _cbr_job_landing_in(landing, warehouse_url, standin_server, work_dir, cbr_source):
    """The CBR job with its landing store in ``landing``."""
    return code_location_for(warehouse_url, standin_server, work_dir, [cbr_source],
                             landing=LandingStoreResource(base_dir=str(landing))
                             ).resolve_job_def("cbr_daily_rates_job")


def test_a_full_landing_disk_fails_the_fetch_as_transient_naming_the_path_and_a_rerun_loads(
    small_disk, warehouse_url, standin_server, standin, tmp_path, cbr_source, instance
):
    landing = small_disk / "landing"
    job = _cbr_job_landing_in(landing, warehouse_url, standin_server, tmp_path, cbr_source)
    fill(small_disk)

    result = run_partition(job, PARTITION, instance)
    assert not result.success
    message = step_failure_message(instance, result.run_id)
    assert "no space left on the device" in message and str(landing) in message, message
    # Transient: space can come back, so the fetch was tried as often as the policy says.
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == (
        cbr_source.extract_retry.max_attempts)
    # Nothing half-written a later run would trust: no temporary file, no fetch recorded.
    assert [path for path in landing.rglob("*") if path.is_file()
            and (path.name.startswith(".tmp-") or path.parent.name == "fetches")] == []
    assert table_rows(warehouse_url, "cbr_daily_rates") == []

    free(small_disk)
    rerun = run_partition(job, PARTITION, instance)
    assert rerun.success
    assert len(table_rows(warehouse_url, "cbr_daily_rates")) == 12


def test_a_read_only_landing_disk_fails_the_fetch_at_once_naming_the_path(
    small_disk, warehouse_url, standin_server, standin, tmp_path, cbr_source, instance
):
    landing = small_disk / "landing"
    job = _cbr_job_landing_in(landing, warehouse_url, standin_server, tmp_path, cbr_source)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)

    result = run_partition(job, PARTITION, instance)
    assert not result.success
    message = step_failure_message(instance, result.run_id)
    assert "read-only file system" in message and str(landing) in message, message
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == 1
    assert table_rows(warehouse_url, "cbr_daily_rates") == []


def _cbr_job_with_op_outputs_in(storage, warehouse_url, standin_server, work_dir, cbr_source,
                                delay_seconds: float = 0.05):
    """The CBR job with its op outputs in ``storage``, retried after ``delay_seconds`` (at
    least half of it, with jitter)."""
    return code_location_for(warehouse_url, standin_server, work_dir, [cbr_source],
                             io_manager=OpOutputStore(base_dir=str(storage), retry_attempts=3,
                                                      retry_base_delay_seconds=delay_seconds)
                             ).resolve_job_def("cbr_daily_rates_job")


def test_a_full_op_output_disk_is_retried_as_transient_and_rides_out_space_coming_back(
    small_disk, warehouse_url, standin_server, standin, tmp_path, cbr_source, instance
):
    storage = small_disk / "storage"
    job = _cbr_job_with_op_outputs_in(storage, warehouse_url, standin_server, tmp_path,
                                      cbr_source)
    fill(small_disk)

    result = run_partition(job, PARTITION, instance)
    assert not result.success
    message = step_failure_message(instance, result.run_id)
    assert "no space left on the device" in message and str(storage) in message, message
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == 3
    # A pickle cut short is removed: nothing half-written for a re-execution to read.
    assert [path for path in storage.rglob("*") if path.is_file()] == []

    # Space comes back while the step waits (2-4 s) to retry: the run rides it out.
    def free_after_the_first_retry() -> None:
        wait_until(lambda: instance.get_records_for_run(
            run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY).records,
            PROCESS_START_MARGIN_SECONDS, "the step's first retry", poll=0.02)
        free(small_disk)

    run_id = str(uuid.uuid4())
    patient = _cbr_job_with_op_outputs_in(storage, warehouse_url, standin_server, tmp_path,
                                          cbr_source, delay_seconds=4.0)
    freeing = threading.Thread(target=free_after_the_first_retry)
    freeing.start()
    retried = run_partition(patient, PARTITION, instance, run_id=run_id)
    freeing.join()
    assert retried.success
    assert len(table_rows(warehouse_url, "cbr_daily_rates")) == 12


def test_a_read_only_op_output_disk_fails_the_step_at_once_naming_the_path(
    small_disk, warehouse_url, standin_server, standin, tmp_path, cbr_source, instance
):
    storage = small_disk / "storage"
    storage.mkdir()
    job = _cbr_job_with_op_outputs_in(storage, warehouse_url, standin_server, tmp_path,
                                      cbr_source)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)

    result = run_partition(job, PARTITION, instance)
    assert not result.success
    message = step_failure_message(instance, result.run_id)
    assert "read-only file system" in message and str(storage) in message, message
    assert step_attempts(instance, result.run_id, "extract_cbr_daily_rates") == 1
