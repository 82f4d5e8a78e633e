"""The CBR precious-metal prices end to end: the stand-in -> a Dagster run -> the warehouse
(PostgreSQL and SQLite), and the operator's job list."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from click.testing import CliRunner
from dagster import AssetKey, DagsterInstance

from mostovik_pipelines.cli import main
from mostovik_pipelines.framework.spec import PartitionNotAvailable, TransformRequest
from mostovik_pipelines.sources.cbr_metal_prices import SOURCE, parse_metal_prices
from mostovik_pipelines.sources.cbr_metal_prices.standin import CbrMetalsStandin
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.runs import (
    load_metadata,
    run_partition,
    step_failure_message,
)
from mostovik_pipelines_tests.support.warehouse import physical_snapshot, table_rows

TABLE = "cbr_metal_prices"
WEDNESDAY = date(2026, 11, 4)
SATURDAY = date(2026, 11, 7)
ORDER = "price_date, metal_code"


def _request(content: bytes, day: date = WEDNESDAY,
             fetched_at: datetime = datetime(2026, 11, 20, tzinfo=UTC)) -> TransformRequest:
    return TransformRequest(TABLE, day.isoformat(), content, "application/xml", fetched_at)


@pytest.fixture
def job(warehouse_url, standin_server, standin, tmp_path):
    source = dataclasses.replace(SOURCE, extract_retry=FAST_RETRY, load_retry=FAST_RETRY)
    location = code_location_for(warehouse_url, standin_server, tmp_path, [source])
    return location.resolve_job_def("cbr_metal_prices_job")


def test_parses_windows_1251_with_a_decimal_comma_into_exact_prices():
    content = (
        '<?xml version="1.0" encoding="windows-1251"?><Metall FromDate="20261104" '
        'ToDate="20261104" name="Precious metals quotations"><Record Date="04.11.2026" '
        'Code="1"><Buy>5837,39</Buy><Sell>5837,39</Sell></Record><Record Date="04.11.2026" '
        'Code="2"><Buy>70,1</Buy><Sell>70,12</Sell></Record></Metall>').encode("windows-1251")
    parsed = parse_metal_prices(_request(content))
    assert parsed.rejected == []
    assert parsed.as_frame().to_dict("records") == [
        {"price_date": WEDNESDAY, "metal_code": 1, "buy": Decimal("5837.39"),
         "sell": Decimal("5837.39")},
        {"price_date": WEDNESDAY, "metal_code": 2, "buy": Decimal("70.1"),
         "sell": Decimal("70.12")},
    ]


def test_no_records_is_an_empty_day_off_and_not_available_yet_on_a_working_day():
    empty = CbrMetalsStandin().document(SATURDAY, SATURDAY)
    assert parse_metal_prices(_request(empty, SATURDAY)).as_frame().empty
    # A day off's own empty answer is the day's: no prices are set on it.
    assert parse_metal_prices(_request(
        empty, SATURDAY, fetched_at=datetime(2026, 11, 7, 15, tzinfo=UTC))).as_frame().empty
    # A working day's empty answer on the day itself: not published yet.
    tuesday = date(2026, 11, 10)
    standin = CbrMetalsStandin()
    standin.control("POST", "published_until", {}, {"date": "2026-11-09"})
    with pytest.raises(PartitionNotAvailable, match="no prices for 2026-11-10"):
        parse_metal_prices(_request(standin.document(tuesday, tuesday), tuesday,
                                    fetched_at=datetime(2026, 11, 10, 9, tzinfo=UTC)))


@pytest.mark.parametrize("today", [False, True], ids=["a past day", "the day itself"])
def test_a_renamed_record_element_is_a_change_of_shape_not_an_empty_day(
        job, instance, warehouse_url, standin, today):
    """The CBR renames ``<Record>``: every day reads as one without prices. Asked for a past
    day, the answer would load as an empty final day; asked on the day itself, as "not
    published yet". Either is a change of shape: the partition fails for good (it waits for an
    operator), its observation names the change, and nothing is loaded."""
    standin.control("cbr_metals", "record_element", {"name": "Rec"})
    day = SOURCE.partitions_def.get_partition_keys()[-1] if today else WEDNESDAY.isoformat()
    if today and date.fromisoformat(day).weekday() >= 5:
        pytest.skip("a weekend: the stand-in sets no prices today, renamed or not")
    if today:
        standin.control("cbr_metals", "published_until", {"date": day})
    result = run_partition(job, day, instance)
    assert not result.success
    message = step_failure_message(instance, result.run_id)
    assert "no Record records but Metall/Rec: not an empty period" in message, message
    assert table_rows(warehouse_url, TABLE) == []
    assert instance.get_materialized_partitions(AssetKey(TABLE)) == set()
    [observation] = instance.fetch_observations(AssetKey(TABLE), limit=1).records
    assert observation.partition_key == day
    assert "no Record records" in str(
        observation.asset_observation.metadata["source_shape_change"].value)


def test_a_working_day_loads_its_four_metals_and_a_rerun_changes_nothing(
        job, instance, warehouse_url):
    first = run_partition(job, WEDNESDAY.isoformat(), instance)
    assert first.success
    assert load_metadata(instance, first.run_id)["inserted"] == 4
    rows = table_rows(warehouse_url, TABLE)
    assert [(r["price_date"], r["metal_code"]) for r in rows] == [
        (WEDNESDAY, code) for code in (1, 2, 3, 4)]
    prices = dict(CbrMetalsStandin().records(WEDNESDAY))
    assert all(Decimal(str(r["buy"])) == Decimal(str(r["sell"])) == prices[r["metal_code"]]
               for r in rows)
    before = physical_snapshot(warehouse_url, TABLE, order_by=ORDER)

    second = run_partition(job, WEDNESDAY.isoformat(), instance)
    assert second.success
    figures = load_metadata(instance, second.run_id)
    assert (figures["inserted"], figures["updated"], figures["deleted"]) == (0, 0, 0)
    assert physical_snapshot(warehouse_url, TABLE, order_by=ORDER) == before


def test_a_day_without_records_completes_with_nothing_loaded(job, instance, warehouse_url):
    result = run_partition(job, SATURDAY.isoformat(), instance)
    assert result.success
    figures = load_metadata(instance, result.run_id)
    assert (figures["inserted"], figures["dagster/row_count"]) == (0, 0)
    assert table_rows(warehouse_url, TABLE) == []


def test_an_empty_answer_for_a_day_with_stored_prices_deletes_nothing(
        job, instance, warehouse_url, standin):
    """A day without records is legitimate (a holiday), but the CBR answering with none for a
    day whose prices it published is a glitch, not a withdrawal: the run fails naming the day
    and the stored prices stay."""
    assert run_partition(job, WEDNESDAY.isoformat(), instance).success
    before = physical_snapshot(warehouse_url, TABLE, order_by=ORDER)
    standin.serve_bytes(CbrMetalsStandin().document(SATURDAY, SATURDAY), route="cbr_metals")
    result = run_partition(job, WEDNESDAY.isoformat(), instance)
    assert not result.success
    message = step_failure_message(instance, result.run_id)
    assert "cbr_metal_prices [2026-11-04]" in message and "holds 4" in message, message
    assert physical_snapshot(warehouse_url, TABLE, order_by=ORDER) == before


def test_a_day_not_published_yet_waits_for_a_later_run(job, instance, warehouse_url, standin):
    standin.control("cbr_metals", "published_until", {"date": "2026-11-03"})
    today = SOURCE.partitions_def.get_partition_keys()[-1]
    result = run_partition(job, today, instance)
    assert result.success
    assert table_rows(warehouse_url, TABLE) == []
    assert instance.get_materialized_partitions(AssetKey(TABLE)) == set()


def test_its_runs_are_in_the_operators_job_list(pg_warehouse_url, standin_server, standin,
                                                tmp_path):
    home = local_dagster_home(tmp_path)
    source = dataclasses.replace(SOURCE, extract_retry=FAST_RETRY, load_retry=FAST_RETRY)
    job = code_location_for(pg_warehouse_url, standin_server, tmp_path,
                            [source]).resolve_job_def("cbr_metal_prices_job")
    with DagsterInstance.from_config(str(home)) as instance:
        run_id = run_partition(job, WEDNESDAY.isoformat(), instance).run_id
    listed = CliRunner().invoke(main, ["jobs", "list", "--source", TABLE, "--json"],
                                env={"DAGSTER_HOME": str(home)})
    assert listed.exit_code == 0, listed.output
    [listed_job] = json.loads(listed.output)
    assert (listed_job["run_id"], listed_job["job_type"], listed_job["period"],
            listed_job["status"]) == (run_id, "parser", "2026-11-04", "completed")

