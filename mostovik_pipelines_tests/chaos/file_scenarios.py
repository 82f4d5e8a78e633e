"""Randomized scenarios of the file kind (material deliveries, issue 14), and their judge.

An inbox of a few delivery reports with overlapping lifetimes. A scenario mixes, at random:

* drops, as an uploader makes them (written as ``name.part``, renamed), each with a modification
  time later than every earlier drop's: a new file (CSV or XLSX variants of the report
  generator), a corrected version of a file (lines changed, removed, added), the same bytes
  again, a version with some bad rows (unreadable values; sometimes an unreadable line number,
  whose key cannot be read), a version claiming waybill lines another file holds, a
  file-level-defective file (PDF, legacy .xls, macros, zip bomb, no header, ...) and a file
  with a systematic defect (over 20% bad rows);
* sensor ticks (the inbox sensor evaluated with ``build_sensor_context``, its partitions added)
  and runs of the versions it requests, skipping run keys already launched as the daemon does,
  warm (forked) or real ``dagster job execute`` with ``MOSTOVIK_INBOX_DIR`` and
  ``MOSTOVIK_ARCHIVE_DIR``;
* kill -9 of a run: at the start of its extract, once it has landed the file, inside its load
  transaction (the suite holds the file's business lock), right after its load committed (the
  ledger names the run; the archive step is next) or at a random moment;
* duplicate concurrent runs of one version (an operator's re-run beside the sensor's), and
  re-uploads racing a run: a corrected version dropped while the older version's run is in
  flight, at the same points, and its run started at once;
* an operator's re-run of an older version's landed payload (``reuse_landed``) once a newer
  version is loaded: its load must be refused as superseded.

Then, as an operator would, it ticks the sensor once more and re-runs the newest version of each
file whose runs were killed, until a run succeeds.

The judge's model. The newest version of a file is its last drop (drop order is modification
time order, so any older version's load is refused as superseded). For every file name the table
holds exactly the rows of its newest loadable version (a defective version leaves the file's
rows as they were, and so does a version overwritten before any tick saw it), on every field and
with that ``file_version``; no row of another file is touched, no (waybill, line) is held twice,
and the newest loaded version's quarantine holds its rejected rows (the bad rows, at their
spreadsheet row numbers, and the claimed lines). The model is kept independent of which older
versions loaded in between: bad rows only ever have keys the file never held, and an unreadable
key (which holds back every deletion by absence) only appears in a version that removes nothing
from a file whose stored rows are known. A defective newest version is still in the inbox; a
loaded one is in the archive as ``<name>@<hash>`` with its bytes and a note of its outcome (a
copy of the same bytes dropped again may stay in the inbox: the sensor never requests a run key
twice), and nothing ever leaves the archive.

``--reverts`` adds one more drop: the bytes of an older version of a file dropped again as its
newest (the sensor runs such a revert under a run key of its own).
``--no-claims`` leaves out the lines claimed from other files (a re-load of a version with such
a line used to empty its quarantine, until loads that leave rows out stopped recording a digest).

``python -m mostovik_pipelines_tests.chaos.file_scenarios --scenarios 50 --seed N`` runs it at
length on its own PostgreSQL and prints the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from dagster import (
    AssetKey,
    DagsterEventType,
    DagsterRunStatus,
    RunsFilter,
    build_sensor_context,
)
from dagster._core.storage.tags import RUN_KEY_TAG, SENSOR_NAME_TAG

from mostovik_pipelines.core.tags import PARTITION_TAG
from mostovik_pipelines.framework.load.lock import partition_lock_keys
from mostovik_pipelines.resources.inbox import InboxResource, file_name_of, version_key
from mostovik_pipelines.sources import material_deliveries
from mostovik_pipelines_tests.chaos.harness import RunHandle, Workspace, wait_until
from mostovik_pipelines_tests.chaos.sync_scenarios import counts_text, status_text
from mostovik_pipelines_tests.chaos.tally import Tally, named, tallied
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.delivery_reports import TITLE_ROWS, Delivery, Layout
from mostovik_pipelines_tests.support.locations import FAST_RETRY
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

SOURCE = material_deliveries.SOURCE.name
SENSOR = f"{SOURCE}_inbox_sensor"
RESOURCE_KEY = f"{SOURCE}_source"
TABLE = material_deliveries.material_deliveries.name
COLUMNS = ("delivery_date", "object_code", "waybill", "line_no", "material", "unit",
           "quantity::text", "price::text", "supplier", "source_file", "file_version")
QUANTITY, PRICE = 6, 7
"""Positions of the exact decimals in a row of :data:`COLUMNS`."""
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
KILL_POINTS = ("extract", "landed", "load", "committed", "random")
RACE_POINTS = ("extract", "landed", "load", "random")
SETTLE_ATTEMPTS = 3
REUSE_LANDED = {SOURCE: {"ops": {f"extract_{SOURCE}": {"config": {"reuse_landed": True}}}}}
"""Run config of the ops: re-transform the version's latest landed payload."""
MAX_BAD_SHARE = 0.17
"""Bad rows of a loadable version stay below the source's 20% (``max_rejected_share``)."""
DROP_SPACING_NS = 2 * 10**9
"""Modification times of successive drops lie this far apart: the newest drop is the newest
version by time too."""


