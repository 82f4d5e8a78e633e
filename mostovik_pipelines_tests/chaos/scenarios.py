"""Randomized scenarios of ADR-011's promise, and the judge of their outcome.

A scenario takes one partition of the CBR source and mixes, at random: a change of the source's
rates (values, removed currencies, a currency that turns unreadable and goes to quarantine, often
one whose rate is stored already) before a run; transient source faults (503, 429 with
Retry-After, dropped connections, hangs past the timeout) and permanent ones (malformed,
truncated, HTML, wrong encoding, renamed element, 404); a kill -9 of the run's process at a chosen
point, or instead (some scenarios) a crash of the warehouse server at that point, back 1-4 s
later; a concurrent duplicate run; a re-run of the loaded partition, possibly after another
source change; a re-execution of an older run of the partition once newer runs have finished
(from its failure, through ``mostovik jobs rerun`` or a warm process, or all its steps), possibly
after a source change and sometimes killed too. A killed run is recorded as failed, as the
dead-run sensor does, or (some) left "started", as it is until the sensor marks it.

A ranged scenario runs 3-5 consecutive dates of the pool, with the Sundays and Mondays between
them, in one run, with permanent faults on 1-2 of its dates: those partitions fail, the others
load; the faults cleared, the failed run is re-executed from its failure.

Then, as an operator would, it re-runs the partition until a run succeeds if the last runs were
killed or failed, re-runs the loaded partitions a source change reached that no run has fetched
since (a Saturday's rates are its Sunday's and Monday's; a re-execution does not fetch what the
run it repeats loaded), and compares every partition it touched with its expected state. After
a scenario with a kill, no dead run may hold the partition: the first fresh run of it after the
last kill (a settling re-run, else one started to check) must end within 30 s and wait at most
20 s (a run that died before its first step counts as alive for 10 s). The warehouse is kept
from scenario to scenario, so partitions are loaded, re-loaded and changed many times over.

The expected state of a partition: the rows of one clean run, on a freshly emptied database, of
the source's current state, plus the kept rows: a currency that is unreadable now keeps the row
that was stored under its key when it turned unreadable (or stays absent). The harness reads
that row from the warehouse when it changes the source, while no run is in flight; nothing can
change it afterwards, since a rejected row keeps its stored row and no payload fetched before the
change can be loaded after a later one. The quarantine must equal the clean run's.

Kill points are observed from outside, without hooks in production code:

* ``extract``: the source hangs the request; the run's extract step has started;
* ``landed``: the run's fetch record is in the landing store (extract done, transform next);
* ``transform``: a few milliseconds after ``landed``;
* ``load``: the suite holds the partition's advisory lock, so the load waits inside its
  transaction; killed there;
* ``load_mid``: as ``load``, but the lock is released and the kill lands a moment later, in the
  middle of the load's statements;
* event boundaries (:data:`EVENTS`): right after the run's event appears in the event log, from
  ``run_start`` (before the first step) to ``after_commit`` (the materialisation written right
  after the load commits);
* ``between``: a random moment up to 50 ms after one of those events;
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

from mostovik_pipelines.core.outages import Store, budget_seconds
from mostovik_pipelines.framework.load.lock import partition_lock_keys
from mostovik_pipelines.sources.cbr_daily_rates.standin import CURRENCIES, MOSCOW, effective_date
from mostovik_pipelines_tests.chaos.environment import (
    CLI_TIMEOUT_SECONDS,
    SOURCE,
    WARM_TIMEOUT_SECONDS,
    ChaosEnvironment,
    date_range,
)
from mostovik_pipelines_tests.chaos.harness import (
    FINISHED,
    LEFT_STARTED_SHARE,
    RunHandle,
    a_load_waits_for_a_lock,
    wait_until,
)

TABLE = "cbr_daily_rates"
CODES = [currency[2] for currency in CURRENCIES]
EVENTS = {
    "run_start": (DagsterEventType.RUN_START, None),
    "extract_start": (DagsterEventType.STEP_START, "extract"),
    "extract_output": (DagsterEventType.STEP_OUTPUT, "extract"),
    "extract_success": (DagsterEventType.STEP_SUCCESS, "extract"),
    "transform_start": (DagsterEventType.STEP_START, "transform"),
    "transform_success": (DagsterEventType.STEP_SUCCESS, "transform"),
    "load_start": (DagsterEventType.STEP_START, "load"),
    "after_commit": (DagsterEventType.ASSET_MATERIALIZATION, None),
}
"""Kill points right after an event of the run: its type, and the op of its step."""
KILL_POINTS = ("extract", "landed", "transform", "load", "load_mid", *EVENTS, "between",
               "random")
RUN_KILL_POINTS = (*EVENTS, "between", "random")
"""Kill points of ranged runs and re-executions: they watch no one partition's landing or lock."""
TRANSIENT_FAULTS = ("503", "429", "drop", "hang")
PERMANENT_FAULTS = ("malformed", "truncate", "html", "wrong_encoding", "rename_element", "404")
RANGE_FAULTS = ("404", "malformed")
"""Permanent faults that fail a partition of a range in extract and in transform."""
UNREADABLE_VALUES = ("n/a", "-5,0", "1e9", "12,34,56", "'; DROP TABLE x;--")
MAX_REMOVED = 2
"""Removed currencies per date: with one unreadable currency among 10 the share is 10%, still
a partial load; among 9 it would be a systematic defect that no re-run can settle."""
SETTLE_ATTEMPTS = 6
CRASH_POINTS = ("extract", "landed", "transform", *EVENTS, "between", "random")
"""Where the warehouse may crash instead of the run being killed: not inside the load, where the
suite itself holds a connection to the warehouse."""
WAREHOUSE_CRASH_SHARE = 0.3
"""Scenarios whose first kill is a crash of the warehouse instead (``pg_ctl -m immediate``, back
1-4 s later, far within the warehouse's outage budget): every run rides it out, warm and
``dagster job execute`` alike, and a run that fails on it is a finding whatever the data ends
as. Decided apart from the scenario's other choices."""
RANGED_SHARE = 0.15
REEXECUTION_SHARE = 0.3
CHECK_TIMEOUT_SECONDS = 120.0
"""What the liveness check's run is given before it counts as blocked (and is killed): far more
than a free partition's run needs even on a loaded machine. Whether a dead run held the
partition is read from the run's own log (:meth:`ChaosEnvironment.late_waits_for`)."""
ROW_COLUMNS = ("partition_date, rate_date, cbr_id, num_code, char_code, nominal, name, "
               "value::text, unit_rate::text")
