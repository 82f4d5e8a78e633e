"""Material delivery reports as the sites send them, as bytes, with the rows each must parse to.

A report is built in two steps: :func:`report_table` lays deliveries out as cells (header
spelling, column order, extra columns, how dates and numbers are written), then :func:`csv_report`
or :func:`xlsx_report` writes the cells as a file (encoding, delimiter, title rows, trailing empty
rows). Tests change single cells in between to make bad rows. The defect builders at the end make
files the parser must refuse as a whole.
"""

from __future__ import annotations

import csv
import io
import random
import re
import struct
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal
from typing import Any

from openpyxl import Workbook
from openpyxl.cell import WriteOnlyCell
from openpyxl.styles import PatternFill
from openpyxl.utils.datetime import CALENDAR_MAC_1904

HEADERS = (
    "Дата поставки", "Объект", "Накладная", "Строка", "Материал", "Ед. изм.", "Количество",
    "Цена", "Поставщик",
)
# The same names as exports and hand-edited files spell them.
HEADER_VARIANTS = (
    "ДАТА ПОСТАВКИ", "объект", "накладная ", "Строка", " Материал", "Ед.изм.", "КОЛИЧЕСТВО",
    "цена", "Поставщик  ",
)
TITLE_ROWS = (
    "Отчёт о поставках материалов на объект",
    "Период: 01.11.2026 – 30.11.2026, выгружено 01.12.2026 09:15",
)
EXCEL_1900_EPOCH = date(1899, 12, 30)
EXCEL_1904_EPOCH = date(1904, 1, 1)

OBJECTS = ("МСК-ЖК-014", "СПБ-БЦ-003", "КЗН-МОСТ-07", "ЕКБ-ШК-112")
# (material, unit, price range in roubles, decimal places of the quantity, quantity range)
MATERIALS = (
    ("Бетон В25 П4 F200 W6", "м3", (5_800, 7_200), 3, (0.5, 60)),
    ("Арматура А500С ф12", "т", (62_000, 75_000), 3, (0.1, 25)),
    ("Кирпич керамический М150", "шт", (18, 35), 0, (500, 20_000)),
    ("Цемент ПЦ 500-Д0, мешок 50 кг", "шт", (450, 650), 0, (10, 400)),
    ("Щебень гранитный фр. 20-40", "т", (1_800, 2_600), 2, (5, 120)),
    ("Утеплитель «Техноблок», 50 мм", "м2", (180, 320), 2, (20, 900)),
    ("Гипсокартон ГКЛ 12,5 мм", "лист", (350, 520), 0, (10, 600)),
)
SUPPLIERS = ('ООО "СтройБетон"', "АО «Северсталь»", "ИП Петров А. В.",
             'ООО "ТД "Кирпичный двор""')


@dataclass(frozen=True)
class Delivery:
    """One waybill line as the site recorded it, typed as the parser must return it."""

    delivery_date: date
    object_code: str
    waybill: str
    line_no: int
    material: str
    unit: str
    quantity: Decimal
    price: Decimal
    supplier: str


def deliveries(count: int, seed: int = 1, *, numeric_waybills: bool = False) -> list[Delivery]:
    """``count`` realistic waybill lines of November 2026, 1 to 5 per waybill, keys unique.
    Waybill numbers have leading zeros, letters and slashes, unless ``numeric_waybills``
    (digits, no leading zero: what a numeric XLSX cell can hold)."""
    rng = random.Random(seed)
    lines: list[Delivery] = []
    waybill_no = 784_500
    while len(lines) < count:
        waybill_no += rng.randint(1, 9)
        if numeric_waybills:
            waybill = str(waybill_no)
        else:
            waybill = rng.choice((f"{waybill_no:08d}", f"НК-2026/{waybill_no}", f"{waybill_no}"))
        day = date(2026, 11, 2) + timedelta(days=rng.randint(0, 27))
        site, supplier = rng.choice(OBJECTS), rng.choice(SUPPLIERS)
        for line_no in range(1, rng.randint(1, 5) + 1):
            material, unit, (low, high), places, (q_low, q_high) = rng.choice(MATERIALS)
            quantity = Decimal(str(round(rng.uniform(q_low, q_high), places)))
            lines.append(Delivery(
                delivery_date=day, object_code=site, waybill=waybill, line_no=line_no,
                material=material, unit=unit,
                quantity=quantity.quantize(Decimal(1).scaleb(-places)),
                price=Decimal(rng.randint(low * 100, high * 100)).scaleb(-2),
                supplier=supplier,
            ))
    return lines[:count]


