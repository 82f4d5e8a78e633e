"""The judge of the file suite: after each scenario, the table, the quarantine, the inbox and
the archive against the model of the uploads (:mod:`.file_drops`).

The newest version of a file is its last drop (drop order is modification time order, so any older
version's load is refused as superseded). For every file name the table holds exactly the rows of
its newest loadable version (a defective version leaves the file's rows as they were, and so does a
version overwritten before any tick saw it), on every field and with that ``file_version``; no row
of another file is touched, no (waybill, line) is held twice, and the newest loaded version's
quarantine holds its rejected rows (the bad rows, at their spreadsheet row numbers, and the claimed
lines). The model is kept independent of which older versions loaded in between: bad rows only ever
have keys the file never held, and an unreadable key (which holds back every deletion by absence)
only appears in a version that removes nothing from a file whose stored rows are known. A defective
newest version is still in the inbox; a loaded one is in the archive as ``<name>@<hash>`` with its
bytes and a note of its outcome (a copy of the same bytes dropped again may stay in the inbox: the
sensor never requests a run key twice), and nothing ever leaves the archive.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from decimal import Decimal
from pathlib import Path

import psycopg

from mostovik_pipelines.resources.inbox import file_name_of, version_key
from mostovik_pipelines_tests.chaos.file_drops import SOURCE, TABLE, Drop, ReportFile, key_of
from mostovik_pipelines_tests.support.delivery_reports import Delivery

COLUMNS = ("delivery_date", "object_code", "waybill", "line_no", "material", "unit",
           "quantity::text", "price::text", "supplier", "source_file", "file_version")
QUANTITY, PRICE = 6, 7
"""Positions of the exact decimals in a row of :data:`COLUMNS`."""


class FileJudge:
    """The judge, for :class:`.file_scenarios.FileSuite`: it reads the suite's workspace, report
    files, inbox and archive, and counts into its totals."""
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