CHAR_CODE = 4
"""Position of char_code in :data:`ROW_COLUMNS`."""
ONE_DAY = timedelta(days=1)


@dataclass
class Totals:
    scenarios: int = 0
    kills: Counter = field(default_factory=Counter)
    warehouse_crashes: Counter = field(default_factory=Counter)
    """Crashes of the warehouse server under a run, per point of the run."""
    failed_within_budget: int = 0
    """Runs that failed on a warehouse crash shorter than the warehouse's outage budget: each a
    finding (unsettled), however exact the data ended."""
    cli_kills: int = 0
    scenarios_with_cli_kill: int = 0
    left_started: int = 0
    faults: Counter = field(default_factory=Counter)
    source_changes: int = 0
    unreadable_changes: int = 0
    """Changes that made a currency unreadable, newly or again with another value."""
    unreadable_again: int = 0
    unreadable_between_fetches: int = 0
    """Of those, changes that made a stored rate unreadable (it was loaded, the next fetch sees
    it unreadable)."""
    duplicate_runs: int = 0
    reruns_of_loaded: int = 0
    reexecutions: Counter = field(default_factory=Counter)
    """Re-executions by kind ("from failure, cli", "from failure, warm", "all steps, warm")."""
    reexecutions_of_older_runs: int = 0
    reexecutions_killed: int = 0
    ranged_runs: int = 0
    ranged_failed_partitions: int = 0
    settle_runs: int = 0
    refresh_runs: int = 0
    runs: Counter = field(default_factory=Counter)
    liveness_checks: int = 0
    liveness_runs: int = 0
    """Runs started only to check liveness (otherwise a settling re-run is the check)."""
    blocked: int = 0
    """Partitions a fresh run could not have within 30 s (or only after waiting over 20 s)."""
    kept_rows: int = 0
    """Kept rows in the expected states of the final sweep."""
    differences: int = 0
    duplicates: int = 0
    errors: int = 0
    """Failures that are not differences: a partition no re-run settled, a failed reference."""
    failures: list[str] = field(default_factory=list)
    reference_cache_hits: int = 0


@dataclass
class Change:
    """One revision of a date's rates, and what it does to the date's unreadable currency."""

    values: dict[str, str]
    remove: list[str]
    readable_again: str | None = None
    """The currency that was unreadable and is readable (or removed) now."""
    unreadable: str | None = None
    """The currency this change makes unreadable."""
    again: bool = False
    """The unreadable currency stays unreadable, with another unreadable value."""


