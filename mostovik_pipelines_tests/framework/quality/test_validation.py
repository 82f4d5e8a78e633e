"""The checks every partition passes before loading, and the de-duplication policy."""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pandas as pd
import pytest

from mostovik_pipelines.core.errors import DataValidationError, SourceContractError
from mostovik_pipelines.framework.quality.validation import validate_partition
from mostovik_pipelines.sources.cbr_daily_rates import SOURCE

DAY = date(2026, 11, 5)


def row(code: str, value: str = "1.0000", **overrides) -> dict:
    return {"partition_date": DAY, "rate_date": DAY, "cbr_id": f"R{code}", "num_code": "001",
            "char_code": code, "nominal": 1, "name": code, "value": Decimal(value),
            "unit_rate": Decimal(value)} | overrides


def validate(rows: list[dict], max_rejected_share: float = 0.9):
    return validate_partition(pd.DataFrame(rows), SOURCE.load_target, DAY.isoformat(),
                              max_rejected_share)


def test_exact_duplicates_are_dropped_and_conflicting_ones_rejected():
    result = validate([row("USD"), row("USD"), row("EUR", "1.0"), row("EUR", "2.0"), row("JPY")])
    assert list(result.frame["char_code"]) == ["USD", "JPY"]
    assert result.duplicates_dropped == 1
    assert [(r.row_number, r.reason) for r in result.rejected] == [
        (3, "shares its natural key with a different row"),
        (4, "shares its natural key with a different row"),
    ]


def test_rows_outside_the_partition_or_without_a_key_are_rejected():
    result = validate([row("USD"), row("EUR", partition_date=date(2026, 11, 6)),
                       row("JPY", char_code=None)])
    assert list(result.frame["char_code"]) == ["USD"]
    reasons = {r.row_number: r.reason for r in result.rejected}
    assert reasons == {2: "partition_date is not partition 2026-11-05",
                       3: "incomplete natural key ['partition_date', 'char_code']"}


def test_rows_repeating_an_incomplete_key_are_rejected_for_it_not_counted_as_copies():
    result = validate([row("USD"), row("EUR", char_code=None), row("EUR", char_code=None),
                       row("JPY", char_code=float("nan")), row("USD")])
    assert list(result.frame["char_code"]) == ["USD"]
    assert result.duplicates_dropped == 1
    assert {r.row_number: r.reason for r in result.rejected} == {
        n: "incomplete natural key ['partition_date', 'char_code']" for n in (2, 3, 4)}


@pytest.mark.parametrize("text_dtype", [object, "str"])
def test_a_missing_text_is_not_too_long_whatever_the_frame_holds_text_as(text_dtype):
    frame = pd.DataFrame([row("USD", name=None), row("EUR", name="x" * 256)])
    frame["name"] = frame["name"].astype(text_dtype)
    result = validate_partition(frame, SOURCE.load_target, DAY.isoformat(), 0.9)
    assert list(result.frame["char_code"]) == ["USD"]
    assert {r.row_number: r.reason for r in result.rejected} == {
        2: "name is longer than the 255 characters it may hold"}


def test_values_the_columns_cannot_hold_reject_their_row_not_the_load():
    result = validate([row("USD"), row("EUR", name="x" * 256), row("JPY", nominal=2**31)])
    assert list(result.frame["char_code"]) == ["USD"]
    assert {r.row_number: r.reason for r in result.rejected} == {
        2: "name is longer than the 255 characters it may hold",
        3: "nominal is beyond a 32-bit integer",
    }


def test_too_many_rejections_are_a_systematic_defect():
    with pytest.raises(DataValidationError, match=r"systematic defect: 2 of 3 rows rejected"):
        validate([row("USD"), row("EUR", char_code=None), row("JPY", char_code=None)],
                 max_rejected_share=0.5)


def test_a_frame_without_the_table_columns_is_a_contract_change():
    with pytest.raises(SourceContractError, match=r"missing \['unit_rate'\]"):
        validate([{k: v for k, v in row("USD").items() if k != "unit_rate"}])


def _work_order(record_id: str, version: int, title: str = "Опора 3") -> dict:
    from datetime import datetime
    from zoneinfo import ZoneInfo
    return {"id": record_id, "object_code": "MST-01", "title": title, "status": "planned",
            "planned_start": None, "planned_finish": None, "amount": Decimal("10.00"),
            "updated_at": datetime(2026, 11, 5, 9, tzinfo=ZoneInfo("Europe/Moscow")),
            "version": version, "deleted": False, "window_date": DAY}


def test_a_sync_payload_sending_a_record_twice_keeps_its_newest_version():
    """A record changed while its window was paged comes again, later, newer: only the newest
    can win, so the older one is a duplicate, not a conflict that would quarantine both."""
    from mostovik_pipelines.framework.spec import ParsedRows
    from mostovik_pipelines.sources.erp_work_orders import SOURCE as WORK_ORDERS

    rows = [_work_order("A", 3), _work_order("B", 1), _work_order("A", 5, "Опора 3, доп."),
            _work_order("C", 2), _work_order("C", 2, "другое")]
    result = validate_partition(ParsedRows(pd.DataFrame(rows), row_numbers=[11, 12, 13, 14, 15]),
                                WORK_ORDERS.load_target, DAY.isoformat(), 0.9)
    assert list(zip(result.frame["id"], result.frame["version"], strict=True)) == [
        ("B", 1), ("A", 5)]
    assert result.duplicates_dropped == 1
    # The same version with different data is still a conflict: both rows go to quarantine,
    # numbered as the payload numbers them.
    assert [(r.row_number, r.key) for r in result.rejected] == [(14, {"id": "C"}),
                                                                 (15, {"id": "C"})]
    assert list(result.row_numbers) == [12, 13]
