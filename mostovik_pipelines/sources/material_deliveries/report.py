"""Delivery reports as sites export them from their own spreadsheets: the rows of one file.

Sites send CSV or XLSX exports of their own spreadsheets, so the format drifts: UTF-8 (with or
without a BOM) or windows-1251, ``;``, tab or ``,`` between cells, decimal commas with spaces,
no-break or narrow no-break spaces between thousands (``1 234,50``) or decimal points,
``DD.MM.YYYY`` text or real Excel dates, title rows above the header, header names in any case
and spacing, extra columns and any column order. Waybill numbers are text (leading zeros count).

Choices. A file starting with a ZIP signature is read as XLSX, anything else as CSV text, by the
framework's readers (:mod:`mostovik_pipelines.framework.readers`), which find the header by
:data:`HEADERS`; :data:`READERS` types each column's cells (the framework's cell readers, and the
report's own for the waybill and line numbers). Rows a spreadsheet shows as empty are not rows.
Either way each distinct cell of a column is read once, and rows with a problem again for their
reasons. Imported by the transform step only: it needs pandas and Arrow.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from operator import itemgetter
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from mostovik_pipelines.core.errors import DataValidationError, SourceContractError
from mostovik_pipelines.framework.quality.shape import SAMPLE_VALUES, ObservedShape, observe_columns
from mostovik_pipelines.framework.readers.cell_values import (
    UNREADABLE,
    cell_amount,
    cell_date,
    cell_text,
    read_column,
    read_distinct,
)
from mostovik_pipelines.framework.readers.csv_export import CsvTable, read_csv
from mostovik_pipelines.framework.readers.headers import (
    locate_header,
    named_columns,
    observe_sheet,
)
from mostovik_pipelines.framework.readers.sheet import Cell, Sheet, is_empty
from mostovik_pipelines.framework.readers.xlsx_export import read_xlsx
from mostovik_pipelines.framework.spec import ParsedRows, RejectedRow

COLUMNS = (
    "delivery_date", "object_code", "waybill", "line_no", "material", "unit", "quantity",
    "price", "supplier", "source_file", "file_version",
)
# The report's header as the sites' template spells it, and the column each header fills.
HEADERS = {
    "Дата поставки": "delivery_date",
    "Объект": "object_code",
    "Накладная": "waybill",
    "Строка": "line_no",
    "Материал": "material",
    "Ед. изм.": "unit",
    "Количество": "quantity",
    "Цена": "price",
    "Поставщик": "supplier",
}
LARGEST_LINE_NO = 2**31 - 1  # an INTEGER column


def _waybill(cell: Cell) -> str:
    if isinstance(cell, float) and not cell.is_integer():
        raise ValueError("is a fractional number, not a waybill number")
    text = cell_text(cell)
    if not text:
        raise ValueError("is empty: the waybill number is part of the row's key")
    return text


def _line_no(cell: Cell) -> int:
    if isinstance(cell, float) and cell.is_integer():
        number = int(cell)
    elif isinstance(cell, int) and not isinstance(cell, bool):
        number = cell
    elif isinstance(cell, str) and cell.strip().isdecimal() and cell.strip().isascii():
        number = int(cell.strip())
    elif isinstance(cell, str) and not cell.strip():
        raise ValueError("is empty: the line number is part of the row's key")
    else:
        raise ValueError("is not a positive whole number")
    if not 0 < number <= LARGEST_LINE_NO:
        raise ValueError("is not a positive whole number")
    return number


# How each column's cell is read; the date's reader also needs the workbook's date system.
READERS: dict[str, Callable[[Cell], Any]] = {
    "object_code": cell_text,
    "waybill": _waybill,
    "line_no": _line_no,
    "material": cell_text,
    "unit": cell_text,
    "quantity": cell_amount,
    "price": cell_amount,
    "supplier": cell_text,
}


def parse_delivery_report(content: bytes, file_name: str, file_version: str,
                          max_bytes: int,
                          report_shape: Callable[[ObservedShape], None] | None = None,
                          ) -> ParsedRows:
    """The rows of one delivery report, typed as :data:`COLUMNS`; a row that cannot be read is
    rejected with its reason (quarantined), the file as a whole must be a readable report.
    ``report_shape`` is told the report's columns (its header and its values' kinds) before
    its rows are read."""
    if len(content) > max_bytes:
        raise DataValidationError(
            f"{file_name}: {len(content):,} bytes is over the limit of {max_bytes:,} bytes"
        )
    with _collector_paused():
        source = _read_sheet(content, file_name, max_bytes)
        shape = _observed(source)
        if shape is not None and report_shape is not None:
            report_shape(shape)
        if isinstance(source, CsvTable):
            return _parse_table(source, file_name, file_version)
        return _parse_sheet(source, file_name, file_version)


def _observed(source: Sheet | CsvTable) -> ObservedShape | None:
    """The report's columns as sent: the header's names and a sample of each column's values
    (:data:`SAMPLE_VALUES` rows spread over the file, taken by Arrow for a CSV); None when no
    row looks like the header."""
    if isinstance(source, CsvTable):
        count = source.rows.num_rows
        taken = pa.array(np.linspace(0, count - 1, min(count, SAMPLE_VALUES), dtype=np.int64))
        named = named_columns(source.header, HEADERS)
        return observe_columns([name for _, name in named],
                               [source.rows.column(position).take(taken).to_pylist()
                                for position, _ in named])
    return observe_sheet(source, HEADERS)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The parse makes millions of small objects (every cell, every typed value) and no
    reference cycle: Python's cyclic collector would walk them over and over while they pile up
    (half of the parse's time for 100,000 rows), and would find nothing to free."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan(positions: dict[str, int], date_1904: bool
          ) -> list[tuple[str, str, int, Callable[[Cell], Any]]]:
    """(header, column, position in a row, reader) for each column of the report."""
    readers = {**READERS, "delivery_date": partial(cell_date, date_1904=date_1904)}
    return [(name, column, positions[column], readers[column]) for name, column in HEADERS.items()]


def _parse_sheet(sheet: Sheet, file_name: str, file_version: str) -> ParsedRows:
    """The rows of a sheet read row by row (XLSX, and CSV that needs Python's ``csv``), typed a
    column at a time: each distinct cell of a column is read once (a report repeats dates, sites,
    materials, units and suppliers on every row); only rows with a problem are read again, cell
    by cell, for their reason."""
    header_at, positions = locate_header(sheet, file_name, HEADERS)
    data_rows = sheet.rows[header_at + 1:]
    if not data_rows:
        raise SourceContractError(f"{file_name}: no data rows below the header ({sheet.described})")
    plan = _plan(positions, sheet.date_1904)
    header_width = len(sheet.rows[header_at][1])
    numbers = [number for number, _ in data_rows]
    rows = [cells for _, cells in data_rows]
    shortest = min(map(len, rows))
    values: dict[str, list[Any]] = {}
    failed: set[int] = set()
    for _, column, position, read in plan:
        values[column], unreadable = read_column(_column(rows, position, shortest), read)
        failed.update(unreadable)
    if sheet.strict_width:
        failed.update(index for index, cells in enumerate(rows)
                      if len(cells) > header_width and not is_empty(cells[header_width:]))
    rejected = [_rejected(rows[index], numbers[index], plan, file_name,
                          header_width if sheet.strict_width else None)
                for index in sorted(failed)]
    if failed:
        kept = [index for index in range(len(rows)) if index not in failed]
        numbers = [numbers[index] for index in kept]
        values = {column: [column_values[index] for index in kept]
                  for column, column_values in values.items()}
    values["line_no"] = np.asarray(values["line_no"], dtype=np.int64)
    return ParsedRows(_frame(values, len(numbers), file_name, file_version), rejected, numbers)


def _parse_table(table: CsvTable, file_name: str, file_version: str) -> ParsedRows:
    """The rows of a CSV that Arrow split into columns: every column dictionary-encoded, each
    distinct cell read once by the same readers, rows with a problem read again cell by cell."""
    columns = [column.combine_chunks().dictionary_encode() for column in table.rows.columns]
    codes = [column.indices.to_numpy() for column in columns]
    distinct = [column.dictionary.to_pylist() for column in columns]
    # Rows of nothing but spaces are not rows. The columns of fewest distinct cells first: once
    # every row has a filled cell (a date, say), the others need not be looked at.
    blank = np.ones(table.rows.num_rows, dtype=bool)
    for position in sorted(range(len(columns)), key=lambda position: len(distinct[position])):
        if not blank.any():
            break
        filled = np.array([bool(text.strip()) for text in distinct[position]], dtype=bool)
        blank &= ~filled[codes[position]]
    present = np.flatnonzero(~blank)
    if not len(present):
        raise SourceContractError(f"{file_name}: no data rows below the header ({table.described})")
    numbers = table.first_row_number + present
    plan = _plan(table.positions, date_1904=False)
    failed = np.zeros(len(present), dtype=bool)
    read_columns = {}
    for _, column, position, read in plan:
        typed = read_distinct(distinct[position], read, texts=True)
        column_codes = codes[position][present]
        failed |= np.array([value is UNREADABLE for value in typed], dtype=bool)[column_codes]
        read_columns[column] = (typed, column_codes)
    rejected = [_rejected([texts[column_codes[row]] for texts, column_codes
                           in zip(distinct, codes, strict=True)],
                          int(numbers[index]), plan, file_name, None)
                for index, row in zip(np.flatnonzero(failed), present[failed], strict=True)]
    kept = np.flatnonzero(~failed)
    values = {column: _taken(column, typed, column_codes[kept])
              for column, (typed, column_codes) in read_columns.items()}
    return ParsedRows(_frame(values, len(kept), file_name, file_version), rejected,
                      numbers[kept].tolist())


_TEXT_COLUMNS = frozenset({"object_code", "waybill", "material", "unit", "supplier"})
_TEXT = pd.StringDtype("pyarrow", na_value=np.nan)
"""pandas' ``str``: what a column of Python strings becomes in a frame."""


def _taken(column: str, typed: list[Any], codes: np.ndarray) -> Any:
    """The column's value at each code (an index into ``typed``, the distinct cells read)."""
    typed = [None if value is UNREADABLE else value for value in typed]
    if column in _TEXT_COLUMNS:
        return pd.array(pa.array(typed, pa.string()).take(codes), dtype=_TEXT)
    if column == "line_no":
        return np.array([value or 0 for value in typed], dtype=np.int64)[codes]
    objects = np.empty(len(typed), dtype=object)
    objects[:] = typed
    return objects[codes]


def _frame(values: dict[str, Any], count: int, file_name: str, file_version: str
           ) -> pd.DataFrame:
    if not count:  # every row rejected: untyped columns, as a frame of no records has
        return pd.DataFrame(columns=list(COLUMNS)).astype({"line_no": "int64"})
    every_row = np.zeros(count, dtype=np.int32)
    return pd.DataFrame({
        **values,
        "source_file": pd.array(pa.array([file_name]).take(every_row), dtype=_TEXT),
        "file_version": pd.array(pa.array([file_version]).take(every_row), dtype=_TEXT),
    }, columns=list(COLUMNS))


def _rejected(cells: list[Cell], row_number: int,
              plan: Sequence[tuple[str, str, int, Callable[[Cell], Any]]], file_name: str,
              header_width: int | None) -> RejectedRow:
    """A row that cannot be loaded, with every reason; ``header_width`` if a filled cell right of
    the header is a reason too (CSV)."""
    values, problems = _parse_row(cells, plan)
    if header_width is not None and not is_empty(cells[header_width:]):
        problems.append(
            f"has {len(cells)} cells where the header has {header_width}: a delimiter "
            f"inside an unquoted cell?"
        )
    return RejectedRow(
        row_number=row_number,
        raw=json.dumps(cells, ensure_ascii=False, default=_json_cell),
        reason="; ".join(problems),
        key=_readable_key(values, file_name),
    )


def _column(rows: list[list[Cell]], position: int, shortest: int) -> list[Cell]:
    """The column's cells, an empty text where a row ends before it."""
    if position < shortest:
        return list(map(itemgetter(position), rows))
    return [cells[position] if position < len(cells) else "" for cells in rows]


def _read_sheet(content: bytes, file_name: str, max_bytes: int) -> Sheet | CsvTable:
    if content.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return read_xlsx(content, file_name, max_bytes)
    if content.startswith(b"%PDF-"):
        raise SourceContractError(f"{file_name}: a PDF document, not a CSV or XLSX report")
    if content.startswith(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"):
        raise SourceContractError(
            f"{file_name}: a legacy .xls or password-protected workbook, not a CSV or XLSX "
            f"report (save it as .xlsx or CSV without a password)"
        )
    return read_csv(content, file_name, HEADERS, arrow=True)


def _parse_row(cells: list[Cell], plan: Sequence[tuple[str, str, int, Callable[[Cell], Any]]],
               ) -> tuple[dict[str, Any], list[str]]:
    """The row's values by column in the plan's order (``None`` where unreadable), and what was
    wrong with it. The plan: (header, column, position in the row, reader) per column."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    width = len(cells)
    for name, column, position, read in plan:
        cell = cells[position] if position < width else ""
        try:
            values[column] = read(cell)
        except ValueError as defect:
            values[column] = None
            problems.append(f"{name} {_shown(cell)} {defect}")
    return values, problems


def _shown(cell: Cell) -> str:
    text = cell if isinstance(cell, str) else str(cell)
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _readable_key(values: dict[str, Any], file_name: str) -> dict[str, Any] | None:
    if values["waybill"] is None or values["line_no"] is None:
        return None
    return {"source_file": file_name, "waybill": values["waybill"], "line_no": values["line_no"]}


def _json_cell(cell: Any) -> str:
    return cell.isoformat() if hasattr(cell, "isoformat") else str(cell)
