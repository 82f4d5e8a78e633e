"""The uploads of the file suite: the report files of the inbox, their versions, and how an
uploader drops them.

A :class:`ReportFile` is one file name as the site keeps it; each upload of it is a :class:`Drop`,
which also says what the table and the quarantine must hold once it is loaded (the judge's model,
:mod:`.file_judge`). :class:`FileDrops` makes the drops as an uploader does (written as
``name.part``, renamed), each with a modification time later than every earlier drop's: a new file
(CSV or XLSX variants of the report generator), a corrected version of a file (lines changed,
removed, added), the same bytes again, a version with some bad rows (unreadable values; sometimes
an unreadable line number, whose key cannot be read), a version claiming waybill lines another file
holds, a file-level-defective file (PDF, legacy .xls, macros, zip bomb, no header, ...) and a file
with a systematic defect (over 20% bad rows).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from mostovik_pipelines.resources.inbox import version_key
from mostovik_pipelines.sources import material_deliveries
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.delivery_reports import TITLE_ROWS, Delivery, Layout

SOURCE = material_deliveries.SOURCE.name
TABLE = material_deliveries.material_deliveries.name
HEADER = dict(zip(("date", "object", "waybill", "line", "material", "unit", "quantity", "price",
                   "supplier"), range(9), strict=True))
"""The report's columns, as indexes into a layout's header names."""
CSV_VARIANTS: tuple[tuple[Layout, dict[str, Any]], ...] = (
    (Layout(), {}),
    (Layout(thousands="\u00a0"), {"encoding": "windows-1251", "title_rows": TITLE_ROWS}),
    (Layout(decimal=".", thousands=""), {"delimiter": ","}),
    (Layout(headers=reports.HEADER_VARIANTS, order=(2, 3, 0, 4, 6, 5, 7, 8, 1)),
     {"delimiter": "\t"}),
    (Layout(), {"encoding": "utf-16", "delimiter": "\t"}),
    (Layout(thousands="\u202f"), {"bom": True, "newline": "\n"}),
)
XLSX_VARIANTS: tuple[tuple[Layout, dict[str, Any]], ...] = (
    (Layout(dates="cell", numbers="cell"), {"title_rows": TITLE_ROWS}),
    (Layout(), {}),
    (Layout(dates="serial", numbers="cell"), {}),
    (Layout(extra_columns=((0, "№ п/п"),), numbers="cell"), {"other_sheets": ("Справочник",)}),
)
BAD_CELLS = (("quantity", "n/a"), ("price", "-5,00"), ("date", "31.02.2026"),
             ("quantity", "12,5,1"))
"""Cells that make a row unreadable while its key stays readable: (column, value)."""
BAD_KEY_CELL = ("line", "7а")
"""A line number that is not a number: the row's key cannot be read."""
DEFECTIVE: dict[str, Callable[[], bytes]] = {
    "pdf": reports.pdf_bytes,
    "legacy_xls": reports.legacy_xls_bytes,
    "zipped_csv": reports.zip_not_xlsx,
    "macros": reports.macro_enabled_xlsx,
    "external_link": reports.xlsx_with_external_link,
    "bad_encoding": reports.invalid_encoding_csv,
    "missing_column": lambda: reports.missing_columns("Цена"),
    "no_header": reports.without_header,
    "header_only": reports.header_only,
    "junk": reports.binary_junk,
    "zip_bomb": lambda: reports.zip_bomb_xlsx(2),
}
DROP_KINDS = {"new": 3, "correction": 4, "same_bytes": 1.5, "bad_rows": 2, "defective": 1.5,
              "systematic": 0.5}
"""Run config of the ops: re-transform the version's latest landed payload."""
MAX_BAD_SHARE = 0.17
"""Bad rows of a loadable version stay below the source's 20% (``max_rejected_share``)."""
DROP_SPACING_NS = 2 * 10**9
"""Modification times of successive drops lie this far apart: the newest drop is the newest
version by time too."""


@dataclass(frozen=True)
class Drop:
    """One upload: its bytes, and what the table and quarantine must hold once it is loaded."""

    number: int
    name: str
    version: str
    content: bytes
    kind: str
    loadable: bool
    lines: tuple[Delivery, ...] = ()
    """The lines the table must hold for the file (claimed lines excluded)."""
    parser_rejects: tuple[int, ...] = ()
    """Spreadsheet row numbers of the bad rows."""
    rejected: int = 0
    """Rows the version's quarantine holds: bad rows and claimed lines."""


@dataclass
class ReportFile:
    """One file name of the inbox: the report as the site keeps it, and every upload of it."""

    name: str
    index: int
    xlsx: bool
    lines: list[Delivery]
    bad: list[tuple[Delivery, tuple[str, str]]] = field(default_factory=list)
    """Lines the site has not got right yet, with their broken cell."""
    claims: list[Delivery] = field(default_factory=list)
    """Lines of other files this file claims too."""
    pinned: set[tuple[str, int]] = field(default_factory=set)
    """Keys other files claim: never removed, so this file holds them for good."""
    drops: list[Drop] = field(default_factory=list)
    generation: int = 0