def expected_rows(lines: Sequence[Delivery], file_name: str,
                  file_version: str) -> list[dict[str, Any]]:
    """The rows the parser must return for ``lines``, as ``frame.to_dict("records")`` gives."""
    return [{
        "delivery_date": line.delivery_date, "object_code": line.object_code,
        "waybill": line.waybill, "line_no": line.line_no, "material": line.material,
        "unit": line.unit, "quantity": line.quantity, "price": line.price,
        "supplier": line.supplier, "source_file": file_name, "file_version": file_version,
    } for line in lines]


@dataclass(frozen=True)
class Layout:
    """How a report lays its columns out and writes its values."""

    headers: Sequence[str] = HEADERS
    """The nine header names in the standard order, as this file spells them."""
    order: Sequence[int] = tuple(range(9))
    """The standard columns' order in the file, as indexes into ``headers``."""
    extra_columns: Sequence[tuple[int, str]] = ()
    """Columns the parser must ignore: (position in the file's row, header)."""
    decimal: str = ","
    thousands: str = " "
    dates: str = "text"
    """``text`` (DD.MM.YYYY), ``cell`` (XLSX date cells), ``serial`` (XLSX plain numbers)."""
    numbers: str = "text"
    """``text`` (formatted with ``decimal`` and ``thousands``) or ``cell`` (XLSX numbers)."""
    waybills: str = "text"
    """``text`` or ``number`` (XLSX numeric cells: the waybills must be digits)."""
    date_1904: bool = False
    """Serial dates count from 1904 (old Mac Excel workbooks); give :func:`xlsx_report` the same
    flag."""


def report_table(lines: Sequence[Delivery], layout: Layout = Layout()) -> list[list[Any]]:
    """The header row and one row of cells per line, laid out as ``layout`` says."""
    header = _arrange([layout.headers[index] for index in layout.order], layout, None)
    rows = [header]
    for number, line in enumerate(lines, 1):
        cells = _cells(line, layout)
        rows.append(_arrange([cells[index] for index in layout.order], layout, number))
    return rows


def set_cell(table: list[list[Any]], data_row: int, header: str, value: Any) -> None:
    """Overwrite one cell of a data row (0-based, below the header) found by its header."""
    table[1 + data_row][table[0].index(header)] = value


def format_amount(amount: Decimal, decimal: str = ",", thousands: str = " ") -> str:
    """``amount`` as a person types it: ``1 234,50`` (its scale kept)."""
    sign, digits = ("-", -amount) if amount < 0 else ("", amount)
    whole, _, fraction = f"{digits:f}".partition(".")
    groups = [whole[max(0, end - 3):end] for end in range(len(whole), 0, -3)][::-1]
    return sign + thousands.join(groups) + (decimal + fraction if fraction else "")


