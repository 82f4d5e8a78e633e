"""CSV text exports of a spreadsheet: decoded, split into cells, rows numbered as a spreadsheet
numbers them.

CSV text is decoded by its BOM (UTF-8, or UTF-16 as Excel's "Unicode text" writes it), else as
strict UTF-8, else as windows-1251: cp1251 Cyrillic is almost never valid UTF-8, while cp1251
decodes nearly any byte, so that order cannot mistake one for the other. The delimiter is the one
of ``;`` (Excel's choice where the decimal separator is a comma), tab and ``,`` under which a row
of the first ten holds the most of the header names the source expects; ties go in that order.
Asked to, the rows below the header are split by Arrow's CSV reader when it splits them exactly
as Python's ``csv`` does (every record as wide as the header, no blank line), else by ``csv``.
"""

from __future__ import annotations

import codecs
import csv
import io
import re
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv

from mostovik_pipelines.core.errors import SourceContractError
from mostovik_pipelines.framework.readers.headers import (
    HEADER_SEARCH_ROWS,
    header_score,
    locate_header,
)
from mostovik_pipelines.framework.readers.sheet import Cell, Sheet

CSV_DELIMITERS = (";", "\t", ",")
# Control characters never appear in a text report: bytes that decode to them are binary data
# or an encoding we do not read.
CONTROL_CHARACTER = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")

_CONTROL_BYTES = bytes(0 if CONTROL_CHARACTER.fullmatch(chr(byte)) else 1 for byte in range(256))
"""Each byte's mark: 0 for the control characters of :data:`CONTROL_CHARACTER`."""


def read_csv(content: bytes, file_name: str, headers: Mapping[str, str], *,
             arrow: bool = False) -> Sheet | CsvTable:
    """The file's rows, the delimiter chosen by ``headers`` (header text -> column). ``arrow``:
    the rows below the header as a :class:`CsvTable` where Arrow can split them (read by column)."""
    text, encoding = _decode(content, file_name)
    if not text.strip():
        raise SourceContractError(f"{file_name}: the file is empty, no data rows")
    # Only the first rows are parsed per delimiter; the chosen one then reads the whole file.
    heads = {delimiter: _csv_rows(text, delimiter, file_name, HEADER_SEARCH_ROWS)
             for delimiter in CSV_DELIMITERS}
    best = max(CSV_DELIMITERS, key=lambda delimiter: header_score(heads[delimiter], headers))
    described = f"read as {encoding}, {_DELIMITER_NAMES[best]}"
    table = _csv_table(text, best, heads[best], described, file_name, headers) if arrow else None
    if table is not None:
        return table
    return Sheet(_csv_rows(text, best, file_name), described, strict_width=True)


@dataclass(frozen=True)
class CsvTable:
    """A CSV report's rows below its header as Arrow split them: text columns, one per cell of
    the header row."""

    rows: pa.Table
    first_row_number: int
    """The number (as :func:`_csv_rows` numbers them) of the table's first row."""
    positions: dict[str, int]
    described: str
    header: list[Cell]
    """The header row's cells."""


def _csv_table(text: str, delimiter: str, head: list[tuple[int, list[Cell]]], described: str,
               file_name: str, headers: Mapping[str, str]) -> CsvTable | None:
    """The rows below the header split by Arrow's CSV reader (in C++, ten times Python's
    ``csv``), or None when it could split them differently from :func:`_csv_rows`, which then
    reads the file. Arrow splits as ``csv`` does (quotes, doubled quotes, newlines in quoted
    cells, ``\r``, ``\n`` or ``\r\n`` between records) when every record is as wide as the
    header and no line below it is blank (``csv`` numbers a blank line, Arrow skips it); it
    refuses rows of another width itself, and cells longer than ``csv`` accepts are refused
    here."""
    try:
        header_at, positions = locate_header(Sheet(head, described), file_name, headers)
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
    return CsvTable(rows, header_number + 1, positions, described, header)


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
