"""The sync section: one window of ``erp_work_orders`` from the local ERP stand-in to commit,
our job next to dlt's ``rest_api`` source, each sync in a process of its own.

* ours: ``erp_work_orders_job`` for one partition, in process
  (``job.execute_in_process(partition_key=day, instance=DagsterInstance.ephemeral())``) against
  a migrated warehouse: extract lands every page, transform keeps each page's frame, load
  merges page by page with the progress checkpoint in each page's transaction;
* dlt: ``rest_api_source`` with the stand-in's cursor paginator (``next_page_token`` in the JSON
  body, ``page_token`` query parameter), incremental on ``updated_at`` bounded to the same window
  (``updated_from``/``updated_to``, ``initial_value``/``end_value``), ``write_disposition=
  "merge"`` with primary key ``id``, into the same PostgreSQL;
* the fetch floor: a bare ``httpx`` client paging the same window and parsing the JSON, nothing
  stored: what the stand-in and HTTP cost before anyone writes a row;
* a re-sync of the unchanged window by both, with the target table's ``pg_stat_user_tables``
  ``n_tup_ins/n_tup_upd/n_tup_del`` deltas;
* our peak RSS for windows of several sizes (a process each): is it flat in the number of pages;
* ours once more in pages of ``BIG_PAGE_SIZE``: how much of our time is paid per page.

The stand-in runs in a thread of the benchmark's own process, on 127.0.0.1, every day it serves
generated and its sorted view built before the clock starts (one warm-up request per window).

``python -m benchmarks.sync CASE '{...}'`` runs one case and prints one JSON line, like
``benchmarks.cases``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any

from benchmarks.measure import Figure, run_case, serve_cases

DATABASE = "sync"
TABLE = "erp_work_orders"
DLT_DATASET = "dlt_sync"
PAGE_SIZE = 100
BIG_PAGE_SIZE = 1000
"""The stand-in's largest page: an extra run of ours shows how much of its time is per page."""
FIRST_DAY = date(2026, 11, 2)
"""Windows are Moscow days from here on, one day per window size (inside the source's
partitions, which start on 2026-01-01)."""


# --- the figures ---------------------------------------------------------------------------------


@dataclass
class SyncFigures:
    records: int
    fetch: Figure
    ours_first: Figure
    ours_resync: Figure
    dlt_first: Figure
    dlt_resync: Figure
    ours_written: dict[str, int] = field(default_factory=dict)
    ours_resync_written: dict[str, int] = field(default_factory=dict)
    dlt_written: dict[str, int] = field(default_factory=dict)
    dlt_resync_written: dict[str, int] = field(default_factory=dict)
    memory: dict[int, Figure] = field(default_factory=dict)
    """Window size -> our first sync of such a window (the largest is ``ours_first``)."""
    load_before: float = 0.0
    load_after: float = 0.0
    """The machine's 1-minute load average around the section (it is shared)."""
    ours_big_pages: Figure | None = None
    """Ours on the same window in pages of ``BIG_PAGE_SIZE``: what the per-page cost is."""
    steps: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    """Case label -> per run, seconds by step (ours: extract/transform/load; dlt:
    extract/normalize/load)."""

    def add(self, figure: Figure, result: dict[str, Any]) -> None:
        figure.add(result)
        self.steps.setdefault(figure.label, []).append(result.get("steps") or {})

    def median_steps(self, figure: Figure) -> dict[str, float]:
        runs = self.steps.get(figure.label) or []
        names = [name for name in (runs[0] if runs else {}) if name != "run"]
        return {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}


# --- the section, run by benchmarks.run ---------------------------------------------------------


