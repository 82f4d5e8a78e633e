"""The orchestration section: what Dagster adds around a load, from the command line.

* one partition run through ``dagster job execute`` next to an empty three-op job (the floor);
* a year of daily partitions as Dagster runs a backfill with the source's policy (the CBR
  source's ``BackfillPolicy.single_run()``: one ranged run, ``dagster asset materialize
  --partition-range``), then the same year already loaded, next to Dagster's events-only year
  (the floor of a ranged year): ``repeat`` repetitions interleaved (the floor first in one,
  last in the next), each year on a fresh warehouse database and a fresh instance, so that the
  machine's load falls on both sides alike; and one run per partition, extrapolated from a few
  such runs.

Runs go against the local stand-in (``StandinServer``) and a migrated warehouse database on the
throw-away PostgreSQL, with a fresh ``DAGSTER_HOME`` of each instance an operator runs them on:

* ``sqlite``: Dagster's default storage (``make demo``, the repository's ``dagster.yaml``, CI);
* ``production``: ``deploy/dagster.yaml``'s storage, PostgreSQL with kept connections
  (``PooledPostgresStorage``), in a database of its own on the same throw-away server.

Each instance has its own floor (the empty job on it): the ratios compare like with like.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

import psycopg

from benchmarks.measure import ROOT, run_command
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.support.postgres import SUPERUSER, ThrowawayPostgres

DATABASE = "orchestration"
INSTANCES = ("sqlite", "production")
PRODUCTION_INSTANCE = """telemetry:
  enabled: false
storage:
  custom:
    module: mostovik_pipelines.platform.instance_storage
    class: PooledPostgresStorage
    config:
      postgres_db:
        username: {env: BENCH_DAGSTER_PG_USER}
        password: {env: BENCH_DAGSTER_PG_PASSWORD}
        hostname: 127.0.0.1
        port: {env: BENCH_DAGSTER_PG_PORT}
        db_name: {env: BENCH_DAGSTER_PG_DB}
        scheme: postgresql+psycopg2
"""
"""deploy/dagster.yaml's storage, every connection detail from the environment."""
DAGSTER = str(Path(sys.executable).parent / "dagster")


@dataclass
class OrchestrationFigures:
    instance: str
    executor: str
    floor: list[float]
    partition_run: list[float]
    per_partition_runs: list[float]
    backfill_partitions: int
    backfill: list[float]
    backfill_rows: int
    rerun: list[float]
    events_only: list[float]
    """The same range of ``benchmarks.year_events``: Dagster recording what the year records,
    with no work."""
    imports: ImportFigures | None = None
    missing: str = ""

    @property
    def backfill_seconds(self) -> float:
        return statistics.median(self.backfill)

    @property
    def rerun_seconds(self) -> float:
        return statistics.median(self.rerun)

    @property
    def events_only_seconds(self) -> float:
        return statistics.median(self.events_only)

    @property
    def per_partition_extrapolated(self) -> float:
        return statistics.mean(self.per_partition_runs) * self.backfill_partitions


@dataclass
class ImportFigures:
    """Wall seconds and peak RSS (bytes) of a fresh interpreter importing Dagster alone and
    importing the code location (what every code server, daemon, run and step process pays)."""

    dagster_seconds: list[float]
    dagster_rss: list[int]
    location_seconds: list[float]
    location_rss: list[int]


IMPORT_DAGSTER = "import dagster"
IMPORT_LOCATION = "import mostovik_pipelines.definitions"


def measure_imports(repeat: int, env: dict[str, str]) -> ImportFigures:
    """Both imports ``repeat`` times, alternating, after a warm-up of each (the page cache)."""
    figures = ImportFigures([], [], [], [])
    _import(IMPORT_DAGSTER, env)
    _import(IMPORT_LOCATION, env)
    for _ in range(repeat):
        seconds, rss = _import(IMPORT_DAGSTER, env)
        figures.dagster_seconds.append(seconds)
        figures.dagster_rss.append(rss)
        seconds, rss = _import(IMPORT_LOCATION, env)
        figures.location_seconds.append(seconds)
        figures.location_rss.append(rss)
    return figures


PEAK_RSS = ("; print(next(line.split()[1] for line in open('/proc/self/status') "
            "if line.startswith('VmHWM:')))")
"""The interpreter's own peak RSS in KiB, printed last: the rusage of a child started from this
(large) process would report ours, which Linux carries over fork and exec."""


def _import(statement: str, env: dict[str, str]) -> tuple[float, int]:
    started = time.perf_counter()
    completed = subprocess.run([sys.executable, "-c", statement + PEAK_RSS], cwd=ROOT, env=env,
                               capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"python -c {statement!r} exited {completed.returncode}:\n"
                           f"{completed.stderr[-2000:]}")
    return seconds, int(completed.stdout.split()[-1]) * 1024


def _days(first: date, count: int) -> list[str]:
    return [(first + timedelta(days=i)).isoformat() for i in range(count)]


def measure_orchestration(server: ThrowawayPostgres, work_dir: Path, repeat: int,
                          per_partition_runs: int, backfill_days: int, log,
                          ) -> list[OrchestrationFigures]:
    """The section on each instance in turn; the imports once, with the first."""
    figures = []
    for instance in INSTANCES:
        figures.append(_measure_on(instance, server, work_dir / instance, repeat,
                                   per_partition_runs, backfill_days, log,
                                   imports=not figures))
    return figures


