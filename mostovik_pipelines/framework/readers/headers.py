"""The delivery report's header row: the names the sites' template spells, found among a sheet's
first rows (title rows may stand above it) whatever their case, spacing, dots or order."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from mostovik_pipelines.framework.errors import SourceContractError
from mostovik_pipelines.framework.readers.sheet import Cell, Sheet

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


def header_score(rows: Sequence[tuple[int, list[Cell]]]) -> int:
    return max((len(_header_names(cells)) for _, cells in rows), default=0)


def locate_header(sheet: Sheet, file_name: str) -> tuple[int, dict[str, int]]:
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