def measure_sync(server, work_dir: Path, records: int, memory_windows: tuple[int, ...],
                 repeat: int, log) -> SyncFigures:
    import httpx
    import psycopg

    from mostovik_pipelines.standin import StandinClient, StandinServer
    from mostovik_pipelines.warehouse import migrate

    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {DATABASE}")
    url = server.url(DATABASE)
    migrate.upgrade(url)
    sizes = sorted({*memory_windows, records})
    days = {size: (FIRST_DAY + timedelta(days=i)).isoformat() for i, size in enumerate(sizes)}
    day = days[records]
    figures = SyncFigures(
        records=records,
        fetch=Figure("fetch floor: httpx pages the window, parses JSON"),
        ours_first=Figure("ours: erp_work_orders_job, first sync"),
        ours_resync=Figure("ours: re-sync of the unchanged window"),
        dlt_first=Figure("dlt rest_api, incremental + merge: first sync"),
        dlt_resync=Figure("dlt rest_api: re-sync of the unchanged window"),
        ours_big_pages=Figure(f"ours, pages of {BIG_PAGE_SIZE:,}: first sync"),
    )
    figures.memory = {size: (figures.ours_first if size == records
                             else Figure(f"ours: first sync, {size:,} records"))
                      for size in sizes}
    figures.load_before = os.getloadavg()[0]
    standin = StandinServer().start()  # 127.0.0.1, a thread of this process
    try:
        client = StandinClient(standin.url)
        client.reset_erp()
        for size, window_day in days.items():
            client.set_erp_volume(window_day, size)
        log(f"stand-in: windows of {', '.join(f'{s:,}' for s in sizes)} records, warming up")
        with httpx.Client() as warm:  # generates each day and builds its sorted view
            for window_day in days.values():
                warm.get(f"{standin.erp_url}/api/v1/work-orders",
                         params={**_window_params(window_day), "page_size": str(PAGE_SIZE)}
                         ).raise_for_status()
        common = {"url": url, "erp_url": standin.erp_url, "page_size": PAGE_SIZE}
        with psycopg.connect(server.dsn(DATABASE), autocommit=True) as db:
            for repetition in range(1, repeat + 1):
                log(f"sync repetition {repetition} of {repeat}")
                run_dir = work_dir / f"sync-{repetition}"
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir(parents=True)
                _forget_everything(db)
                figures.add(figures.fetch, _run("fetch", {**common, "day": day}))

                ours_args = {**common, "day": day, "dir": str(run_dir / "ours")}
                log(f"  ours: {records:,} records, first sync and re-sync")
                before = _settled_stats(db, TABLE)
                figures.add(figures.ours_first, _run("ours", ours_args))
                figures.ours_written = _written_since(db, TABLE, before)
                _check_rows(db, f"SELECT count(*) FROM {TABLE} WHERE window_date = %s", (day,),
                            records, "ours")
                before = _settled_stats(db, TABLE)
                figures.add(figures.ours_resync, _run("ours", ours_args))
                figures.ours_resync_written = _written_since(db, TABLE, before)

                log("  dlt: first sync and re-sync")
                dlt_args = {**common, "day": day, "pipelines_dir": str(run_dir / "dlt")}
                figures.add(figures.dlt_first, _run("dlt", dlt_args))
                figures.dlt_written = _settled_stats(db, TABLE, DLT_DATASET)
                _check_rows(db, f"SELECT count(*) FROM {DLT_DATASET}.{TABLE}", (), records,
                            "dlt")
                before = _settled_stats(db, TABLE, DLT_DATASET)
                figures.add(figures.dlt_resync, _run("dlt", dlt_args))
                figures.dlt_resync_written = _written_since(db, TABLE, before, DLT_DATASET)

                log(f"  ours in pages of {BIG_PAGE_SIZE:,}")
                db.execute(f"TRUNCATE {TABLE}")
                figures.add(figures.ours_big_pages, _run("ours", {
                    **ours_args, "page_size": BIG_PAGE_SIZE, "dir": str(run_dir / "big")}))
                _check_rows(db, f"SELECT count(*) FROM {TABLE} WHERE window_date = %s", (day,),
                            records, "ours (big pages)")

                for size in sizes:
                    if size != records:
                        log(f"  ours: peak memory, a window of {size:,} records")
                        figures.add(figures.memory[size], _run("ours", {
                            **common, "day": days[size], "dir": str(run_dir / f"w{size}")}))
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        standin.stop()
    figures.load_after = os.getloadavg()[0]
    return figures


