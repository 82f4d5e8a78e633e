"""A spreadsheet export's header row: the names a source expects, found among a sheet's first
rows (title rows may stand above it) whatever their case, spacing, dots or order. A source
passes its names as a mapping, header text -> the column it fills."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from mostovik_pipelines.core.errors import SourceContractError
from mostovik_pipelines.framework.quality.shape import (
    SAMPLE_VALUES,
    ObservedShape,
    observe_columns,
)
from mostovik_pipelines.framework.readers.sheet import Cell, Sheet

HEADER_SEARCH_ROWS = 10
# A row of the header search holding at least this many header names is taken for a header
# with columns missing rather than for a title row.
HEADER_MIN_NAMES = 2


def _normalised(cell: Cell) -> str:
    """A header name as compared: case, spaces and dots do not count (``Ед.изм.``, ``ЕД. ИЗМ``)."""
    return re.sub(r"[\s.]+", "", str(cell)).casefold().replace("ё", "е")


def _header_names(cells: Iterable[Cell], headers: Mapping[str, str]) -> dict[str, list[int]]:
    """The expected header names in a row, each with the positions it stands at."""
    known = {_normalised(name): name for name in headers}
    found: dict[str, list[int]] = {}
    for position, cell in enumerate(cells):
        name = known.get(_normalised(cell))
        if name is not None:
            found.setdefault(name, []).append(position)
    return found


def header_score(rows: Sequence[tuple[int, list[Cell]]], headers: Mapping[str, str]) -> int:
    """The most of the expected header names any one of the rows holds."""
    return max((len(_header_names(cells, headers)) for _, cells in rows), default=0)


def header_row(sheet: Sheet, headers: Mapping[str, str]) -> int | None:
    """The index of the row that looks most like the header (the first of equals), columns
    missing or not; None when no row of the search holds enough of the names."""
    searched = sheet.rows[:HEADER_SEARCH_ROWS]
    candidates = [(len(_header_names(cells, headers)), index)
                  for index, (_, cells) in enumerate(searched)]
    found, index = max(candidates, key=lambda c: (c[0], -c[1]), default=(0, 0))
    return index if found >= min(HEADER_MIN_NAMES, len(headers)) else None


def named_columns(cells: Sequence[Cell], headers: Mapping[str, str]) -> list[tuple[int, str]]:
    """(position, name) of every named cell of a header row: an expected name as the source
    spells it in ``headers``, any other as written."""
    known = {_normalised(name): name for name in headers}
    return [(position, known.get(_normalised(cell), str(cell).strip()))
            for position, cell in enumerate(cells) if cell is not None and str(cell).strip()]


def observe_sheet(sheet: Sheet, headers: Mapping[str, str]) -> ObservedShape | None:
    """The sheet's columns as sent (:mod:`..quality.shape`): the header's names and a sample of
    each column's values, :data:`SAMPLE_VALUES` rows spread over the sheet; None when no row
    looks like the header."""
    at = header_row(sheet, headers)
    if at is None:
        return None
    below = [cells for _, cells in sheet.rows[at + 1:]]
    if len(below) > SAMPLE_VALUES:
        below = [below[int(i * len(below) / SAMPLE_VALUES)] for i in range(SAMPLE_VALUES)]
    named = named_columns(sheet.rows[at][1], headers)
    return observe_columns([name for _, name in named],
                           [[cells[position] if position < len(cells) else None
                             for cells in below] for position, _ in named])


def locate_header(sheet: Sheet, file_name: str, headers: Mapping[str, str]
                  ) -> tuple[int, dict[str, int]]:
    """The header's index among the sheet's rows, and each column's position in a row."""
    searched = sheet.rows[:HEADER_SEARCH_ROWS]
    index = header_row(sheet, headers)
    if index is None:
        raise SourceContractError(
            f"{file_name}: no header row ({', '.join(headers)}) in the first "
            f"{len(searched)} rows ({sheet.described})"
        )
    row_number, cells = sheet.rows[index]
    names = _header_names(cells, headers)
    missing = [name for name in headers if name not in names]
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
    return index, {headers[name]: positions[0] for name, positions in names.items()}
