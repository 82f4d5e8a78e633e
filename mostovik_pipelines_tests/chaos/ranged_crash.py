"""A warehouse crash of 8 s at a random point of a ranged run of 120 CBR partitions, run as an
operator runs one (``dagster asset materialize --partition-range``), repeated: every run must
ride it out (an 8 s outage is far within the warehouse's 90 s budget), whatever point it meets
(a fetch landing, a parse, a load's transaction, the checks' connection just after a commit).

Each repetition gets a fresh warehouse database and Dagster home. A first run without a crash
gives the reference rows and how long the range's execution takes; each crash then falls at a
point drawn uniformly over that time after the run started (the event log says which step it
met). The judge, per run: the process exits 0, run storage says SUCCESS, each of the range's
partitions is materialised exactly once by it, and the table equals the reference's. A run that
fails on the crash is a finding whatever the data.

    python -m mostovik_pipelines_tests.chaos.ranged_crash --runs 20 --seed 1

prints one line per run and a summary; exit 1 if any run was not ridden out.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import date, timedelta
from pathlib import Path

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus

from mostovik_pipelines.core.outages import Store, budget_seconds
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.chaos.harness import (
    DAGSTER,
    DAGSTER_YAML,
    create_database,
    drop_database,
)
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.warehouse import table_rows

SOURCE = cbr_daily_rates.SOURCE.name
PARTITIONS = 120
FIRST_DAY = date(2026, 5, 1)
CRASH_SECONDS = 8.0
RUN_LIMIT_SECONDS = 600.0
TEMPLATE = "ranged_crash_template"


def partition_range() -> tuple[str, str]:
    return FIRST_DAY.isoformat(), (FIRST_DAY + timedelta(days=PARTITIONS - 1)).isoformat()


class RangedRuns:
    """A PostgreSQL server for the warehouses, the stand-in, and a work directory."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.postgres = ThrowawayPostgres().start()
        self.standin = StandinServer().start()
        create_database(self.postgres, TEMPLATE, None)
        migrate.upgrade(self.postgres.url(TEMPLATE))

    def close(self) -> None:
        self.standin.stop()
        self.postgres.stop()

    def run(self, name: str, crash_after: float | None) -> dict:
        """One ranged run on a fresh warehouse and home; with ``crash_after``, the warehouse
        crashes that many seconds after the run started, for :data:`CRASH_SECONDS`."""
        database = f"ranged_{name}".replace("-", "_")
        url = create_database(self.postgres, database, TEMPLATE)
        home = self.work_dir / name / "home"
        home.mkdir(parents=True)
        (home / "dagster.yaml").write_text(DAGSTER_YAML.format(home=home))
        first, last = partition_range()
        environment = {
            **os.environ, "DAGSTER_HOME": str(home),
            "MOSTOVIK_DATABASE_URL": url, "MOSTOVIK_DATA_DIR": str(self.work_dir / name / "data"),
            "MOSTOVIK_CBR_URL": self.standin.cbr_url, "MOSTOVIK_EXECUTOR": "in_process",
        }
        log_path = self.work_dir / name / "run.log"
        started = time.monotonic()
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [DAGSTER, "asset", "materialize", "-m", "mostovik_pipelines", "--select", SOURCE,
                 "--partition-range", f"{first}...{last}"],
                env=environment, cwd=self.work_dir, stdout=log, stderr=subprocess.STDOUT)
        outcome: dict = {"name": name, "log": str(log_path)}
        with DagsterInstance.from_config(str(home)) as instance:
            run_started = self._wait_for_start(instance, process)
            outcome["start_seconds"] = (run_started or time.monotonic()) - started
            if crash_after is not None and run_started is not None:
                time.sleep(max(0.0, run_started + crash_after - time.monotonic()))
                if process.poll() is None:
                    outcome["met"] = self._where(instance)
                    self.postgres.down_for(CRASH_SECONDS)
                    outcome["crashed_at"] = crash_after
            try:
                process.wait(timeout=RUN_LIMIT_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            outcome["exit"] = process.returncode
            outcome["seconds"] = time.monotonic() - started
            outcome["execution_seconds"] = time.monotonic() - (run_started or started)
            [run] = instance.get_runs() or [None]
            outcome["status"] = run.status.value if run else "none"
            materialised = Counter(
                record.event_log_entry.asset_materialization.partition
                for record in instance.get_records_for_run(
                    run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
            ) if run else Counter()
            outcome["materialised"] = materialised
            outcome["succeeded"] = (run is not None and run.status is DagsterRunStatus.SUCCESS
                                    and process.returncode == 0)
        outcome["rows"] = [_key_and_figures(row) for row in table_rows(url, SOURCE)]
        drop_database(self.postgres, database)
        return outcome

    @staticmethod
    def _wait_for_start(instance: DagsterInstance, process) -> float | None:
        """When the run's record says it started (monotonic), or None if it ended first."""
        while process.poll() is None:
            runs = instance.get_runs()
            if runs and runs[0].status is not DagsterRunStatus.NOT_STARTED:
                return time.monotonic()
            time.sleep(0.05)
        return None

    @staticmethod
    def _where(instance: DagsterInstance) -> str:
        """The step the run was in (the step of its latest event); in the load, whether its
        latest event was a partition's commit or check (its checks were running then)."""
        [run] = instance.get_runs()
        records = instance.get_records_for_run(run.run_id, ascending=False, limit=20).records
        for record in records:
            step = record.event_log_entry.step_key
            if step:
                op = step.rsplit(".", 1)[-1].split("_", 1)[0]
                event = record.event_log_entry.dagster_event
                if op == "load" and event is not None and event.event_type in (
                        DagsterEventType.ASSET_MATERIALIZATION,
                        DagsterEventType.ASSET_CHECK_EVALUATION):
                    return "load, a partition's checks"
                return op
        return "start"


def _key_and_figures(row: dict) -> tuple:
    return (str(row["partition_date"]), row["char_code"], str(row["value"]),
            str(row["unit_rate"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=random.randrange(2**31))
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="mostovik-ranged-crash-"))
    rng = random.Random(args.seed)
    print(f"seed {args.seed}; {args.runs} runs of {PARTITIONS} partitions "
          f"({'...'.join(partition_range())}); a warehouse crash of {CRASH_SECONDS:.0f} s each, "
          f"within the {budget_seconds(Store.WAREHOUSE):.0f} s budget; work in {work_dir}",
          flush=True)
    runs = RangedRuns(work_dir)
    findings: list[str] = []
    met: Counter = Counter()
    try:
        reference = runs.run("reference", None)
        if not reference["succeeded"]:
            print(f"the reference run failed: {reference['log']}")
            return 1
        span = reference["execution_seconds"]
        print(f"reference: {len(reference['rows'])} rows, the range's execution "
              f"{span:.1f} s", flush=True)
        ridden_out = missed = 0
        for number in range(1, args.runs + 1):
            outcome = runs.run(f"run{number:02d}", rng.uniform(0.0, span))
            while "crashed_at" not in outcome and outcome["succeeded"]:
                missed += 1  # it ended before its crash: a point past its end, drawn again
                outcome = runs.run(f"run{number:02d}-{missed}", rng.uniform(0.0, span))
            problems = []
            if "crashed_at" not in outcome:
                problems.append("the run ended before its crash")
            if not outcome["succeeded"]:
                problems.append(f"run {outcome['status']}, exit {outcome['exit']}")
            wrong = {p: n for p, n in outcome["materialised"].items() if n != 1}
            if wrong or len(outcome["materialised"]) != PARTITIONS:
                problems.append(f"materialised other than once: {len(outcome['materialised'])} "
                                f"partitions, {wrong}")
            if outcome["rows"] != reference["rows"]:
                problems.append("the table differs from the reference")
            met[outcome.get("met", "-")] += 1
            ridden_out += not problems
            print(f"run {number:2d}: crash {CRASH_SECONDS:.0f} s at "
                  f"{outcome.get('crashed_at', float('nan')):5.1f} s ({outcome.get('met', '-')}), "
                  f"{outcome['status']} in {outcome['seconds']:.1f} s"
                  + (f"; {'; '.join(problems)}; see {outcome['log']}" if problems else ""),
                  flush=True)
            findings += [f"run {number}: {problem}" for problem in problems]
        print(f"\n{ridden_out} of {args.runs} runs rode out the crash "
              f"(met in: {', '.join(f'{k} {n}' for k, n in sorted(met.items()))}); "
              f"{missed} draws past a run's end drawn again; findings: {len(findings)}; "
              f"seed {args.seed}")
    finally:
        runs.close()
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