@dataclass
class FileTotals:
    scenarios: int = 0
    drops: Counter = field(default_factory=Counter)
    ticks: int = 0
    requests_skipped: int = 0
    """Run requests the daemon would skip: their run key was launched before."""
    runs: Counter = field(default_factory=Counter)
    """Runs started: sensor (warm), sensor (cli), operator."""
    kills: Counter = field(default_factory=Counter)
    cli_kills: int = 0
    duplicate_runs: int = 0
    reupload_races: Counter = field(default_factory=Counter)
    """Re-uploads dropped while the older version's run was in flight, by point."""
    replays: int = 0
    """Operators' re-runs of an older version's landed payload (``reuse_landed``)."""
    superseded: int = 0
    """Loads refused because a newer version of the file was loaded first."""
    settle_runs: int = 0
    copies_left: int = 0
    """Identical re-uploads of a loaded version in the inbox at the last judgement (the sensor
    never requests a run key twice)."""
    stale_quarantine: int = 0
    """Quarantined rows of versions no longer loaded (kept under their own partition key)."""
    differences: int = 0
    duplicates: int = 0
    unsettled: int = 0
    failures: list[str] = field(default_factory=list)
    distinct_problems: set[str] = field(default_factory=set)
    """Problems as judged, once each: a difference left standing is found again by every later
    judgement."""


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


