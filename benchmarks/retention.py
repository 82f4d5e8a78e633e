"""The retention section: a simulated year of operation, then the prune a year on.

A year is built the way it would have been, on a fresh ``DAGSTER_HOME``, landing store and
op-output storage, against the stand-in and a migrated warehouse database, once per instance an
operator runs (``sqlite``: the repository's ``dagster.yaml``; ``production``:
``deploy/dagster.yaml``, run storage in a PostgreSQL database of its own):

* every daily source (CBR rates, CBR metal prices, ERP sync windows) over 365 days by the real
  jobs, as the daily schedules run them: a run per source and day, each with its record, event
  log and op outputs (``execute_in_process`` in one process per source, the code location
  loaded once: a tick's run without its process start-up);
* a sample of what a year of daily operation adds, by the real jobs too: partitions loaded
  again twice (``dagster job execute``), runs that failed (the source answering 404), each
  re-executed from its failure in a process of its own (``rerun_from_failure``: what
  ``mostovik jobs rerun`` queues for the daemon);
* what the daily schedule's later ticks fetch again: for every day of the two CBR sources, two
  more fetches of the same page, landed by ``LandingStoreResource.land`` as the extract step
  lands them (the same bytes: a new record, the same blob);
* a delivery report file a day (CSV, 30 lines each), each through the real file job as the
  inbox sensor launches it (the file dropped into the inbox, its version added as a partition,
  a run that lands, loads and archives it), one in ten processed again from the archive: a run
  each, with its record, event log, op outputs and landed payload.

What bounds storage is stated as two numbers with targets that can fail: the bytes a partition
keeps past the window (after the prune past ``keep_runs``: its latest payload, and the run that
holds its present; on production the database compacted), and the bytes a day of history takes
inside the window (after the prune a year on: every run of the year kept, their landed payloads
and op outputs gone but each partition's latest, divided by the days).

The clock is not touched: the prune is run in this process with ``now`` a year on (the default
policy: op outputs and every landed payload but each partition's latest go, runs younger than
``keep_runs`` stay), then once more just past ``keep_runs`` (400 days), when the runs no
partition's present depends on go too. Bytes are what the files take on disk (allocated blocks),
and on the production instance its database's size as PostgreSQL reports it (plus its compute
logs); after the last prune, also that size once ``VACUUM FULL`` compacted it: what the kept
runs take, where autovacuum only makes the freed space reusable.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import psycopg

from benchmarks.measure import ROOT, run_command
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.support.delivery_reports import csv_report, deliveries, report_table
from mostovik_pipelines_tests.support.instances import (
    create_instance_storage,
    production_instance,
)
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.processes import RERUN_IN_PROCESS, local_dagster_home

DATABASE = "retention"
INSTANCES = ("sqlite", "production")
INSTANCE_NAMES = {"sqlite": "the repository's dagster.yaml, SQLite",
                  "production": "deploy/dagster.yaml, PostgreSQL"}
BIN = Path(sys.executable).parent
DAYS = 365
FIRST_DAY = date(2025, 12, 1)
DAILY = {"cbr_daily_rates": "cbr", "cbr_metal_prices": "cbr_metals", "erp_work_orders": "erp"}
"""The daily sources and their stand-in routes."""
LOADED_AGAIN = 3
FAILED = 2
"""Per daily source: partitions loaded again twice (the first of the two is then no
partition's present: the prune deletes it past ``keep_runs``), and runs failed then
re-executed from failure (kept: the re-execution repeats them)."""
REFETCHED = ("cbr_daily_rates", "cbr_metal_prices")
DELIVERY_LINES = 30
REPROCESSED_EVERY = 10
"""One delivery file in ten is processed again (re-run from the archive): two runs of one
version."""
KEEP_RUNS_DAYS = 400
KEPT_PER_PARTITION_TARGET_KIB = {"sqlite": 400, "production": 260}
"""KiB a partition keeps past the window, at most: the measurement of 2026-12-06 (20 days: 355
and 234 KiB, benchmarks/README) plus about 12%. The instance's fixed size (an empty database)
is shared by fewer partitions in a shorter simulation, so a year measures less."""
PER_DAY_TARGET_KIB = {"sqlite": 1_900, "production": 1_300}
"""KiB a day of history takes inside the window, at most: the same measurement (1,719 and
1,158 KiB) plus about 12%."""


@dataclass
class Footprint:
    """Bytes on disk per store and runs in run storage, at one moment."""

    landing: int
    op_outputs: int
    instance: int
    runs: int

    @property
    def total(self) -> int:
        return self.landing + self.op_outputs + self.instance


@dataclass
class RetentionFigures:
    instance: str
    days: int
    partitions: dict[str, int]
    delivery_files: int
    build_seconds: float
    before: Footprint
    after: list[tuple[str, Footprint, float, list[str]]] = field(default_factory=list)
    """Per prune: when (label), the footprint after it, its wall seconds, its report lines."""
    compacted_instance: int | None = None
    """Production: the instance's bytes after the last prune, once ``VACUUM FULL`` ran."""

    @property
    def kept_per_partition_kib(self) -> float:
        """What a partition keeps past the window, every store (the database compacted)."""
        last = self.after[-1][1]
        instance = (self.compacted_instance if self.compacted_instance is not None
                    else last.instance)
        return (last.landing + last.op_outputs + instance) / sum(self.partitions.values()) / 1024


def measure_retention(server: ThrowawayPostgres, work_dir: Path, log: Callable[[str], None],
                      days: int = DAYS, instances: tuple[str, ...] = INSTANCES,
                      ) -> list[RetentionFigures]:
    """The simulated operation of ``days`` days (a year unless told: fewer days give the same
    figures per partition and per day, sooner), on each of ``instances``."""
    return [_measure_on(instance, server, work_dir / f"retention_{instance}", log, days)
            for instance in instances]


def _measure_on(instance_kind: str, server: ThrowawayPostgres, root: Path,
                log: Callable[[str], None], days: int) -> RetentionFigures:
    from dagster import DagsterInstance

    from mostovik_pipelines.definitions import defs
    from mostovik_pipelines.maintenance.policy import RetentionPolicy
    from mostovik_pipelines.maintenance.prune import prune

    root.mkdir()
    warehouse, run_storage = f"{DATABASE}_{instance_kind}", f"{DATABASE}_dagster"
    with psycopg.connect(server.dsn(), autocommit=True) as db:
        db.execute(f"CREATE DATABASE {warehouse}")
    warehouse_url = server.url(warehouse)
    migrate.upgrade(warehouse_url)
    if instance_kind == "production":
        home, instance_env = production_instance(server, run_storage, root)
        create_instance_storage(home, instance_env)

        def instance_bytes() -> int:
            with psycopg.connect(server.dsn(run_storage)) as db:
                size = db.execute("SELECT pg_database_size(current_database())").fetchone()[0]
            return size + sum(_disk_bytes(Path(instance_env[name])) for name in (
                "MOSTOVIK_DAGSTER_LOG_DIR", "MOSTOVIK_DAGSTER_ARTIFACT_DIR"))
    else:
        home, instance_env = local_dagster_home(root), {}

        def instance_bytes() -> int:
            return _disk_bytes(root / "dagster")
    log(f"retention on the {instance_kind} instance")
    standin = StandinServer().start()
    env = {**os.environ, **instance_env,
           "DAGSTER_HOME": str(home), "MOSTOVIK_DATA_DIR": str(root / "data"),
           "MOSTOVIK_DATABASE_URL": warehouse_url, "MOSTOVIK_CBR_URL": standin.cbr_url,
           "MOSTOVIK_CBR_METALS_URL": standin.endpoint_url("cbr_metal_prices"),
           "MOSTOVIK_ERP_URL": standin.erp_url,
           "MOSTOVIK_ERP_START_DATE": FIRST_DAY.isoformat(),
           "MOSTOVIK_CBR_METAL_PRICES_START_DATE": FIRST_DAY.isoformat()}
    # This process reads the instance too (the failed runs' ids, the prunes).
    os.environ.update({k: v for k, v in env.items() if k.startswith(("MOSTOVIK_", "DAGSTER_"))})
    landing, storage = root / "data" / "landing", root / "data" / "storage"
    keys = [(FIRST_DAY + timedelta(days=n)).isoformat() for n in range(days)]
    started = time.perf_counter()
    try:
        for source in DAILY:
            log(f"retention: {source}, a run a day, {keys[0]}...{keys[-1]}")
            run_command([sys.executable, "-m", "benchmarks.retention", source, *keys], env)
        _daily_operation(env, keys, home, StandinClient(standin.url), log)
        log(f"retention: material_deliveries, {days:,} files, a run each")
        run_command([sys.executable, "-m", "benchmarks.retention", "--deliveries", str(days)],
                    env)
    finally:
        standin.stop()
    log("retention: later ticks' fetches, landed")
    _fetched_again(landing, keys)
    build = time.perf_counter() - started

    partitions = {source.name: len(list(source.iterdir())) for source in landing.iterdir()}
    check_keys = list(defs.resolve_asset_graph().asset_check_keys)
    figures = RetentionFigures(instance_kind, days, partitions, days, build,
                               _footprint(landing, storage, home, instance_bytes))
    year_on = datetime.now(UTC) + timedelta(days=DAYS)
    past_keep_runs = datetime.now(UTC) + timedelta(days=KEEP_RUNS_DAYS + 1)
    for label, now in (("a year on", year_on), (f"{KEEP_RUNS_DAYS + 1} days on", past_keep_runs)):
        log(f"retention: prune as of {label}")
        with DagsterInstance.from_config(str(home)) as instance:
            clock = time.perf_counter()
            report = prune(instance, landing_dir=landing, op_output_dir=storage,
                           check_keys=check_keys, policy=RetentionPolicy(), now=now)
            seconds = time.perf_counter() - clock
        figures.after.append((label, _footprint(landing, storage, home, instance_bytes),
                              seconds, report.lines()))
    if instance_kind == "production":
        with psycopg.connect(server.dsn(run_storage), autocommit=True) as db:
            db.execute("VACUUM FULL")
        figures.compacted_instance = instance_bytes()
    return figures


def _run_days(source: str, keys: list[str]) -> None:
    """A run of ``source``'s job for each day, one after another on the instance of
    ``DAGSTER_HOME``; each must succeed."""
    from dagster import DagsterInstance

    from mostovik_pipelines.definitions import defs

    job = defs.resolve_job_def(f"{source}_job")
    with DagsterInstance.get() as instance:
        for key in keys:
            job.execute_in_process(partition_key=key, instance=instance)


def _daily_operation(env: dict[str, str], keys: list[str], home: Path, standin: StandinClient,
                     log: Callable[[str], None]) -> None:
    """Partitions loaded again, and runs that failed, each re-executed from its failure."""
    from dagster import DagsterInstance

    for number, (source, route) in enumerate(DAILY.items()):
        log(f"retention: {source}: {LOADED_AGAIN} partitions loaded again twice, {FAILED} failed "
            "runs re-executed")
        for key in keys[len(keys) // 12 + number::max(1, len(keys) // 4)][:LOADED_AGAIN]:
            for _tick in range(2):
                run_command(_execute(source, key), env)
        for key in keys[len(keys) // 6 + number::max(1, len(keys) // 3)][:FAILED]:
            when = date.fromisoformat(key)
            match = {"cbr": f"date_req={when:%d/%m/%Y}", "cbr_metals": f"date_req1={when:%d/%m/%Y}",
                     "erp": f"updated_from={key}"}[route]
            standin.fault("status", route=route, status=404, times=-1, match=match)
            failed = subprocess.run(_execute(source, key), cwd=ROOT, env=env,
                                    capture_output=True, check=False)
            standin.clear_faults()
            if failed.returncode == 0:
                raise RuntimeError(f"{source} {key}: the run meant to fail succeeded")
            with DagsterInstance.from_config(str(home)) as instance:
                run_id = instance.get_runs(limit=1)[0].run_id
            run_command([sys.executable, "-c", RERUN_IN_PROCESS, run_id], env)


def _execute(source: str, key: str) -> list[str]:
    return [str(BIN / "dagster"), "job", "execute", "-m", "mostovik_pipelines", "-j",
            f"{source}_job", "--tags", json.dumps({"dagster/partition": key})]


def _fetched_again(landing: Path, keys: list[str]) -> None:
    """Two more fetches of each day's page, as the schedule's later ticks land them."""
    from mostovik_pipelines.resources import LandingStoreResource

    store = LandingStoreResource(base_dir=str(landing))
    for source in REFETCHED:
        for key in keys:
            latest = store.latest(source, key)
            content = Path(latest.blob_path).read_bytes()
            for tick in (1, 2):
                store.land(source, key, content, content_type=latest.content_type,
                           origin=latest.origin,
                           fetched_at=latest.fetched_at + timedelta(hours=4 * tick))


def _run_deliveries(count: int) -> None:
    """``count`` delivery reports through the file job, as the inbox sensor launches it: each
    dropped into the inbox, its version added as a partition, a run for it (which archives the
    file); one in ten run again (re-processed from the archive). Each run must succeed."""
    from dagster import DagsterInstance

    from mostovik_pipelines.definitions import defs
    from mostovik_pipelines.resources.inbox import version_key
    from mostovik_pipelines.sources.material_deliveries.source import (
        SOURCE,
        material_deliveries_file_versions,
    )
    from mostovik_pipelines_tests.support.inbox import drop, renumbered

    job = defs.resolve_job_def(f"{SOURCE.name}_job")
    inbox = Path(SOURCE.resource.inbox_dir)
    with DagsterInstance.get() as instance:
        for number in range(count):
            lines = renumbered(deliveries(DELIVERY_LINES, seed=number), 1_000 * number)
            content = csv_report(report_table(lines))
            name = f"site-{number % 40:02d}-deliveries-{number:05d}.csv"
            key = drop(inbox, name, content)
            assert key == version_key(name, hashlib.sha256(content).hexdigest())
            instance.add_dynamic_partitions(material_deliveries_file_versions.name, [key])
            for _run in range(2 if number % REPROCESSED_EVERY == 0 else 1):
                job.execute_in_process(partition_key=key, instance=instance)


def _footprint(landing: Path, storage: Path, home: Path,
               instance_bytes: Callable[[], int]) -> Footprint:
    from dagster import DagsterInstance

    with DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs_count()
    return Footprint(_disk_bytes(landing), _disk_bytes(storage), instance_bytes(), runs)


def _disk_bytes(folder: Path) -> int:
    return sum(path.lstat().st_blocks * 512 for path in folder.rglob("*")) if folder.exists() else 0


def retention_table(r: RetentionFigures, checks: list[tuple[bool, str]]) -> list[str]:
    partitions = sum(r.partitions.values())
    lines = [
        "",
        f"Retention: a simulated year ({r.days} days of {', '.join(DAILY)}; "
        f"{r.delivery_files:,} delivery files) on the {r.instance} instance "
        f"({INSTANCE_NAMES[r.instance]}), built in {r.build_seconds:.0f} s; the prune in "
        "process with the default policy",
        "  partitions: " + ", ".join(f"{name} {count:,}" for name, count in
                                     sorted(r.partitions.items())),
        f"{'':<26}{'landing':>12}{'op outputs':>12}{'instance':>12}{'total':>12}{'runs':>7}"
        f"{'prune s':>9}",
    ]

    def row(label: str, f: Footprint, seconds: float | None = None) -> str:
        return (f"{label:<26}{_mb(f.landing):>12}{_mb(f.op_outputs):>12}{_mb(f.instance):>12}"
                f"{_mb(f.total):>12}{f.runs:>7}"
                + (f"{seconds:>9.2f}" if seconds is not None else ""))

    lines.append(row("the year, before a prune", r.before))
    for label, footprint, seconds, _report in r.after:
        lines.append(row(f"after a prune {label}", footprint, seconds))
    last = r.after[-1][1]
    lines += [
        f"  kept per partition: landing {last.landing / partitions / 1024:.1f} KiB, op outputs "
        f"{last.op_outputs / partitions / 1024:.1f} KiB, instance "
        f"{last.instance / partitions / 1024:.1f} KiB ({partitions:,} partitions)",
        *(f"  prune {label}: {'; '.join(report)}" for label, _f, _s, report in r.after),
    ]
    if r.compacted_instance is not None:
        lines += [
            f"  the instance after VACUUM FULL: {_mb(r.compacted_instance)}, "
            f"{r.compacted_instance / partitions / 1024:.1f} KiB per partition, "
            f"{r.compacted_instance / last.runs / 1024:.1f} KiB per run kept (what the kept runs",
            "  take; autovacuum makes the space of deleted rows reusable, it does not return it)",
        ]
    else:
        lines += [
            "  bytes: allocated on disk. The instance's shared SQLite files (index, runs) keep",
            "  their size after rows are deleted (freed pages are reused; VACUUM would return",
            "  them); a deleted run's own event-log file is removed with it.",
        ]
    year_on = r.after[0][1]
    kept = r.kept_per_partition_kib
    per_day = year_on.total / r.days / 1024
    lines += [
        f"  what bounds storage: {kept:.1f} KiB kept per partition past the window (all stores"
        + (", the database compacted)" if r.compacted_instance is not None else ")")
        + f"; {per_day:.1f} KiB per day of history inside it (after the prune a year on)",
    ]
    checks.append((kept <= KEPT_PER_PARTITION_TARGET_KIB[r.instance],
                   f"a partition keeps {kept:.1f} KiB past the window on {r.instance} (target "
                   f"<= {KEPT_PER_PARTITION_TARGET_KIB[r.instance]} KiB)"))
    checks.append((per_day <= PER_DAY_TARGET_KIB[r.instance],
                   f"a day of history takes {per_day:.1f} KiB inside the window on "
                   f"{r.instance} (target <= {PER_DAY_TARGET_KIB[r.instance]} KiB)"))
    checks.append((year_on.op_outputs == 0 and last.op_outputs == 0,
                   f"no op outputs kept a year on on {r.instance} (target: none)"))
    return lines


def _mb(size: int) -> str:
    return f"{size / 2**20:.1f} MB"


if __name__ == "__main__":
    if sys.argv[1] == "--deliveries":
        _run_deliveries(int(sys.argv[2]))
    else:
        _run_days(sys.argv[1], sys.argv[2:])
