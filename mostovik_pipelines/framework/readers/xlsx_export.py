"""XLSX workbooks exported from a spreadsheet: the first worksheet's rows, once the workbook has
passed the guard that refuses it unread if it is dangerous.

The first worksheet in workbook order is read (a report is one table; other sheets are notes or
lookups); cells are read as values cached by Excel, never evaluated, and a workbook that could be
a zip bomb, links outside itself or carries macros is refused unread.
"""

from __future__ import annotations

import io
import re
import zipfile
import zlib
from collections.abc import Sequence

import python_calamine

from mostovik_pipelines.core.errors import SourceContractError
from mostovik_pipelines.framework.readers.sheet import Sheet, is_empty

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


def read_xlsx(content: bytes, file_name: str, max_bytes: int) -> Sheet:
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
    rows = [(number, cells) for number, cells in enumerate(grid, 1) if not is_empty(cells)]
    if not rows:
        raise SourceContractError(f"{file_name}: worksheet {sheet.name!r} is empty, no data rows")
    return Sheet(rows, f"worksheet {sheet.name!r}", date_1904)


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