class SourceModel:
    """What the harness has asked the stand-in to change, per effective date, so that the final
    state of every date stays loadable (at most one unreadable currency, at most two removed)."""

    def __init__(self) -> None:
        self.bad: dict[str, str] = {}
        self.removed: dict[str, set[str]] = {}

    def random_change(self, rng: random.Random, day: str,
                      force_unreadable: bool = False) -> Change:
        removed = self.removed.setdefault(day, set())
        present = [c for c in CODES if c not in removed]
        values = {code: random_rate(rng) for code in rng.sample(present, rng.randint(1, 3))}
        remove: list[str] = []
        if len(removed) < MAX_REMOVED and rng.random() < 0.3:
            remove = [rng.choice([c for c in present if c not in values])]
        change = Change(values, remove)
        bad = self.bad.get(day)
        if bad in values or bad in remove:
            change.readable_again = self.bad.pop(day)
            bad = None
        if bad is not None and (force_unreadable or rng.random() < 0.3):
            values[bad] = rng.choice(UNREADABLE_VALUES)
            change.again = True
        elif bad is None and (force_unreadable or rng.random() < 0.45):
            code = rng.choice([c for c in present
                               if c not in remove and c != change.readable_again])
            values[code] = rng.choice(UNREADABLE_VALUES)
            self.bad[day] = change.unreadable = code
        removed.update(remove)
        return change


def random_rate(rng: random.Random) -> str:
    amount = Decimal(rng.randint(1, 2_000_000)) / Decimal(10_000)
    return format(amount, "f").replace(".", ",")


def partition_pool(today: date, size: int) -> list[str]:
    """Past dates whose rates are their own (Tuesday to Saturday), newest first; a change of a
    date's rates then touches that partition only (and, for a Saturday, its Sunday and Monday,
    which only ranged runs load)."""
    pool, day = [], today - timedelta(days=3)
    while len(pool) < size:
        if day.weekday() not in (6, 0):
            pool.append(day.isoformat())
        day -= timedelta(days=1)
    return pool


def _match(partition: str) -> str:
    """The stand-in's fault match for requests of the partition."""
    return f"date_req={date.fromisoformat(partition):%d/%m/%Y}"


