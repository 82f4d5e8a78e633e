"""The CBR daily rates source end to end: stand-in HTTP server -> Dagster run -> warehouse."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from mostovik_pipelines.core.errors import SourceContractError
from mostovik_pipelines.framework.spec import PartitionNotAvailable, TransformRequest
from mostovik_pipelines.sources.cbr_daily_rates import parse_daily_rates
from mostovik_pipelines.sources.cbr_daily_rates.standin import CbrStandin
from mostovik_pipelines_tests.support.runs import load_metadata, run_partition
from mostovik_pipelines_tests.support.warehouse import physical_snapshot, table_rows

PARTITION = "2026-11-02"  # a Monday: the CBR answers with Saturday's rates


def _request(content: bytes, partition: str = PARTITION,
             fetched_at: datetime = datetime(2026, 11, 20, tzinfo=UTC)) -> TransformRequest:
    return TransformRequest("cbr_daily_rates", partition, content, "application/xml", fetched_at)


def test_parses_windows_1251_with_decimal_comma_and_keeps_both_dates():
    parsed = parse_daily_rates(_request(CbrStandin().document(date(2026, 11, 2))))
    assert parsed.rejected == []
    frame = parsed.as_frame()
    usd = frame.set_index("char_code").loc["USD"]
    assert usd["partition_date"] == date(2026, 11, 2)
    assert usd["rate_date"] == date(2026, 10, 31)
    assert usd["name"] == "Доллар США"
    assert isinstance(usd["value"], Decimal)
    assert usd["value"].as_tuple().exponent == -4


def test_unit_rate_is_value_per_nominal_when_vunitrate_is_absent():
    frame = parse_daily_rates(
        _request(CbrStandin().document(date(2021, 3, 3)), "2021-03-03")).as_frame()
    jpy = frame.set_index("char_code").loc["JPY"]
    assert jpy["nominal"] == 100
    assert jpy["unit_rate"] == (jpy["value"] / 100).quantize(Decimal("0.00000001"))


def test_a_date_not_published_yet_is_not_available_rather_than_an_error():
    standin = CbrStandin()
    standin.set_published_until("2026-11-20")
    content = standin.document(date(2026, 11, 21))
    with pytest.raises(PartitionNotAvailable, match="2026-11-20"):
        parse_daily_rates(_request(content, "2026-11-21"))


@pytest.mark.parametrize(
    ("content", "error", "message"),
    [
        (b"<ValCurs Date=\"02.11.2026\"><Valute", SourceContractError, "not well-formed"),
        (b"<html><body>Maintenance</body></html>", SourceContractError, "root element is <html>"),
        (b"<ValCurs Date=\"31.10.2026\"></ValCurs>", SourceContractError, "no <Valute>"),
        (b"<ValCurs Date=\"2026-10-31\"></ValCurs>", SourceContractError, "not DD.MM.YYYY"),
        (b"<!DOCTYPE x [<!ENTITY a \"b\">]><ValCurs/>", SourceContractError, "DTD"),
    ],
)
def test_defects_are_named(content, error, message):
    with pytest.raises(error, match=message):
        parse_daily_rates(_request(content))


GOOD_VALUTE = (b"<Valute ID=\"R01235\"><NumCode>840</NumCode><CharCode>USD</CharCode>"
               b"<Nominal>1</Nominal><Name>x</Name><Value>92,5000</Value></Valute>")


@pytest.mark.parametrize(
    ("bad_valute", "reason"),
    [
        (b"<Valute ID=\"R1\"><NumCode>978</NumCode><CharCode>EUR</CharCode><Nominal>1</Nominal>"
         b"<Name>x</Name><Rate>1,0</Rate></Valute>", "has no <Value>"),
        (b"<Valute ID=\"R1\"><NumCode>978</NumCode><CharCode>EUR</CharCode><Nominal>1</Nominal>"
         b"<Name>x</Name><Value>abc</Value></Valute>", "Value 'abc' is not a decimal"),
        (b"<Valute ID=\"R1\"><NumCode>978</NumCode><CharCode>EUR</CharCode><Nominal>0</Nominal>"
         b"<Name>x</Name><Value>1,0</Value></Valute>", "Nominal '0' is not a positive integer"),
    ],
)
def test_an_unreadable_currency_is_rejected_with_its_reason(bad_valute, reason):
    content = b"<ValCurs Date=\"31.10.2026\">" + GOOD_VALUTE + bad_valute + b"</ValCurs>"
    parsed = parse_daily_rates(_request(content))
    assert list(parsed.as_frame()["char_code"]) == ["USD"]
    [rejected] = parsed.rejected
    assert rejected.row_number == 2
    assert reason in rejected.reason
    assert "<Valute" in rejected.raw


def test_materialising_a_partition_twice_leaves_the_table_byte_for_byte_identical(
    cbr_job, instance, warehouse_url
):
    first = run_partition(cbr_job, PARTITION, instance)
    assert first.success
    assert load_metadata(instance, first.run_id)["inserted"] == 12
    before = physical_snapshot(warehouse_url, "cbr_daily_rates")

    second = run_partition(cbr_job, PARTITION, instance)
    assert second.success
    figures = load_metadata(instance, second.run_id)
    assert (figures["inserted"], figures["updated"], figures["deleted"]) == (0, 0, 0)
    assert figures["unchanged"] == 12
    assert figures["dagster/row_count"] == 12
    assert physical_snapshot(warehouse_url, "cbr_daily_rates") == before


def test_a_source_change_is_reflected_exactly(cbr_job, instance, warehouse_url, standin):
    other_partition = "2026-11-03"
    assert run_partition(cbr_job, PARTITION, instance).success
    assert run_partition(cbr_job, other_partition, instance).success
    untouched = [r for r in table_rows(warehouse_url, "cbr_daily_rates")
                 if r["partition_date"] == date(2026, 11, 3)]

    standin.change_cbr_rates("2026-10-31", set_values={"USD": "81,0001"}, remove=["EUR"])
    rerun = run_partition(cbr_job, PARTITION, instance)
    assert rerun.success
    figures = load_metadata(instance, rerun.run_id)
    assert (figures["inserted"], figures["updated"], figures["deleted"]) == (0, 1, 1)

    rows = table_rows(warehouse_url, "cbr_daily_rates")
    changed = {r["char_code"]: r for r in rows if r["partition_date"] == date(2026, 11, 2)}
    assert "EUR" not in changed and len(changed) == 11
    assert changed["USD"]["value"] == Decimal("81.0001")
    assert changed["USD"]["changed_by_run"] == rerun.run_id
    assert changed["GBP"]["changed_by_run"] != rerun.run_id
    assert [r for r in rows if r["partition_date"] == date(2026, 11, 3)] == untouched


def test_exact_decimals_survive_the_round_trip(cbr_job, instance, warehouse_url, standin):
    standin.change_cbr_rates("2026-10-31", set_values={"USD": "92,1234"})
    assert run_partition(cbr_job, PARTITION, instance).success
    usd = next(r for r in table_rows(warehouse_url, "cbr_daily_rates") if r["char_code"] == "USD")
    assert usd["value"] == Decimal("92.1234")
    assert str(usd["value"]) == "92.1234"
    assert usd["unit_rate"] == Decimal("92.1234")


@pytest.mark.parametrize("fault", ["malformed", "truncate", "html", "wrong_encoding"])
def test_a_bad_response_fails_the_run_and_keeps_the_loaded_rows(
    cbr_job, instance, warehouse_url, standin, fault
):
    assert run_partition(cbr_job, PARTITION, instance).success
    before = physical_snapshot(warehouse_url, "cbr_daily_rates")

    standin.fault(fault)
    failed = run_partition(cbr_job, PARTITION, instance)
    assert not failed.success
    assert physical_snapshot(warehouse_url, "cbr_daily_rates") == before


def test_an_unpublished_partition_loads_nothing_and_does_not_fail(
    cbr_job, instance, warehouse_url, standin
):
    tomorrow = cbr_job.partitions_def.get_partition_keys()[-1]
    standin.publish_cbr_until(cbr_job.partitions_def.get_partition_keys()[-2])
    result = run_partition(cbr_job, tomorrow, instance)
    assert result.success
    assert result.asset_materializations_for_node("cbr_daily_rates") == []
    assert table_rows(warehouse_url, "cbr_daily_rates") == []


def test_one_unreadable_currency_is_quarantined_and_the_rest_loaded(
    cbr_job, instance, warehouse_url, standin
):
    from mostovik_pipelines.resources.warehouse import warehouse_engine
    from mostovik_pipelines_tests.support.warehouse import quarantined_by_run

    standin.change_cbr_rates("2026-10-31", set_values={"USD": "n/a"})
    result = run_partition(cbr_job, PARTITION, instance)
    assert result.success
    figures = load_metadata(instance, result.run_id)
    assert (figures["inserted"], figures["rejected"]) == (11, 1)
    assert "USD" not in {r["char_code"] for r in table_rows(warehouse_url, "cbr_daily_rates")}
    [quarantined] = quarantined_by_run(warehouse_engine(warehouse_url), result.run_id)
    assert (quarantined["source"], quarantined["partition_key"]) == ("cbr_daily_rates", PARTITION)
    assert "Value 'n/a' is not a decimal" in quarantined["reason"]
    assert "<CharCode>USD</CharCode>" in quarantined["raw_row"]

    standin.reset_cbr_rates()
    fixed = run_partition(cbr_job, PARTITION, instance)
    assert load_metadata(instance, fixed.run_id)["inserted"] == 1
    assert quarantined_by_run(warehouse_engine(warehouse_url), result.run_id) == []


def test_many_unreadable_currencies_are_a_systematic_defect_and_load_nothing(
    cbr_job, instance, warehouse_url, standin
):
    assert run_partition(cbr_job, PARTITION, instance).success
    before = physical_snapshot(warehouse_url, "cbr_daily_rates")
    standin.change_cbr_rates("2026-10-31", set_values={c: "?" for c in ("USD", "EUR", "GBP")})
    result = run_partition(cbr_job, PARTITION, instance)
    assert not result.success
    assert physical_snapshot(warehouse_url, "cbr_daily_rates") == before
