"""Delivery reports as sites export them from their own spreadsheets: the rows of one file.

Sites send CSV or XLSX exports of their own spreadsheets, so the format drifts: UTF-8 (with or
without a BOM) or windows-1251, ``;``, tab or ``,`` between cells, decimal commas with spaces,
no-break or narrow no-break spaces between thousands (``1 234,50``) or decimal points,
``DD.MM.YYYY`` text or real Excel dates, title rows above the header, header names in any case
and spacing, extra columns and any column order. Waybill numbers are text (leading zeros count).

Choices. A file starting with a ZIP signature is read as XLSX, anything else as CSV text. CSV
text is decoded by its BOM (UTF-8, or UTF-16 as Excel's "Unicode text" writes it), else as
strict UTF-8, else as windows-1251: cp1251 Cyrillic is almost never valid UTF-8, while cp1251
decodes nearly any byte, so that order cannot mistake one for the other. The delimiter is the one
of ``;`` (Excel's choice where the decimal separator is a comma), tab and ``,`` under which a row
of the first ten holds the header; ties go in that order. Rows a spreadsheet shows as empty are
not rows. The rows below the header are split by Arrow's CSV reader when it splits them exactly as
Python's ``csv`` does (every record as wide as the header, no blank line), else by ``csv``; either
way each distinct cell of a column is read once, and rows with a problem again for their reasons.
XLSX: the first worksheet in workbook order is read (a report is one table; other
sheets are notes or lookups); cells are read as values cached by Excel, never evaluated, and a
workbook that could be a zip bomb, links outside itself or carries macros is refused unread.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import gc
import io
import json
import re
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal, InvalidOperation
from functools import partial
from operator import itemgetter
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import python_calamine

from mostovik_pipelines.etl.errors import DataValidationError, SourceContractError
from mostovik_pipelines.etl.spec import (
    ParsedRows,
    RejectedRow,
)

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
HEADER_SEARCH_ROWS = 10
# A row of the header search holding at least this many header names is taken for a header
# with columns missing rather than for a title row.
HEADER_MIN_NAMES = 2
CSV_DELIMITERS = (";", "\t", ",")
LARGEST_LINE_NO = 2**31 - 1  # an INTEGER column

MB = 1024 * 1024
# Zip bomb limits, checked on the declared sizes before anything is decompressed. Real XLSX
# unpack to 5-15x their size; a bomb to hundreds or thousands of times.
UNCOMPRESSED_PER_INPUT_BYTE = 20
MAX_UNCOMPRESSED_BYTES = 200 * MB
MAX_MEMBER_RATIO = 100
RATIO_CHECKED_FROM_BYTES = 1 * MB  # small parts compress absurdly well and are harmless
MAX_ZIP_MEMBERS = 10_000
XLSX_MAIN_CONTENT_TYPE = (
    b"application/vnd.openxmlformats-officedocument.spreadsheetml.sheet.main+xml"
)
EXTERNAL_TARGET = re.compile(rb"""TargetMode\s*=\s*["']External["']""")
DATE_1904 = re.compile(rb"""date1904\s*=\s*["'](?:1|true)["']""")

# Excel's 1900 date system counts a 29 February 1900 that never was (serial 60), so the serials
# of real dates start from 30 December 1899; nobody delivered anything before March 1900.
EXCEL_EPOCH = date(1899, 12, 30)
EXCEL_1904_EPOCH = date(1904, 1, 1)
FIRST_REAL_1900_SERIAL = 61

TEXT_DATE = re.compile(r"(\d{1,2})\.(\d{1,2})\.(\d{4})")
# Digits grouped by thousands with a space, a no-break, narrow no-break or thin space, or not
# grouped; a decimal comma or point.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:[ \u00a0\u202f\u2009]\d{3})+|\d+)(?:[.,]\d+)?")
THOUSANDS_SEPARATORS = str.maketrans("", "", " \u00a0\u202f\u2009")
# Control characters never appear in a text report: bytes that decode to them are binary data
# or an encoding we do not read.
CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")

_CONTROL_BYTES = bytes(0 if CONTROL_CHARACTER.fullmatch(chr(byte)) else 1 for byte in range(256))
"""Each byte's mark: 0 for the control characters of :data:`CONTROL_CHARACTER`."""

Cell = Any  # str from CSV; str, float, int, bool, date, datetime, time or timedelta from XLSX


@dataclass(frozen=True)
class _Sheet:
    """The non-empty rows of a file as (row number a spreadsheet shows, cells), and how it was
    read, for messages."""

    rows: list[tuple[int, list[Cell]]]
    described: str
    date_1904: bool = False
    strict_width: bool = False
    """Whether a filled cell right of the header's last column rejects the row. In CSV it means
    a delimiter in an unquoted cell (``12,5`` in a ``,``-delimited file) shifted the row; XLSX
    cells cannot shift, and a note typed beside the table is no defect."""


def parse_delivery_report(content: bytes, file_name: str, file_version: str,
                          max_bytes: int) -> ParsedRows:
    """The rows of one delivery report, typed as :data:`COLUMNS`; a row that cannot be read is
    rejected with its reason (quarantined), the file as a whole must be a readable report."""
    if len(content) > max_bytes:
        raise DataValidationError(
            f"{file_name}: {len(content):,} bytes is over the limit of {max_bytes:,} bytes"
        )
    with _collector_paused():
        return _parse(content, file_name, file_version, max_bytes)


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


def _parse(content: bytes, file_name: str, file_version: str, max_bytes: int) -> ParsedRows:
    source = _read_sheet(content, file_name, max_bytes)
    if isinstance(source, _CsvTable):
        return _parse_table(source, file_name, file_version)
    return _parse_sheet(source, file_name, file_version)


def _plan(positions: dict[str, int], date_1904: bool
          ) -> list[tuple[str, str, int, Callable[[Cell], Any]]]:
    """(header, column, position in a row, reader) for each column of the report."""
    readers = {**_READERS, "delivery_date": partial(_delivery_date, date_1904=date_1904)}
    return [(name, column, positions[column], readers[column]) for name, column in HEADERS.items()]


def _parse_sheet(sheet: _Sheet, file_name: str, file_version: str) -> ParsedRows:
    """The rows of a sheet read row by row (XLSX, and CSV that needs Python's ``csv``), typed a
    column at a time: each distinct cell of a column is read once (a report repeats dates, sites,
    materials, units and suppliers on every row); only rows with a problem are read again, cell
    by cell, for their reason."""
    header_at, positions = _locate_header(sheet, file_name)
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
        values[column], unreadable = _read_column(_column(rows, position, shortest), read)
        failed.update(unreadable)
    if sheet.strict_width:
        failed.update(index for index, cells in enumerate(rows)
                      if len(cells) > header_width and not _is_empty(cells[header_width:]))
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


def _parse_table(table: _CsvTable, file_name: str, file_version: str) -> ParsedRows:
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
        typed = _read_distinct(distinct[position], read, texts=True)
        column_codes = codes[position][present]
        failed |= np.array([value is _UNREADABLE for value in typed], dtype=bool)[column_codes]
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
    typed = [None if value is _UNREADABLE else value for value in typed]
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
    if header_width is not None and not _is_empty(cells[header_width:]):
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


def _read_column(cells: list[Cell], read: Callable[[Cell], Any]) -> tuple[list[Any], list[int]]:
    """Each cell read, ``None`` where it cannot be, and the positions where it cannot. Distinct
    cells are read once; cells count as the same only if they are of the same type (``1``,
    ``1.0`` and ``True`` are equal keys of a dict, and read differently)."""
    types = set(map(type, cells))
    keys: list[Any] = (cells if len(types) == 1
                       else list(zip(map(type, cells), cells, strict=True)))
    distinct = dict.fromkeys(keys)
    cells_read = _read_distinct(list(distinct) if keys is cells
                                else [cell for _, cell in distinct], read, texts=types == {str})
    distinct.update(zip(distinct, cells_read, strict=True))
    typed = list(map(distinct.__getitem__, keys))
    if not any(value is _UNREADABLE for value in cells_read):
        return typed, []
    unreadable = [index for index, value in enumerate(typed) if value is _UNREADABLE]
    for index in unreadable:
        typed[index] = None
    return typed, unreadable


_UNREADABLE = object()


def _read_distinct(cells: list[Cell], read: Callable[[Cell], Any], *, texts: bool = False
                   ) -> list[Any]:
    """Each cell read (:data:`_UNREADABLE` where the reader refuses it); ``texts``: the cells
    are known to be ``str``."""
    if read is _amount and (texts or set(map(type, cells)) == {str}):
        return _amounts(cells)
    return [_read_or_fail(read, cell) for cell in cells]


# The plain form of an amount (ASCII digits, thousands grouped by one of the separators or not,
# a decimal comma or point, nothing around): a subset of what NUMBER accepts, which Arrow's regex
# engine checks for a whole column at once.
PLAIN_AMOUNT = r"^(?:[0-9]{1,3}(?:[ \x{00a0}\x{202f}\x{2009}][0-9]{3})+|[0-9]+)(?:[.,][0-9]+)?$"


def _amounts(texts: list[str]) -> list[Any]:
    """:func:`_amount` of each text: the plain ones checked and cleaned by column, the rest
    (spaces around, a minus, other digits, not a number) read one by one."""
    column = pa.array(texts, pa.string())
    plain = pc.match_substring_regex(column, PLAIN_AMOUNT).to_numpy(zero_copy_only=False)
    digits = pc.replace_substring(
        pc.replace_substring_regex(column, r"[ \x{00a0}\x{202f}\x{2009}]", ""), ",", "."
    ).to_pylist()
    if plain.all():
        return list(map(Decimal, digits))
    return [Decimal(number) if is_plain else _read_or_fail(_amount, text)
            for text, number, is_plain in zip(texts, digits, plain, strict=True)]


def _read_or_fail(read: Callable[[Cell], Any], cell: Cell) -> Any:
    try:
        return read(cell)
    except ValueError:
        return _UNREADABLE


def _read_sheet(content: bytes, file_name: str, max_bytes: int) -> _Sheet | _CsvTable:
    if content.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return _read_xlsx(content, file_name, max_bytes)
    if content.startswith(b"%PDF-"):
        raise SourceContractError(f"{file_name}: a PDF document, not a CSV or XLSX report")
    if content.startswith(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"):
        raise SourceContractError(
            f"{file_name}: a legacy .xls or password-protected workbook, not a CSV or XLSX "
            f"report (save it as .xlsx or CSV without a password)"
        )
    return _read_csv(content, file_name)


# CSV


def _read_csv(content: bytes, file_name: str) -> _Sheet | _CsvTable:
    text, encoding = _decode(content, file_name)
    if not text.strip():
        raise SourceContractError(f"{file_name}: the file is empty, no data rows")
    # Only the first rows are parsed per delimiter; the chosen one then reads the whole file.
    heads = {delimiter: _csv_rows(text, delimiter, file_name, HEADER_SEARCH_ROWS)
             for delimiter in CSV_DELIMITERS}
    best = max(CSV_DELIMITERS, key=lambda delimiter: _header_score(heads[delimiter]))
    described = f"read as {encoding}, {_DELIMITER_NAMES[best]}"
    table = _csv_table(text, best, heads[best], described, file_name)
    if table is not None:
        return table
    return _Sheet(_csv_rows(text, best, file_name), described, strict_width=True)


@dataclass(frozen=True)
class _CsvTable:
    """A CSV report's rows below its header as Arrow split them: text columns, one per cell of
    the header row."""

    rows: pa.Table
    first_row_number: int
    """The number (as :func:`_csv_rows` numbers them) of the table's first row."""
    positions: dict[str, int]
    described: str


def _csv_table(text: str, delimiter: str, head: list[tuple[int, list[Cell]]], described: str,
               file_name: str) -> _CsvTable | None:
    """The rows below the header split by Arrow's CSV reader (in C++, ten times Python's
    ``csv``), or None when it could split them differently from :func:`_csv_rows`, which then
    reads the file. Arrow splits as ``csv`` does (quotes, doubled quotes, newlines in quoted
    cells, ``\r``, ``\n`` or ``\r\n`` between records) when every record is as wide as the
    header and no line below it is blank (``csv`` numbers a blank line, Arrow skips it); it
    refuses rows of another width itself, and cells longer than ``csv`` accepts are refused
    here."""
    try:
        header_at, positions = _locate_header(_Sheet(head, described), file_name)
    except SourceContractError:
        return None  # reading the whole file row by row says what is wrong, in its own order
    header_number, header = head[header_at]
    lines = _Lines(text)
    reader = csv.reader(lines, delimiter=delimiter)
    for _ in range(header_number):
        next(reader)
    below = text[lines.taken:]
    lines = below.rstrip("\r\n")
    if not lines or lines.startswith(("\r", "\n")) or any(
            blank in lines for blank in ("\n\n", "\n\r", "\r\r")):
        return None
    names = [str(position) for position in range(len(header))]
    try:
        encoded = below.encode()
    except UnicodeEncodeError:  # a lone surrogate: Python's csv reads it, Arrow would not
        return None
    try:
        rows = pa_csv.read_csv(
            pa.BufferReader(encoded),
            read_options=pa_csv.ReadOptions(column_names=names, use_threads=False),
            parse_options=pa_csv.ParseOptions(delimiter=delimiter, newlines_in_values=True,
                                              ignore_empty_lines=True),
            convert_options=pa_csv.ConvertOptions(
                column_types=dict.fromkeys(names, pa.string()), null_values=[],
                strings_can_be_null=False, quoted_strings_can_be_null=False),
        )
    except pa.ArrowInvalid:
        return None
    limit = csv.field_size_limit()
    if any((pc.max(pc.utf8_length(column)).as_py() or 0) > limit for column in rows.columns):
        return None
    return _CsvTable(rows, header_number + 1, positions, described)


_DELIMITER_NAMES = {";": "';'-delimited", "\t": "tab-delimited", ",": "','-delimited"}


def _decode(content: bytes, file_name: str) -> tuple[str, str]:
    if content.startswith(codecs.BOM_UTF8):
        candidates = [("utf-8", content[len(codecs.BOM_UTF8):])]
    elif content.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        candidates = [("utf-16", content)]
    else:
        candidates = [("utf-8", content), ("windows-1251", content)]
    for encoding, data in candidates:
        try:
            text = data.decode(encoding)
        except UnicodeDecodeError:
            continue
        # In UTF-8 and windows-1251 a control character is its own byte: looking for the byte
        # is quicker than the regex over the text, which then says where.
        control = (CONTROL_CHARACTER.search(text)
                   if encoding == "utf-16" or data.translate(_CONTROL_BYTES).find(0) >= 0
                   else None)
        if control:
            raise SourceContractError(
                f"{file_name}: not CSV text: binary data or an unreadable encoding (character "
                f"U+{ord(control.group()):04X} at position {control.start()} when read as "
                f"{encoding})"
            )
        return text, encoding
    raise SourceContractError(
        f"{file_name}: not CSV text: binary data or an unreadable encoding (neither "
        f"{' nor '.join(encoding for encoding, _ in candidates)})"
    )


class _Lines:
    """The text's lines as ``io.StringIO(text, newline="")`` hands them to ``csv.reader`` (each
    ending at ``\r\n``, ``\r`` or ``\n``, kept), without copying the text; ``taken``: the
    characters handed out so far."""

    LINE = re.compile(r"[^\r\n]*(?:\r\n?|\n)|[^\r\n]+")

    def __init__(self, text: str) -> None:
        self._matches = self.LINE.finditer(text)
        self.taken = 0

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        line = next(self._matches)
        self.taken = line.end()
        return line.group()


def _csv_rows(text: str, delimiter: str, file_name: str,
              limit: int | None = None) -> list[tuple[int, list[Cell]]]:
    """Non-empty records numbered as a spreadsheet numbers them: blank lines count, a quoted
    cell spanning lines does not."""
    rows: list[tuple[int, list[Cell]]] = []
    # A few rows are read from the text's lines in place (a StringIO would copy the whole text).
    lines = io.StringIO(text, newline="") if limit is None else _Lines(text)
    reader = csv.reader(lines, delimiter=delimiter)
    try:
        for number, cells in enumerate(reader, 1):
            if "".join(cells).strip():  # a cell with more than spaces in it
                rows.append((number, cells))
                if limit is not None and len(rows) >= limit:
                    break
    except csv.Error as exc:
        raise SourceContractError(
            f"{file_name}: not readable CSV near line {reader.line_num} ({exc})"
        ) from exc
    return rows


# XLSX


def _read_xlsx(content: bytes, file_name: str, max_bytes: int) -> _Sheet:
    """The first worksheet's rows, read by calamine (Rust) once the archive passed
    :func:`_check_xlsx`. Calamine returns the values Excel cached and evaluates no formula; its
    zip reader stops a part at its declared size (checked here), and its XML parser (quick-xml)
    expands no entity: a reference to one declared in a DTD fails the read."""
    date_1904 = _check_xlsx(content, file_name, max_bytes)
    try:
        with python_calamine.CalamineWorkbook.from_filelike(io.BytesIO(content)) as book:
            first = next((index for index, sheet in enumerate(book.sheets_metadata)
                          if sheet.typ == python_calamine.SheetTypeEnum.WorkSheet), None)
            if first is None:
                raise SourceContractError(f"{file_name}: the workbook has no worksheet")
            sheet = book.get_sheet_by_index(first)
            grid = sheet.to_python(skip_empty_area=False)
    except python_calamine.CalamineError as exc:
        raise SourceContractError(f"{file_name}: unreadable XLSX ({exc})") from exc
    rows = [(number, cells) for number, cells in enumerate(grid, 1) if not _is_empty(cells)]
    if not rows:
        raise SourceContractError(f"{file_name}: worksheet {sheet.name!r} is empty, no data rows")
    return _Sheet(rows, f"worksheet {sheet.name!r}", date_1904)


def _check_xlsx(content: bytes, file_name: str, max_bytes: int) -> bool:
    """Refuse what is not a plain XLSX or is dangerous to unpack, before any part is inflated;
    whether the workbook counts dates from 1904."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(content))
    except zipfile.BadZipFile as exc:
        raise SourceContractError(f"{file_name}: a damaged ZIP archive ({exc})") from exc
    with archive:
        members = archive.infolist()
        names = {member.filename for member in members}
        if not {"[Content_Types].xml", "xl/workbook.xml"} <= names:
            raise SourceContractError(
                f"{file_name}: a ZIP archive that is not an XLSX workbook (no xl/workbook.xml)"
            )
        if len(names) != len(members):
            # Readers disagree on which of two same-named parts counts.
            raise SourceContractError(f"{file_name}: the XLSX archive repeats a part's name")
        _refuse_zip_bomb(members, file_name, max_bytes)
        if any(name.startswith("xl/externalLinks/") for name in names):
            raise SourceContractError(f"{file_name}: the workbook links to other workbooks")
        if "xl/vbaProject.bin" in names:
            raise SourceContractError(
                f"{file_name}: a macro-enabled workbook (.xlsm), not an XLSX report"
            )
        try:
            content_types, workbook, relationships = [
                archive.read(name) if name in names else b""
                for name in ("[Content_Types].xml", "xl/workbook.xml", "xl/_rels/workbook.xml.rels")
            ]
        except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError,
                NotImplementedError) as exc:
            raise SourceContractError(f"{file_name}: a damaged XLSX archive ({exc})") from exc
    if XLSX_MAIN_CONTENT_TYPE not in content_types:
        raise SourceContractError(
            f"{file_name}: not an XLSX workbook (a template, macro-enabled or other OOXML file)"
        )
    if EXTERNAL_TARGET.search(relationships):
        raise SourceContractError(
            f"{file_name}: the workbook has external relationships (links outside the file)"
        )
    return bool(DATE_1904.search(workbook))


def _refuse_zip_bomb(members: Sequence[zipfile.ZipInfo], file_name: str, max_bytes: int) -> None:
    if len(members) > MAX_ZIP_MEMBERS:
        raise SourceContractError(f"{file_name}: {len(members):,} parts in the XLSX archive")
    limit = min(MAX_UNCOMPRESSED_BYTES, UNCOMPRESSED_PER_INPUT_BYTE * max_bytes)
    total = sum(member.file_size for member in members)
    if total > limit:
        raise SourceContractError(
            f"{file_name}: the XLSX unpacks to {total:,} bytes, over the limit of {limit:,} "
            f"(a zip bomb?)"
        )
    for member in members:
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size >= RATIO_CHECKED_FROM_BYTES and ratio > MAX_MEMBER_RATIO:
            raise SourceContractError(
                f"{file_name}: {member.filename} is compressed {ratio:,.0f} to 1, more than "
                f"{MAX_MEMBER_RATIO} to 1 (a zip bomb?)"
            )


# Header


def _normalised(cell: Cell) -> str:
    """A header name as compared: case, spaces and dots do not count (``Ед.изм.``, ``ЕД. ИЗМ``)."""
    return re.sub(r"[\s.]+", "", str(cell)).casefold().replace("ё", "е")


_KNOWN_HEADERS = {_normalised(name): name for name in HEADERS}


def _header_names(cells: Iterable[Cell]) -> dict[str, list[int]]:
    """The report's header names in a row, each with the positions it stands at."""
    found: dict[str, list[int]] = {}
    for position, cell in enumerate(cells):
        name = _KNOWN_HEADERS.get(_normalised(cell))
        if name is not None:
            found.setdefault(name, []).append(position)
    return found


def _header_score(rows: Sequence[tuple[int, list[Cell]]]) -> int:
    return max((len(_header_names(cells)) for _, cells in rows), default=0)


def _locate_header(sheet: _Sheet, file_name: str) -> tuple[int, dict[str, int]]:
    """The header's index among the sheet's rows, and each column's position in a row."""
    searched = sheet.rows[:HEADER_SEARCH_ROWS]
    candidates = [(len(_header_names(cells)), index) for index, (_, cells) in enumerate(searched)]
    found, index = max(candidates, key=lambda c: (c[0], -c[1]))
    if found < HEADER_MIN_NAMES:
        raise SourceContractError(
            f"{file_name}: no header row ({', '.join(HEADERS)}) in the first "
            f"{len(searched)} rows ({sheet.described})"
        )
    row_number, cells = sheet.rows[index]
    names = _header_names(cells)
    missing = [name for name in HEADERS if name not in names]
    if missing:
        raise SourceContractError(
            f"{file_name}: the header in row {row_number} lacks the columns "
            f"{', '.join(missing)} ({sheet.described})"
        )
    repeated = {name: positions for name, positions in names.items() if len(positions) > 1}
    if repeated:
        name, positions = next(iter(repeated.items()))
        raise SourceContractError(
            f"{file_name}: the header in row {row_number} has the column {name} "
            f"{len(positions)} times"
        )
    return index, {HEADERS[name]: positions[0] for name, positions in names.items()}


# Rows


def _is_empty(cells: Iterable[Cell]) -> bool:
    for cell in cells:  # a loop, not all(...): called for every row of a sheet
        if cell is not None and not (isinstance(cell, str) and not cell.strip()):
            return False
    return True


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


def _text(cell: Cell) -> str:
    if type(cell) is str:  # the common case first: most cells of most files are text
        return cell.strip()
    if isinstance(cell, float) and cell.is_integer():
        return str(int(cell))  # a code typed into a numeric cell: 784512, not 784512.0
    return cell.strip() if isinstance(cell, str) else str(cell)


def _waybill(cell: Cell) -> str:
    if isinstance(cell, float) and not cell.is_integer():
        raise ValueError("is a fractional number, not a waybill number")
    text = _text(cell)
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


def _amount(cell: Cell) -> Decimal:
    """An exact decimal: a number typed into a cell (the shortest decimal that reads back as
    Excel's double) or text with a decimal comma or point and spaces between thousands."""
    if isinstance(cell, str):
        text = cell.strip()
        if not text:
            raise ValueError("is empty")
        if not NUMBER.fullmatch(text):
            raise ValueError("is not a number")
        try:
            amount = Decimal(text.translate(THOUSANDS_SEPARATORS).replace(",", "."))
        except InvalidOperation as exc:
            raise ValueError("is not a number") from exc
    elif isinstance(cell, float) and cell.is_integer():
        amount = Decimal(int(cell))
    elif isinstance(cell, int | float) and not isinstance(cell, bool):
        amount = Decimal(repr(cell))
    else:
        raise ValueError("is not a number")
    if not amount.is_finite():
        raise ValueError("is not a number")
    if amount < 0:
        raise ValueError("is negative")
    return amount


def _delivery_date(cell: Cell, *, date_1904: bool) -> date:
    if isinstance(cell, str):
        text = cell.strip()
        if not text:
            raise ValueError("is empty")
        match = TEXT_DATE.fullmatch(text)
        if match:
            try:
                return date(int(match[3]), int(match[2]), int(match[1]))
            except ValueError as exc:
                raise ValueError("is not a date") from exc
    elif isinstance(cell, datetime):
        return cell.date()
    elif isinstance(cell, date):
        return cell
    elif isinstance(cell, int | float) and not isinstance(cell, bool):
        return _excel_serial_date(cell, date_1904)
    raise ValueError("is not a date in DD.MM.YYYY")


def _excel_serial_date(serial: float, date_1904: bool) -> date:
    """A date typed as a plain number: Excel's day count (its date cells arrive as dates)."""
    epoch, first = (EXCEL_1904_EPOCH, 0) if date_1904 else (EXCEL_EPOCH, FIRST_REAL_1900_SERIAL)
    with contextlib.suppress(ValueError, OverflowError):  # NaN, infinity, past the year 9999
        days = int(serial)
        if days >= first:
            return epoch + timedelta(days=days)
    raise ValueError("is not an Excel date")


# How each column's cell is read; the date's reader also needs the workbook's date system.
_READERS: dict[str, Callable[[Cell], Any]] = {
    "object_code": _text,
    "waybill": _waybill,
    "line_no": _line_no,
    "material": _text,
    "unit": _text,
    "quantity": _amount,
    "price": _amount,
    "supplier": _text,
}