def _cells(line: Delivery, layout: Layout) -> list[Any]:
    if layout.dates == "text":
        when: Any = line.delivery_date.strftime("%d.%m.%Y")
    elif layout.dates == "cell":
        when = line.delivery_date
    else:
        epoch = EXCEL_1904_EPOCH if layout.date_1904 else EXCEL_1900_EPOCH
        when = (line.delivery_date - epoch).days
    if layout.numbers == "text":
        quantity: Any = format_amount(line.quantity, layout.decimal, layout.thousands)
        price: Any = format_amount(line.price, layout.decimal, layout.thousands)
        line_no: Any = str(line.line_no)
    else:
        quantity, price, line_no = float(line.quantity), float(line.price), line.line_no
    waybill = int(line.waybill) if layout.waybills == "number" else line.waybill
    return [when, line.object_code, waybill, line_no, line.material, line.unit, quantity, price,
            line.supplier]


def _arrange(cells: list[Any], layout: Layout, number: int | None) -> list[Any]:
    for position, header in layout.extra_columns:
        cells.insert(position, header if number is None else _extra_value(header, number))
    return cells


def _extra_value(header: str, number: int) -> Any:
    return number if header.startswith("№") else f"{header.lower()} {number}"


# Files


def csv_report(table: Sequence[Sequence[Any]], *, encoding: str = "utf-8", bom: bool = False,
               delimiter: str = ";", newline: str = "\r\n", title_rows: Sequence[str] = (),
               trailing_empty_rows: int = 0) -> bytes:
    """The table as CSV bytes, as Excel's "Save as CSV" writes it: title rows each in the first
    cell followed by a blank line, trailing rows of empty cells (a range once formatted)."""
    text = io.StringIO()
    writer = csv.writer(text, delimiter=delimiter, lineterminator=newline)
    width = len(table[0])
    for title in title_rows:
        writer.writerow([title] + [""] * (width - 1))
    if title_rows:
        text.write(newline)
    writer.writerows(table)
    for _ in range(trailing_empty_rows):
        writer.writerow([""] * width)
    prefix = "\ufeff" if bom else ""
    return (prefix + text.getvalue()).encode(encoding)


def first_data_row_number(title_rows: Sequence[str] = ()) -> int:
    """The row number a spreadsheet shows for the first data row of :func:`csv_report`'s and
    :func:`xlsx_report`'s files: below the title rows, their blank row and the header."""
    return len(title_rows) + (1 if title_rows else 0) + 2


def xlsx_report(table: Sequence[Sequence[Any]], *, title_rows: Sequence[str] = (),
                trailing_empty_rows: int = 0, sheet_name: str = "Поставки",
                other_sheets: Sequence[str] = (), date_1904: bool = False) -> bytes:
    """The table as an XLSX workbook like an accounting export: title rows above the header,
    a blank row, trailing rows of formatted empty cells, further sheets after the first."""
    book = Workbook(write_only=True)
    if date_1904:
        book.epoch = CALENDAR_MAC_1904
    sheet = book.create_sheet(sheet_name)
    for title in title_rows:
        sheet.append([title])
    if title_rows:
        sheet.append([])
    for row in table:
        sheet.append(list(row))
    shaded = PatternFill("solid", fgColor="FFF2CC")
    for _ in range(trailing_empty_rows):
        empty = [WriteOnlyCell(sheet) for _ in table[0]]
        for cell in empty:
            cell.fill = shaded
        sheet.append(empty)
    for name in other_sheets:
        book.create_sheet(name).append(["Справочник объектов", "не данные"])
    output = io.BytesIO()
    book.save(output)
    return output.getvalue()


def benchmark_lines(count: int) -> list[Delivery]:
    """``count`` lines for benchmarks, the same for every run."""
    return deliveries(count, seed=20261101)


def benchmark_xlsx(count: int) -> bytes:
    """An ``count``-row XLSX as the accounting system exports it: date cells, numeric cells."""
    return xlsx_report(report_table(benchmark_lines(count), Layout(dates="cell", numbers="cell")),
                       title_rows=TITLE_ROWS)


def benchmark_csv(count: int) -> bytes:
    """An ``count``-row windows-1251 ``;`` CSV with decimal commas and spaced thousands."""
    return csv_report(report_table(benchmark_lines(count)), encoding="windows-1251")


