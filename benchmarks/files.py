"""The files section: a material delivery report from the inbox to commit, our job next to the
pandas path a user would write, and the inbox sensor's tick over a full inbox.

* ours: the report (``benchmark_csv`` / ``benchmark_xlsx`` of
  ``mostovik_pipelines_tests.support.delivery_reports``) is dropped into the inbox before the
  clock; the clock covers hashing it for its version key ``<name>@<sha256[:12]>`` (what the
  sensor does), adding that dynamic partition and ``material_deliveries_job.execute_in_process``
  for it on the production instance (``deploy/dagster.yaml``: run and event storage in
  PostgreSQL) against a migrated warehouse: extract reads and lands the bytes, transform parses
  them (``parse_delivery_report``), load commits them, and the file moves to the archive; the
  table is then checked: every row, and the amounts exactly as the report wrote them (their
  exact sums and the sum of their scales: ``1,500`` stored as ``1.500``);
* ours, re-processing: the same partition run again (the file read back from the archive, the
  rows identical to the stored ones);
* naive: ``pandas.read_csv(sep=";", decimal=",", thousands=" ", encoding="cp1251")`` or
  ``pandas.read_excel`` (openpyxl, pandas' default engine for XLSX, and calamine), then
  ``DataFrame.to_sql(method="multi", chunksize=1000)`` into a plain table in the same
  PostgreSQL (for CSV also with ``to_sql``'s default method). It reads the numbers as floats,
  the waybills as text (leading zeros kept) and the dates as dates; a check compares its row
  count, keys, dates and sums with our table's after each run. (``benchmark_csv`` groups
  thousands with a plain space, U+0020; a report grouping them with a no-break space would need
  ``thousands="\xa0"``, and one mixing both cannot be read this way at all);
* the inbox sensor over ``files`` waiting files on a fresh production instance: the first tick
  (every file new: each one hashed, one run request each), then ticks with the cursor of the
  first one and its dynamic partitions added (none new: no file opened).

Every case runs in a process of its own (:mod:`benchmarks.files_cases`).
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.files_cases import (
    AMOUNT_FIGURES,
    DATABASE,
    JOB,
    NAIVE,
    NAIVE_TABLE,
    QUIET_TICKS,
    REPORTS,
    ROWS_PER_INBOX_FILE,
    TABLE,
)
from benchmarks.measure import Figure, run_case

# --- the figures ---------------------------------------------------------------------------------


@dataclass
class FilesFigures:
    rows: int
    sizes: dict[str, int]
    """Format -> the report's size in bytes."""
    ours: dict[str, Figure]
    reload: dict[str, Figure]
    naive: dict[str, Figure]
    steps: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """Our first load, per format: extract/transform/load -> seconds of each run."""
    counts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Format -> the counts of our first load and of the re-load (the last repetition's)."""
    reload_written: dict[str, dict[str, int]] = field(default_factory=dict)
    files: int = 0
    first_tick: Figure | None = None
    quiet_tick: Figure | None = None
    tick_runs: int = 0
    """Run requests of the first tick (must be ``files``)."""
    partitions_added: list[float] = field(default_factory=list)
    """Seconds to add the first tick's dynamic partitions to the instance (the daemon's
    work, not the tick's)."""


# --- the section, run by benchmarks.run ---------------------------------------------------------


def measure_files(server, work_dir: Path, rows: int, files: int, repeat: int, log
                  ) -> FilesFigures:
    import psycopg

    from benchmarks.loader import _tuple_stats, _written
    from mostovik_pipelines.warehouse import migrate
    from mostovik_pipelines_tests.support.instances import production_instance

    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {DATABASE}")
    url = server.url(DATABASE)
    migrate.upgrade(url)
    root = work_dir / "files"
    data_dir, inbox_files = root / "reports", root / "waiting"
    data_dir.mkdir(parents=True)
    log(f"writing a {rows:,}-row CSV and XLSX report and {files:,} small reports for the "
        "sensor (openpyxl writes the XLSX: this takes a while)")
    written = _run("generate", {"rows": rows, "dir": str(data_dir), "files": files,
                                "inbox": str(inbox_files)}, {})["amounts"]
    reports = {fmt: data_dir / name for fmt, name in REPORTS.items()}
    (root / "instance").mkdir()
    _, dagster_env = production_instance(server, "files_dagster", root / "instance")

    figures = FilesFigures(
        rows=rows, sizes={fmt: path.stat().st_size for fmt, path in reports.items()},
        ours={fmt: Figure(f"ours: {JOB}, {fmt.upper()}, file -> commit") for fmt in REPORTS},
        reload={fmt: Figure(f"ours: {fmt.upper()}, re-processing the same file")
                for fmt in REPORTS},
        naive={case: Figure(f"naive: {_naive_label(case)}") for case in NAIVE},
        files=files,
        first_tick=Figure(f"sensor: first tick, {files:,} files all new (each hashed)"),
        quiet_tick=Figure(f"sensor: a tick over {files:,} files, none new"),
    )
    with psycopg.connect(server.dsn(DATABASE), autocommit=True) as db:
        for repetition in range(1, repeat + 1):
            log(f"files repetition {repetition} of {repeat}")
            for fmt, report in reports.items():
                run_dir = root / f"run-{repetition}-{fmt}"
                _forget_everything(db)
                args = {"url": url, "dir": str(run_dir), "report": str(report),
                        "name": REPORTS[fmt]}
                log(f"  ours, {fmt}: first load, then re-processing")
                first = _run("ours", {**args, "stage": "first"}, dagster_env)
                figures.ours[fmt].add(first)
                _check_ours(db, first, rows, fmt, written[fmt])
                figures.steps.setdefault(fmt, {})
                for step, seconds in first["steps"].items():
                    figures.steps[fmt].setdefault(step, []).append(seconds)
                before = _tuple_stats(db, TABLE)
                again = _run("ours", {**args, "stage": "reload"}, dagster_env)
                figures.reload[fmt].add(again)
                figures.reload_written[fmt] = _written(db, TABLE, before)
                figures.counts[fmt] = {"first": first["counts"], "reload": again["counts"]}
                for case, (source, _, _) in NAIVE.items():
                    if source != fmt:
                        continue
                    log(f"  naive: {_naive_label(case)}")
                    db.execute(f"DROP TABLE IF EXISTS {NAIVE_TABLE}")
                    figures.naive[case].add(_run("naive", {"url": url, "report": str(report),
                                                           "case": case}, {}))
                    _check_naive(db, rows, case)
                shutil.rmtree(run_dir, ignore_errors=True)
            log(f"  sensor: {files:,} files in the inbox, a fresh instance")
            (root / f"sensor-{repetition}").mkdir()
            _, sensor_env = production_instance(server, f"files_sensor_{repetition}",
                                                root / f"sensor-{repetition}")
            ticks = _run("sensor", {"url": url, "inbox": str(inbox_files), "files": files,
                                    "dir": str(root / f"sensor-{repetition}"),
                                    "quiet_ticks": QUIET_TICKS}, sensor_env)
            memory = {"rows": files, "rss_before": ticks["rss_before"],
                      "peak_rss": ticks["peak_rss"]}
            figures.first_tick.add({**memory, "seconds": ticks["first"]["seconds"]})
            figures.tick_runs = ticks["first"]["run_requests"]
            figures.partitions_added.append(ticks["partitions_added_seconds"])
            for seconds in ticks["quiet"]:
                figures.quiet_tick.add({**memory, "seconds": seconds})
    return figures


def files_table(f: FilesFigures, checks: list[tuple[bool, str]]) -> list[str]:
    """The printed section; the CSV and sensor targets go to ``checks``."""
    from benchmarks.measure import MB

    repeat = len(f.ours["csv"].seconds)
    reference = {"csv": f.naive["csv"], "xlsx": f.naive["xlsx openpyxl"]}
    lines = [
        "",
        f"Files (material_deliveries): one report of {f.rows:,} rows (CSV windows-1251 ';' "
        f"{f.sizes['csv'] / MB:.1f} MB, XLSX {f.sizes['xlsx'] / MB:.1f} MB), file -> commit; "
        f"median of {repeat} run(s), each in a process of its own; ours on the production "
        "instance (PostgreSQL storage), execute_in_process",
        f"{'case':<68}{'median s':>9}{'rows/s':>9}{'vs naive':>9}{'peak RSS':>10}  "
        "counts i/u/=/d, tuples written ins/upd/del",
    ]

    def row(figure: Figure, fmt: str, note: str = "") -> str:
        ratio = reference[fmt].median / figure.median
        return (f"{figure.label:<68}{figure.median:>9.2f}{figure.rows_per_second:>9,.0f}"
                f"{ratio:>8.2f}x{figure.peak_mb:>7.0f} MB  {note}".rstrip())

    def counts(c: dict[str, Any]) -> str:
        return "/".join(str(c.get(k)) for k in ("inserted", "updated", "unchanged", "deleted"))

    for fmt in REPORTS:
        lines.append(row(f.ours[fmt], fmt, counts(f.counts[fmt]["first"])))
        written = f.reload_written.get(fmt, {})
        lines.append(row(f.reload[fmt], fmt, f"{counts(f.counts[fmt]['reload'])}, "
                                             f"{written.get('ins')}/{written.get('upd')}/"
                                             f"{written.get('del')}"))
        for case, (source, _, _) in NAIVE.items():
            if source == fmt:
                lines.append(row(f.naive[case], fmt))
    steps = "; ".join(
        f"{fmt.upper()} " + ", ".join(f"{step} {statistics.median(seconds):.2f}"
                                      for step, seconds in f.steps[fmt].items())
        for fmt in REPORTS)
    lines += [
        f"  ours, first load, step durations (median s): {steps}; the rest of the run is "
        "hashing, the partition, run start and events",
        "  vs naive: the naive read + to_sql(multi) time of the same format over this case's "
        "(CSV: read_csv, XLSX: read_excel openpyxl)",
    ]
    first, quiet = f.first_tick, f.quiet_tick
    lines += [
        "",
        f"Inbox sensor: {f.files:,} files waiting ({ROWS_PER_INBOX_FILE}-row CSV reports), "
        f"build_sensor_context + evaluation on the production instance (PostgreSQL), "
        f"{repeat} fresh instance(s), {QUIET_TICKS} quiet ticks each",
        f"{'case':<68}{'median s':>9}{'max s':>9}{'peak RSS':>10}",
        f"{f'first tick: all new, each file hashed, {f.tick_runs:,} run requests':<68}"
        f"{first.median:>9.2f}{max(first.seconds):>9.2f}{first.peak_mb:>7.0f} MB",
        f"{'a tick with its cursor, none new (no file opened)':<68}"
        f"{quiet.median:>9.2f}{max(quiet.seconds):>9.2f}",
        f"{'adding its dynamic partitions (the daemon does, not the tick)':<68}"
        f"{statistics.median(f.partitions_added):>9.2f}{max(f.partitions_added):>9.2f}",
    ]
    ours_csv = f.ours["csv"].rows_per_second
    versus = {case: ours_csv / f.naive[case].rows_per_second for case in ("csv",
                                                                          "csv executemany")}
    checks.append((versus["csv"] >= 10,
                   f"ours CSV file -> commit {ours_csv:,.0f} rows/s, {versus['csv']:.1f}x the "
                   "naive read_csv + to_sql(multi, chunksize=1000) (target >= 10x; against "
                   f"to_sql's default method {versus['csv executemany']:.1f}x)"))
    checks.append((quiet.median < 2,
                   f"an inbox sensor tick over {f.files:,} files, none new, {quiet.median:.2f} s "
                   f"(max {max(quiet.seconds):.2f} s; target < 2 s); the first tick, every file "
                   f"new: {first.median:.2f} s"))
    return lines


def _naive_label(case: str) -> str:
    _, reader, method = NAIVE[case]
    read = "read_csv" if reader == "read_csv" else f"read_excel({reader})"
    return f"pandas.{read} + to_sql({'multi, ' if method else ''}chunksize=1000)"


def _forget_everything(db) -> None:
    """An empty target and no ledger or quarantine of the source: every first load is one."""
    db.execute(f"TRUNCATE {TABLE}")
    db.execute("DELETE FROM partition_loads WHERE table_name = %s", (TABLE,))
    db.execute("DELETE FROM quarantined_rows WHERE source = %s", (TABLE,))


def _check_ours(db, result: dict[str, Any], rows: int, fmt: str,
                written: dict[str, str | int]) -> None:
    """Every row is in the table, and its amounts exactly as the report wrote them: their exact
    sums and the sum of their scales (``1.500`` is stored as ``1.500``, not ``1.5``)."""
    found = db.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]
    counts = result["counts"]
    if found != rows or counts.get("inserted") != rows or result["rows"] != rows:
        raise RuntimeError(f"ours ({fmt}) left {found} rows of {rows}; counts {counts}, "
                           f"row count {result['rows']}")
    stored = dict(zip(AMOUNT_FIGURES, db.execute(
        f"SELECT sum(quantity)::text, sum(price)::text, sum(scale(quantity)), "
        f"sum(scale(price)) FROM {TABLE}").fetchone(), strict=True))
    if stored != written:
        raise RuntimeError(f"ours ({fmt}) stored amounts {stored}, the report wrote {written}")

def _check_naive(db, rows: int, case: str) -> None:
    """The naive table holds what ours holds: same rows, keys, dates and (float) sums."""
    sql = ("SELECT count(*), count(DISTINCT (waybill, line_no)), min(delivery_date::date), "
           "max(delivery_date::date), sum(quantity::float8), sum(price::float8) FROM {}")
    ours = db.execute(sql.format(TABLE)).fetchone()
    naive = db.execute(sql.format(NAIVE_TABLE)).fetchone()
    same = ours[:4] == naive[:4] and all(abs(a - b) <= 1e-6 * abs(a) + 0.01
                                         for a, b in zip(ours[4:], naive[4:], strict=True))
    if not same or naive[0] != rows:
        raise RuntimeError(f"naive ({case}) differs from ours: ours {ours}, naive {naive}")


def _run(name: str, args: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """Run a case of :mod:`benchmarks.files_cases` in a fresh process; its JSON line as a dict."""
    return run_case(name, args, "benchmarks.files_cases",
                    {**env, "DAGSTER_TELEMETRY_ENABLED": "false"})