class FileSuite:
    """The scenarios and their judge, against one :class:`Workspace` whose source is the inbox."""

    def __init__(self, workspace: Workspace, seed: int, *, lines: tuple[int, int] = (20, 80),
                 cli_share: float = 0.25, claims: bool = True, reverts: bool = False,
                 log=print) -> None:
        self.ws = workspace
        self.seed = seed
        self.line_counts = lines
        self.cli_share = cli_share
        self.claims = claims
        self.reverts = reverts
        self.log = log
        self.totals = FileTotals()
        self.inbox: InboxResource = workspace.resource
        self.inbox_dir, self.archive_dir = Path(self.inbox.inbox_dir), Path(self.inbox.archive_dir)
        self.sensor = workspace.location.get_sensor_def(SENSOR)
        self.cursor: str | None = None
        self.launched_keys: set[str] = set()
        self.requested: set[str] = set()
        """Versions the sensor asked to run: the daemon would have a run record of each."""
        self.files: dict[str, ReportFile] = {}
        self.drops = 0
        self.clock_ns = time.time_ns() - 86_400 * 10**9
        """Modification time of the latest drop: every drop is newer than the one before."""
        self.observations_cursor: str | None = None
        self.archive_seen: dict[str, str] = {}
        """Archive entries seen by earlier judgements, with their sha256: never to vanish."""
        self.copies_left = 0

    def run(self, scenarios: int) -> FileTotals:
        for number in range(1, scenarios + 1):
            self.scenario(number)
        return self.totals

    def scenario(self, number: int) -> None:
        rng = random.Random(f"{self.seed}:files:{number}")
        notes: list[str] = []
        for step in range(rng.randint(3, 5)):
            action = rng.random()
            if step == 0 or action < 0.55:
                self._drop_action(rng, notes)
            elif action < 0.9 or not self._replay_older(rng, notes):
                self._tick_and_run(rng, notes)
        self._settle(rng, notes)
        problems = self._judge()
        self.totals.distinct_problems.update(problems)
        self.totals.scenarios += 1
        if problems:
            self._fail(f"scenario {number} ({' '.join(notes)}): {'; '.join(problems)}")
        self.log(f"  #{number:<4} {' '.join(notes)}{'  DIFFERENT' if problems else ''}")

    # --- drops ----------------------------------------------------------------------------------

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

    # --- the sensor and runs --------------------------------------------------------------------

    def _tick(self) -> list[tuple[str, str]]:
        """One sensor evaluation, its partitions added: the (version, run key) pairs the daemon
        would launch (a run key launched before is skipped)."""
        self.totals.ticks += 1
        context = build_sensor_context(instance=self.ws.instance, cursor=self.cursor,
                                       resources={RESOURCE_KEY: self.inbox})
        context.log.setLevel(logging.WARNING)  # each tick's new versions: not in the output
        result = self.sensor(context)
        for request in result.dynamic_partitions_requests:
            self.ws.instance.add_dynamic_partitions(request.partitions_def_name,
                                                    list(request.partition_keys))
        self.cursor = result.cursor
        wanted = []
        for request in result.run_requests:
            if request.run_key in self.launched_keys or self.ws.instance.get_run_records(
                    RunsFilter(tags={RUN_KEY_TAG: request.run_key, SENSOR_NAME_TAG: SENSOR}),
                    limit=1):
                self.totals.requests_skipped += 1
                continue
            self.launched_keys.add(request.run_key)
            self.requested.add(request.partition_key)
            wanted.append((request.partition_key, request.run_key))
        return wanted

    def _start(self, version: str, run_key: str | None, cli: bool = False) -> RunHandle:
        tags = {RUN_KEY_TAG: run_key, SENSOR_NAME_TAG: SENSOR} if run_key else {}
        self.totals.runs["operator" if run_key is None else
                         "sensor, cli" if cli else "sensor, warm"] += 1
        return self.ws.start_cli(version, tags) if cli else self.ws.start_warm(version, tags)

    def _tick_and_run(self, rng: random.Random, notes: list[str]) -> None:
        wanted = self._tick()
        if not wanted:
            notes.append("tick:-")
            return
        runs = [(version, self._start(version, run_key, rng.random() < self.cli_share))
                for version, run_key in wanted]
        note = [f"tick:{len(runs)}"]
        if rng.random() < 0.2:
            version, _ = rng.choice(runs)
            runs.append((version, self._start(version, None)))
            self.totals.duplicate_runs += 1
            note.append("dup")
        version, handle = runs[0]
        report = self.files[file_name_of(version)]
        if report.drops[-1].version == version and report.drops[-1].loadable and (
                rng.random() < 0.3):
            runs += self._race(rng, report, handle, note)
        elif rng.random() < 0.4 + 0.4 * (handle.kind == "cli"):
            point = rng.choice(KILL_POINTS)
            killed = self._kill_at(rng, handle, point, version)
            note.append(f"{'kill' if killed else 'nokill'}@{point}")
        statuses = [self.ws.finish(h, rng) for _, h in runs]
        note.append("/".join(status_text(s) for s in statuses))
        notes.append("[" + " ".join(note) + "]")

    def _race(self, rng: random.Random, report: ReportFile, handle: RunHandle,
              note: list[str]) -> list[tuple[str, RunHandle]]:
        """Drop a corrected version while the run of the file's version is at a random point,
        and start the runs the next tick asks for at once."""
        point = rng.choice(RACE_POINTS)
        started: list[tuple[str, RunHandle]] = []
        with psycopg.connect(self.ws.dsn, autocommit=True) as holder:
            if point == "load":
                holder.execute("SELECT pg_advisory_lock(%s, %s)",
                               partition_lock_keys(TABLE, report.name))
            reached = self._reach(rng, handle, point, handle.partition, holder)
            self._correction(rng, report, bad_rows=False, systematic=False)
            started = [(version, self._start(version, run_key, rng.random() < self.cli_share))
                       for version, run_key in self._tick()]
            if point == "load":
                # Both versions' loads meet at the file's lock, the older one waiting first.
                newer = next((h for version, h in started
                              if file_name_of(version) == report.name), handle)
                wait_until(lambda: self.ws.has_event(newer, DagsterEventType.STEP_START,
                                                     f"{SOURCE}.load_"), newer, 30, 0.02)
                holder.execute("SELECT pg_advisory_unlock(%s, %s)",
                               partition_lock_keys(TABLE, report.name))
        self.totals.reupload_races[point] += 1
        note.append(f"race@{point}{'' if reached else '(late)'}")
        return started

    def _kill_at(self, rng: random.Random, handle: RunHandle, point: str, version: str) -> bool:
        with psycopg.connect(self.ws.dsn, autocommit=True) as holder:
            if point == "load":
                lock = partition_lock_keys(TABLE, file_name_of(version))
                holder.execute("SELECT pg_advisory_lock(%s, %s)", lock)
                try:
                    reached = self._reach(rng, handle, point, version, holder)
                    killed = reached and handle.kill()
                finally:
                    holder.execute("SELECT pg_advisory_unlock(%s, %s)", lock)
            else:
                killed = self._reach(rng, handle, point, version, holder) and handle.kill()
        if killed:
            self.totals.kills[point] += 1
            self.totals.cli_kills += handle.kind == "cli"
        return killed

    def _reach(self, rng: random.Random, handle: RunHandle, point: str, version: str,
               observer: psycopg.Connection) -> bool:
        """Wait until the run is at ``point``; False if it ended first."""
        ws = self.ws
        patience = 90.0 if handle.kind == "cli" else 40.0
        if point == "extract":
            return wait_until(lambda: ws.has_event(handle, DagsterEventType.STEP_START,
                                                   f"{SOURCE}.extract_"), handle, patience, 0.005)
        if point == "landed":
            return wait_until(lambda: self._landed_by(handle, version), handle, patience, 0.003)
        if point == "load":
            lock = partition_lock_keys(TABLE, file_name_of(version))
            return wait_until(lambda: _waiting_for(observer, lock), handle, patience, 0.005)
        if point == "committed":
            name = file_name_of(version)
            return wait_until(lambda: ws.run_id_of(handle) is not None
                              and _loaded_by(observer, name) == ws.run_id_of(handle),
                              handle, patience, 0.002)
        wait_until(lambda: False, handle, rng.uniform(0, 8.0 if handle.kind == "cli" else 2.5),
                   0.02)
        return handle.alive()

    def _landed_by(self, handle: RunHandle, version: str) -> bool:
        run_id = self.ws.run_id_of(handle)
        folder = (self.ws.data_dir / "landing" / quote(SOURCE, safe="")
                  / quote(version, safe="") / "fetches")
        if run_id is None or not folder.exists():
            return False
        for record in folder.glob("*.json"):
            try:
                if json.loads(record.read_text()).get("run_id") == run_id:
                    return True
            except (OSError, ValueError):
                continue
        return False

    def _replay_older(self, rng: random.Random, notes: list[str]) -> bool:
        """An operator re-transforms the landed payload of a version older than the file's
        loaded one (``reuse_landed``): its load must be refused as superseded, the table left
        as it is. False if no file has such a version."""
        older = [drop for report in self.files.values()
                 if (loaded := self._expected(report)) is not None
                 and self._loaded(loaded.version)
                 for drop in report.drops
                 if drop.number < loaded.number and drop.loadable
                 and drop.version != loaded.version and self._landed(drop.version)]
        if not older:
            return False
        drop = rng.choice(older)
        self.totals.replays += 1
        handle = self.ws.start_warm(drop.version, ops_config=REUSE_LANDED)
        self.totals.runs["operator"] += 1
        notes.append(f"replay[{drop.name[:14]}]:{status_text(self.ws.finish(handle, rng))}")
        return True

    def _landed(self, version: str) -> bool:
        return (self.ws.data_dir / "landing" / quote(SOURCE, safe="")
                / quote(version, safe="") / "fetches").exists()

    # --- settling -------------------------------------------------------------------------------

    def _settle(self, rng: random.Random, notes: list[str]) -> None:
        """Tick once more and run what the sensor asks for, then re-run the newest version of
        each file that no run has loaded (its runs were killed), as an operator does."""
        runs = [self._start(version, run_key) for version, run_key in self._tick()]
        for handle in runs:
            self.ws.finish(handle, rng)
        rerun = [report for report in self.files.values()
                 if self._settle_file(rng, report)]
        superseded = self._count_superseded()
        notes.append(f"settled[{len(runs)} sensor, {len(rerun)} re-run]"
                     + (f" superseded {superseded}" if superseded else ""))

    def _settle_file(self, rng: random.Random, report: ReportFile) -> bool:
        """Re-run the file's newest version until a run succeeds, if it is loadable and its
        runs (the sensor asked for it) loaded nothing; whether it had to."""
        last = report.drops[-1]
        if (not last.loadable or last.version not in self.requested
                or self._loaded(last.version)):
            return False
        for _ in range(SETTLE_ATTEMPTS):
            self.totals.settle_runs += 1
            if self.ws.finish(self._start(last.version, None), rng) == DagsterRunStatus.SUCCESS:
                return True
        self.totals.unsettled += 1
        self._fail(f"{last.version}: no run succeeded after {SETTLE_ATTEMPTS} re-runs")
        return True

    def _loaded(self, version: str) -> bool:
        """Whether a run of the version succeeded (the newest version of a file: it loaded)."""
        return bool(self.ws.instance.get_run_records(
            RunsFilter(tags={PARTITION_TAG: version}, statuses=[DagsterRunStatus.SUCCESS]),
            limit=1))

    def _count_superseded(self) -> int:
        """Loads refused as superseded since the last count, from the observations runs record
        of the partitions they left out."""
        refused = 0
        while True:
            result = self.ws.instance.fetch_observations(
                AssetKey(SOURCE), limit=1000, cursor=self.observations_cursor, ascending=True)
            for record in result.records:
                observation = record.event_log_entry.asset_observation
                skipped = observation.metadata.get("mostovik/skipped") if observation else None
                refused += skipped is not None and "superseded" in json.dumps(skipped.value)
            self.observations_cursor = result.cursor
            if not result.has_more:
                break
        self.totals.superseded += refused
        return refused

    # --- the judge ------------------------------------------------------------------------------

    def _judge(self) -> list[str]:
        problems: list[str] = []
        with psycopg.connect(self.ws.dsn) as connection:
            rows = connection.execute(f"SELECT {', '.join(COLUMNS)} FROM {TABLE}").fetchall()
            quarantine = connection.execute(
                "SELECT partition_key, row_number FROM quarantined_rows WHERE source = %s",
                (SOURCE,)).fetchall()
        by_file: dict[str, list[tuple]] = {}
        for row in rows:
            by_file.setdefault(row[9], []).append(row)
        quarantined: dict[str, list[int]] = {}
        for version, row_number in quarantine:
            quarantined.setdefault(version, []).append(row_number)
        differences = 0
        loaded_versions = set()
        self.copies_left = 0
        for name in sorted(set(by_file) - set(self.files)):
            differences += len(by_file[name])
            problems.append(f"{len(by_file[name])} rows of a file never dropped: {name}")
        for report in self.files.values():
            expected = self._expected(report)
            if expected is not None:
                loaded_versions.add(expected.version)
            found, problem = _compare_file(report.name, expected, by_file.get(report.name, []),
                                           quarantined)
            differences += found
            problems += problem
            problems += self._check_files(report, expected)
        self.totals.stale_quarantine = sum(len(numbers) for version, numbers
                                           in quarantined.items()
                                           if version not in loaded_versions)
        keys = Counter((row[2], row[3]) for row in rows)
        held_twice = sum(n - 1 for n in keys.values() if n > 1)
        numbers = Counter((version, number) for version, number in quarantine)
        held_twice += sum(n - 1 for n in numbers.values() if n > 1)
        if held_twice:
            self.totals.duplicates += held_twice
            problems.append(f"{held_twice} keys held twice (table or quarantine)")
        problems += self._check_archive()
        self.totals.copies_left = self.copies_left
        self.totals.differences += differences + len(
            [p for p in problems if p.startswith(("inbox", "archive"))])
        return problems

    def _expected(self, report: ReportFile) -> Drop | None:
        """The file's newest loadable version: what the table holds for it."""
        return next((drop for drop in reversed(report.drops) if drop.loadable), None)

    def _check_files(self, report: ReportFile, expected: Drop | None) -> list[str]:
        """Where the file's newest version must be: failed ones in the inbox, loaded ones in
        the archive with a note of their outcome."""
        last = report.drops[-1]
        in_inbox = self.inbox_dir / report.name
        stored = in_inbox.read_bytes() if in_inbox.exists() else None
        archived = self.archive_dir / last.version
        if not last.loadable:
            if stored != last.content:
                return [f"inbox: the failed {last.version} is not in the inbox as uploaded"]
            return []
        problems = []
        if not archived.exists() or archived.read_bytes() != last.content:
            problems.append(f"archive: the loaded {last.version} is not in the archive")
        else:
            note_path = Path(f"{archived}.outcome.json")
            note = json.loads(note_path.read_text()) if note_path.exists() else {}
            outcome = "partial" if last.rejected else "loaded"
            if note.get("outcome") != outcome:
                problems.append(f"archive: {last.version}'s note says {note.get('outcome')}, "
                                f"expected {outcome}")
        if stored is not None:
            if stored == last.content and last.kind == "same_bytes" and archived.exists():
                self.copies_left += 1
            else:
                problems.append(f"inbox: the loaded {last.version} is still in the inbox")
        return problems

    def _check_archive(self) -> list[str]:
        """Nothing leaves the archive, and every archived version holds its own bytes."""
        problems = []
        now = {}
        for path in self.archive_dir.glob("*") if self.archive_dir.exists() else []:
            if path.name.endswith(".outcome.json"):
                continue
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            now[path.name] = digest
            if version_key(file_name_of(path.name), digest) != path.name:
                problems.append(f"archive: {path.name} holds other bytes")
        for name, digest in self.archive_seen.items():
            if now.get(name) != digest:
                problems.append(f"archive: {name} vanished or changed")
        self.archive_seen = now
        return problems

    def _fail(self, message: str) -> None:
        self.totals.failures.append(message)
        self.log(f"  FAILURE: {message}")


