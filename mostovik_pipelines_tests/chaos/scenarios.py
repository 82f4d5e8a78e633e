"""Randomized scenarios of ADR-011's promise, and the judge of their outcome.

A scenario takes one partition of the CBR source and mixes, at random: a change of the source's
rates (values, removed currencies, one unreadable currency that goes to quarantine) before a
run; transient source faults (503, 429 with Retry-After, dropped connections, hangs past the
timeout) and permanent ones (malformed, truncated, HTML, wrong encoding, renamed element, 404);
a kill -9 of the run's process at a chosen point; a concurrent duplicate run; a re-run of the
loaded partition, possibly after another source change. Then, as an operator would, it re-runs
the partition until a run succeeds if the last runs were killed or failed, and compares the
partition's rows and quarantine with a reference: one clean run, on a freshly emptied database,
of the same final source state. The warehouse is kept from scenario to scenario, so partitions
are loaded, re-loaded and changed many times over.

Kill points are observed from outside, without hooks in production code:

* ``extract``: the source hangs the request; the run's extract step has started;
* ``landed``: the run's fetch record is in the landing store (extract done, transform next);
* ``transform``: a few milliseconds after ``landed``;
* ``load``: the suite holds the partition's advisory lock, so the load waits inside its
  transaction; killed there;
* ``load_mid``: as ``load``, but the lock is released and the kill lands a moment later, in the
  middle of the load's statements;
* ``after_commit``: the run's materialisation (written right after the load commits) is in the
  event log;
* ``random``: after a random delay.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from decimal import Decimal

import httpx
import psycopg
from dagster import DagsterEventType, DagsterRunStatus

from mostovik_pipelines.etl.locking import partition_lock_keys
from mostovik_pipelines.standin.cbr import CURRENCIES, MOSCOW
from mostovik_pipelines_tests.chaos.environment import (
    CLI_TIMEOUT_SECONDS,
    SOURCE,
    WARM_TIMEOUT_SECONDS,
    ChaosEnvironment,
    RunHandle,
    wait_until,
)

TABLE = "cbr_daily_rates"
CODES = [currency[2] for currency in CURRENCIES]
KILL_POINTS = ("extract", "landed", "transform", "load", "load_mid", "after_commit", "random")
TRANSIENT_FAULTS = ("503", "429", "drop", "hang")
PERMANENT_FAULTS = ("malformed", "truncate", "html", "wrong_encoding", "rename_element", "404")
MAX_REMOVED = 2
"""Removed currencies per date: with one unreadable currency among 10 the share is 10%, still
a partial load; among 9 it would be a systematic defect that no re-run can settle."""
SETTLE_ATTEMPTS = 6
ROW_COLUMNS = ("partition_date, rate_date, cbr_id, num_code, char_code, nominal, name, "
               "value::text, unit_rate::text")


@dataclass
class Totals:
    scenarios: int = 0
    kills: Counter = field(default_factory=Counter)
    cli_kills: int = 0
    scenarios_with_cli_kill: int = 0
    faults: Counter = field(default_factory=Counter)
    source_changes: int = 0
    duplicate_runs: int = 0
    reruns_of_loaded: int = 0
    settle_runs: int = 0
    runs: Counter = field(default_factory=Counter)
    differences: int = 0
    duplicates: int = 0
    errors: int = 0
    """Failures that are not differences: a partition no re-run settled, a failed reference."""
    failures: list[str] = field(default_factory=list)
    reference_cache_hits: int = 0


class SourceModel:
    """What the harness has asked the stand-in to change, per effective date, so that the final
    state of every date stays loadable (at most one unreadable currency, at most two removed)."""

    def __init__(self) -> None:
        self.bad: dict[str, str] = {}
        self.removed: dict[str, set[str]] = {}

    def random_change(self, rng: random.Random, day: str) -> tuple[dict[str, str], list[str]]:
        removed = self.removed.setdefault(day, set())
        present = [c for c in CODES if c not in removed]
        values = {code: _random_rate(rng) for code in rng.sample(present, rng.randint(1, 3))}
        remove: list[str] = []
        if len(removed) < MAX_REMOVED and rng.random() < 0.3:
            remove = [rng.choice([c for c in present if c not in values])]
        bad = self.bad.get(day)
        if bad in values:
            del self.bad[day]
            bad = None
        if bad is None and rng.random() < 0.25:
            code = rng.choice([c for c in present if c not in remove])
            values[code] = rng.choice(["n/a", "-5,0", "1e9", "12,34,56", "'; DROP TABLE x;--"])
            self.bad[day] = code
        if remove and self.bad.get(day) in remove:
            del self.bad[day]
        removed.update(remove)
        return values, remove


def _random_rate(rng: random.Random) -> str:
    amount = Decimal(rng.randint(1, 2_000_000)) / Decimal(10_000)
    return format(amount, "f").replace(".", ",")


def partition_pool(today: date, size: int) -> list[str]:
    """Past dates whose rates are their own (Tuesday to Saturday), newest first; a change of a
    date's rates then touches that partition only."""
    pool, day = [], today - timedelta(days=3)
    while len(pool) < size:
        if day.weekday() not in (6, 0):
            pool.append(day.isoformat())
        day -= timedelta(days=1)
    return pool


