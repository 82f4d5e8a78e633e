"""Material delivery reports, the file format alone: every variant the sites send parses to the
same rows, bad rows are rejected with their reason and key, bad files are refused by name, and
Arrow's CSV reader and Python's csv split a report alike."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import zipfile
from datetime import date
from decimal import Decimal

import pytest

from mostovik_pipelines.core.errors import DataValidationError, SourceContractError
from mostovik_pipelines.framework.readers import csv_export
from mostovik_pipelines.sources.material_deliveries import report
from mostovik_pipelines.sources.material_deliveries.report import COLUMNS, parse_delivery_report
from mostovik_pipelines_tests.sources.material_deliveries.report_files import report_lines
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.delivery_reports import TITLE_ROWS, Layout

VERSION = "2026-11-30T18:04:11"
MB = 1024 * 1024
MAX_BYTES = 10 * MB
LINES = reports.deliveries(40)
NUMERIC_LINES = reports.deliveries(40, numeric_waybills=True)


def _parse(content: bytes, name: str = "поставки_ноябрь.csv", max_bytes: int = MAX_BYTES):
    return parse_delivery_report(content, name, VERSION, max_bytes)


def _sheet_xml(content: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        return archive.read("xl/worksheets/sheet1.xml")


def _assert_parses_to(content: bytes, name: str, lines=LINES) -> None:
    parsed = _parse(content, name)
    assert parsed.rejected == []
    assert parsed.frame.to_dict("records") == reports.expected_rows(lines, name, VERSION)


CSV_CASES = {
    "utf-8, ';', decimal comma, spaced thousands": (Layout(), {}),
    "utf-8 with BOM": (Layout(), {"bom": True}),
    "windows-1251": (Layout(), {"encoding": "windows-1251"}),
    "windows-1251, no-break space thousands": (Layout(thousands="\u00a0"),
                                               {"encoding": "windows-1251"}),
    "narrow no-break space thousands": (Layout(thousands="\u202f"), {}),
    "no thousands separator": (Layout(thousands=""), {}),
    "decimal point": (Layout(decimal=".", thousands=""), {}),
    "decimal point, spaced thousands": (Layout(decimal="."), {}),
    "',' delimiter, decimal commas quoted": (Layout(), {"delimiter": ","}),
    "tab delimiter": (Layout(), {"delimiter": "\t"}),
    "utf-16 unicode text (Excel)": (Layout(), {"encoding": "utf-16", "delimiter": "\t"}),
    "LF line endings": (Layout(), {"newline": "\n"}),
    "header in other case and spacing": (Layout(headers=reports.HEADER_VARIANTS), {}),
    "columns in another order": (Layout(order=(2, 3, 0, 4, 6, 5, 7, 8, 1)), {}),
    "extra columns": (Layout(extra_columns=((0, "№ п/п"), (6, "Примечание"), (11, "Склад"))),
                      {}),
    "title rows above the header": (Layout(), {"title_rows": reports.TITLE_ROWS}),
    "trailing empty rows": (Layout(), {"trailing_empty_rows": 5}),
    "all quirks at once": (
        Layout(headers=reports.HEADER_VARIANTS, order=(8, 7, 6, 5, 4, 3, 2, 1, 0),
               extra_columns=((3, "Склад"),), thousands="\u00a0"),
        {"encoding": "windows-1251", "delimiter": "\t", "title_rows": reports.TITLE_ROWS,
         "trailing_empty_rows": 3},
    ),
}


@pytest.mark.parametrize(("layout", "options"), CSV_CASES.values(), ids=CSV_CASES.keys())
def test_every_csv_variant_parses_to_exactly_the_expected_rows(layout, options):
    content = reports.csv_report(reports.report_table(LINES, layout), **options)
    _assert_parses_to(content, "поставки_ноябрь.csv")


XLSX_CASES = {
    "text cells as in the CSV": (LINES, Layout(), {}),
    "date and number cells": (LINES, Layout(dates="cell", numbers="cell"), {}),
    "dates as plain serial numbers": (LINES, Layout(dates="serial", numbers="cell"), {}),
    "serial dates of a 1904 workbook": (
        LINES, Layout(dates="serial", date_1904=True), {"date_1904": True}),
    "date cells of a 1904 workbook": (
        LINES, Layout(dates="cell", date_1904=True), {"date_1904": True}),
    "waybills in numeric cells": (
        NUMERIC_LINES, Layout(numbers="cell", waybills="number"), {}),
    "title rows above the header": (
        LINES, Layout(dates="cell", numbers="cell"), {"title_rows": reports.TITLE_ROWS}),
    "formatted empty rows below": (LINES, Layout(dates="cell"), {"trailing_empty_rows": 20}),
    "header variants, reordered and extra columns": (
        LINES, Layout(headers=reports.HEADER_VARIANTS, order=(3, 2, 1, 0, 8, 7, 6, 5, 4),
                      extra_columns=((0, "№ п/п"), (10, "Примечание")), numbers="cell"), {}),
    "lookup sheets after the report": (
        LINES, Layout(), {"other_sheets": ("Справочник", "Итоги")}),
}


@pytest.mark.parametrize(("lines", "layout", "options"), XLSX_CASES.values(),
                         ids=XLSX_CASES.keys())
def test_every_xlsx_variant_parses_to_exactly_the_expected_rows(lines, layout, options):
    content = reports.xlsx_report(reports.report_table(lines, layout), **options)
    _assert_parses_to(content, "Поставки 11.2026.xlsx", lines)


def test_the_frame_has_exactly_the_columns_and_their_types():
    frame = _parse(reports.csv_report(reports.report_table(LINES))).frame
    assert tuple(frame.columns) == COLUMNS
    assert str(frame["line_no"].dtype) == "int64"
    assert frame["quantity"].dtype == object and frame["price"].dtype == object
    assert all(isinstance(value, Decimal) for value in [*frame["quantity"], *frame["price"]])
    assert all(type(value) is date for value in frame["delivery_date"])
    assert set(frame["source_file"]) == {"поставки_ноябрь.csv"}
    assert set(frame["file_version"]) == {VERSION}


def test_amounts_are_exact_with_their_scale():
    line = dataclasses.replace(LINES[0], quantity=Decimal("1234.500"), price=Decimal("0.10"))
    for thousands in (" ", "\u00a0", "\u202f"):
        content = reports.csv_report(reports.report_table([line], Layout(thousands=thousands)))
        assert b"1" + thousands.encode() + b"234,500" in content
        row = _parse(content).frame.iloc[0]
        assert (str(row["quantity"]), str(row["price"])) == ("1234.500", "0.10")


def test_leading_zeros_of_a_waybill_are_kept():
    line = dataclasses.replace(LINES[0], waybill="000784")
    for content, name in (
        (reports.csv_report(reports.report_table([line])), "a.csv"),
        (reports.xlsx_report(reports.report_table([line])), "a.xlsx"),
    ):
        assert _parse(content, name).frame["waybill"].tolist() == ["000784"]


def test_a_numeric_waybill_cell_is_its_digits():
    line = dataclasses.replace(NUMERIC_LINES[0], waybill="784512")
    content = reports.xlsx_report(reports.report_table([line], Layout(waybills="number")))
    assert b"<v>784512</v>" in _sheet_xml(content)
    assert _parse(content, "a.xlsx").frame["waybill"].tolist() == ["784512"]


def test_excel_serial_dates_are_dates():
    line = dataclasses.replace(LINES[0], delivery_date=date(2026, 11, 2))
    for date_1904, serial in ((False, b"46328"), (True, b"44866")):
        content = reports.xlsx_report(
            reports.report_table([line], Layout(dates="serial", date_1904=date_1904)),
            date_1904=date_1904)
        assert b"<v>" + serial + b"</v>" in _sheet_xml(content)
        assert _parse(content, "a.xlsx").frame["delivery_date"].tolist() == [date(2026, 11, 2)]


def test_formulas_are_not_evaluated_the_cached_value_is_read():
    parsed = _parse(reports.xlsx_with_cached_formula(), "a.xlsx")
    assert parsed.frame["quantity"].iloc[0] == Decimal(5)  # =2+2 would say 4


def test_trailing_empty_rows_are_not_rows():
    table = reports.report_table(LINES[:5])
    for content, name in (
        (reports.csv_report(table, trailing_empty_rows=30), "a.csv"),
        (reports.csv_report(table) + b"\r\n" * 10 + b";;;;;;;;\r\n" * 10, "b.csv"),
        (reports.xlsx_report(table, trailing_empty_rows=30), "a.xlsx"),
    ):
        parsed = _parse(content, name)
        assert (len(parsed.frame), parsed.rejected) == (5, [])


def test_three_bad_rows_among_a_hundred_are_rejected_with_reasons_and_keys():
    lines = reports.deliveries(100, seed=5)
    table = reports.report_table(lines)
    reports.set_cell(table, 10, "Количество", "12,5,3")
    reports.set_cell(table, 41, "Дата поставки", "31.02.2026")
    reports.set_cell(table, 77, "Накладная", "")
    content = reports.csv_report(table, title_rows=reports.TITLE_ROWS)
    first = reports.first_data_row_number(reports.TITLE_ROWS)

    parsed = _parse(content)

    assert len(parsed.frame) == 97
    good = [line for index, line in enumerate(lines) if index not in (10, 41, 77)]
    assert parsed.frame.to_dict("records") == reports.expected_rows(
        good, "поставки_ноябрь.csv", VERSION)
    by_row = {rejected.row_number: rejected for rejected in parsed.rejected}
    assert sorted(by_row) == [first + 10, first + 41, first + 77]
    quantity, day, waybill = (by_row[first + index] for index in (10, 41, 77))
    assert quantity.reason == "Количество '12,5,3' is not a number"
    assert quantity.key == {"source_file": "поставки_ноябрь.csv", "waybill": lines[10].waybill,
                            "line_no": lines[10].line_no}
    assert json.loads(quantity.raw) == [str(cell) for cell in table[11]]
    assert day.reason == "Дата поставки '31.02.2026' is not a date"
    assert day.key["waybill"] == lines[41].waybill
    assert waybill.reason.startswith("Накладная '' is empty")
    assert waybill.key is None


def _one_bad_row(column: str, value: str) -> tuple:
    table = reports.report_table(LINES[:3])
    reports.set_cell(table, 1, column, value)
    parsed = _parse(reports.csv_report(table))
    assert len(parsed.frame) == 2 and len(parsed.rejected) == 1
    rejected = parsed.rejected[0]
    assert rejected.row_number == 3
    return rejected.reason, rejected.key


@pytest.mark.parametrize(
    ("column", "value", "reason", "has_key"),
    [
        ("Количество", "много", "Количество 'много' is not a number", True),
        ("Количество", "-5", "Количество '-5' is negative", True),
        ("Количество", "", "Количество '' is empty", True),
        ("Количество", "1,234.50", "Количество '1,234.50' is not a number", True),
        ("Количество", "12 34,5", "Количество '12 34,5' is not a number", True),
        ("Цена", "-1 200,00", "Цена '-1 200,00' is negative", True),
        ("Цена", "1 200 руб.", "Цена '1 200 руб.' is not a number", True),
        ("Дата поставки", "2026-11-02", "Дата поставки '2026-11-02' is not a date in DD.MM.YYYY",
         True),
        ("Дата поставки", "", "Дата поставки '' is empty", True),
        ("Строка", "0", "Строка '0' is not a positive whole number", False),
        ("Строка", "-1", "Строка '-1' is not a positive whole number", False),
        ("Строка", "1.5", "Строка '1.5' is not a positive whole number", False),
        ("Строка", "99999999999", "Строка '99999999999' is not a positive whole number", False),
        ("Строка", "", "Строка '' is empty: the line number is part of the row's key", False),
        ("Накладная", "  ", "Накладная '  ' is empty: the waybill number is part of the row's key",
         False),
    ],
)
def test_each_row_level_problem_names_the_column_and_the_value(column, value, reason, has_key):
    got_reason, key = _one_bad_row(column, value)
    assert got_reason == reason
    assert (key is not None) == has_key


def test_a_row_shifted_by_an_unquoted_delimiter_is_rejected_not_misread():
    table = reports.report_table(LINES[:3])
    reports.set_cell(table, 1, "Количество", "12,5")
    content = reports.csv_report(table, delimiter=",")
    shifted = content.replace(b'"12,5"', b"12,5", 1)
    assert shifted != content
    parsed = _parse(shifted)
    assert len(parsed.frame) == 2
    assert parsed.rejected[0].row_number == 3
    assert parsed.rejected[0].reason.endswith(
        "has 10 cells where the header has 9: a delimiter inside an unquoted cell?")


def test_a_file_of_bad_rows_only_gives_an_empty_frame_and_every_row_rejected():
    table = reports.report_table(LINES[:4])
    for row in range(4):
        reports.set_cell(table, row, "Цена", "договорная")
    parsed = _parse(reports.csv_report(table))
    assert tuple(parsed.frame.columns) == COLUMNS and len(parsed.frame) == 0
    assert str(parsed.frame["line_no"].dtype) == "int64"
    assert [rejected.row_number for rejected in parsed.rejected] == [2, 3, 4, 5]


def test_problems_of_one_row_are_all_named():
    table = reports.report_table(LINES[:2])
    reports.set_cell(table, 0, "Цена", "-3")
    reports.set_cell(table, 0, "Строка", "x")
    (rejected,) = _parse(reports.csv_report(table)).rejected
    assert rejected.reason == "Строка 'x' is not a positive whole number; Цена '-3' is negative"
    assert rejected.key is None


def test_an_unclosed_quote_swallowing_the_file_is_refused():
    content = reports.csv_report(reports.report_table(LINES[:2])) + b'"' + b"x" * 200_000
    with pytest.raises(SourceContractError, match=r"^a\.csv: not readable CSV near line 4"):
        _parse(content, "a.csv")


def test_xlsx_cells_of_the_wrong_type_are_rejected():
    table = reports.report_table(NUMERIC_LINES[:3], Layout(numbers="cell", dates="cell"))
    reports.set_cell(table, 0, "Строка", 2.5)
    reports.set_cell(table, 1, "Дата поставки", 12)
    reports.set_cell(table, 2, "Накладная", 784512.5)
    parsed = _parse(reports.xlsx_report(table, title_rows=reports.TITLE_ROWS), "a.xlsx")
    assert [r.reason for r in parsed.rejected] == [
        "Строка '2.5' is not a positive whole number",
        "Дата поставки '12.0' is not an Excel date",
        "Накладная '784512.5' is a fractional number, not a waybill number",
    ]
    first = reports.first_data_row_number(reports.TITLE_ROWS)
    assert [r.row_number for r in parsed.rejected] == [first, first + 1, first + 2]
    assert [r.key is None for r in parsed.rejected] == [True, False, True]
    assert json.loads(parsed.rejected[1].raw)[0] == 12.0


FILE_DEFECTS = {
    "pdf": (reports.pdf_bytes, "a PDF document"),
    "legacy xls": (reports.legacy_xls_bytes, "legacy .xls"),
    "zip that is not an xlsx": (reports.zip_not_xlsx, "not an XLSX workbook"),
    "binary junk": (reports.binary_junk, "not CSV text"),
    "invalid byte for utf-8 and windows-1251": (
        reports.invalid_encoding_csv, "neither utf-8 nor windows-1251"),
    "nul bytes (utf-16 without bom)": (
        lambda: reports.invalid_encoding_csv(nul=True), "U+0000"),
    "empty": (lambda: b"", "no data rows"),
    "blank lines only": (lambda: b"\r\n\r\n  \r\n", "no data rows"),
    "header only csv": (reports.header_only, "no data rows"),
    "header only xlsx": (lambda: reports.header_only("xlsx"), "no data rows"),
    "no header": (reports.without_header, "no header row"),
    "missing columns": (lambda: reports.missing_columns("Цена", "Ед. изм."),
                        "lacks the columns Ед. изм., Цена"),
    "repeated column": (
        lambda: reports.csv_report(reports.report_table(
            LINES[:2], Layout(extra_columns=((9, "Цена"),)))),
        "has the column Цена 2 times"),
    "zip bomb by ratio": (reports.zip_bomb_xlsx, "compressed"),
    "zip sizes that lie": (reports.lying_zip_xlsx, "larger than its declared"),
    "external link part": (reports.xlsx_with_external_link, "links to other workbooks"),
    "external relationship": (
        lambda: reports.xlsx_with_external_link(part=False), "external relationships"),
    "entity bomb": (reports.xlsx_with_entity_bomb, "unrecognized entity"),
    "macro-enabled": (reports.macro_enabled_xlsx, "macro-enabled"),
    "damaged zip": (lambda: reports.xlsx_report(reports.report_table(LINES[:3]))[:-200],
                    "damaged ZIP"),
}


@pytest.mark.parametrize(("build", "message"), FILE_DEFECTS.values(), ids=FILE_DEFECTS.keys())
def test_file_level_defects_are_refused_naming_the_file(build, message):
    with pytest.raises(SourceContractError) as raised:
        _parse(build(), "отчёт сайта 14.dat")
    assert str(raised.value).startswith("отчёт сайта 14.dat: ")
    assert message in str(raised.value)


def test_an_xlsx_unpacking_to_over_twenty_times_the_size_limit_is_a_zip_bomb():
    content = reports.zip_bomb_xlsx(45, parts=50)  # parts under 1 MB: no ratio is checked
    assert len(content) < MB
    with pytest.raises(SourceContractError, match=r"^a\.xlsx: the XLSX unpacks to 4\d,\d{3},\d{3} "
                                                  r"bytes, over the limit of 20,971,520"):
        _parse(content, "a.xlsx", max_bytes=MB)


def test_a_file_over_the_size_limit_is_refused_before_parsing():
    content = reports.pdf_bytes()  # would be a contract error if it were parsed
    with pytest.raises(DataValidationError, match=r"^big\.csv: .* over the limit of 100 bytes"):
        _parse(content, "big.csv", max_bytes=100)


def test_the_first_worksheet_is_read():
    content = reports.xlsx_report(reports.report_table(LINES[:3]), sheet_name="Лист1",
                                  other_sheets=("Поставки",))
    assert len(_parse(content, "a.xlsx").frame) == 3


def test_the_header_is_searched_in_the_first_ten_rows_only():
    table = reports.report_table(LINES[:3])
    content = reports.csv_report(table, title_rows=[f"строка шапки {n}" for n in range(10)])
    with pytest.raises(SourceContractError, match=r"no header row .* first 10 rows"):
        _parse(content)


# The parser splits a CSV two ways: Arrow's reader (in C++) when it splits exactly as Python's
# csv does, csv itself otherwise. Both must give the same rows, rejects and row numbers.


def _split_by_csv_only(monkeypatch) -> None:
    monkeypatch.setattr(csv_export, "_csv_table", lambda *args, **kwargs: None)


def _parsed(content: bytes) -> tuple:
    parsed = report.parse_delivery_report(content, "Объект.csv", "Объект.csv@v1",
                                          10 * 1024 * 1024)
    frame = parsed.frame
    return ([str(dtype) for dtype in frame.dtypes],
            [tuple((type(v).__name__, str(v)) for v in row) for row in frame.itertuples()],
            [(r.row_number, r.raw, r.reason, r.key) for r in parsed.rejected],
            list(parsed.row_numbers))


def _with_bad_cells(lines) -> list[list]:
    table = reports.report_table(lines)
    reports.set_cell(table, 1, "Количество", "12,5,0")
    reports.set_cell(table, 4, "Цена", "")
    reports.set_cell(table, 4, "Строка", "-1")
    reports.set_cell(table, 6, "Дата поставки", "31.02.2026")
    reports.set_cell(table, 7, "Материал", 'Бетон "В25";\r\nпо ГОСТ')
    reports.set_cell(table, 8, "Количество", " 1\u00a0234,5 ")
    reports.set_cell(table, 9, "Цена", "١٢")
    return table


SPLIT_CASES = {
    "plain, windows-1251, title rows": (True, lambda lines: reports.csv_report(
        reports.report_table(lines), encoding="windows-1251", title_rows=TITLE_ROWS,
        trailing_empty_rows=2)),
    "bad cells, a quoted cell spanning lines, tab-delimited": (True, lambda lines: (
        reports.csv_report(_with_bad_cells(lines), delimiter="\t"))),
    "a blank line between rows": (False, lambda lines: reports.csv_report(
        _with_bad_cells(lines)).replace(b"\r\n", b"\r\n\r\n", 5)),
    "a row shifted by an unquoted decimal comma": (False, lambda lines: re.sub(
        rb'"([0-9]+),([0-9]+)"', rb"\1,\2",
        reports.csv_report(reports.report_table(lines), delimiter=","), count=1)),
}


@pytest.mark.parametrize("arrow_splits, build", SPLIT_CASES.values(), ids=SPLIT_CASES)
def test_arrow_and_python_csv_split_a_report_alike(monkeypatch, arrow_splits, build):
    """Where Arrow may split it, against csv alone; where it may not (it would skip the blank
    line; a shifted row is wider than the header), csv splits it either way."""
    content = build(report_lines(40, 3))
    split = report._read_sheet(content, "Объект.csv", len(content))
    assert isinstance(split, csv_export.CsvTable) is arrow_splits
    by_arrow = _parsed(content)
    _split_by_csv_only(monkeypatch)
    assert _parsed(content) == by_arrow