def _compare_file(name: str, expected: Drop | None, rows: list[tuple],
                  quarantined: dict[str, list[int]]) -> tuple[int, list[str]]:
    """Differences between the file's rows (and its version's quarantine) and the expected
    version's."""
    wanted = {} if expected is None else {
        key_of(line): _expected_row(line, name, expected.version) for line in expected.lines}
    actual = {(row[2], row[3]): _actual_row(row) for row in rows}
    missing = sorted(set(wanted) - set(actual))
    extra = sorted(set(actual) - set(wanted))
    different = [key for key in sorted(set(wanted) & set(actual)) if wanted[key] != actual[key]]
    problems = []
    if missing:
        problems.append(f"{name}: {len(missing)} rows missing, e.g. {missing[:2]}")
    if extra:
        problems.append(f"{name}: {len(extra)} rows not in its newest loadable version, "
                        f"e.g. {[actual[k] for k in extra[:2]]}")
    for key in different[:2]:
        problems.append(f"{name} {key}: expected {wanted[key]}, got {actual[key]}")
    found = len(missing) + len(extra) + len(different)
    if expected is not None:
        numbers = quarantined.get(expected.version, [])
        if len(numbers) != expected.rejected or not set(expected.parser_rejects) <= set(numbers):
            found += 1
            problems.append(f"{expected.version}: quarantine holds rows {sorted(numbers)}, "
                            f"expected {expected.rejected} incl. rows "
                            f"{list(expected.parser_rejects)}")
    return found, problems