class ChaosSuite:
    def __init__(self, env: ChaosEnvironment, seed: int, cli_share: float = 0.35,
                 pool_size: int = 12, log=print) -> None:
        self.env = env
        self.seed = seed
        self.cli_share = cli_share
        self.log = log
        self.totals = Totals()
        self.model = SourceModel()
        self.today = datetime.now(MOSCOW).date()
        self.tomorrow = (self.today + timedelta(days=1)).isoformat()
        self.pool = partition_pool(self.today, pool_size)
        self.published_tomorrow = False
        self.loaded: set[str] = set()
        self._references: dict[tuple, tuple] = {}
        self._cli_kill_in_scenario = False
        env.standin.clear_faults()
        env.standin.reset_cbr_rates()
        env.standin.publish_cbr_until(self.today.isoformat())

    # --- one scenario -------------------------------------------------------------------------

    def run(self, scenarios: int) -> Totals:
        for number in range(1, scenarios + 1):
            self.scenario(number)
        self.final_sweep()
        return self.totals

    def final_sweep(self) -> None:
        """Every partition the suite ever touched, against its reference once more: a scenario
        must not have disturbed the partitions of earlier ones."""
        for partition in sorted(self.loaded):
            problems = self._compare(partition)
            if problems:
                self.totals.differences += len(problems)
                self._fail(f"final sweep, {partition}: {'; '.join(problems)}", error=False)
        self.log(f"  final sweep: {len(self.loaded)} partitions compared")

    def scenario(self, number: int) -> None:
        rng = random.Random(f"{self.seed}:{number}")
        cli = rng.random() < self.cli_share
        # A killed `dagster job execute` is the point of a CLI scenario: its partition is one
        # that loads (not tomorrow's) and its faults are transient, so the run reaches the kill.
        partition = (self.tomorrow if not cli and rng.random() < 0.1
                     else rng.choice(self.pool))
        notes: list[str] = [partition, "cli" if cli else "warm"]
        if partition in self.loaded:
            self.totals.reruns_of_loaded += 1
            notes.append("loaded-before")
        if partition != self.tomorrow and rng.random() < 0.4:
            self._change_source(rng, partition, notes)
        if partition == self.tomorrow and not self.published_tomorrow and rng.random() < 0.3:
            self.published_tomorrow = True
            self.env.standin.publish_cbr_until(self.tomorrow)
            notes.append("published")

        self._queue_faults(rng, partition, cli, notes)
        kill_point = rng.choice(KILL_POINTS) if (cli or rng.random() < 0.75) else None
        duplicate = rng.random() < (0.2 if cli else 0.35)
        phase = self._phase(rng, partition, cli, kill_point, duplicate, notes)

        if phase and rng.random() < 0.35:
            # A manual re-run of the partition just loaded, possibly after the source changed.
            if partition != self.tomorrow and rng.random() < 0.5:
                self._change_source(rng, partition, notes)
            self._queue_faults(rng, partition, False, notes)
            phase = self._phase(rng, partition, False,
                                rng.choice(KILL_POINTS) if rng.random() < 0.5 else None,
                                rng.random() < 0.2, notes)
        self._settle(partition, phase, notes)
        self.env.standin.clear_faults()
        self._judge(number, partition, notes)
        self.loaded.add(partition)
        self.totals.scenarios += 1

    def _change_source(self, rng: random.Random, partition: str, notes: list[str]) -> None:
        values, remove = self.model.random_change(rng, partition)
        self.env.standin.change_cbr_rates(partition, set_values=values, remove=remove)
        self.totals.source_changes += 1
        notes.append(f"change({len(values)}v,{len(remove)}r)")

    def _queue_faults(self, rng: random.Random, partition: str, cli: bool,
                      notes: list[str]) -> None:
        match = f"date_req={date.fromisoformat(partition):%d/%m/%Y}"
        timeout = CLI_TIMEOUT_SECONDS if cli else WARM_TIMEOUT_SECONDS
        for _ in range(rng.choice((0, 1, 1, 2) if not cli else (0, 1))):
            kind = (rng.choice(PERMANENT_FAULTS) if not cli and rng.random() < 0.25
                    else rng.choice(TRANSIENT_FAULTS))
            options: dict = {"match": match}
            if kind in ("503", "404"):
                fault, options["status"] = "status", int(kind)
                if kind == "503" and rng.random() < 0.5:
                    options["retry_after"] = 0
            elif kind == "429":
                fault, options["status"], options["retry_after"] = "status", 429, 1
            elif kind == "hang":
                fault, options["seconds"] = "hang", timeout + 0.5
            elif kind == "rename_element":
                fault = kind
                options.update(element=rng.choice(["Value", "CharCode"]), renamed_to="Rate")
            else:
                fault = kind
            self.env.standin.fault(fault, **options)
            self.totals.faults[kind] += 1
            notes.append(kind)

    # --- runs and kills -----------------------------------------------------------------------

    def _start(self, partition: str, cli: bool) -> RunHandle:
        self.totals.runs["cli" if cli else "warm"] += 1
        return self.env.start_cli_run(partition) if cli else self.env.start_warm_run(partition)

    def _phase(self, rng: random.Random, partition: str, cli: bool, kill_point: str | None,
               duplicate: bool, notes: list[str]) -> bool:
        """Run the partition (and maybe a duplicate at once), killing the first run at
        ``kill_point``; True if one of them succeeded."""
        if kill_point == "extract":
            match = f"date_req={date.fromisoformat(partition):%d/%m/%Y}"
            self.env.standin.fault("hang", match=match, seconds=3)
            self.totals.faults["hang"] += 1
        handles = [self._start(partition, cli)]
        if duplicate:
            self.totals.duplicate_runs += 1
            notes.append("duplicate")
            handles.append(self._start(partition, cli and rng.random() < 0.5))
        if kill_point:
            killed = self._kill_at(rng, handles[0], kill_point)
            notes.append(f"kill@{kill_point}" if killed else f"nokill@{kill_point}")
        for handle in handles:
            handle.wait(timeout=120)
            if handle.killed:
                self.env.mark_dead_run_failed(handle)
        statuses = [self.env.run_status(h) for h in handles]
        notes.append("/".join(s.value if s else "none" for s in statuses))
        # A run that succeeded loaded the source's current state whole (or found it not
        # available yet); whatever the other run did, nothing more should be needed.
        return any(s == DagsterRunStatus.SUCCESS for s in statuses)

    def _kill_at(self, rng: random.Random, handle: RunHandle, point: str) -> bool:
        env = self.env
        startup = 30 if handle.kind == "cli" else 10
        if point == "extract":
            reached = wait_until(lambda: env.has_event(
                handle, DagsterEventType.STEP_START, "cbr_daily_rates.extract"), handle, startup)
            if reached:
                time.sleep(rng.uniform(0.05, 0.5))
        elif point in ("landed", "transform"):
            reached = wait_until(lambda: env.landed_by(handle), handle, startup, 0.003)
            if reached and point == "transform":
                time.sleep(rng.uniform(0, 0.03))
        elif point in ("load", "load_mid"):
            return self._kill_in_load(rng, handle, point, startup)
        elif point == "after_commit":
            reached = wait_until(lambda: env.has_event(
                handle, DagsterEventType.ASSET_MATERIALIZATION), handle, startup, 0.005)
        else:
            delay = rng.uniform(0, 4.0 if handle.kind == "cli" else 1.0)
            wait_until(lambda: False, handle, delay, 0.02)  # the delay, or the run's end
            reached = handle.alive()
        return self._deliver(handle, point) if reached else False

    def _kill_in_load(self, rng: random.Random, handle: RunHandle, point: str,
                      startup: float) -> bool:
        table_key, partition_key = partition_lock_keys(TABLE, handle.partition)
        with psycopg.connect(self.env.postgres.dsn(self.env.database),
                             autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s, %s)", (table_key, partition_key))
            try:
                reached = wait_until(lambda: _waiting_for_lock(holder), handle, startup, 0.01)
                if reached and point == "load":
                    return self._deliver(handle, point)
            finally:
                holder.execute("SELECT pg_advisory_unlock(%s, %s)", (table_key, partition_key))
            if reached:
                time.sleep(rng.uniform(0, 0.02))
                return self._deliver(handle, point)
        return False

    def _deliver(self, handle: RunHandle, point: str) -> bool:
        if not handle.kill():
            return False
        self.totals.kills[point] += 1
        if handle.kind == "cli":
            self.totals.cli_kills += 1
            self._cli_kill_in_scenario = True
        return True

    def _settle(self, partition: str, phase_ok: bool, notes: list[str]) -> None:
        """Re-run the partition until a run succeeds, if the last runs did not; faults still
        queued hit the first re-run, later ones run against a healthy source."""
        if phase_ok:
            return
        for attempt in range(SETTLE_ATTEMPTS):
            if attempt:
                self.env.standin.clear_faults()
            self.totals.settle_runs += 1
            handle = self._start(partition, False)
            handle.wait(timeout=120)
            if self.env.run_status(handle) == DagsterRunStatus.SUCCESS:
                notes.append(f"settled after {attempt + 1}")
                return
        notes.append("NOT SETTLED")
        self._fail(f"{partition}: no run succeeded after {SETTLE_ATTEMPTS} re-runs")

    # --- the judge ----------------------------------------------------------------------------

    def _compare(self, partition: str) -> list[str]:
        expected = self._reference(partition)
        actual = _partition_state(self.env.postgres.dsn(self.env.database), partition)
        problems = []
        if actual[0] != expected[0]:
            problems.append(f"rows differ: expected {_diff(expected[0], actual[0])}")
        if actual[1] != expected[1]:
            problems.append(f"quarantine differs: expected {_diff(expected[1], actual[1])}")
        return problems

    def _judge(self, number: int, partition: str, notes: list[str]) -> None:
        problems = self._compare(partition)
        duplicates = _duplicates(self.env.postgres.dsn(self.env.database))
        if duplicates:
            self.totals.duplicates += duplicates
            problems.append(f"{duplicates} duplicated keys")
        if problems:
            self.totals.differences += sum(p.startswith(("rows", "quarantine")) for p in problems)
            self._fail(f"scenario {number} ({' '.join(notes)}): {'; '.join(problems)}",
                       error=False)
        if self._cli_kill_in_scenario:
            self.totals.scenarios_with_cli_kill += 1
            self._cli_kill_in_scenario = False
        self.log(f"  #{number:<4} {' '.join(notes)}{'  DIFFERENT' if problems else ''}")

    def _reference(self, partition: str) -> tuple:
        """The partition as one clean run on an empty database makes it, for the source's
        current state (cached by the exact bytes the source now serves)."""
        asked = date.fromisoformat(partition)
        document = httpx.get(self.env.standin_server.cbr_url,
                             params={"date_req": f"{asked:%d/%m/%Y}"}).content
        key = (partition, document, self.today)
        if key in self._references:
            self.totals.reference_cache_hits += 1
            return self._references[key]
        dsn = self.env.postgres.dsn(self.env.reference_database)
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(f"TRUNCATE {TABLE}, quarantined_rows")
        handle = self.env.start_warm_run(partition, reference=True)
        handle.wait(timeout=120)
        if handle.process.exitcode != 0:
            self._fail(f"reference run of {partition} failed (exit {handle.process.exitcode})")
        self._references[key] = _partition_state(dsn, partition)
        return self._references[key]

    def _fail(self, message: str, error: bool = True) -> None:
        self.totals.errors += error
        self.totals.failures.append(message)
        self.log(f"  FAILURE: {message}")


