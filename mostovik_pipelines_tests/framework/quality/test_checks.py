"""Asset checks: a result per check on every partition a run loads (ranged runs too), the
per-partition metadata the UI plots, what each check finds in a broken table, and what a failed
blocking check does to the job."""

from __future__ import annotations

import dataclasses
from datetime import UTC, date, datetime, timedelta

import pandas as pd
import pytest
from dagster import AssetCheckSeverity, DagsterEventType
from sqlalchemy import Column, Date, Integer, MetaData, String, Table, UniqueConstraint, insert

from mostovik_pipelines.framework.automation.partition_states import Outcome, partition_states
from mostovik_pipelines.framework.quality.checks import evaluate_partition, partition_checks
from mostovik_pipelines.framework.quality.quarantine import replace_quarantine
from mostovik_pipelines.framework.spec import CheckResult, PartitionCheck, RejectedRow
from mostovik_pipelines.platform.tracking import JobStatus, load_job
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.sources import ALL_SOURCES, cbr_daily_rates, erp_work_orders
from mostovik_pipelines.warehouse.schema import BOOKKEEPING_COLUMNS
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.runs import load_metadata, run_partition, step_failure_message

PARTITION = "2026-11-04"
CBR_CHECKS = {"natural_key_unique", "rows_in_partition", "quarantine_share", "source_shape",
              "currencies_present_and_positive"}


@pytest.fixture
def sqlite_cbr_job(sqlite_warehouse_url, standin_server, standin, tmp_path, cbr_source):
    """The CBR job on SQLite: what the checks record does not depend on the backend (the first
    test runs them on both)."""
    return code_location_for(sqlite_warehouse_url, standin_server, tmp_path,
                             [cbr_source]).resolve_job_def("cbr_daily_rates_job")


def _evaluations(instance, run_id: str) -> dict[tuple[str, str], object]:
    records = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records
    evaluations = {}
    for record in records:
        evaluation = record.event_log_entry.dagster_event.event_specific_data
        key = (evaluation.check_name, evaluation.partition)
        assert key not in evaluations, f"two results for {key}"
        evaluations[key] = evaluation
    return evaluations