def _expected_row(line: Delivery, name: str, version: str) -> tuple:
    return (line.delivery_date, line.object_code, line.waybill, line.line_no, line.material,
            line.unit, line.quantity.normalize(), line.price.normalize(), line.supplier, name,
            version)


def _actual_row(row: tuple) -> tuple:
    values = list(row)
    # XLSX numeric cells carry no scale: amounts compare by value.
    values[QUANTITY] = Decimal(values[QUANTITY]).normalize()
    values[PRICE] = Decimal(values[PRICE]).normalize()
    return tuple(values)


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


def _waiting_for(observer: psycopg.Connection, lock: tuple[int, int]) -> bool:
    """Whether a session waits for the advisory lock ``lock`` (two int4 keys)."""
    return observer.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 2 "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        tuple(key % 2**32 for key in lock)).fetchone()[0] > 0


def _loaded_by(observer: psycopg.Connection, name: str) -> str | None:
    row = observer.execute(
        "SELECT loaded_by_run FROM partition_loads WHERE table_name = %s AND partition_key = %s",
        (TABLE, name)).fetchone()
    return row[0] if row else None


def file_summary(totals: FileTotals, replay: str, seconds: float) -> str:
    return "\n".join([
        "",
        "file chaos summary (material_deliveries)",
        f"  scenarios run:        {totals.scenarios}",
        f"  drops:                {sum(totals.drops.values())} ({counts_text(totals.drops)})",
        f"  sensor ticks:         {totals.ticks}; requests skipped for a launched run key: "
        f"{totals.requests_skipped}",
        f"  runs started:         {sum(totals.runs.values())} ({counts_text(totals.runs)}); "
        f"settling re-runs {totals.settle_runs}",
        f"  kills delivered:      {sum(totals.kills.values())} ({counts_text(totals.kills)}); "
        f"of dagster job execute processes: {totals.cli_kills}",
        f"  duplicate runs:       {totals.duplicate_runs}",
        f"  re-upload races:      {sum(totals.reupload_races.values())} "
        f"({counts_text(totals.reupload_races)}); loads refused as superseded: "
        f"{totals.superseded}",
        f"  replays of an older version's landed payload: {totals.replays}",
        f"  identical re-uploads left in the inbox: {totals.copies_left}",
        f"  quarantined rows of versions no longer loaded: {totals.stale_quarantine}",
        f"  differences found:    {totals.differences} (distinct problems: "
        f"{len(totals.distinct_problems)})",
        f"  duplicates found:     {totals.duplicates}",
        f"  unsettled files:      {totals.unsettled}",
        f"  failures:             {len(totals.failures)}",
        f"  wall time:            {seconds:.0f} s",
        f"  replay:               python -m mostovik_pipelines_tests.chaos.file_scenarios "
        f"{replay}",
    ])


