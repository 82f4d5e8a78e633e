"""A source's shape: the kinds of values, what a payload holds, how it differs from the
declaration (added, missing with its likely replacement, a kind changed systematically), and the
cost of observing a large report."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import date, datetime
from decimal import Decimal

import pytest

from mostovik_pipelines.framework.quality.shape import (
    NUMBER,
    AddedFieldPolicy,
    SourceShape,
    ValueKind,
    compare,
    expect,
    judge,
    kind_of,
    observe_columns,
    observe_records,
    observe_xml,
)

K = ValueKind
SHAPE = SourceShape((
    expect("id", K.TEXT),
    expect("amount", NUMBER),
    expect("day", K.DATE_ISO),
    expect("note", K.TEXT, optional=True),
))


@pytest.mark.parametrize(("value", "kind"), [
    (None, K.EMPTY), ("  ", K.EMPTY), (True, K.BOOLEAN), ("false", K.BOOLEAN), (7, K.INTEGER),
    ("036", K.INTEGER), (3.0, K.INTEGER), (2.5, K.DECIMAL), (Decimal("1.5"), K.DECIMAL),
    ("92.5000", K.DECIMAL), ("92,5000", K.DECIMAL_COMMA), ("1 234,50", K.DECIMAL_COMMA),
    ("1\u00a0234", K.INTEGER), ("2026-11-04", K.DATE_ISO), ("04.11.2026", K.DATE_DMY),
    ("2026-11-04T10:00:00+03:00", K.DATETIME), (date(2026, 11, 4), K.DATE_ISO),
    (datetime(2026, 11, 4, 10), K.DATETIME), ("12 kg", K.TEXT), ("USD", K.TEXT),
])
def test_every_value_has_a_kind(value, kind):
    assert kind_of(value) is kind


def _records(n: int = 4, **extra) -> list[dict]:
    return [{"id": f"A{i}", "amount": f"{i}.50", "day": "2026-11-04", **extra}
            for i in range(n)]


def test_the_declared_shape_is_no_change():
    drift = compare(SHAPE, observe_records(_records()))
    assert not drift
    assert drift.describe() == "no change"


def test_an_added_field_breaks_only_a_frozen_declaration():
    drift = compare(SHAPE, observe_records(_records(currency="RUB")))
    assert drift.added == ("currency",)
    assert drift.describe() == "added field currency"
    assert not drift.breaks(AddedFieldPolicy.WARN)
    assert drift.breaks(AddedFieldPolicy.FREEZE)


def test_a_missing_field_names_its_likely_replacement():
    records = [{"id": r["id"], "sum": r["amount"], "day": r["day"]} for r in _records()]
    drift = compare(SHAPE, observe_records(records))
    assert drift.missing == ("amount",)
    assert drift.breaks(AddedFieldPolicy.WARN)
    assert drift.describe() == ("missing field amount, sum looks like its replacement (same "
                                "position, same kind of values)")
    renamed = [{"id": r["id"], "amounts": r["amount"], "day": r["day"], "x": 1, "y": "z"}
               for r in _records()]
    assert compare(SHAPE, observe_records(renamed)).replacements == {
        "amount": ("amounts", "same position, similar name, same kind of values")}


def test_an_optional_field_may_be_left_out_and_a_lone_missing_one_is_named_alone():
    records = [{"id": r["id"], "day": r["day"]} for r in _records()]
    drift = compare(SHAPE, observe_records(records))
    assert drift.describe() == "missing field amount"


def test_a_kind_changed_for_most_values_is_systematic_a_few_are_not():
    records = _records(10)
    for record in records[:6]:
        record["amount"] = f"{record['amount']} RUB"
    drift = compare(SHAPE, observe_records(records))
    assert [change.name for change in drift.kinds] == ["amount"]
    assert drift.describe() == ("amount is now text (6 of 10 values), expected decimal or "
                                "decimal_comma or integer")
    for record in records[:3]:
        record["amount"] = "1.5"
    assert not compare(SHAPE, observe_records(records))


def test_the_same_change_has_the_same_fingerprint_in_every_partition():
    one = compare(SHAPE, observe_records(_records(3, currency="RUB")))
    other = compare(SHAPE, observe_records(_records(50, currency="EUR")))
    assert one.fingerprint == other.fingerprint
    assert one.fingerprint != compare(SHAPE, observe_records(_records(3, rate="1"))).fingerprint


def test_an_xml_document_is_observed_by_its_attributes_and_elements():
    root = ET.fromstring('<ValCurs Date="04.11.2026"><Valute ID="R1"><Value>92,50</Value>'
                         '<Unit>1</Unit></Valute><Valute ID="R2"><Value>9,1</Value></Valute>'
                         '</ValCurs>')
    shape = observe_xml(root, "Valute")
    assert shape.names == ("ValCurs/@Date", "Valute/@ID", "Valute/Value", "Valute/Unit")
    assert dict(shape.fields[2].kinds) == {"decimal_comma": 2}


def test_pages_merge_into_the_partitions_shape():
    report = judge("s", SHAPE, AddedFieldPolicy.WARN, [
        observe_records(_records(2)), observe_records(_records(2, currency="RUB"))])
    assert report is not None and report.observed.names == ("id", "amount", "day", "currency")
    assert dict(report.observed.fields[0].kinds) == {"text": 4}
    assert not report.breaks
    assert judge("s", SHAPE, AddedFieldPolicy.WARN, []) is None


def test_columns_are_observed_on_a_sample():
    shape = observe_columns(["a"], [["1"] * 50_000 + ["x"] * 50_000])
    assert sum(shape.fields[0].kinds.values()) == 1_000
    assert shape.fields[0].kinds == {"integer": 500, "text": 500}


METALS = SourceShape((
    expect("Metall/@FromDate", K.INTEGER),
    expect("Record/@Code", K.INTEGER),
    expect("Record/Buy", NUMBER),
), records="Record")


def test_an_answer_without_records_is_empty_only_when_it_holds_nothing_else():
    """The CBR's metals on a day off: ``<Metall FromDate=...>`` and nothing in it is an empty
    day. The record element renamed reads the same to a parser (no ``<Record>``), and is a
    change of shape that fails the partition whatever the policy for added fields."""
    empty = observe_xml(ET.fromstring('<Metall FromDate="20261107"></Metall>'), "Record")
    assert empty.records == 0 and not compare(METALS, empty)
    renamed = observe_xml(ET.fromstring(
        '<Metall FromDate="20261105"><Rec Code="1"><Buy>1,5</Buy></Rec></Metall>'), "Record")
    drift = compare(METALS, renamed)
    assert drift.no_records == "Record" and drift.breaks(AddedFieldPolicy.WARN)
    assert drift.describe() == "no Record records but Metall/Rec: not an empty period"
    # Without its envelope, even an answer without records is a change.
    assert compare(METALS, observe_xml(ET.fromstring("<Metall/>"), "Record")).missing == (
        "Metall/@FromDate",)
    # JSON records: an empty list of them is the source saying there are none.
    items = SourceShape(SHAPE.fields, records="items")
    assert not compare(items, observe_records([]))
    assert compare(SHAPE, observe_records([])).missing == ("id", "amount", "day")