def _waiting_for_lock(holder: psycopg.Connection) -> bool:
    return holder.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE '%pg_advisory_xact_lock%' AND datname = current_database() "
        "AND pid <> pg_backend_pid()"
    ).fetchone()[0] > 0


def _partition_state(dsn: str, partition: str) -> tuple[list, list]:
    with psycopg.connect(dsn) as connection:
        rows = connection.execute(
            f"SELECT {ROW_COLUMNS} FROM {TABLE} WHERE partition_date = %s ORDER BY char_code",
            (date.fromisoformat(partition),)).fetchall()
        quarantined = connection.execute(
            "SELECT row_number, raw_row, reason FROM quarantined_rows "
            "WHERE source = %s AND partition_key = %s ORDER BY row_number, id",
            (SOURCE, partition)).fetchall()
    return rows, quarantined


def _duplicates(dsn: str) -> int:
    """Natural keys held more than once: in the table (its constraint forbids them) and in the
    quarantine (a partition's rejected row is kept once, whatever the number of runs)."""
    with psycopg.connect(dsn) as connection:
        table = connection.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM {TABLE} GROUP BY partition_date, char_code "
            "HAVING count(*) > 1) d").fetchone()[0]
        quarantine = connection.execute(
            "SELECT count(*) FROM (SELECT 1 FROM quarantined_rows "
            "GROUP BY source, partition_key, row_number HAVING count(*) > 1) d").fetchone()[0]
    return table + quarantine


def _diff(expected: list, actual: list) -> str:
    missing = [r for r in expected if r not in actual]
    extra = [r for r in actual if r not in expected]
    return f"{len(expected)} rows, got {len(actual)}; missing {missing[:3]}, extra {extra[:3]}"

