"""An A/B of the ranged year between checkouts of the code, interleaved on one machine.

    python -m benchmarks.year_ab --tree before=/tmp/ab/3fc4c26 --tree after=. \\
        [--days 365] [--first 2024-01-01] [--repeat 3] [--instance production] [--no-rerun]

Each repetition runs, for every tree in turn (the order rotates from one repetition to the
next), the year as one ranged run (``dagster asset materialize --partition-range``) on a fresh
warehouse database migrated by that tree's code and a fresh instance, then the same year again
(every partition already loaded), and once per repetition Dagster's events-only year
(``benchmarks.year_events`` of this checkout) on a fresh instance of its own. A tree is a
checkout of this repository (``git worktree add --detach DIR COMMIT``): its code runs with this
checkout's virtualenv, from its own directory and first on ``PYTHONPATH``. It prints every
figure with the load average when it was measured, each tree's median and spread, and the ratios
to the events-only year; what it measures is what ``make bench``'s orchestration section
measures, for several trees at once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

import psycopg

from benchmarks.measure import ROOT
from benchmarks.orchestration import DAGSTER, PRODUCTION_INSTANCE
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.postgres import SUPERUSER, ThrowawayPostgres

FLOOR = "events-only"


def timed(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, int, float]:
    """Wall seconds, the peak RSS (bytes) and the CPU seconds (user and system) of
    ``command``'s own process, which must succeed. Its CPU time moves less than its wall time
    with what else runs on the machine (not the database's, which is in the server)."""
    with tempfile.TemporaryFile() as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output,
                                   stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            output.seek(0)
            raise RuntimeError(f"{' '.join(command)} in {cwd} failed:\n"
                               f"{output.read()[-4000:].decode(errors='replace')}")
    return seconds, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


class Case:
    """A fresh warehouse and instance for one tree's year (or the floor)."""

    def __init__(self, server: ThrowawayPostgres, work: Path, name: str, tree: Path,
                 instance: str, cbr_url: str) -> None:
        self.tree, self.name = tree, name
        database, storage = f"w_{name}".lower(), f"d_{name}".lower()
        with psycopg.connect(server.dsn(), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {database}")
            admin.execute(f"CREATE DATABASE {storage}")
        home = work / name / "dagster_home"
        home.mkdir(parents=True)
        (home / "dagster.yaml").write_text(
            PRODUCTION_INSTANCE if instance == "production" else "telemetry:\n  enabled: false\n")
        self.env = {
            **os.environ,
            "PYTHONPATH": str(tree),
            "DAGSTER_HOME": str(home),
            "MOSTOVIK_DATA_DIR": str(work / name / "data"),
            "MOSTOVIK_DATABASE_URL": server.url(database),
            "MOSTOVIK_CBR_URL": cbr_url,
            "BENCH_DAGSTER_PG_USER": SUPERUSER,
            "BENCH_DAGSTER_PG_PASSWORD": server.password,
            "BENCH_DAGSTER_PG_PORT": str(server.port),
            "BENCH_DAGSTER_PG_DB": storage,
        }
        migrated = subprocess.run(
            [sys.executable, "-c", "import os; from mostovik_pipelines.warehouse import migrate; "
             "migrate.upgrade(os.environ['MOSTOVIK_DATABASE_URL'])"],
            cwd=tree, env=self.env, capture_output=True, text=True, check=False)
        if migrated.returncode:
            raise RuntimeError(f"migrating with {tree} failed:\n{migrated.stderr[-3000:]}")

    def materialize(self, first: str, last: str, module: str = "mostovik_pipelines",
                    asset: str = "cbr_daily_rates", profile: Path | None = None,
                    ) -> tuple[float, int, float]:
        """The range as one ranged run; sampled by py-spy into ``profile`` when given (collapsed
        stacks, idle time included: its seconds are the profiler's, not comparable with a
        run's)."""
        profiler = ([str(Path(sys.executable).parent / "py-spy"), "record", "-o", str(profile),
                     "-f", "raw", "-r", "200", "--idle", "--"] if profile else [])
        return timed([*profiler, DAGSTER, "asset", "materialize", "-m", module, "--select",
                      asset, "--partition-range", f"{first}...{last}"], self.env, self.tree)


def load_average() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="NAME=PATH of a checkout (repeat for each)")
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--first", type=date.fromisoformat, default=date(2024, 1, 1),
                        help="the range's first day (five years: 2020-01-01 with --days 1826)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--instance", choices=("production", "sqlite"), default="production")
    parser.add_argument("--no-rerun", action="store_true", help="the first load only")
    parser.add_argument("--no-floor", action="store_true", help="no events-only year")
    parser.add_argument("--profile", type=Path,
                        help="a folder: sample every run with py-spy into it")
    options = parser.parse_args(argv)
    trees = [(name, Path(path).resolve()) for name, path in
             (tree.split("=", 1) for tree in options.tree)]
    first = options.first
    last = (first + timedelta(days=options.days - 1)).isoformat()
    first = first.isoformat()
    figures: dict[str, list[tuple[float, int, float, float]]] = {}

    def note(label: str, seconds: float, rss: int, cpu: float, load: float) -> None:
        figures.setdefault(label, []).append((seconds, rss, cpu, load))
        print(f"[{time.strftime('%H:%M:%S')}] {label:<28} {seconds:8.2f} s {rss / 2**20:7.0f} MB"
              f" cpu {cpu:7.2f} s   load {load:.2f}", file=sys.stderr, flush=True)

    server = ThrowawayPostgres().start()
    standin = StandinServer().start()
    work = Path(tempfile.mkdtemp(prefix="mostovik-ab-"))
    try:
        for repetition in range(options.repeat):
            order = trees[repetition % len(trees):] + trees[:repetition % len(trees)]
            cases = [(FLOOR, Path(ROOT))] if not options.no_floor else []
            cases = (cases + order) if repetition % 2 == 0 else (order + cases)
            for name, tree in cases:
                case = Case(server, work, f"{name.replace('-', '_')}_{repetition}", tree,
                            options.instance, standin.cbr_url)
                if name == FLOOR:
                    profile = (options.profile / f"{FLOOR}-{repetition}.txt"
                               if options.profile else None)
                    load = load_average()
                    note(FLOOR, *case.materialize(first, last, "benchmarks.year_events",
                                                  "ranged_year_events", profile), load)
                    continue
                for label in ("first load", "already loaded")[:1 if options.no_rerun else 2]:
                    profile = (options.profile / f"{name}-{label.replace(' ', '_')}-"
                               f"{repetition}.txt" if options.profile else None)
                    load = load_average()
                    note(f"{name} {label}", *case.materialize(first, last, profile=profile),
                         load)
    finally:
        standin.stop()
        server.stop()
    floor = statistics.median(s for s, *_ in figures.get(FLOOR, [(0,)])) or None
    print(f"{options.days} partitions, {options.instance} instance, {options.repeat} "
          "repetitions interleaved; wall s median (min-max), the process's CPU s median "
          "(min-max), peak RSS, load average at the start")
    for label, runs in figures.items():
        seconds, cpu = [run[0] for run in runs], [run[2] for run in runs]
        median = statistics.median(seconds)
        ratio = f"  {median / floor:.2f}x the events-only year" if floor else ""
        print(f"  {label:<28} {median:7.2f} ({min(seconds):.2f}-{max(seconds):.2f})"
              f"  cpu {statistics.median(cpu):6.2f} ({min(cpu):.2f}-{max(cpu):.2f})"
              f"  {max(run[1] for run in runs) / 2**20:5.0f} MB"
              f"  load {', '.join(f'{run[3]:.1f}' for run in runs)}{ratio}")


if __name__ == "__main__":
    main()