# File-level defects


def zip_bomb_xlsx(megabytes: int = 20, *, parts: int = 1) -> bytes:
    """A valid report carrying ``parts`` extra parts of ``megabytes`` of zeros each (deflate
    packs them ~1000 to 1): a bomb by ratio, or by total size with many parts under 1 MB."""
    zeros = bytes(megabytes * 1024 * 1024 // parts)
    extra = {f"xl/media/image{index}.png": zeros for index in range(1, parts + 1)}
    return rezip(xlsx_report(report_table(deliveries(3))), extra=extra)


def padded_xlsx(megabytes: int) -> bytes:
    """A report whose worksheet carries a comment of ``megabytes`` of spaces (deflate packs it
    ~1000 to 1), its sizes declared truly."""
    return rezip(xlsx_report(report_table(deliveries(3))), change={
        "xl/worksheets/sheet1.xml": lambda xml: xml.replace(
            b"<sheetData>", b"<!--" + b" " * (megabytes * 1024 * 1024) + b"--><sheetData>"),
    })


def lying_zip_xlsx(megabytes: int = 4) -> bytes:
    """:func:`padded_xlsx` declaring its worksheet 2,000 bytes long: a bomb that a reader
    trusting the declared sizes would inflate in full."""
    return declare_size(padded_xlsx(megabytes), "xl/worksheets/sheet1.xml", 2_000)


def xlsx_with_cached_formula() -> bytes:
    """A report whose first quantity (G2) is the formula ``=2+2`` with the cached value 5, as a
    workbook edited after its last calculation holds it: a reader that evaluates says 4."""
    report = xlsx_report(report_table(deliveries(3), Layout(numbers="cell")))
    return rezip(report, change={"xl/worksheets/sheet1.xml": lambda xml: re.sub(
        rb'<c r="G2"[^>]*>.*?</c>', b'<c r="G2"><f>2+2</f><v>5</v></c>', xml, count=1)})


def xlsx_with_external_link(*, part: bool = True) -> bytes:
    """A report whose workbook links to another workbook: an ``xl/externalLinks/`` part, or
    (``part=False``) only an external relationship in the workbook's rels."""
    relationship = (b'<Relationship Id="rId99" Target="file:///C:/%D0%A1%D0%BC%D0%B5%D1%82%D1%8B/'
                    b'prices.xlsx" TargetMode="External" Type="http://schemas.openxmlformats.org/'
                    b'officeDocument/2006/relationships/externalLinkPath"/></Relationships>')
    change = {"xl/_rels/workbook.xml.rels":
              lambda rels: rels.replace(b"</Relationships>", relationship)}
    extra = {"xl/externalLinks/externalLink1.xml": (
        b'<?xml version="1.0" encoding="UTF-8"?><externalLink xmlns="http://schemas.'
        b'openxmlformats.org/spreadsheetml/2006/main"><externalBook r:id="rId1" xmlns:r="http://'
        b'schemas.openxmlformats.org/officeDocument/2006/relationships"/></externalLink>')}
    return rezip(xlsx_report(report_table(deliveries(3))), change=change,
                 extra=extra if part else {})


def xlsx_with_entity_bomb() -> bytes:
    """A report whose worksheet declares a billion-laughs entity and uses it in a cell."""
    entities = b"".join(
        b'<!ENTITY e%d "%s">' % (level, (b"&e%d;" % (level - 1)) * 10 if level else b"ha")
        for level in range(10)
    )

    def poison(xml: bytes) -> bytes:
        declared = xml.replace(b"<worksheet", b"<!DOCTYPE worksheet [%s]><worksheet" % entities, 1)
        return declared.replace("<t>Объект</t>".encode(), b"<t>&e9;</t>", 1)

    return rezip(xlsx_report(report_table(deliveries(3))),
                 change={"xl/worksheets/sheet1.xml": poison})


def macro_enabled_xlsx() -> bytes:
    """A report saved as .xlsm: a VBA project part and the macro-enabled content type."""
    return rezip(
        xlsx_report(report_table(deliveries(3))),
        change={"[Content_Types].xml": lambda types: types.replace(
            b"spreadsheetml.sheet.main+xml", b"ms-excel.sheet.macroEnabled.main+xml")},
        extra={"xl/vbaProject.bin": b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(504)},
    )


def zip_not_xlsx() -> bytes:
    """A ZIP archive holding a CSV report: what a site sends when it zips the file."""
    output = io.BytesIO()
    with zipfile.ZipFile(output, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("поставки.csv", csv_report(report_table(deliveries(3))))
    return output.getvalue()


def pdf_bytes() -> bytes:
    """The start of a PDF print of the report."""
    return (b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n"
            b"2 0 obj\n<< /Type /Pages /Kids [] /Count 0 >>\nendobj\ntrailer\n<< /Root 1 0 R >>"
            b"\n%%EOF\n")


def legacy_xls_bytes() -> bytes:
    """The start of an Excel 97-2003 .xls (an OLE2 compound file)."""
    return b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(16) + b"\x3e\x00\x03\x00\xfe\xff" + bytes(
        482)


def binary_junk(size: int = 4096, seed: int = 7) -> bytes:
    """Random bytes, as a truncated upload or a picture renamed to .csv would be."""
    return random.Random(seed).randbytes(size)


def invalid_encoding_csv(*, nul: bool = False) -> bytes:
    """A windows-1251 report with a byte that no encoding we read has (0x98), or with NUL bytes
    (``nul``), as a UTF-16 file without its BOM has."""
    content = csv_report(report_table(deliveries(3)), encoding="windows-1251")
    if nul:
        return b"\0".join(bytes([byte]) for byte in content[:200])
    return content.replace(b";", b";\x98", 1)


def header_only(fmt: str = "csv") -> bytes:
    """A report with its header and no rows (a site with no deliveries that month)."""
    table = report_table([])
    return csv_report(table) if fmt == "csv" else xlsx_report(table, title_rows=TITLE_ROWS)


def missing_columns(*names: str) -> bytes:
    """A CSV report whose header lacks the columns ``names``."""
    table = report_table(deliveries(3))
    keep = [index for index, header in enumerate(table[0]) if header not in names]
    return csv_report([[row[index] for index in keep] for row in table])


def without_header() -> bytes:
    """A CSV report whose header row was deleted: data from the first line."""
    return csv_report(report_table(deliveries(5))[1:])


def rezip(content: bytes, *, change: dict[str, Callable[[bytes], bytes]] | None = None,
          extra: dict[str, bytes] | None = None) -> bytes:
    """The archive with some parts changed (name -> function of the bytes) and some added."""
    change = change or {}
    source = zipfile.ZipFile(io.BytesIO(content))
    output = io.BytesIO()
    with source, zipfile.ZipFile(output, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            data = source.read(member)
            if member.filename in change:
                data = change[member.filename](data)
            target.writestr(member.filename, data)
        for name, data in (extra or {}).items():
            target.writestr(name, data)
    return output.getvalue()


def declare_size(content: bytes, name: str, size: int) -> bytes:
    """The archive with ``name``'s uncompressed size rewritten to ``size`` in both its local
    header and the central directory (its data and CRC unchanged)."""
    patched = bytearray(content)
    with zipfile.ZipFile(io.BytesIO(content)) as archive:
        member = archive.getinfo(name)
        struct.pack_into("<I", patched, member.header_offset + 22, size)
        position = archive.start_dir
        for entry in archive.infolist():
            if entry.filename == name:
                struct.pack_into("<I", patched, position + 24, size)
            name_length, extra_length, comment_length = struct.unpack_from(
                "<HHH", patched, position + 28)
            position += 46 + name_length + extra_length + comment_length
    return bytes(patched)

