"""The cases of the files section (:mod:`benchmarks.files` describes and measures them), each in
a process of its own: ``python -m benchmarks.files_cases CASE '{...}'`` runs one and prints one
JSON line, like ``benchmarks.cases``."""

from __future__ import annotations

import shutil
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

from benchmarks.measure import serve_cases

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




AMOUNT_FIGURES = ("quantity_sum", "price_sum", "quantity_scales", "price_scales")


def _amounts_written(amounts: list[tuple[Decimal, Decimal]]) -> dict[str, str | int]:
    """The figures :func:`benchmarks.files._check_ours` compares, for the (quantity, price) of
    every row."""
    quantities, prices = zip(*amounts, strict=True)
    return dict(zip(AMOUNT_FIGURES, (
        str(sum(quantities)), str(sum(prices)),
        sum(-q.as_tuple().exponent for q in quantities),
        sum(-p.as_tuple().exponent for p in prices)), strict=True))


def _as_cell(amount: Decimal) -> Decimal:
    """The amount an XLSX numeric cell holds: a double, read back as its shortest decimal."""
    number = float(amount)
    return Decimal(int(number)) if number.is_integer() else Decimal(repr(number))


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
