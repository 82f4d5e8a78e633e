"""A sheet: the rows of one spreadsheet export that a spreadsheet shows as non-empty, numbered
as it shows them, with how the file was read (for messages). The CSV and XLSX readers both hand
their rows on as one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

Cell = Any  # str from CSV; str, float, int, bool, date, datetime, time or timedelta from XLSX


@dataclass(frozen=True)
class Sheet:
    """The non-empty rows of a file as (row number a spreadsheet shows, cells), and how it was
    read, for messages."""

    rows: list[tuple[int, list[Cell]]]
    described: str
    date_1904: bool = False
    strict_width: bool = False
    """Whether a filled cell right of the header's last column rejects the row. In CSV it means
    a delimiter in an unquoted cell (``12,5`` in a ``,``-delimited file) shifted the row; XLSX
    cells cannot shift, and a note typed beside the table is no defect."""


def is_empty(cells: Iterable[Cell]) -> bool:
    for cell in cells:  # a loop, not all(...): called for every row of a sheet
        if cell is not None and not (isinstance(cell, str) and not cell.strip()):
            return False
    return True