def key_of(line: Delivery) -> tuple[str, int]:
    return line.waybill, line.line_no


def renumber(lines: Sequence[Delivery], offset: int) -> list[Delivery]:
    """``lines`` with ``offset`` added to each waybill's number, its spelling kept."""
    def shifted(waybill: str) -> str:
        digits = re.search(r"\d+$", waybill)
        assert digits, waybill
        number = str(int(digits.group()) + offset).rjust(len(digits.group()), "0")
        return waybill[:digits.start()] + number
    return [dataclasses.replace(line, waybill=shifted(line.waybill)) for line in lines]



class FileDrops:
    """The drawing and dropping of uploads, for :class:`.file_scenarios.FileSuite`: it keeps the
    report files (``files``), the count of drops and the latest modification time, and asks the
    suite whether a version loaded (``_loaded``) and to settle a file (``_settle_file``)."""
    def _drop_action(self, rng: random.Random, notes: list[str]) -> None:
        kinds = dict(DROP_KINDS)
        if self.reverts:
            kinds["revert"] = 3
        kind = rng.choices(list(kinds), list(kinds.values()))[0]
        if len(self.files) < 2 or kind == "new":
            drop = self._new_file(rng)
        else:
            report = self.files[rng.choice(sorted(self.files))]
            drop = self._drop_kind(rng, report, kind)
        notes.append(f"drop[{drop.kind}:{drop.name[:14]}]")

    def _drop_kind(self, rng: random.Random, report: ReportFile, kind: str) -> Drop:
        if kind == "same_bytes":
            last = report.drops[-1]
            return self._drop(report, last.content, "same_bytes", last.loadable, last.lines,
                              last.parser_rejects, last.rejected)
        if kind == "revert":
            # A version without bad rows and holding every claimed key: the model of what it
            # must leave in the table stays exact.
            older = [d for d in report.drops[:-1] if d.loadable and not d.parser_rejects
                     and d.version != report.drops[-1].version
                     and report.pinned <= {key_of(line) for line in d.lines}]
            if older:
                old = rng.choice(older)
                report.lines, report.bad = list(old.lines), []
                return self._drop(report, old.content, "revert", True, old.lines,
                                  old.parser_rejects, old.rejected)
            kind = "correction"
        if kind == "defective":
            # The file's stored rows must be certain when a defective upload hides its
            # predecessor from the inbox: a killed run of that one is finished first.
            self._settle_file(rng, report)
            name = rng.choice(list(DEFECTIVE))
            return self._drop(report, DEFECTIVE[name](), f"defective:{name}", False)
        return self._correction(rng, report, bad_rows=kind == "bad_rows",
                                systematic=kind == "systematic")

    def _new_file(self, rng: random.Random) -> Drop:
        index = len(self.files) + 1
        xlsx = rng.random() < 0.4
        name = rng.choice(("Поставки {n} ноябрь", "site_{n:03d}_deliveries", "Отчёт МСК-{n}",
                           "накладные {n}")).format(n=index) + (".xlsx" if xlsx else ".csv")
        report = ReportFile(name, index, xlsx, [])
        report.lines = self._fresh(rng, report, rng.randint(*self.line_counts))
        self.files[name] = report
        if self.claims and rng.random() < 0.2:
            self._claim(rng, report)
        return self._write(rng, report, "new")

    def _correction(self, rng: random.Random, report: ReportFile, *, bad_rows: bool,
                    systematic: bool) -> Drop:
        lines = list(report.lines)
        for position in rng.sample(range(len(lines)), min(len(lines), rng.randint(0, 4))):
            lines[position] = _changed(rng, lines[position])
        removable = [line for line in lines if key_of(line) not in report.pinned]
        for line in rng.sample(removable, min(max(len(removable) - 5, 0), rng.randint(0, 3))):
            lines.remove(line)
        lines += self._fresh(rng, report, rng.randint(0, 4))
        bad: list[tuple[Delivery, tuple[str, str]]] = []
        for line, cell in report.bad:
            fate = rng.random()
            if fate < 0.5:
                lines.append(line)
            elif fate < 0.8:
                bad.append((line, cell))
        if systematic:
            # Over a fifth of the rows unreadable: the file is refused whole, nothing changes.
            broken = self._fresh(rng, report, len(lines) // 2 + 1)
            bad = [(line, rng.choice(BAD_CELLS)) for line in broken]
            return self._write(rng, report, "systematic", lines, bad, loadable=False)
        # An unreadable key holds back every deletion by absence: it only appears where the
        # stored rows are known and nothing of them would be deleted anyway.
        last = report.drops[-1]
        removes = {key_of(line) for line in last.lines} - {key_of(line) for line in lines}
        unreadable_key_allowed = (bad_rows and last.loadable and not removes
                                  and self._loaded(last.version))
        bad = [(line, cell) for line, cell in bad
               if cell != BAD_KEY_CELL or unreadable_key_allowed]
        if bad_rows:
            bad += [(line, rng.choice(BAD_CELLS))
                    for line in self._fresh(rng, report, max(1, len(lines) // 20))]
            if unreadable_key_allowed and rng.random() < 0.5:
                bad[-1] = (bad[-1][0], BAD_KEY_CELL)
        while len(bad) > 1 and len(bad) > MAX_BAD_SHARE * (len(lines) + len(bad)):
            lines.append(bad.pop(0)[0])  # the site fixed it: the share stays a partial load's
        if rng.random() < 0.3 and report.claims:
            report.claims.pop(rng.randrange(len(report.claims)))
        if self.claims and rng.random() < 0.15:
            self._claim(rng, report)
        kind = "bad_rows" if bad_rows else "correction"
        return self._write(rng, report, kind, lines, bad)

    def _claim(self, rng: random.Random, report: ReportFile) -> None:
        """Claim a line of another file whose rows are settled: it holds the line for good."""
        holders = [f for f in self.files.values() if f is not report and f.drops
                   and f.drops[-1].loadable and f.drops[-1].lines
                   and self._loaded(f.drops[-1].version)]
        if not holders:
            return
        holder = rng.choice(holders)
        line = rng.choice(holder.drops[-1].lines)
        holder.pinned.add(key_of(line))
        report.claims.append(_changed(rng, line))

    def _fresh(self, rng: random.Random, report: ReportFile, count: int) -> list[Delivery]:
        """New lines under waybills no other file and no earlier generation of this one uses."""
        if count == 0:
            return []
        report.generation += 1
        lines = reports.deliveries(count, seed=rng.randrange(1 << 30))
        return renumber(lines, report.index * 1_000_000 + report.generation * 10_000)

    def _write(self, rng: random.Random, report: ReportFile, kind: str,
               lines: list[Delivery] | None = None,
               bad: list[tuple[Delivery, tuple[str, str]]] | None = None,
               loadable: bool = True) -> Drop:
        """Lay the report out in a random variant of its format and drop it."""
        good = list(report.lines if lines is None else lines)
        bad = list(report.bad if bad is None else bad)
        entries: list[tuple[Delivery, tuple[str, str] | None]] = [
            *((line, None) for line in good), *bad, *((line, None) for line in report.claims)]
        rng.shuffle(entries)
        layout, options = rng.choice(XLSX_VARIANTS if report.xlsx else CSV_VARIANTS)
        table = reports.report_table([line for line, _ in entries], layout)
        first = reports.first_data_row_number(options.get("title_rows", ()))
        rejects = []
        for position, (_, cell) in enumerate(entries):
            if cell is not None:
                column, value = cell
                table[1 + position][table[0].index(layout.headers[HEADER[column]])] = value
                rejects.append(first + position)
        content = (reports.xlsx_report(table, **options) if report.xlsx
                   else reports.csv_report(table, **options))
        if loadable:
            report.lines, report.bad = good, bad
        return self._drop(report, content, kind, loadable, tuple(good), tuple(rejects),
                          len(rejects) + len(report.claims))

    def _drop(self, report: ReportFile, content: bytes, kind: str, loadable: bool,
              lines: tuple[Delivery, ...] = (), parser_rejects: tuple[int, ...] = (),
              rejected: int = 0) -> Drop:
        self.drops += 1
        self.clock_ns += DROP_SPACING_NS
        version = version_key(report.name, hashlib.sha256(content).hexdigest())
        drop = Drop(self.drops, report.name, version, content, kind, loadable, lines,
                    parser_rejects, rejected)
        previous = report.drops[-1] if report.drops else None
        if (previous is not None and previous.loadable and previous.version != version
                and previous.version not in self.requested):
            # Overwritten before the sensor saw it: no run can ever read those bytes.
            report.drops[-1] = dataclasses.replace(previous, loadable=False,
                                                   kind=f"{previous.kind}, never seen")
        self.inbox_dir.mkdir(parents=True, exist_ok=True)
        partial = self.inbox_dir / f"{report.name}.part"
        partial.write_bytes(content)
        os.utime(partial, ns=(self.clock_ns, self.clock_ns))
        os.replace(partial, self.inbox_dir / report.name)
        report.drops.append(drop)
        self.totals.drops[kind.split(":")[0]] += 1
        return drop


def _changed(rng: random.Random, line: Delivery) -> Delivery:
    places = -line.quantity.as_tuple().exponent
    quantity = (line.quantity * Decimal(rng.randint(50, 150)) / 100).quantize(
        Decimal(1).scaleb(-places)) or line.quantity
    material, unit, _, _, _ = rng.choice(reports.MATERIALS)
    return dataclasses.replace(
        line, quantity=quantity,
        price=(line.price + Decimal(rng.randint(1, 9_999)) / 100).quantize(Decimal("0.01")),
        material=material if rng.random() < 0.3 else line.material,
        unit=unit if rng.random() < 0.1 else line.unit)