class ChaosSuite:
    def __init__(self, env: ChaosEnvironment, seed: int, cli_share: float = 0.35,
                 pool_size: int = 12, log=print) -> None:
        """``cli_share``: the share of scenarios that start and kill ``dagster job execute``,
        and of re-executions from failure through ``mostovik jobs rerun`` (the rest run warm)."""
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
        self.kept: dict[tuple[str, str], tuple | None] = {}
        """(partition, currency) -> the row stored when the currency turned unreadable (None:
        no row), for the currencies unreadable now."""
        self.stale: set[str] = set()
        """Partitions whose source changed after the last successful run that fetched them."""
        self.history: dict[str, list[str]] = {}
        """Partition -> its finished runs (single or ranged), oldest first."""
        self._references: dict[tuple, tuple] = {}
        self._killed_in_scenario = False
        self._killed_runs: list[str] = []
        """The runs killed in this scenario (those that had a run id by then)."""
        self._probe: RunHandle | None = None
        """The first fresh warm run of the scenario's partitions after its last kill."""
        self._cli_kill_in_scenario = False
        self._crash_rng: random.Random | None = None
        """Set for a scenario whose first kill is a warehouse crash instead."""
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
        """Every partition the suite ever touched, against its expected state once more: a
        scenario must not have disturbed the partitions of earlier ones."""
        for problem in self.compare(sorted(self.loaded)):
            self._fail(f"final sweep, {problem}", error=False)
        self.totals.kept_rows = sum(row is not None for (partition, _), row in self.kept.items()
                                    if partition in self.loaded)
        self.log(f"  final sweep: {len(self.loaded)} partitions compared")

    def scenario(self, number: int) -> None:
        rng = random.Random(f"{self.seed}:{number}")
        crash_rng = random.Random(f"{self.seed}:{number}:warehouse")
        self._crash_rng = crash_rng if crash_rng.random() < WAREHOUSE_CRASH_SHARE else None
        cli = rng.random() < self.cli_share
        self._killed_in_scenario = False
        self._killed_runs = []
        self._probe = None
        if not cli and rng.random() < RANGED_SHARE:
            notes: list[str] = []
            scope = self._ranged_scenario(rng, notes)
            touched = set(scope)
        else:
            scope, touched, notes = self._single_scenario(rng, cli)
        self.env.standin.clear_faults()
        touched |= self._refresh(touched, notes)
        problems = self.compare(sorted(touched))
        if self._killed_in_scenario:
            problems += self._check_not_blocked(scope, notes)
        self._report(number, notes, problems)
        self.loaded |= touched
        self.totals.scenarios += 1

    def _single_scenario(self, rng: random.Random, cli: bool
                         ) -> tuple[tuple[str, ...], set[str], list[str]]:
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
            # A manual re-run of the partition just loaded, possibly after the source changed,
            # often making a currency it just loaded unreadable.
            if partition != self.tomorrow and rng.random() < 0.5:
                self._change_source(rng, partition, notes, force_unreadable=rng.random() < 0.5)
            self._queue_faults(rng, partition, False, notes)
            phase = self._phase(rng, partition, False,
                                rng.choice(KILL_POINTS) if rng.random() < 0.5 else None,
                                rng.random() < 0.2, notes)
        self._settle((partition,), phase, notes)
        touched = {partition}
        if rng.random() < REEXECUTION_SHARE:
            touched |= self._reexecute_older_run(rng, partition, notes)
        return (partition,), touched, notes

    def _ranged_scenario(self, rng: random.Random, notes: list[str]) -> tuple[str, ...]:
        """One run of 3-5 consecutive pool dates (and the Sundays and Mondays between them)
        with permanent faults on 1-2 of its dates; the faults cleared, the failed run is
        re-executed from its failure. Returns the range's partitions."""
        size = rng.randint(3, 5)
        first = rng.randrange(len(self.pool) - size + 1)
        days = sorted(self.pool[first:first + size])
        scope = date_range(days[0], days[-1])
        notes += [f"{days[0]}..{days[-1]}", f"ranged({len(scope)})"]
        for day in rng.sample(days, rng.randint(0, 2)):
            self._change_source(rng, day, notes)
        for day in sorted(rng.sample(scope, rng.randint(1, 2))):
            kind = rng.choice(RANGE_FAULTS)
            if kind == "404":
                self.env.standin.fault("status", status=404, times=-1, match=_match(day))
            else:
                self.env.standin.fault(kind, times=-1, match=_match(day))
            self.totals.faults[kind] += 1
            notes.append(f"{kind}@{day}")
        if rng.random() < 0.3:
            self.env.standin.fault("status", status=503, retry_after=0,
                                   match=_match(rng.choice(scope)))
            self.totals.faults["503"] += 1
            notes.append("503")

        self.totals.ranged_runs += 1
        self.totals.runs["warm"] += 1
        handle = self.env.start_warm(scope)
        kill_point = rng.choice(RUN_KILL_POINTS) if rng.random() < 0.25 else None
        killed = kill_point is not None and self._kill_at(rng, handle, kill_point)
        if kill_point:
            notes.append(f"kill@{kill_point}" if killed else f"nokill@{kill_point}")
        status = self._finish(handle, rng)
        notes.append(_status_text(status))
        run_id = self.env.run_id_of(handle)
        if status == DagsterRunStatus.FAILURE and not killed:
            failed = set(scope) - self.env.materialized_by(run_id)
            self.totals.ranged_failed_partitions += len(failed)
            notes.append(f"{len(failed)} failed")

        self.env.standin.clear_faults()
        succeeded = status == DagsterRunStatus.SUCCESS
        if status in (DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED):
            if rng.random() < 0.4:
                self._change_source(rng, rng.choice(days), notes,
                                    force_unreadable=rng.random() < 0.5)
            succeeded = self._reexecute(
                rng, run_id, from_failure=True, cli=rng.random() < self.cli_share,
                kill_point=rng.choice(RUN_KILL_POINTS) if rng.random() < 0.15 else None,
                notes=notes)
        self._settle(scope, succeeded, notes)
        return scope

    def _change_source(self, rng: random.Random, day: str, notes: list[str],
                       force_unreadable: bool = False) -> None:
        change = self.model.random_change(rng, day, force_unreadable)
        carried = self._carried(day)
        # No run is in flight: what a partition stores now under a currency that turns
        # unreadable is what its loads keep from now on.
        if change.readable_again:
            for partition in carried:
                self.kept.pop((partition, change.readable_again), None)
        if change.unreadable:
            dsn = self.env.postgres.dsn(self.env.database)
            for partition in carried:
                self.kept[(partition, change.unreadable)] = _stored_row(dsn, partition,
                                                                        change.unreadable)
        unreadable = change.unreadable or (self.model.bad[day] if change.again else None)
        if unreadable:
            self.totals.unreadable_changes += 1
            self.totals.unreadable_again += change.again
            if any(self.kept.get((partition, unreadable)) is not None for partition in carried):
                self.totals.unreadable_between_fetches += 1
        self.env.standin.change_cbr_rates(day, set_values=change.values, remove=change.remove)
        self.stale.update(carried)
        self.totals.source_changes += 1
        notes.append(f"change({len(change.values)}v,{len(change.remove)}r"
                     f"{',unreadable ' + unreadable if unreadable else ''})")

    def _carried(self, day: str) -> list[str]:
        """The partitions whose rates are ``day``'s: the day's own, and a Saturday's Sunday and
        Monday."""
        published = (date.fromisoformat(self.tomorrow) if self.published_tomorrow
                     else self.today)
        first = date.fromisoformat(day)
        days = (first + timedelta(days=n) for n in range(3))
        return [d.isoformat() for d in days if effective_date(d, published) == first]

    def _queue_faults(self, rng: random.Random, partition: str, cli: bool,
                      notes: list[str]) -> None:
        timeout = CLI_TIMEOUT_SECONDS if cli else WARM_TIMEOUT_SECONDS
        for _ in range(rng.choice((0, 1, 1, 2) if not cli else (0, 1))):
            kind = (rng.choice(PERMANENT_FAULTS) if not cli and rng.random() < 0.25
                    else rng.choice(TRANSIENT_FAULTS))
            options: dict = {"match": _match(partition)}
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
        return (self.env.start_cli(partition) if cli
                else self.env.start_warm((partition,)))

    def _start_warm(self, scope: tuple[str, ...]) -> RunHandle:
        self.totals.runs["warm"] += 1
        return self.env.start_warm(scope)

    def _finish(self, handle: RunHandle, rng: random.Random | None = None,
                fetched: set[str] | None = None) -> DagsterRunStatus | None:
        """Wait for the run. A killed run is recorded as failed, or (given ``rng``, some) left
        started. The run joins its partitions' history. The source's current state is what
        the partitions it loaded hold, and if it succeeded, all its partitions (or those it
        ``fetched``)."""
        handle.wait(timeout=120)
        status = self.env.status_of(handle)
        if handle.killed and status not in FINISHED:
            if rng is not None and rng.random() < LEFT_STARTED_SHARE:
                self.totals.left_started += 1
                self.env.leave_started(handle)
            else:
                self.env.mark_dead_run_failed(handle)
                status = self.env.status_of(handle)
        run_id = self.env.run_id_of(handle)
        if status in FINISHED:
            for partition in handle.partitions:
                self.history.setdefault(partition, []).append(run_id)
        if status == DagsterRunStatus.SUCCESS:
            self.stale -= set(handle.partitions) if fetched is None else fetched
        if run_id is not None:
            # Its loads came after every change: the source only changes between runs.
            self.stale -= self.env.materialized_by(run_id)
        return status

    def _phase(self, rng: random.Random, partition: str, cli: bool, kill_point: str | None,
               duplicate: bool, notes: list[str]) -> bool:
        """Run the partition (and maybe a duplicate at once), killing the first run at
        ``kill_point``; True if one of them succeeded."""
        if kill_point == "extract":
            self.env.standin.fault("hang", match=_match(partition), seconds=3)
            self.totals.faults["hang"] += 1
        handles = [self._start(partition, cli)]
        if duplicate:
            self.totals.duplicate_runs += 1
            notes.append("duplicate")
            handles.append(self._start(partition, cli and rng.random() < 0.5))
        crashed = None
        if kill_point and self._crash_rng and kill_point in CRASH_POINTS:
            crash_rng, self._crash_rng = self._crash_rng, None
            crashed = self._crash_warehouse_at(crash_rng, handles[0], kill_point)
            notes.append(f"warehouse-crash@{kill_point}" if crashed
                         else f"nocrash@{kill_point}")
        elif kill_point:
            killed = self._kill_at(rng, handles[0], kill_point)
            notes.append(f"kill@{kill_point}" if killed else f"nokill@{kill_point}")
        statuses = [self._finish(handle, rng) for handle in handles]
        notes.append("/".join(_status_text(s) for s in statuses))
        if crashed:
            self._judge_the_crash(partition, crashed, handles, statuses)
        for handle, status in zip(handles, statuses, strict=True):
            if status is None and not handle.killed:
                self._fail(f"a {handle.kind} run of {partition} never reached run storage; "
                           f"see {handle.log_path}")
        # A run that succeeded loaded the source's current state whole (or found it not
        # available yet); whatever the other run did, nothing more should be needed.
        return any(s == DagsterRunStatus.SUCCESS for s in statuses)

    def _reexecute_older_run(self, rng: random.Random, partition: str,
                             notes: list[str]) -> set[str]:
        """Re-execute a run of the partition older than its latest finished one, possibly
        after a source change: the partition must not go back to that run's data. Returns the
        re-executed run's partitions."""
        older = self.history.get(partition, [])[:-1]
        if not older:
            return set()
        run_id = rng.choice(older)
        if partition != self.tomorrow and rng.random() < 0.4:
            self._change_source(rng, partition, notes, force_unreadable=rng.random() < 0.5)
        self.env.standin.clear_faults()
        run = self.env.instance.get_run_by_id(run_id)
        failed = run is not None and run.status in (DagsterRunStatus.FAILURE,
                                                    DagsterRunStatus.CANCELED)
        from_failure = failed and rng.random() < 0.7
        self.totals.reexecutions_of_older_runs += 1
        succeeded = self._reexecute(
            rng, run_id, from_failure=from_failure,
            cli=from_failure and rng.random() < self.cli_share,
            kill_point=rng.choice(RUN_KILL_POINTS) if rng.random() < 0.25 else None,
            notes=notes)
        self._settle((partition,), succeeded, notes)
        return set(self.env.partitions_of(run_id))

    def _reexecute(self, rng: random.Random, run_id: str, from_failure: bool, cli: bool,
                   kill_point: str | None, notes: list[str]) -> bool:
        """Re-execute the run (from its failure, or all steps), maybe killing it; True if the
        re-execution succeeded."""
        fetched = set(self.env.partitions_of(run_id))
        if from_failure:
            # A re-execution from failure fetches again what its lineage did not load.
            fetched -= self.env.loaded_by_lineage(run_id)
        kind = f"{'from failure' if from_failure else 'all steps'}, {'cli' if cli else 'warm'}"
        self.totals.reexecutions[kind] += 1
        self.totals.runs["cli" if cli else "warm"] += 1
        handle = (self.env.start_cli_rerun(run_id) if cli
                  else self.env.start_warm_reexecution(run_id, from_failure))
        killed = kill_point is not None and self._kill_at(rng, handle, kill_point)
        self.totals.reexecutions_killed += killed
        status = self._finish(handle, rng, fetched)
        notes.append(f"rerun[{kind} of {run_id[:8]}"
                     f"{' kill@' + kill_point if killed else ''}]:{_status_text(status)}")
        if not killed and status != DagsterRunStatus.SUCCESS:
            # Against a healthy source nothing but a defect fails a re-execution.
            self._fail(f"re-execution ({kind}) of {run_id} ended {_status_text(status)}; "
                       f"see {handle.log_path}")
        return status == DagsterRunStatus.SUCCESS

    def _kill_at(self, rng: random.Random, handle: RunHandle, point: str) -> bool:
        if point in ("load", "load_mid"):
            startup = 30 if handle.kind == "cli" else 10
            return self._kill_in_load(rng, handle, point, startup)
        return self._deliver(handle, point) if self._reach(rng, handle, point) else False

    def _crash_warehouse_at(self, rng: random.Random, handle: RunHandle,
                            point: str) -> float | None:
        """Crash the warehouse server once the run reaches ``point``, and start it again 1-4 s
        later; how long it was down, or None if the run ended first."""
        if not self._reach(rng, handle, point):
            return None
        seconds = rng.uniform(1.0, 4.0)
        self.env.postgres.down_for(seconds)
        self.totals.warehouse_crashes[point] += 1
        return seconds

    def _judge_the_crash(self, partition: str, seconds: float, handles: list[RunHandle],
                         statuses: list[DagsterRunStatus | None]) -> None:
        """A fault shorter than its budget is ridden out: a run (not killed) that failed on the
        warehouse's crash is a finding, whatever the data (its re-runs settle that)."""
        budget = budget_seconds(Store.WAREHOUSE)
        for handle, status in zip(handles, statuses, strict=True):
            if handle.killed or status == DagsterRunStatus.SUCCESS or seconds >= budget:
                continue
            failure = self.env.failure_on_the_warehouse(handle)
            if failure:
                self.totals.failed_within_budget += 1
                self._fail(f"a {handle.kind} run of {partition} failed on a warehouse crash of "
                           f"{seconds:.1f} s, within the {budget:.0f} s it rides out: {failure}; "
                           f"see {handle.log_path}")

    def _reach(self, rng: random.Random, handle: RunHandle, point: str) -> bool:
        """Wait until the run is at ``point`` (not one inside the load); False if it ended
        or never got there."""
        env = self.env
        startup = 30 if handle.kind == "cli" else 10
        if point == "extract":
            reached = wait_until(lambda: env.has_event(
                handle, DagsterEventType.STEP_START, f"{SOURCE}.extract_"), handle, startup)
            if reached:
                time.sleep(rng.uniform(0.05, 0.5))
        elif point in ("landed", "transform"):
            reached = wait_until(lambda: env.landed_by(handle), handle, startup, 0.003)
            if reached and point == "transform":
                time.sleep(rng.uniform(0, 0.03))
        elif point in EVENTS or point == "between":
            event_type, op = EVENTS[rng.choice(list(EVENTS)) if point == "between" else point]
            step = f"{SOURCE}.{op}_" if op else None
            reached = wait_until(lambda: env.has_event(handle, event_type, step), handle,
                                 startup, 0.005)
            if reached and point == "between":
                time.sleep(rng.uniform(0, 0.05))
        else:
            delay = rng.uniform(0, 4.0 if handle.kind == "cli" else 1.0)
            wait_until(lambda: False, handle, delay, 0.02)  # the delay, or the run's end
            reached = handle.alive()
        return reached

    def _kill_in_load(self, rng: random.Random, handle: RunHandle, point: str,
                      startup: float) -> bool:
        table_key, partition_key = partition_lock_keys(TABLE, handle.partition)
        with psycopg.connect(self.env.postgres.dsn(self.env.database),
                             autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s, %s)", (table_key, partition_key))
            try:
                reached = wait_until(lambda: a_load_waits_for_a_lock(holder), handle, startup, 0.01)
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
        self._killed_in_scenario = True
        self._killed_runs += [run_id for run_id in [self.env.run_id_of(handle)] if run_id]
        self._probe = None
        if handle.kind == "cli":
            self.totals.cli_kills += 1
            self._cli_kill_in_scenario = True
        return True

    def _settle(self, scope: tuple[str, ...], phase_ok: bool, notes: list[str]) -> None:
        """Re-run the partitions until a run succeeds, if the last runs did not; faults still
        queued hit the first re-run, later ones run against a healthy source."""
        if phase_ok:
            return
        for attempt in range(SETTLE_ATTEMPTS):
            if attempt:
                self.env.standin.clear_faults()
            self.totals.settle_runs += 1
            handle = self._start_warm(scope)
            status = self._finish(handle)
            self._observe(handle)
            if status == DagsterRunStatus.SUCCESS:
                notes.append(f"settled after {attempt + 1}")
                return
        notes.append("NOT SETTLED")
        self._fail(f"{scope[0]}: no run succeeded after {SETTLE_ATTEMPTS} re-runs")

    def _refresh(self, touched: set[str], notes: list[str]) -> set[str]:
        """Re-run the loaded partitions a source change reached that no run has loaded since,
        as an operator re-runs what a revision touched (consecutive dates in one ranged run).
        Returns them."""
        due = sorted(self.stale & (self.loaded | touched))
        for scope in _consecutive(due):
            self.totals.refresh_runs += 1
            if self._finish(self._start_warm(scope)) != DagsterRunStatus.SUCCESS:
                self._fail(f"the refresh run of {scope[0]}..{scope[-1]} failed")
        if due:
            notes.append(f"refreshed {','.join(due)}")
        return set(due)

    def _observe(self, handle: RunHandle) -> None:
        """Take the run as the scenario's liveness probe if it is the first fresh run of its
        partitions since the last kill."""
        if self._killed_in_scenario and self._probe is None:
            self._probe = handle

    def _check_not_blocked(self, scope: tuple[str, ...], notes: list[str]) -> list[str]:
        """After a kill, no dead run may hold the partitions: the first fresh run of them since
        the last kill (a settling re-run, else one started here) may wait for a killed run only
        within its launch grace (a run that died before its first step counts as alive for
        10 s after its last change; one that died later, not at all), as its own log records,
        and must end. Returns the problems, a check run's outcome compared too."""
        self.totals.liveness_checks += 1
        problems = []
        if self._probe is None:
            self.totals.liveness_runs += 1
            handle = self._start_warm(scope)
            handle.wait(timeout=CHECK_TIMEOUT_SECONDS)
            self._observe(handle)
            status = self._finish(handle)
            if status == DagsterRunStatus.SUCCESS:
                problems += [f"after the liveness check, {problem}"
                             for problem in self.compare(scope)]
            elif not handle.killed:
                problems.append(f"the liveness check's run ended {_status_text(status)}")
        assert self._probe is not None
        late = self.env.late_waits_for(self._probe, self._killed_runs)
        waited = self.env.waited_for_older_run(self._probe)
        notes.append(f"free{' after waiting' if waited else ''}")
        if self._probe.killed or late:
            self.totals.blocked += 1
            problems.append(f"{scope[0]} blocked: the first run after the kill "
                            f"{'waited for ' + '; '.join(late) if late else 'never ended'}")
        return problems

    # --- the judge ----------------------------------------------------------------------------

    def compare(self, partitions) -> list[str]:
        """Each partition against its expected state; the differences, counted."""
        partitions = list(partitions)
        references = self._references_of(partitions)
        dsn = self.env.postgres.dsn(self.env.database)
        problems = []
        for partition in partitions:
            expected = self._expected(partition, references[partition])
            actual = _partition_state(dsn, partition)
            if actual[0] != expected[0]:
                problems.append(f"{partition}: rows differ: expected "
                                f"{_diff(expected[0], actual[0])}")
            if actual[1] != expected[1]:
                problems.append(f"{partition}: quarantine differs: expected "
                                f"{_diff(expected[1], actual[1])}")
        self.totals.differences += len(problems)
        return problems

    def _expected(self, partition: str, reference: tuple[list, list]) -> tuple[list, list]:
        """The reference's rows plus the rows kept under currencies unreadable now, and the
        reference's quarantine."""
        rows, quarantined = reference
        kept = [row for (kept_in, _), row in self.kept.items()
                if kept_in == partition and row is not None]
        return sorted([*rows, *kept], key=lambda row: row[CHAR_CODE]), quarantined

    def _report(self, number: int, notes: list[str], problems: list[str]) -> None:
        duplicates = duplicated_keys(self.env.postgres.dsn(self.env.database))
        if duplicates:
            self.totals.duplicates += duplicates
            problems.append(f"{duplicates} duplicated keys")
        if problems:
            self._fail(f"scenario {number} ({' '.join(notes)}): {'; '.join(problems)}",
                       error=False)
        if self._cli_kill_in_scenario:
            self.totals.scenarios_with_cli_kill += 1
            self._cli_kill_in_scenario = False
        self.log(f"  #{number:<4} {' '.join(notes)}{'  DIFFERENT' if problems else ''}")

    def _references_of(self, partitions: list[str]) -> dict[str, tuple[list, list]]:
        """Each partition as one clean run on an empty database makes it, for the source's
        current state (cached by the exact bytes the source now serves). Consecutive dates
        missing from the cache are loaded by one ranged run: its partitions load independently,
        exactly as single runs load them."""
        keys = {}
        for partition in partitions:
            asked = date.fromisoformat(partition)
            document = httpx.get(self.env.standin_server.cbr_url,
                                 params={"date_req": f"{asked:%d/%m/%Y}"}).content
            keys[partition] = (partition, document, self.today)
        missing = sorted(p for p, key in keys.items() if key not in self._references)
        self.totals.reference_cache_hits += len(partitions) - len(missing)
        dsn = self.env.postgres.dsn(self.env.reference_database)
        for scope in _consecutive(missing):
            with psycopg.connect(dsn, autocommit=True) as connection:
                connection.execute(f"TRUNCATE {TABLE}, quarantined_rows")
            handle = self.env.start_reference_run(scope)
            handle.wait(timeout=120)
            if handle.process.exitcode != 0:
                self._fail(f"reference run of {scope[0]}..{scope[-1]} failed "
                           f"(exit {handle.process.exitcode})")
            for partition in scope:
                self._references[keys[partition]] = _partition_state(dsn, partition)
        return {partition: self._references[key] for partition, key in keys.items()}

    def _fail(self, message: str, error: bool = True) -> None:
        self.totals.errors += error
        self.totals.failures.append(message)
        self.log(f"  FAILURE: {message}")


def _consecutive(days: list[str]) -> list[tuple[str, ...]]:
    """Sorted dates grouped into runs of consecutive dates."""
    groups: list[list[str]] = []
    for day in days:
        if groups and date.fromisoformat(day) - date.fromisoformat(groups[-1][-1]) == ONE_DAY:
            groups[-1].append(day)
        else:
            groups.append([day])
    return [tuple(group) for group in groups]


def _status_text(status: DagsterRunStatus | None) -> str:
    return status.value if status else "none"


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


def _stored_row(dsn: str, partition: str, code: str) -> tuple | None:
    with psycopg.connect(dsn) as connection:
        return connection.execute(
            f"SELECT {ROW_COLUMNS} FROM {TABLE} WHERE partition_date = %s AND char_code = %s",
            (date.fromisoformat(partition), code)).fetchone()


def duplicated_keys(dsn: str) -> int:
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