def test_a_loaded_partition_has_every_check_passed_and_metadata_to_plot(
    cbr_job, instance
):
    result = run_partition(cbr_job, PARTITION, instance)
    assert result.success
    evaluations = _evaluations(instance, result.run_id)
    assert set(evaluations) == {(name, PARTITION) for name in CBR_CHECKS}
    assert all(e.passed for e in evaluations.values()), evaluations
    # Each result names the materialisation it checked, this run's (a private Dagster type,
    # AssetCheckEvaluationTargetMaterializationData: what makes the UI count it as current).
    [materialization] = instance.get_records_for_run(
        result.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    assert {(e.target_materialization_data.run_id, e.target_materialization_data.storage_id)
            for e in evaluations.values()} == {(result.run_id, materialization.storage_id)}
    metadata = load_metadata(instance, result.run_id)
    assert metadata["dagster/row_count"] == 12 and metadata["inserted"] == 12
    assert metadata["duration_seconds"] > 0
    assert metadata["payload_bytes"] > 1000
    assert len(metadata["content_hash"]) == 64
    preview = metadata["preview"].splitlines()
    assert preview[0].startswith("| partition_date | rate_date | cbr_id |")
    assert len(preview) == 2 + 5


def test_a_ranged_run_records_every_check_on_every_partition(sqlite_cbr_job, instance):
    result = sqlite_cbr_job.execute_in_process(instance=instance, raise_on_error=False, tags={
        "dagster/asset_partition_range_start": "2026-11-02",
        "dagster/asset_partition_range_end": "2026-11-04"})
    assert result.success
    evaluations = _evaluations(instance, result.run_id)
    assert set(evaluations) == {(name, day) for name in CBR_CHECKS
                                for day in ("2026-11-02", "2026-11-03", "2026-11-04")}
    assert all(e.passed for e in evaluations.values())


def test_a_missing_expected_currency_warns_and_the_job_stays_partial(
    sqlite_cbr_job, instance, standin
):
    standin.change_cbr_rates(PARTITION, set_values={"USD": "n/a"})
    result = run_partition(sqlite_cbr_job, PARTITION, instance)
    assert result.success
    currencies = _evaluations(instance, result.run_id)[
        ("currencies_present_and_positive", PARTITION)]
    assert not currencies.passed and currencies.severity is AssetCheckSeverity.WARN
    assert currencies.description == "expected currencies missing: USD"
    assert load_job(instance, result.run_id, ALL_SOURCES).status is JobStatus.PARTIAL


@pytest.mark.parametrize("ranged", [False, True])
def test_a_failed_blocking_check_fails_its_partition_after_the_load(
    sqlite_warehouse_url, standin_server, standin, tmp_path, instance, cbr_source, ranged
):
    broken = dataclasses.replace(cbr_source, checks=(PartitionCheck(
        "never_on_the_fourth", "fails on 2026-11-04",
        lambda request: CheckResult(request.partition_key != PARTITION, "the fourth")),))
    job = code_location_for(sqlite_warehouse_url, standin_server, tmp_path,
                            [broken]).resolve_job_def("cbr_daily_rates_job")
    tags = ({"dagster/asset_partition_range_start": "2026-11-03",
             "dagster/asset_partition_range_end": PARTITION} if ranged
            else {"dagster/partition": PARTITION})
    result = job.execute_in_process(instance=instance, raise_on_error=False, tags=tags)
    assert not result.success
    evaluations = _evaluations(instance, result.run_id)
    assert not evaluations[("never_on_the_fourth", PARTITION)].passed
    message = step_failure_message(instance, result.run_id)
    assert f"cbr_daily_rates [{PARTITION}] check: check failed" in message
    assert "never_on_the_fourth: the fourth" in message
    materialized = {r.event_log_entry.asset_materialization.partition for r in
                    instance.get_records_for_run(
                        result.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records}
    # The load committed and says so; the job fails and names the check.
    assert materialized == ({"2026-11-03", PARTITION} if ranged else {PARTITION})
    assert instance.get_run_by_id(result.run_id).tags["mostovik/status"] == "failed"
    # Loaded, and yet not final: it waits for an operator like a permanent failure (nothing
    # asks for it again, and its period's deadline stays red).
    states = partition_states(instance, broken, ["2026-11-03", PARTITION],
                              datetime.now(UTC) - timedelta(days=1))
    assert states[PARTITION].loaded and not states[PARTITION].final
    assert states[PARTITION].latest_outcome is Outcome.FAILED_PERMANENTLY
    assert states[PARTITION].waiting_for_operator
    if ranged:
        assert states["2026-11-03"].final and not states["2026-11-03"].waiting_for_operator


# --- what the framework's checks find, on a table they can see broken ---------------------


@pytest.fixture
def loose_rates(sqlite_warehouse_url):
    """A rates table whose unique constraint went missing in the database, and the CBR source
    on it."""
    columns = ("partition_date", "char_code", "nominal", *BOOKKEEPING_COLUMNS)
    table = Table(
        "loose_rates", MetaData(),
        Column("partition_date", Date), Column("char_code", String(3)),
        Column("nominal", Integer), *(Column(name, String(64)) for name in BOOKKEEPING_COLUMNS),
        UniqueConstraint("partition_date", "char_code"))
    engine = warehouse_engine(sqlite_warehouse_url)
    with engine.begin() as connection:
        connection.exec_driver_sql(f"CREATE TABLE loose_rates ({', '.join(columns)})")
    return engine, table, dataclasses.replace(cbr_daily_rates.SOURCE, table=table, checks=())


def _results(engine, spec, key, received=None, received_rows=12, loaded=None):
    received = received if received is not None else pd.DataFrame(columns=spec.natural_key)
    loaded = loaded if loaded is not None else [spec.load_target.partition_value(key)]
    return {e.check_name: e for e in evaluate_partition(engine, spec, key, "run-1", received,
                                                         received_rows, loaded)}


def test_a_key_stored_twice_fails_natural_key_unique(loose_rates):
    engine, table, spec = loose_rates
    row = {"partition_date": date(2026, 11, 4), "char_code": "USD", "nominal": 1,
           "changed_by_run": "run-1"}
    with engine.begin() as connection:
        connection.execute(insert(table), [row, row, {**row, "char_code": "EUR"}])
    unique = _results(engine, spec, PARTITION)["natural_key_unique"]
    assert not unique.passed and unique.blocking
    assert unique.metadata["duplicated_keys"].value == 1
    assert "| 2026-11-04 | USD | 2 |" in unique.metadata["sample"].value


def test_a_row_the_run_wrote_outside_its_partitions_fails_rows_in_partition(loose_rates):
    engine, table, spec = loose_rates
    with engine.begin() as connection:
        connection.execute(insert(table), [
            {"partition_date": date(2026, 11, 4), "char_code": "USD", "changed_by_run": "run-1"},
            {"partition_date": date(2026, 11, 9), "char_code": "EUR", "changed_by_run": "run-1"},
            {"partition_date": date(2026, 11, 8), "char_code": "EUR", "changed_by_run": "other"},
        ])
    inside = _results(engine, spec, PARTITION)["rows_in_partition"]
    assert not inside.passed and inside.metadata["rows_outside"].value == 1
    assert "2026-11-09" in inside.metadata["sample"].value
    later = _results(engine, spec, "2026-11-09", loaded=[date(2026, 11, 4), date(2026, 11, 9)])
    assert later["rows_in_partition"].passed


def test_a_quarantine_above_the_threshold_warns_without_blocking(loose_rates):
    engine, _, spec = loose_rates
    replace_quarantine(engine, spec.name, PARTITION, "run-1",
                       [RejectedRow(n, "<Valute/>", "unreadable") for n in (1, 2)])
    share = _results(engine, spec, PARTITION, received_rows=12)["quarantine_share"]
    assert not share.passed and share.severity is AssetCheckSeverity.WARN
    assert not share.blocking
    assert share.description == "2 of 12 rows quarantined: 16.7%, above the source's 10%"


def test_a_version_stored_lower_than_received_fails_version_never_goes_down(warehouse_url):
    spec = erp_work_orders.SOURCE
    assert "version_never_goes_down" in {check.name for check in partition_checks(spec)}
    engine = warehouse_engine(warehouse_url)
    table = spec.table
    stored = {"object_code": "M-1", "title": "t", "status": "done", "amount": "1",
              "updated_at": pd.Timestamp("2026-11-04T10:00:00Z"), "deleted": False,
              "window_date": date(2026, 11, 4), "loaded_by_run": "run-1",
              "loaded_at": pd.Timestamp.now(tz="UTC"), "changed_by_run": "run-1",
              "changed_at": pd.Timestamp.now(tz="UTC")}
    with engine.begin() as connection:
        connection.execute(insert(table), [{**stored, "id": "A", "version": 5},
                                           {**stored, "id": "B", "version": 9}])
    # A received twice (6, then 7): its newest version is what the table must hold at least.
    received = pd.DataFrame({"id": ["A", "B", "A"], "version": [6, 7, 7]})
    version = _results(engine, spec, PARTITION, received=received)["version_never_goes_down"]
    assert not version.passed and version.blocking
    assert version.metadata["versions_gone_down"].value == 1
    assert "| A | 5 | 7 |" in version.metadata["sample"].value


def test_natural_key_unique_names_the_unique_index_and_counts_without_it(pg_warehouse_url):
    """On PostgreSQL the unique index on the natural key is the proof; if it is gone, the check
    counts the partition's keys and finds the one stored twice."""
    spec = erp_work_orders.SOURCE
    engine = warehouse_engine(pg_warehouse_url)
    stored = {"object_code": "M-1", "title": "t", "status": "done", "amount": "1",
              "updated_at": pd.Timestamp("2026-11-04T10:00:00Z"), "deleted": False,
              "window_date": date(2026, 11, 4), "version": 1, "loaded_by_run": "run-1",
              "changed_by_run": "run-1"}
    with engine.begin() as connection:
        connection.execute(insert(spec.table), [{**stored, "id": "A"}, {**stored, "id": "B"}])
    unique = _results(engine, spec, PARTITION)["natural_key_unique"]
    assert unique.passed
    assert unique.metadata["enforced_by"].value == "uq_erp_work_orders_natural_key"

    with engine.begin() as connection:
        connection.exec_driver_sql(
            "ALTER TABLE erp_work_orders DROP CONSTRAINT uq_erp_work_orders_natural_key")
        connection.execute(insert(spec.table), [{**stored, "id": "A"}])
    unique = _results(engine, spec, PARTITION)["natural_key_unique"]
    assert not unique.passed and "enforced_by" not in unique.metadata
    assert unique.metadata["duplicated_keys"].value == 1


def test_rows_in_partition_reads_the_rows_its_load_wrote_since_it_began(pg_warehouse_url):
    """On PostgreSQL a partition loaded in one transaction is checked by the rows the run wrote
    since that transaction began (the index on changed_by_run and changed_at reads only those):
    a row written then outside the partition fails it, the run's earlier partitions' rows do
    not."""
    from mostovik_pipelines.framework.load.partition import load_partition
    from mostovik_pipelines_tests.framework.load.test_ledger import operator_sql
    from mostovik_pipelines_tests.framework.load.test_partition import rates

    spec, engine = cbr_daily_rates.SOURCE, warehouse_engine(pg_warehouse_url)
    earlier = load_partition(engine, spec.load_target, rates(date(2026, 11, 3)), "2026-11-03",
                             "run-1")
    loaded = load_partition(engine, spec.load_target, rates(date(2026, 11, 4)), PARTITION,
                            "run-1")
    assert earlier.loaded_at < loaded.loaded_at

    def rows_in_partition():
        return {e.check_name: e for e in evaluate_partition(
            engine, spec, PARTITION, "run-1", pd.DataFrame(columns=spec.natural_key), 3, [],
            written_since=loaded.loaded_at)}["rows_in_partition"]

    assert rows_in_partition().passed  # the loaded list is not read: the earlier day is not stray
    operator_sql(pg_warehouse_url, "UPDATE cbr_daily_rates SET partition_date = '2026-11-09', "
                                   "changed_at = now() WHERE char_code = 'USD' "
                                   "AND partition_date = '2026-11-04'")
    stray = rows_in_partition()
    assert not stray.passed and stray.metadata["rows_outside"].value == 1
    assert "2026-11-09" in stray.metadata["sample"].value