def file_workspace(postgres: ThrowawayPostgres, template: str | None = None,
                   keep: bool = False) -> Workspace:
    """The workspace of the delivery reports, its inbox and archive under its root; CLI runs
    find them through ``MOSTOVIK_INBOX_DIR`` and ``MOSTOVIK_ARCHIVE_DIR``."""
    source = dataclasses.replace(material_deliveries.SOURCE, extract_retry=FAST_RETRY,
                                 load_retry=FAST_RETRY)

    def wiring(root: Path) -> tuple[InboxResource, dict[str, str]]:
        inbox, archive = root / "inbox", root / "archive"
        return (InboxResource(inbox_dir=str(inbox), archive_dir=str(archive)),
                {"MOSTOVIK_INBOX_DIR": str(inbox), "MOSTOVIK_ARCHIVE_DIR": str(archive)})

    return Workspace(postgres, source, wiring, template=template, keep=keep)


def file_faults(totals: FileTotals) -> Counter:
    """What a file scenario met: drops by kind, kills by point, re-uploads racing a run,
    duplicate runs, operators' replays."""
    return (named("drop", totals.drops) + named("kill at", totals.kills)
            + named("re-upload racing at", totals.reupload_races)
            + Counter({"duplicate run": totals.duplicate_runs, "replay": totals.replays}))


