"""The orchestration section: what Dagster adds around a load, from the command line.

* one partition run through ``dagster job execute`` next to an empty three-op job (the floor);
* a year of daily partitions as Dagster runs a backfill with the source's policy (the CBR
  source's ``BackfillPolicy.single_run()``: one ranged run, ``dagster asset materialize
  --partition-range``), next to one run per partition, extrapolated from a few such runs.

Runs go against the local stand-in (``StandinServer``) and a migrated warehouse database on the
throw-away PostgreSQL, with a fresh ``DAGSTER_HOME`` (SQLite run storage).
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
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

DATABASE = "orchestration"
DAGSTER = str(Path(sys.executable).parent / "dagster")


@dataclass
class OrchestrationFigures:
    executor: str
    floor: list[float]
    partition_run: list[float]
    per_partition_runs: list[float]
    backfill_partitions: int
    backfill_seconds: float | None
    backfill_rows: int
    rerun_seconds: float | None
    imports: ImportFigures | None = None
    missing: str = ""

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
                          per_partition_runs: int, backfill_days: int, log
                          ) -> OrchestrationFigures:
    with psycopg.connect(server.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {DATABASE}")
    warehouse_url = server.url(DATABASE)
    migrate.upgrade(warehouse_url)
    dagster_home = work_dir / "dagster_home"
    dagster_home.mkdir()
    (dagster_home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    standin = StandinServer().start()
    env = {
        **os.environ,
        "DAGSTER_HOME": str(dagster_home),
        "MOSTOVIK_DATA_DIR": str(work_dir / "data"),
        "MOSTOVIK_DATABASE_URL": warehouse_url,
        "MOSTOVIK_CBR_URL": standin.cbr_url,
    }
    executor = env.get("MOSTOVIK_EXECUTOR", "in_process")
    log(f"imports: dagster and the code location, {2 * repeat + 1} times each")
    imports = measure_imports(2 * repeat + 1, env)
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
        log(f"backfill of {len(keys)} partitions {keys[0]}...{keys[-1]}")
        backfill = _materialize_range(keys, env)
        rows = _rows(server, keys)
        log("the same backfill again (every partition already loaded)")
        rerun = _materialize_range(keys, env)
    finally:
        standin.stop()
    return OrchestrationFigures(executor, floor, partition_run, one_each, len(keys), backfill,
                                rows, rerun, imports)


def _empty_run(env: dict[str, str]) -> float:
    return run_command(
        [DAGSTER, "job", "execute", "-m", "benchmarks.empty_job", "-j", "empty_three_op_job"],
        env)


def _partition_run(key: str, env: dict[str, str]) -> float:
    return run_command(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", "cbr_daily_rates_job",
         "--tags", json.dumps({"dagster/partition": key})], env)


def _materialize_range(keys: list[str], env: dict[str, str]) -> float:
    return run_command(
        [DAGSTER, "asset", "materialize", "-m", "mostovik_pipelines", "--select",
         "cbr_daily_rates", "--partition-range", f"{keys[0]}...{keys[-1]}"], env)


def _rows(server: ThrowawayPostgres, keys: list[str]) -> int:
    with psycopg.connect(server.dsn(DATABASE)) as db:
        row = db.execute(
            "SELECT count(DISTINCT partition_date), count(*) FROM cbr_daily_rates "
            "WHERE partition_date BETWEEN %s AND %s", (keys[0], keys[-1]),
        ).fetchone()
    if row[0] != len(keys):
        raise RuntimeError(f"backfill loaded {row[0]} of {len(keys)} partitions")
    return row[1]
