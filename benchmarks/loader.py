"""The loader section: one partition from a DataFrame in memory to commit, ours next to the
physical reference, ``to_sql`` and dlt, each case in a process of its own."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import psycopg
from sqlalchemy import create_engine

from benchmarks.data import bench_metadata
from benchmarks.measure import Figure, run_case
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

DATABASE = "bench"
DLT_SCHEMA = "dlt_bench"
MODES = ("replace", "merge")
STEPS = (("first", "first load into an empty partition", "base"),
         ("identical", "re-load of identical data", "base"),
         ("compared", "same, digest forgotten: compare rows", "base"),
         ("changed", "re-load, 1% changed + 1% removed", "changed"))
"""Every step but "identical" starts with the partition's digest forgotten (as after a write
outside the loader), so it shows what comparing the stored rows costs."""


@dataclass
class LoaderFigures:
    rows: int
    reference: Figure
    binary_reference: Figure
    keyed_reference: Figure
    ours: dict[tuple[str, str], Figure]
    to_sql: Figure
    dlt_first: Figure
    dlt_reload: Figure


def _tuple_stats(connection: psycopg.Connection, table: str, schema: str = "public"
                 ) -> dict[str, int]:
    connection.execute("SELECT pg_stat_clear_snapshot()")
    row = connection.execute(
        "SELECT n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables "
        "WHERE schemaname = %s AND relname = %s", (schema, table),
    ).fetchone()
    return dict(zip(("ins", "upd", "del"), row or (0, 0, 0), strict=True))


def _written(connection: psycopg.Connection, table: str, before: dict[str, int],
             schema: str = "public") -> dict[str, int]:
    after = _tuple_stats(connection, table, schema)
    return {k: after[k] - before[k] for k in after}


def measure_loader(server: ThrowawayPostgres, work_dir: Path, rows: int, repeat: int,
                   to_sql_rows: int, log) -> LoaderFigures:
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {DATABASE}")
    url = server.url(DATABASE)
    engine = create_engine(url)
    bench_metadata.create_all(engine)
    engine.dispose()
    log(f"generating {rows:,} rows")
    run_case("generate", {"rows": rows, "dir": str(work_dir)})
    frames = {name: str(work_dir / f"{name}.pickle") for name in ("base", "changed")}
    dlt_url = url.replace("postgresql+psycopg://", "postgresql://")

    figures = LoaderFigures(
        rows=rows,
        reference=Figure("physical reference: COPY, Arrow CSV, no index"),
        binary_reference=Figure("physical reference, binary COPY (pgpq), no index"),
        keyed_reference=Figure("binary COPY into a table shaped like ours (floor)"),
        ours={(mode, step): Figure(f"ours {mode}: {label}")
              for mode in MODES for step, label, _ in STEPS},
        to_sql=Figure(f"to_sql(method='multi'), {to_sql_rows:,} rows"),
        dlt_first=Figure("dlt merge (csv): first load"),
        dlt_reload=Figure("dlt merge (csv): re-load of identical data"),
    )
    with psycopg.connect(server.dsn(DATABASE), autocommit=True) as db:
        for repetition in range(1, repeat + 1):
            log(f"loader repetition {repetition} of {repeat}")
            db.execute("TRUNCATE bench_reference")
            figures.reference.add(run_case("reference", {"dsn": server.dsn(DATABASE),
                                                         "frame": frames["base"]}))
            db.execute("TRUNCATE bench_reference_binary")
            figures.binary_reference.add(run_case("reference", {
                "dsn": server.dsn(DATABASE), "frame": frames["base"], "binary": True}))
            db.execute("TRUNCATE bench_reference_keyed")
            figures.keyed_reference.add(run_case("reference", {
                "dsn": server.dsn(DATABASE), "frame": frames["base"], "keyed": True}))
            for mode in MODES:
                table = f"bench_{mode}"
                db.execute(f"TRUNCATE {table}")
                for step, _, frame in STEPS:
                    if step != "identical":
                        db.execute("UPDATE partition_loads SET content_digest = NULL "
                                   "WHERE table_name = %s", (table,))
                    before = _tuple_stats(db, table)
                    figure = figures.ours[(mode, step)]
                    figure.add(run_case("ours", {
                        "url": url, "mode": mode, "frame": frames[frame],
                        "run_id": f"{mode}-{step}-{repetition}",
                    }))
                    figure.written = _written(db, table, before)
            db.execute("TRUNCATE bench_to_sql")
            figures.to_sql.add(run_case("to_sql", {"url": url, "frame": frames["base"],
                                                   "rows": to_sql_rows}))
            db.execute(f"DROP SCHEMA IF EXISTS {DLT_SCHEMA} CASCADE")
            db.execute(f"DROP SCHEMA IF EXISTS {DLT_SCHEMA}_staging CASCADE")
            pipelines_dir = work_dir / "dlt"
            shutil.rmtree(pipelines_dir, ignore_errors=True)
            dlt_args = {"url": dlt_url, "frame": frames["base"],
                        "pipelines_dir": str(pipelines_dir)}
            figures.dlt_first.add(run_case("dlt", dlt_args))
            before = _tuple_stats(db, "bench_dlt", DLT_SCHEMA)
            figures.dlt_reload.add(run_case("dlt", dlt_args))
            figures.dlt_reload.written = _written(db, "bench_dlt", before, DLT_SCHEMA)
    return figures