def _settled_stats(db, table: str, schema: str = "public") -> dict[str, int]:
    """The table's tuple counters once every other session has gone: a backend hands its
    counters over when it goes idle (at most once a second) or exits, so a figure read while
    the case's connections are still closing would miss the last writes."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and db.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'").fetchone()[0]:
        time.sleep(0.05)
    db.execute("SELECT pg_stat_clear_snapshot()")
    row = db.execute(
        "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables "
        "WHERE schemaname = %s AND relname = %s", (schema, table)).fetchone()
    return dict(zip(("ins", "upd", "del"), row or (0, 0, 0), strict=True))


def _written_since(db, table: str, before: dict[str, int], schema: str = "public"
                   ) -> dict[str, int]:
    after = _settled_stats(db, table, schema)
    return {name: after[name] - before[name] for name in after}


def _forget_everything(db) -> None:
    """An empty target, no checkpoint, no dlt dataset: every repetition starts the same."""
    db.execute(f"TRUNCATE {TABLE}")
    db.execute("DELETE FROM sync_progress")
    db.execute("DELETE FROM partition_loads")
    for schema in (DLT_DATASET, f"{DLT_DATASET}_staging"):
        db.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def _check_rows(db, sql: str, params: tuple, expected: int, who: str) -> None:
    found = db.execute(sql, params).fetchone()[0]
    if found != expected:
        raise RuntimeError(f"{who}'s sync left {found} rows, the window has {expected}")


def _run(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run a case of this module in a fresh process; its JSON line as a dict."""
    return run_case(name, args, "benchmarks.sync", {
        "MOSTOVIK_ERP_PAGE_SIZE": str(args.get("page_size", PAGE_SIZE)),
        "RUNTIME__DLTHUB_TELEMETRY": "false", "DAGSTER_TELEMETRY_ENABLED": "false"})


def _window_params(day: str) -> dict[str, str]:
    from mostovik_pipelines.sources.erp_work_orders import window_bounds

    start, end = window_bounds(day)
    return {"updated_from": start.isoformat(), "updated_to": end.isoformat()}


# --- the cases, each in a process of its own ----------------------------------------------------


def fetch(args: dict[str, Any]):
    """The floor: page the window with one keep-alive client and parse each page."""
    import httpx

    client = httpx.Client(timeout=30)
    base = f"{args['erp_url']}/api/v1/work-orders"
    window = {**_window_params(args["day"]), "page_size": str(PAGE_SIZE)}

    def run() -> dict[str, Any]:
        rows = pages = 0
        token = None
        while True:
            response = client.get(base, params={**window, **({"page_token": token}
                                                              if token else {})})
            response.raise_for_status()
            page = json.loads(response.content)
            rows, pages = rows + len(page["items"]), pages + 1
            token = page["next_page_token"]
            if not token:
                return {"rows": rows, "pages": pages}

    return run


