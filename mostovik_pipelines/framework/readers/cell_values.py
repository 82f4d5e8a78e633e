"""How a spreadsheet export's cells become typed values: text, exact amounts (decimal commas or
points, spaces between thousands), dates (``DD.MM.YYYY`` text, date cells or Excel day counts).
A reader raises ``ValueError`` with its reason, a source's own readers too. A column's distinct
cells are read once: a report repeats dates, codes and names on every row."""

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
    if read is cell_amount and (texts or set(map(type, cells)) == {str}):
        return _amounts(cells)
    return [_read_or_fail(read, cell) for cell in cells]


# The plain form of an amount (ASCII digits, thousands grouped by one of the separators or not,
# a decimal comma or point, nothing around): a subset of what NUMBER accepts, which Arrow's regex
# engine checks for a whole column at once.
PLAIN_AMOUNT = r"^(?:[0-9]{1,3}(?:[ \x{00a0}\x{202f}\x{2009}][0-9]{3})+|[0-9]+)(?:[.,][0-9]+)?$"


def _amounts(texts: list[str]) -> list[Any]:
    """:func:`cell_amount` of each text: the plain ones checked and cleaned by column, the rest
    (spaces around, a minus, other digits, not a number) read one by one."""
    column = pa.array(texts, pa.string())
    plain = pc.match_substring_regex(column, PLAIN_AMOUNT).to_numpy(zero_copy_only=False)
    digits = pc.replace_substring(
        pc.replace_substring_regex(column, r"[ \x{00a0}\x{202f}\x{2009}]", ""), ",", "."
    ).to_pylist()
    if plain.all():
        return list(map(Decimal, digits))
    return [Decimal(number) if is_plain else _read_or_fail(cell_amount, text)
            for text, number, is_plain in zip(texts, digits, plain, strict=True)]


def _read_or_fail(read: Callable[[Cell], Any], cell: Cell) -> Any:
    try:
        return read(cell)
    except ValueError:
        return UNREADABLE


def cell_text(cell: Cell) -> str:
    if type(cell) is str:  # the common case first: most cells of most files are text
        return cell.strip()
    if isinstance(cell, float) and cell.is_integer():
        return str(int(cell))  # a code typed into a numeric cell: 784512, not 784512.0
    return cell.strip() if isinstance(cell, str) else str(cell)


def cell_amount(cell: Cell) -> Decimal:
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


def cell_date(cell: Cell, *, date_1904: bool) -> date:
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
