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

Every case runs in a process of its own; ``python -m benchmarks.files CASE '{...}'`` runs one
and prints one JSON line, like ``benchmarks.cases``.
"""

from __future__ import annotations

import shutil
import statistics
import time
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from benchmarks.measure import Figure, run_case, serve_cases

DATABASE = "files"
TABLE = "material_deliveries"
NAIVE_TABLE = "naive_deliveries"
PARTITIONS = "material_deliveries_file_versions"
JOB = "material_deliveries_job"
SENSOR = "material_deliveries_inbox_sensor"
RESOURCE_KEY = "material_deliveries_source"
REPORTS = {"csv": "deliveries-2026-11.csv", "xlsx": "deliveries-2026-11.xlsx"}
NAIVE = {
    "csv": ("csv", "read_csv", "multi"),
    "csv executemany": ("csv", "read_csv", None),
    "xlsx openpyxl": ("xlsx", "openpyxl", "multi"),
    "xlsx calamine": ("xlsx", "calamine", "multi"),
}
"""Naive case -> (the report it reads, the reader, ``to_sql``'s method). The issue's naive path
is ``method="multi"``; pandas' default method (an ``executemany``, which SQLAlchemy sends as
multi-row ``INSERT ... VALUES`` batches of its own) is measured for CSV too, because on this stack
``"multi"`` is the slower of the two."""
ROWS_PER_INBOX_FILE = 20
QUIET_TICKS = 5
"""Ticks with nothing new, per sensor repetition."""

# The report's header -> the plain table's column, for the naive path.
NAIVE_COLUMNS = {
    "Дата поставки": "delivery_date", "Объект": "object_code", "Накладная": "waybill",
    "Строка": "line_no", "Материал": "material", "Ед. изм.": "unit", "Количество": "quantity",
    "Цена": "price", "Поставщик": "supplier",
}


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


AMOUNT_FIGURES = ("quantity_sum", "price_sum", "quantity_scales", "price_scales")


def _amounts_written(amounts: list[tuple[Decimal, Decimal]]) -> dict[str, str | int]:
    """The figures :func:`_check_ours` compares, for the (quantity, price) of every row."""
    quantities, prices = zip(*amounts, strict=True)
    return dict(zip(AMOUNT_FIGURES, (
        str(sum(quantities)), str(sum(prices)),
        sum(-q.as_tuple().exponent for q in quantities),
        sum(-p.as_tuple().exponent for p in prices)), strict=True))


def _as_cell(amount: Decimal) -> Decimal:
    """The amount an XLSX numeric cell holds: a double, read back as its shortest decimal."""
    number = float(amount)
    return Decimal(int(number)) if number.is_integer() else Decimal(repr(number))


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
    """Run a case of this module in a fresh process; its JSON line as a dict."""
    return run_case(name, args, "benchmarks.files", {**env, "DAGSTER_TELEMETRY_ENABLED": "false"})


# --- the cases, each in a process of its own ----------------------------------------------------


def generate(args: dict[str, Any]) -> dict[str, Any]:
    """The two reports, and ``files`` reports of a few rows each (distinct lines, so distinct
    contents) for the sensor's inbox."""
    from mostovik_pipelines_tests.support import delivery_reports as reports

    out = Path(args["dir"])
    (out / REPORTS["csv"]).write_bytes(reports.benchmark_csv(args["rows"]))
    (out / REPORTS["xlsx"]).write_bytes(reports.benchmark_xlsx(args["rows"]))
    lines = reports.benchmark_lines(args["rows"])
    amounts = {  # the CSV writes each amount with its scale, the XLSX as a number cell
        "csv": _amounts_written([(line.quantity, line.price) for line in lines]),
        "xlsx": _amounts_written([(_as_cell(line.quantity), _as_cell(line.price))
                                  for line in lines]),
    }
    inbox = Path(args["inbox"])
    inbox.mkdir(parents=True)
    lines = reports.deliveries(args["files"] * ROWS_PER_INBOX_FILE, seed=7)
    for index in range(args["files"]):
        chunk = lines[index * ROWS_PER_INBOX_FILE:(index + 1) * ROWS_PER_INBOX_FILE]
        (inbox / f"site-{index:05d}.csv").write_bytes(
            reports.csv_report(reports.report_table(chunk), encoding="windows-1251"))
    return {"rows": args["rows"], "amounts": amounts}


def _location(url: str, work_dir: Path):
    from types import SimpleNamespace

    from mostovik_pipelines.sources import material_deliveries
    from mostovik_pipelines_tests.support.locations import code_location_for

    nowhere = "http://127.0.0.1:9"  # the HTTP sources' resources are built, never called
    return code_location_for(url, SimpleNamespace(cbr_url=nowhere, erp_url=nowhere), work_dir,
                             [material_deliveries.SOURCE])


