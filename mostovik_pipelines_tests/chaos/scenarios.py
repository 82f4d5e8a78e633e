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

The source's changes and faults are drawn in :mod:`.parser_source`, the kills and warehouse
crashes in :mod:`.parser_kills`, the judge is :mod:`.parser_judge` and the counts
:mod:`.parser_totals`; this module runs the scenarios and settles their partitions.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta

from dagster import DagsterRunStatus

from mostovik_pipelines.sources.cbr_daily_rates.standin import MOSCOW
from mostovik_pipelines_tests.chaos.environment import (
    ChaosEnvironment,
    date_range,
)
from mostovik_pipelines_tests.chaos.harness import (
    FINISHED,
    LEFT_STARTED_SHARE,
    RunHandle,
    status_text,
)
from mostovik_pipelines_tests.chaos.parser_judge import ParserJudge, consecutive
from mostovik_pipelines_tests.chaos.parser_kills import (
    CRASH_POINTS,
    KILL_POINTS,
    RUN_KILL_POINTS,
    WAREHOUSE_CRASH_SHARE,
    ParserKills,
)
from mostovik_pipelines_tests.chaos.parser_source import (
    RANGE_FAULTS,
    SourceChanges,
    SourceModel,
    fault_match,
    partition_pool,
)
from mostovik_pipelines_tests.chaos.parser_totals import Totals

SETTLE_ATTEMPTS = 6
RANGED_SHARE = 0.15
REEXECUTION_SHARE = 0.3



class ChaosSuite(SourceChanges, ParserKills, ParserJudge):
    """The scenarios of the CBR source against one :class:`ChaosEnvironment`."""

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
                self.env.standin.fault("status", status=404, times=-1, match=fault_match(day))
            else:
                self.env.standin.fault(kind, times=-1, match=fault_match(day))
            self.totals.faults[kind] += 1
            notes.append(f"{kind}@{day}")
        if rng.random() < 0.3:
            self.env.standin.fault("status", status=503, retry_after=0,
                                   match=fault_match(rng.choice(scope)))
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
        notes.append(status_text(status))
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
            self.env.standin.fault("hang", match=fault_match(partition), seconds=3)
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
        notes.append("/".join(status_text(s) for s in statuses))
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
                     f"{' kill@' + kill_point if killed else ''}]:{status_text(status)}")
        if not killed and status != DagsterRunStatus.SUCCESS:
            # Against a healthy source nothing but a defect fails a re-execution.
            self._fail(f"re-execution ({kind}) of {run_id} ended {status_text(status)}; "
                       f"see {handle.log_path}")
        return status == DagsterRunStatus.SUCCESS


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
        for scope in consecutive(due):
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


    def _fail(self, message: str, error: bool = True) -> None:
        self.totals.errors += error
        self.totals.failures.append(message)
        self.log(f"  FAILURE: {message}")