def _measure_on(instance: str, server: ThrowawayPostgres, work_dir: Path, repeat: int,
                per_partition_runs: int, backfill_days: int, log, imports: bool,
                ) -> OrchestrationFigures:
    warehouse, run_storage = f"{DATABASE}_{instance}", f"dagster_{instance}"
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {warehouse}")
        if instance == "production":
            admin.execute(f"CREATE DATABASE {run_storage}")
    warehouse_url = server.url(warehouse)
    migrate.upgrade(warehouse_url)
    dagster_home = work_dir / "dagster_home"
    dagster_home.mkdir(parents=True)
    (dagster_home / "dagster.yaml").write_text(
        PRODUCTION_INSTANCE if instance == "production" else "telemetry:\n  enabled: false\n")
    standin = StandinServer().start()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(dagster_home),
        "MOSTOVIK_DATA_DIR": str(work_dir / "data"),
        "MOSTOVIK_DATABASE_URL": warehouse_url,
        "MOSTOVIK_CBR_URL": standin.cbr_url,
        "BENCH_DAGSTER_PG_USER": SUPERUSER,
        "BENCH_DAGSTER_PG_PASSWORD": server.password,
        "BENCH_DAGSTER_PG_PORT": str(server.port),
        "BENCH_DAGSTER_PG_DB": run_storage,
    }
    executor = env.get("MOSTOVIK_EXECUTOR", "in_process")
    import_figures = None
    if imports:
        log(f"imports: dagster and the code location, {2 * repeat + 1} times each")
        import_figures = measure_imports(2 * repeat + 1, env)
    log(f"orchestration on the {instance} instance")
    try:
        floor, partition_run = [], []
        runs = iter(_days(date(2023, 1, 2), 1 + repeat + per_partition_runs))
        log("warm-up runs (not counted)")
        _empty_run(env)
        _partition_run(next(runs), env)
        for repetition in range(1, repeat + 1):
            log(f"orchestration repetition {repetition} of {repeat}")
            floor.append(_empty_run(env))
            partition_run.append(_partition_run(next(runs), env))
        log(f"{per_partition_runs} runs of one partition each")
        one_each = [_partition_run(key, env) for key in runs]
        keys = _days(date(2024, 1, 1), backfill_days)
        year = _measure_year(instance, server, work_dir, keys, repeat, env, log)
    finally:
        standin.stop()
    return OrchestrationFigures(instance, executor, floor, partition_run, one_each, len(keys),
                                *year, import_figures)


def _measure_year(instance: str, server: ThrowawayPostgres, work_dir: Path, keys: list[str],
                  repeat: int, env: dict[str, str], log,
                  ) -> tuple[list[float], int, list[float], list[float]]:
    """The year's ranged run, the same year already loaded and Dagster's events-only year,
    ``repeat`` times interleaved; each on a warehouse database and an instance of its own."""
    backfill, rerun, events_only, rows = [], [], [], 0
    for repetition in range(repeat):
        cases = ("ours", "events-only") if repetition % 2 == 0 else ("events-only", "ours")
        for case in cases:
            database = f"{DATABASE}_{instance}_{case[:4]}_{repetition}"
            year_env = _fresh_year(instance, server, work_dir / f"year_{case}_{repetition}",
                                   database, env)
            if case == "events-only":
                log(f"year {repetition + 1} of {repeat}: the same range recording the same "
                    "events, with no work (Dagster's floor)")
                events_only.append(_materialize_range(
                    keys, year_env, module="benchmarks.year_events", asset="ranged_year_events"))
                continue
            log(f"year {repetition + 1} of {repeat}: backfill of {len(keys)} partitions "
                f"{keys[0]}...{keys[-1]}, then again (every partition already loaded)")
            backfill.append(_materialize_range(keys, year_env))
            rows = _rows(server, database, keys)
            rerun.append(_materialize_range(keys, year_env))
    return backfill, rows, rerun, events_only


def _fresh_year(instance: str, server: ThrowawayPostgres, work_dir: Path, database: str,
                env: dict[str, str]) -> dict[str, str]:
    """A migrated warehouse database and a fresh ``DAGSTER_HOME`` (its run storage a database of
    its own on production) for one year."""
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {database}")
        if instance == "production":
            admin.execute(f"CREATE DATABASE {database}_runs")
    migrate.upgrade(server.url(database))
    dagster_home = work_dir / "dagster_home"
    dagster_home.mkdir(parents=True)
    (dagster_home / "dagster.yaml").write_text(
        PRODUCTION_INSTANCE if instance == "production" else "telemetry:\n  enabled: false\n")
    return {**env, "DAGSTER_HOME": str(dagster_home), "MOSTOVIK_DATA_DIR": str(work_dir / "data"),
            "MOSTOVIK_DATABASE_URL": server.url(database),
            "BENCH_DAGSTER_PG_DB": f"{database}_runs"}


def _empty_run(env: dict[str, str]) -> float:
    return run_command(
        [DAGSTER, "job", "execute", "-m", "benchmarks.empty_job", "-j", "empty_three_op_job"],
        env)


def _partition_run(key: str, env: dict[str, str]) -> float:
    return run_command(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", "cbr_daily_rates_job",
         "--tags", json.dumps({"dagster/partition": key})], env)


def _materialize_range(keys: list[str], env: dict[str, str], module: str = "mostovik_pipelines",
                       asset: str = "cbr_daily_rates") -> float:
    return run_command(
        [DAGSTER, "asset", "materialize", "-m", module, "--select", asset,
         "--partition-range", f"{keys[0]}...{keys[-1]}"], env)


def _rows(server: ThrowawayPostgres, database: str, keys: list[str]) -> int:
    with psycopg.connect(server.dsn(database)) as db:
        row = db.execute(
            "SELECT count(DISTINCT partition_date), count(*) FROM cbr_daily_rates "
            "WHERE partition_date BETWEEN %s AND %s", (keys[0], keys[-1]),
        ).fetchone()
    if row[0] != len(keys):
        raise RuntimeError(f"backfill loaded {row[0]} of {len(keys)} partitions")
    return row[1]