def run_file_chaos(postgres: ThrowawayPostgres, seed: int, scenarios: int, *,
                   lines: tuple[int, int] = (20, 80), cli_share: float = 0.25,
                   claims: bool = True, reverts: bool = False, template: str | None = None,
                   keep: bool = False, log=print, tally: Tally | None = None) -> FileTotals:
    """Run the scenarios in a workspace of their own and print the summary (and, per scenario
    and fault, ``tally`` it)."""
    started = time.monotonic()
    workspace = file_workspace(postgres, template, keep)
    try:
        suite = FileSuite(workspace, seed, lines=lines, cli_share=cli_share, claims=claims,
                          reverts=reverts, log=log)

        def findings(totals: FileTotals) -> dict[str, int]:
            return {"differences": totals.differences, "duplicates": totals.duplicates,
                    "unsettled": totals.unsettled, "stuck": len(workspace.stuck_runs())}

        if tally is not None:
            tallied(suite, "file", tally, file_faults, findings)
        totals = suite.run(scenarios)
        if tally is not None:
            tally.settle("file", "end", **findings(totals))
    finally:
        if keep:
            log(f"work dir kept: {workspace.root}")
        workspace.close()
    replay = (f"--seed {seed} --scenarios {scenarios} --min-lines {lines[0]} "
              f"--max-lines {lines[1]} --cli-share {cli_share}"
              f"{'' if claims else ' --no-claims'}{' --reverts' if reverts else ''}")
    log(file_summary(totals, replay, time.monotonic() - started))
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mostovik_pipelines_tests.chaos.file_scenarios")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--scenarios", type=int, default=50)
    parser.add_argument("--min-lines", type=int, default=20)
    parser.add_argument("--max-lines", type=int, default=200)
    parser.add_argument("--cli-share", type=float, default=0.25,
                        help="share of sensor runs started as `dagster job execute`")
    parser.add_argument("--no-claims", dest="claims", action="store_false",
                        help="no file claims a waybill line another file holds")
    parser.add_argument("--reverts", action="store_true",
                        help="also drop an older version's bytes again as a file's newest")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (run logs)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"file chaos: seed {seed}, {args.scenarios} scenarios", flush=True)
    # A plain kill must still stop the servers started here (the finally blocks below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    postgres = ThrowawayPostgres().start()
    try:
        totals = run_file_chaos(postgres, seed, args.scenarios,
                                lines=(args.min_lines, args.max_lines), cli_share=args.cli_share,
                                claims=args.claims, reverts=args.reverts, keep=args.keep,
                                log=lambda line: print(line, flush=True))
    finally:
        postgres.stop()
    return 1 if totals.failures or totals.duplicates or totals.differences else 0


if __name__ == "__main__":
    sys.exit(main())
