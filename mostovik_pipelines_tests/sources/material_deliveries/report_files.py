"""Delivery report files as the tests of the file job drop them: the lines of a numbered report
(no two reports share a waybill line), every layout variant the sites send, a corrected version,
and every file-level defect with what its run's failure must name."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.delivery_reports import TITLE_ROWS, Layout
from mostovik_pipelines_tests.support.inbox import renumbered


def report_lines(count: int, index: int, *, numeric: bool = False):
    """``count`` lines of the report number ``index``: no two reports share a waybill line."""
    lines = reports.deliveries(count, seed=index, numeric_waybills=numeric)
    return renumbered(lines, index * 100_000)


STANDARD = Layout()


def csv_file(lines, layout: Layout = STANDARD, **options) -> bytes:
    return reports.csv_report(reports.report_table(lines, layout), **options)


def xlsx_file(lines, layout: Layout = STANDARD, **options) -> bytes:
    return reports.xlsx_report(reports.report_table(lines, layout), **options)


HEADER_VARIANTS = reports.HEADER_VARIANTS


def variant_files() -> dict[str, tuple[list, bytes]]:
    """Every variant the sites send, a file each: name -> (its lines, its bytes)."""
    specs = {  # name -> (numeric waybills?, how the lines are written)
        "Поставки МСК-ЖК-014 ноябрь.csv": (False, lambda ls: csv_file(ls)),
        "utf8_bom.csv": (False, lambda ls: csv_file(ls, bom=True)),
        "cp1251_nbsp_title.csv": (False, lambda ls: csv_file(
            ls, Layout(thousands="\u00a0"), encoding="windows-1251", title_rows=TITLE_ROWS)),
        "narrow_nbsp_lf.csv": (False, lambda ls: csv_file(ls, Layout(thousands="\u202f"),
                                                      newline="\n")),
        "decimal_point_comma_delimited.csv": (False, lambda ls: csv_file(
            ls, Layout(decimal=".", thousands=""), delimiter=",")),
        "tab_header_spacing_case.csv": (False, lambda ls: csv_file(
            ls, Layout(headers=HEADER_VARIANTS), delimiter="\t")),
        "excel_unicode_text.txt": (False, lambda ls: csv_file(ls, encoding="utf-16",
                                                          delimiter="\t")),
        "reordered_extra_trailing.csv": (False, lambda ls: csv_file(
            ls, Layout(order=(2, 3, 0, 4, 6, 5, 7, 8, 1),
                       extra_columns=((0, "№ п/п"), (6, "Примечание"), (11, "Склад"))),
            trailing_empty_rows=4)),
        "all_quirks.csv": (False, lambda ls: csv_file(
            ls, Layout(headers=HEADER_VARIANTS, order=(8, 7, 6, 5, 4, 3, 2, 1, 0),
                       extra_columns=((3, "Склад"),), thousands="\u00a0"),
            encoding="windows-1251", delimiter="\t", title_rows=TITLE_ROWS,
            trailing_empty_rows=3)),
        "date_and_number_cells.xlsx": (False, lambda ls: xlsx_file(
            ls, Layout(dates="cell", numbers="cell"), title_rows=TITLE_ROWS)),
        "serial_dates.xlsx": (False, lambda ls: xlsx_file(ls, Layout(dates="serial",
                                                                 numbers="cell"))),
        "mac_1904.xlsx": (False, lambda ls: xlsx_file(ls, Layout(dates="serial", date_1904=True),
                                                  date_1904=True)),
        "numeric_waybills.xlsx": (True, lambda ls: xlsx_file(
            ls, Layout(numbers="cell", waybills="number"))),
        "header_variants_lookup_sheets.xlsx": (False, lambda ls: xlsx_file(
            ls, Layout(headers=HEADER_VARIANTS, order=(3, 2, 1, 0, 8, 7, 6, 5, 4),
                       extra_columns=((0, "№ п/п"), (10, "Примечание")), numbers="cell"),
            trailing_empty_rows=10, other_sheets=("Справочник", "Итоги"))),
    }
    files = {}
    for index, (name, (numeric, build)) in enumerate(specs.items(), 1):
        lines = report_lines(12, index, numeric=numeric)
        files[name] = (lines, build(lines))
    return files


def corrected(lines):
    """A corrected report: line 4 changed, line 8 removed, a line added."""
    changed = dataclasses.replace(lines[3], quantity=lines[3].quantity + Decimal("1.5"),
                                  price=Decimal("999.90"))
    added = dataclasses.replace(lines[-1], line_no=lines[-1].line_no + 1,
                                material="Песок строительный", unit="т",
                                quantity=Decimal("12.50"), price=Decimal("650.00"))
    return [*lines[:3], changed, *lines[4:7], *lines[8:], added]


MAX_FILE_BYTES = 64 * 1024


def file_defects() -> dict[str, tuple[bytes, list[str]]]:
    """File name -> (bytes, fragments the run's failure must name besides the file)."""
    big = csv_file(report_lines(900, 9))
    assert len(big) > MAX_FILE_BYTES
    return {
        "Поставки.pdf": (reports.pdf_bytes(), ["a PDF document, not a CSV or XLSX report"]),
        "Поставки 2003.xls": (reports.legacy_xls_bytes(), ["legacy .xls"]),
        "photo.csv": (reports.binary_junk(), ["not CSV text"]),
        "archive.zip": (reports.zip_not_xlsx(), ["not an XLSX workbook"]),
        "no_header.csv": (reports.without_header(), ["no header row"]),
        # A changed shape, named field by field before the parse (framework/quality/shape.py).
        "missing_columns.csv": (reports.missing_columns("Цена", "Количество"),
                                ["missing field Количество; missing field Цена"]),
        "empty.csv": (b"", ["the file is empty"]),
        "header_only.xlsx": (reports.header_only("xlsx"), ["no data rows below the header"]),
        "too_big.csv": (big, [f"{len(big)} bytes, over the {MAX_FILE_BYTES}-byte limit"]),
        "broken_cp1251.csv": (reports.invalid_encoding_csv(), ["not CSV text",
                                                               "unreadable encoding"]),
        "utf16_without_bom.csv": (reports.invalid_encoding_csv(nul=True), ["not CSV text"]),
        "zip_bomb.xlsx": (reports.zip_bomb_xlsx(20), ["zip bomb"]),
        "external_link.xlsx": (reports.xlsx_with_external_link(),
                               ["links to other workbooks"]),
        "external_relationship.xlsx": (reports.xlsx_with_external_link(part=False),
                                       ["external relationships"]),
        "macros.xlsx": (reports.macro_enabled_xlsx(), ["macro-enabled"]),
    }