def ours(args: dict[str, Any]):
    """``erp_work_orders_job`` for the window's partition, in process, ephemeral instance; the
    code location wired as the tests wire it (``code_location_for``): this warehouse, landing
    and op outputs under the case's directory, the source's resource pointed at the stand-in."""
    from dagster import DagsterEventType, DagsterInstance

    from mostovik_pipelines.definitions import build_code_location
    from mostovik_pipelines.framework.assets.resource_keys import source_resource_key
    from mostovik_pipelines.resources import (
        HttpSourceResource,
        LandingStoreResource,
        WarehouseResource,
    )
    from mostovik_pipelines.resources.op_outputs import OpOutputStore
    from mostovik_pipelines.sources import erp_work_orders

    if args["page_size"] != erp_work_orders.PAGE_SIZE:
        raise RuntimeError(f"MOSTOVIK_ERP_PAGE_SIZE is {erp_work_orders.PAGE_SIZE}, the case "
                           f"wants {args['page_size']}")
    source, work_dir = erp_work_orders.SOURCE, Path(args["dir"])
    location = build_code_location(sources=[source], resources={
        "warehouse": WarehouseResource(database_url=args["url"]),
        "landing": LandingStoreResource(base_dir=str(work_dir / "landing")),
        "io_manager": OpOutputStore(base_dir=str(work_dir / "storage")),
        source_resource_key(source): HttpSourceResource(
            base_url=args["erp_url"], timeout_seconds=source.resource.timeout_seconds),
    })
    job = location.resolve_job_def("erp_work_orders_job")
    instance = DagsterInstance.ephemeral()

    def run() -> dict[str, Any]:
        result = job.execute_in_process(partition_key=args["day"], instance=instance)
        steps = {}
        for event in result.all_events:
            if event.event_type is DagsterEventType.STEP_SUCCESS:
                name = event.step_key.split(".")[-1].split("_")[0]  # extract/transform/load
                steps[name] = event.event_specific_data.duration_ms / 1000
        metadata = {}
        for event in result.all_events:
            if event.event_type is DagsterEventType.ASSET_MATERIALIZATION:
                metadata = {k: v.value for k, v in
                            event.event_specific_data.materialization.metadata.items()}
        return {"rows": metadata.get("dagster/row_count", 0), "pages": metadata.get("pages"),
                "steps": steps,
                "counts": {k: metadata.get(k) for k in ("inserted", "updated", "unchanged",
                                                         "ignored_older", "tombstoned")}}

    return run


def dlt_sync(args: dict[str, Any]):
    """dlt's ``rest_api`` source on the same window, merged by primary key ``id``."""
    os.environ.setdefault("RUNTIME__DLTHUB_TELEMETRY", "false")
    import dlt
    from dlt.sources.rest_api import rest_api_source

    window = _window_params(args["day"])
    source = rest_api_source({
        "client": {
            "base_url": f"{args['erp_url']}/api/v1/",
            "paginator": {"type": "cursor", "cursor_path": "next_page_token",
                          "cursor_param": "page_token"},
        },
        "resource_defaults": {"primary_key": "id", "write_disposition": "merge"},
        "resources": [{
            "name": TABLE,
            "endpoint": {
                "path": "work-orders",
                "params": {"page_size": PAGE_SIZE},
                "data_selector": "items",
                "incremental": {
                    "cursor_path": "updated_at",
                    "start_param": "updated_from", "initial_value": window["updated_from"],
                    "end_param": "updated_to", "end_value": window["updated_to"],
                },
            },
            "columns": {"amount": {"data_type": "decimal"},
                        "planned_start": {"data_type": "date"},
                        "planned_finish": {"data_type": "date"},
                        "version": {"data_type": "bigint"}},
        }],
    })
    pipeline = dlt.pipeline(
        pipeline_name="bench_dlt_sync", pipelines_dir=args["pipelines_dir"],
        destination=dlt.destinations.postgres(
            credentials=args["url"].replace("postgresql+psycopg://", "postgresql://")),
        dataset_name=DLT_DATASET,
    )

    def run() -> dict[str, Any]:
        info = pipeline.run(source)
        info.raise_on_failed_jobs()
        rows = pipeline.last_trace.last_normalize_info.row_counts.get(TABLE, 0)
        steps = {step.step: (step.finished_at - step.started_at).total_seconds()
                 for step in pipeline.last_trace.steps if step.finished_at}
        return {"rows": rows, "steps": steps}

    return run


CASES = {"fetch": fetch, "ours": ours, "dlt": dlt_sync}


if __name__ == "__main__":
    serve_cases(CASES)