def ours(args: dict[str, Any]):
    """``material_deliveries_job`` for the report's version, in process, on the production
    instance. ``first``: the report is dropped into the inbox before the clock, hashing it and
    adding its partition are timed; ``reload``: the version is in the archive already."""
    from dagster import DagsterEventType, DagsterInstance

    from mostovik_pipelines.resources.inbox import InboxResource, version_key

    work_dir = Path(args["dir"])
    location = _location(args["url"], work_dir)
    job = location.resolve_job_def(JOB)
    inbox = InboxResource(inbox_dir=str(work_dir / "inbox"),
                          archive_dir=str(work_dir / "archive"))
    instance = DagsterInstance.get()
    instance.get_dynamic_partitions(PARTITIONS)  # connected before the clock
    first, key = args["stage"] == "first", None
    if first:
        Path(inbox.inbox_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args["report"], Path(inbox.inbox_dir) / args["name"])
    else:
        archived = [p.name for p in Path(inbox.archive_dir).iterdir()
                    if p.name.startswith(f"{args['name']}@") and not p.name.endswith(".json")]
        if len(archived) != 1:
            raise RuntimeError(f"expected the archived version of {args['name']}: {archived}")
        key = archived[0]

    def run() -> dict[str, Any]:
        nonlocal key
        if first:
            key = version_key(args["name"], inbox.content_hash(args["name"]))
            instance.add_dynamic_partitions(PARTITIONS, [key])
        result = job.execute_in_process(partition_key=key, instance=instance)
        if not result.success:
            raise RuntimeError(f"{JOB} failed for {key}")
        steps, metadata = {}, {}
        for event in result.all_events:
            if event.event_type is DagsterEventType.STEP_SUCCESS:
                steps[event.step_key.split(".")[-1].split("_")[0]] = (
                    event.event_specific_data.duration_ms / 1000)
            if event.event_type is DagsterEventType.ASSET_MATERIALIZATION:
                metadata = {k: v.value for k, v in
                            event.event_specific_data.materialization.metadata.items()}
        return {"rows": metadata.get("dagster/row_count", 0), "key": key, "steps": steps,
                "counts": {k: metadata.get(k) for k in ("inserted", "updated", "unchanged",
                                                         "deleted", "rejected")}}

    return run


def naive(args: dict[str, Any]):
    """What a user writes first: pandas reads the report, ``to_sql`` writes it."""
    import pandas as pd
    from sqlalchemy import create_engine, text

    case, report = args["case"], args["report"]
    _, reader, method = NAIVE[case]
    engine = create_engine(args["url"])
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))
    if reader != "read_csv":
        import openpyxl  # noqa: F401  (imports before the clock, as for every case)
        import python_calamine  # noqa: F401

    def run() -> dict[str, Any]:
        if reader == "read_csv":
            frame = pd.read_csv(report, sep=";", decimal=",", thousands=" ", encoding="cp1251",
                                dtype={"Накладная": str}, parse_dates=["Дата поставки"],
                                date_format="%d.%m.%Y")
        else:
            # Two title rows and a blank one above the header.
            frame = pd.read_excel(report, engine=reader, header=3,
                                  dtype={"Накладная": str})
        frame = frame.rename(columns=NAIVE_COLUMNS)
        for column in ("quantity", "price"):
            if frame[column].dtype != "float64":
                raise RuntimeError(f"naive {case}: {column} read as {frame[column].dtype}")
        frame.to_sql(NAIVE_TABLE, engine, if_exists="replace", index=False, method=method,
                     chunksize=1000)
        return {"rows": len(frame)}

    return run


def sensor(args: dict[str, Any]):
    """The inbox sensor on the production instance: the first tick over ``files`` new files,
    its partitions added as the daemon adds them, then ticks with its cursor."""
    from dagster import DagsterInstance, build_sensor_context

    from mostovik_pipelines.resources.inbox import InboxResource

    work_dir = Path(args["dir"])
    location = _location(args["url"], work_dir)
    sensor_def = location.resolve_sensor_def(SENSOR)
    resources = {RESOURCE_KEY: InboxResource(inbox_dir=args["inbox"],
                                             archive_dir=str(work_dir / "archive"))}
    instance = DagsterInstance.get()
    instance.get_dynamic_partitions(PARTITIONS)  # connected before the clock

    def tick(cursor: str | None):
        started = time.perf_counter()
        context = build_sensor_context(instance=instance, cursor=cursor, resources=resources)
        result = sensor_def(context)
        return result, time.perf_counter() - started

    def run() -> dict[str, Any]:
        first, first_seconds = tick(None)
        if len(first.run_requests) != args["files"]:
            raise RuntimeError(f"first tick: {len(first.run_requests)} run requests for "
                               f"{args['files']} files")
        added = time.perf_counter()
        for request in first.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name,
                                            list(request.partition_keys))
        added = time.perf_counter() - added
        quiet = []
        for _ in range(args["quiet_ticks"]):
            result, seconds = tick(first.cursor)
            if result.run_requests or result.dynamic_partitions_requests:
                raise RuntimeError(f"a tick with nothing new asked for "
                                   f"{len(result.run_requests)} runs")
            quiet.append(seconds)
        return {"rows": args["files"], "first": {"seconds": first_seconds,
                                                 "run_requests": len(first.run_requests),
                                                 "cursor_bytes": len(first.cursor or "")},
                "partitions_added_seconds": added, "quiet": quiet}

    return run


CASES = {"ours": ours, "naive": naive, "sensor": sensor}


if __name__ == "__main__":
    serve_cases(CASES, generate)
