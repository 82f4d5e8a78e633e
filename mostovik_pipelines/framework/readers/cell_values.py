"""How a delivery report's cells become typed values: text, waybill and line numbers, exact
amounts (decimal commas or points, spaces between thousands), dates (``DD.MM.YYYY`` text, date
cells or Excel day counts). A column's distinct cells are read once: a report repeats dates,
sites, materials, units and suppliers on every row."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from mostovik_pipelines.framework.readers.excel_dates import excel_serial_date
from mostovik_pipelines.framework.readers.sheet import Cell

LARGEST_LINE_NO = 2**31 - 1  # an INTEGER column
TEXT_DATE = re.compile(r"(\d{1,2})\.(\d{1,2})\.(\d{4})")
# Digits grouped by thousands with a space, a no-break, narrow no-break or thin space, or not
# grouped; a decimal comma or point.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:[ \u00a0\u202f\u2009]\d{3})+|\d+)(?:[.,]\d+)?")
THOUSANDS_SEPARATORS = str.maketrans("", "", " \u00a0\u202f\u2009")


def read_column(cells: list[Cell], read: Callable[[Cell], Any]) -> tuple[list[Any], list[int]]:
    """Each cell read, ``None`` where it cannot be, and the positions where it cannot. Distinct
    cells are read once; cells count as the same only if they are of the same type (``1``,
    ``1.0`` and ``True`` are equal keys of a dict, and read differently)."""
    types = set(map(type, cells))
    keys: list[Any] = (cells if len(types) == 1
                       else list(zip(map(type, cells), cells, strict=True)))
    distinct = dict.fromkeys(keys)
    cells_read = read_distinct(list(distinct) if keys is cells
                               else [cell for _, cell in distinct], read, texts=types == {str})
    distinct.update(zip(distinct, cells_read, strict=True))
    typed = list(map(distinct.__getitem__, keys))
    if not any(value is UNREADABLE for value in cells_read):
        return typed, []
    unreadable = [index for index, value in enumerate(typed) if value is UNREADABLE]
    for index in unreadable:
        typed[index] = None
    return typed, unreadable


UNREADABLE = object()


def read_distinct(cells: list[Cell], read: Callable[[Cell], Any], *, texts: bool = False
                  ) -> list[Any]:
    """Each cell read (:data:`UNREADABLE` where the reader refuses it); ``texts``: the cells
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
        return UNREADABLE


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


def delivery_date(cell: Cell, *, date_1904: bool) -> date:
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
        return excel_serial_date(cell, date_1904)
    raise ValueError("is not a date in DD.MM.YYYY")


# How each column's cell is read; the date's reader also needs the workbook's date system.
READERS: dict[str, Callable[[Cell], Any]] = {
    "object_code": _text,
    "waybill": _waybill,
    "line_no": _line_no,
    "material": _text,
    "unit": _text,
    "quantity": _amount,
    "price": _amount,
    "supplier": _text,
}
