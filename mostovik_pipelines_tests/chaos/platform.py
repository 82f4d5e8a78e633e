"""Faults of the parts we stand on, at random, under the production deployment (ADR-011's
infrastructure faults).

The deployment is the runbook's production layout, on this machine (:mod:`.platform_deployment`):
one code server, the webserver and the daemon over deploy/workspace.yaml on an orchestrating
host, two Celery worker hosts, deploy/dagster.yaml on a PostgreSQL server of its own, a
persistent password-protected Redis, the stores in S3 API buckets. A scenario launches partitions
of the CBR source as an operator does in the UI (a backfill, which is one ranged run, or a run
per partition through the run queue), after a random change of some of their rates, and while
its runs are queued or running brings one part down for a random outage:

* ``warehouse``: the warehouse server stops as in a crash (``pg_ctl -m immediate``), then comes
  back on its data;
* ``run_storage``: the same for the instance's PostgreSQL;
* ``broker``: Redis is killed (SIGKILL), then started again on its data. The suite's first
  broker outage, where the range allows, begins while its runs are queued and outlasts Celery's
  own reconnection (:data:`CELERY_GIVES_UP_SECONDS`), so a submission meets Celery giving up;
* ``daemon``: dagster-daemon is killed (SIGKILL), then started again. A run it was launching
  as it died can stay "starting" with no process: Dagster's run monitoring fails it after
  ``start_timeout_seconds`` (deploy/dagster.yaml, 300 s), and its one retry must succeed;
* ``host``: the orchestrating host lost (the daemon, the code server and its run workers) while
  a step is held on a worker (:mod:`.platform_host`); the dead run must be marked failed while
  that step goes on, and its one retry succeed;
* ``code_server``, ``deploy``, ``worker_host``, ``object_store``, ``object_store_past_budget``:
  the production layout's own parts (:mod:`.platform_layout`);
* ``run_storage_past_budget``: the run storage away longer than a run rides out, under a run's
  step let go from its fetch (:mod:`.platform_budget`, ``make chaos`` only): the run gives up
  naming the setting, is marked dead once the database is back, and its one retry succeeds;
* ``claim_cut`` and ``wrong_setting``: one ``dagster job execute`` run's claim connection cut
  while a second run of its partition starts (only as root, for ``ss -K``), or a run started
  with a wrong run storage setting (:mod:`.platform_claims`, which judges them).

Scenarios take the kinds in turn, in a seeded order, so a short run has each. A webserver or
daemon found exited is started again 5 s later, as deploy/systemd does; the summary counts it.

Every fault is one the deployment promises to ride out without an operator, so the judge asks
for all of it: every run of the scenario succeeded (after a lost daemon or host: but a dead run,
or one that never started, whose one retry did), each partition was materialised once, no run
is left unfinished, the webserver answers and every daemon is healthy again, every partition
equals a clean run of the source's current rates, no key is held twice; at the end, every
backfill is marked completed.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml
from dagster import DagsterEventType

from mostovik_pipelines.core.outages import Store, setting_of
from mostovik_pipelines.core.tags import PARTITION_TAG, RANGE_END_TAG, RANGE_START_TAG
from mostovik_pipelines_tests.chaos.environment import JOB, ChaosEnvironment, date_range
from mostovik_pipelines_tests.chaos.parser_judge import duplicated_keys
from mostovik_pipelines_tests.chaos.parser_source import CODES, partition_pool, random_rate
from mostovik_pipelines_tests.chaos.platform_budget import (
    PAST_BUDGET,
    gave_up_problems,
    log_sizes,
    past_budget_outage_seconds,
    storage_away_past_budget,
)
from mostovik_pipelines_tests.chaos.platform_claims import CLAIM_KINDS, SCENARIO_TAG, claim_scenario
from mostovik_pipelines_tests.chaos.platform_deployment import PlatformEnvironment
from mostovik_pipelines_tests.chaos.platform_host import HOST, hold_fetch, lose_host
from mostovik_pipelines_tests.chaos.platform_layout import (
    CODE_SERVER,
    DEPLOY,
    FAULT_LENGTHS,
    HELD_KINDS,
    LAYOUT_KINDS,
    LONG_LAYOUT_KINDS,
    OBJECT_STORE,
    STORE_PAST_BUDGET,
    layout_fault,
    store_outage_manner,
)
from mostovik_pipelines_tests.chaos.platform_totals import (
    PlatformTotals,
    platform_faults,
    platform_findings,
    platform_summary,
)
from mostovik_pipelines_tests.chaos.scenarios import ChaosSuite
from mostovik_pipelines_tests.chaos.tally import Tally, tallied
from mostovik_pipelines_tests.support.graphql import (
    BACKFILL_LIMIT_SECONDS,
    TERMINAL_BACKFILL_STATUSES,
    TERMINAL_RUN_STATUSES,
    GraphQLError,
    RunInfo,
)
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS
from mostovik_pipelines_tests.support.webserver import SUPERVISOR_RESTART_SECONDS

KINDS = ("warehouse", "run_storage", "broker", "daemon", HOST, *CLAIM_KINDS,
         PAST_BUDGET, *LAYOUT_KINDS)
LONG_KINDS = (PAST_BUDGET, *LONG_LAYOUT_KINDS)
"""Kinds whose fault outlasts the outage budget (over a minute and a half) or takes minutes to
judge: ``make chaos``'s, not ``make test``'s fixed-seed run."""
MAY_DIE = (HOST, "daemon", PAST_BUDGET, *HELD_KINDS)
"""Kinds after which a run may be dead (or failed past a budget), ridden out by its one
retry."""
ASSET = "cbr_daily_rates"
REPO = Path(__file__).resolve().parents[2]
UNFINISHED = ["QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING"]
RUNS_LIMIT_SECONDS = BACKFILL_LIMIT_SECONDS + 2 * PROCESS_START_MARGIN_SECONDS
START_TIMEOUT_SECONDS = float(yaml.safe_load((REPO / "deploy" / "dagster.yaml").read_text())[
    "run_monitoring"]["start_timeout_seconds"])
"""How long a launched run may stay "starting" before run monitoring fails it (the deployment's
setting): after a lost daemon the judge waits this much longer, for such a run and its retry."""
BOUND_SECONDS = 60.0
"""The outage the deployment promises to ride out: each store's first outage lasts this long
when the range reaches it (later ones are drawn from the range)."""
BOUNDED_KINDS = ("warehouse", "run_storage", "broker", OBJECT_STORE)
OUTAGE_SECONDS = (3.0, BOUND_SECONDS)
CELERY_GIVES_UP_SECONDS = 25.0
"""Past this, a step submitted while Redis is away meets Celery's result consumer giving up its
reconnection (20 retries about a second apart, from a run process started a few seconds into
the outage)."""


class PlatformSuite:
    def __init__(self, platform: PlatformEnvironment, seed: int,
                 outage_seconds: tuple[float, float] = OUTAGE_SECONDS, log=print,
                 long_faults: bool = True, kinds: tuple[str, ...] | None = None) -> None:
        self.platform = platform
        unknown = set(kinds or ()) - set(KINDS)
        assert not unknown, f"no such platform kinds: {sorted(unknown)}; the kinds: {KINDS}"
        self.kinds = tuple(
            kind for kind in KINDS if (kind != "claim_cut" or os.geteuid() == 0)  # ss -K needs root
            and (long_faults or kind not in LONG_KINDS) and (kinds is None or kind in kinds))
        self.chaos = platform.chaos
        self.seed = seed
        self.outage_seconds = outage_seconds
        self.log = log
        self.totals = PlatformTotals()
        self.judge = ChaosSuite(self.chaos, seed, log=log)
        self.pool = partition_pool(self.judge.today, 12)
        self.backfills: list[str] = []
        self.graphql = platform.services.graphql

    def run(self, scenarios: int) -> PlatformTotals:
        kinds: list[str] = []
        for number in range(1, scenarios + 1):
            if not kinds:
                kinds = random.Random(f"{self.seed}:kinds:{number}").sample(
                    self.kinds, len(self.kinds))
            self.scenario(number, kinds.pop(0))
        self._check_backfills_completed()
        return self.totals

    def scenario(self, number: int, kind: str) -> None:
        if kind in CLAIM_KINDS:
            return claim_scenario(self, number, kind)
        rng = random.Random(f"{self.seed}:platform:{number}")
        started = time.monotonic()
        backfill = kind == DEPLOY or (kind not in (STORE_PAST_BUDGET, CODE_SERVER)
                                      and rng.random() < 0.5)
        if backfill:
            first = rng.randrange(len(self.pool) - 1)
            days = sorted(self.pool[first:first + rng.randint(1, 2)])
            partitions = date_range(days[0], days[-1])
        else:
            days = partitions = tuple(sorted(rng.sample(
                self.pool, rng.randint(2 if kind == CODE_SERVER else 1, 3))))
        for day in rng.sample(days, rng.randint(0, len(days))):
            self.chaos.standin.change_cbr_rates(day, set_values={
                code: random_rate(rng) for code in rng.sample(CODES, rng.randint(1, 3))})
        outage = rng.uniform(*self.outage_seconds)
        held_kind = kind in (HOST, PAST_BUDGET, *HELD_KINDS)
        point = ("fetching" if held_kind
                 else "running" if kind == DEPLOY else rng.choice(("queued", "running")))
        if kind == PAST_BUDGET:
            outage = past_budget_outage_seconds()
        if (kind == "broker" and not self.totals.faults[kind]
                and self.outage_seconds[1] > CELERY_GIVES_UP_SECONDS):
            outage = rng.uniform(CELERY_GIVES_UP_SECONDS, self.outage_seconds[1])
            point = "queued"
        if (kind in BOUNDED_KINDS and not self.totals.faults[kind]
                and self.outage_seconds[1] >= BOUND_SECONDS):
            outage = BOUND_SECONDS  # the promise, to the letter, once per store
        if kind == OBJECT_STORE and not self.totals.faults[kind]:
            outage = BOUND_SECONDS  # make test's short range too: its one 60 s of the store
        manner = store_outage_manner(self, number) if kind == OBJECT_STORE else ""
        length = FAULT_LENGTHS.get(kind) or f"{outage:.0f}s"
        notes = [kind + (f"({manner})" if manner else ""), f"{length}@{point}",
                 "backfill" if backfill else "runs",
                 f"{partitions[0]}..{partitions[-1]}({len(partitions)})"]

        tag = {SCENARIO_TAG: f"{self.seed}:{number}"}
        held = hold_fetch(self, partitions) if held_kind else None
        dead_before, logs_before = self.totals.dead_runs_retried, log_sizes(self)
        if backfill:
            self.backfills.append(self.graphql.launch_partition_backfill([ASSET], partitions,
                                                                         tags=tag))
        else:
            # The code server's kill: the later runs are queued as it dies (layout_fault).
            for partition in partitions[:1] if kind == CODE_SERVER else partitions:
                self.graphql.launch_job_run(JOB, partition, tags=tag)
        self.totals.launches["backfill" if backfill else "runs"] += 1
        if point == "running":
            self._wait_for(lambda: self.runs_tagged(tag, started=True), what="a started run")
            time.sleep(rng.uniform(0, 3))
        problems = (lose_host(self, outage, tag, held) if kind == HOST
                    else storage_away_past_budget(self, tag, held) if kind == PAST_BUDGET
                    else layout_fault(self, kind, outage, tag, held, manner, partitions[1:])
                    if kind in LAYOUT_KINDS else self._inject(kind, outage, tag))
        self.totals.faults[kind] += 1
        self.totals.points[point] += 1
        if kind not in FAULT_LENGTHS:
            self.totals.longest_outage[kind] = max(outage,
                                                   self.totals.longest_outage.get(kind, 0))

        problems += self._judge(tag, partitions, expected_runs=None if backfill else len(days),
                                backfill_id=self.backfills[-1] if backfill else None,
                                runs_may_die=kind in MAY_DIE)
        if kind == PAST_BUDGET:
            problems += gave_up_problems(self, dead_before, logs_before)
        self.totals.scenarios += 1
        self.totals.partitions += len(partitions)
        notes.append(f"{time.monotonic() - started:.0f}s")
        if problems:
            self.totals.failures.append(f"scenario {number} ({' '.join(notes)}): "
                                        + "; ".join(problems))
        self.log(f"  #{number:<4} {' '.join(notes)}{'  FAILED: ' if problems else ''}"
                 f"{'; '.join(problems)}")

    # --- faults -------------------------------------------------------------------------------

    def _inject(self, kind: str, outage: float, tag: dict[str, str]) -> list[str]:
        platform = self.platform
        down, up = {
            "warehouse": (self.chaos.postgres.pause, self.chaos.postgres.resume),
            "run_storage": (platform.run_storage.pause, platform.run_storage.resume),
            "broker": (platform.redis.crash, platform.redis.start),
            "daemon": (platform.services.kill_daemon, platform.services.start_daemon),
        }[kind]
        down()
        time.sleep(outage)
        up()
        return []

    # --- the judge ----------------------------------------------------------------------------

    def _judge(self, tag: dict[str, str], partitions: tuple[str, ...],
               expected_runs: int | None, backfill_id: str | None,
               runs_may_die: bool = False) -> list[str]:
        """What went wrong in the scenario's runs. After a lost daemon or host, or the run
        storage away past the budget (``runs_may_die``), a run marked dead, or one that never
        started (failed by run monitoring's start timeout), is ridden out if the daemon retried
        it once and the retry succeeded; each partition is
        then materialised at least once and by no run twice (the dead run may have loaded some
        before it died, its retry loads them again, idempotently)."""
        problems: list[str] = []

        def finished() -> list[RunInfo] | None:
            if backfill_id is not None:
                self._backfill_not_given_up(backfill_id)
            runs = self._all_finished(tag, partitions, expected_runs)
            return None if runs and runs_may_die and _awaiting_retry(runs) else runs

        try:
            runs = self._wait_for(finished, what="the scenario's runs finished", limit=(
                RUNS_LIMIT_SECONDS + (START_TIMEOUT_SECONDS if runs_may_die else 0)))
        except AssertionError as error:
            return [str(error)[:3000]]
        self.totals.runs += len(runs)
        retries = Counter(run.parent_run_id for run in runs if run.parent_run_id)
        succeeded = {run.parent_run_id for run in runs
                     if run.parent_run_id and run.status == "SUCCESS"}
        for run in runs:
            if (runs_may_die and run.status == "FAILURE" and retries[run.run_id] == 1
                    and run.run_id in succeeded):
                errors = str(self._quietly(self.graphql.run_errors, run.run_id))
                if "to start" in errors:
                    self.totals.stuck_launches_retried += 1
                elif setting_of(Store.OBJECT_STORE) in errors:
                    self.totals.past_store_budget_retried += 1
                else:
                    self.totals.dead_runs_retried += 1
            elif run.status != "SUCCESS":
                self.totals.failed_runs += 1
                problems.append(f"run {run.run_id} {run.status}: "
                                f"{self._quietly(self.graphql.run_errors, run.run_id)}")
        per_run = self._materialisations(runs)
        counts = sum(per_run.values(), Counter())
        wrong = {p: counts.get(p, 0) for p in partitions if counts.get(p, 0) != 1 and not (
            runs_may_die and counts.get(p, 0) >= 1 and all(c[p] <= 1 for c in per_run.values()))}
        if wrong:
            self.totals.not_once += len(wrong)
            problems.append(f"materialised other than once: {wrong}")
        try:
            self.platform.services.wait_healthy(PROCESS_START_MARGIN_SECONDS)
            unfinished = self.graphql.runs({"statuses": UNFINISHED})
        except (AssertionError, httpx.HTTPError) as error:
            return [*problems, f"the webserver or the daemon did not recover: {error}"[:3000]]
        if unfinished:
            self.totals.left_unfinished += len(unfinished)
            problems.append(f"runs left unfinished: {[run.run_id for run in unfinished]}")
        differences = self.judge.compare(partitions)
        self.totals.differences += len(differences)
        problems += differences
        duplicates = duplicated_keys(self.chaos.postgres.dsn(self.chaos.database))
        if duplicates:
            self.totals.duplicates += duplicates
            problems.append(f"{duplicates} duplicated keys")
        return problems

    def _check_backfills_completed(self) -> None:
        for backfill_id in self.backfills:
            try:
                info = self.graphql.wait_for_backfill(backfill_id)
            except AssertionError as error:
                self.totals.failures.append(f"backfill {backfill_id}: {error}"[:3000])
                continue
            if info.status != "COMPLETED_SUCCESS":
                self.totals.failures.append(f"backfill {backfill_id} {info.status}: {info.error}")

    # --- reading the deployment ---------------------------------------------------------------

    def _wait_for(self, check, what: str, limit: float = RUNS_LIMIT_SECONDS):
        """``check``'s first truthy result, through outages of the webserver; a webserver or
        daemon that exited meanwhile is started again, as its supervisor does."""
        deadline = time.monotonic() + limit
        while True:
            for name in self.platform.revive(SUPERVISOR_RESTART_SECONDS):
                self.totals.revived[name] += 1
                self.log(f"    {name} had exited: started again")
            result = self._quietly(check)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not after {limit:.0f} s\n"
                                     f"{self.platform.services.log_tails()}")
            time.sleep(0.5)

    @staticmethod
    def _quietly(call, *args):
        """``call(*args)``, or None while the webserver is away or answers with an error."""
        try:
            return call(*args)
        except (GraphQLError, httpx.HTTPError):
            return None

    def runs_tagged(self, tag: dict[str, str], started: bool = False) -> list[RunInfo]:
        runs = self.graphql.runs({"tags": [{"key": k, "value": v} for k, v in tag.items()]})
        return [run for run in runs if run.status == "STARTED"] if started else runs

    def _all_finished(self, tag: dict[str, str], partitions: tuple[str, ...],
                      expected_runs: int | None) -> list[RunInfo] | None:
        """The scenario's runs once all are finished and, but for a failed one, cover its
        partitions (a backfill launches its run on a later pass of its daemon)."""
        runs = self.runs_tagged(tag)
        if not runs or any(run.status not in TERMINAL_RUN_STATUSES for run in runs):
            return None
        covered = {day for run in runs for day in _partitions_of(run)}
        failed = any(run.status != "SUCCESS" for run in runs)
        if expected_runs is not None and len(runs) < expected_runs:
            return None
        return runs if failed or covered >= set(partitions) else None

    def _backfill_not_given_up(self, backfill_id: str) -> None:
        """Raises if the daemon ended the backfill other than by completing it (its runs would
        never come: the judge reports it at once instead of waiting out its limit)."""
        info = self.graphql.backfill_status(backfill_id)
        if info.status in TERMINAL_BACKFILL_STATUSES and info.status != "COMPLETED_SUCCESS":
            raise AssertionError(f"backfill {backfill_id} {info.status}: {info.error}"[:3000])

    def _materialisations(self, runs: list[RunInfo]) -> dict[str, Counter]:
        """Per run, how many times it materialised each partition."""
        counts: dict[str, Counter] = {}
        with self.platform.instance() as instance:
            for run in runs:
                counts[run.run_id] = Counter(
                    record.event_log_entry.dagster_event.partition
                    for record in instance.get_records_for_run(
                        run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION,
                        limit=1000).records)
        return counts


def _awaiting_retry(runs: list[RunInfo]) -> bool:
    """A first run failed whose retry (the daemon's, once) is not among the runs yet."""
    retried = {run.parent_run_id for run in runs}
    return any(run.status == "FAILURE" and run.parent_run_id is None
               and run.run_id not in retried for run in runs)


def _partitions_of(run: RunInfo) -> tuple[str, ...]:
    if PARTITION_TAG in run.tags:
        return (run.tags[PARTITION_TAG],)
    if RANGE_START_TAG in run.tags:
        return date_range(run.tags[RANGE_START_TAG], run.tags[RANGE_END_TAG])
    return ()


def run_platform_chaos(postgres: ThrowawayPostgres | None, standin_server, seed: int,
                       scenarios: int, outage_seconds: tuple[float, float] = OUTAGE_SECONDS,
                       template: str | None = None, log=print,
                       tally: Tally | None = None, long_faults: bool = True,
                       kinds: tuple[str, ...] | None = None) -> PlatformTotals:
    """Start the deployment, run ``scenarios`` scenarios, print the summary (and, per scenario
    and fault, ``tally`` them); without ``long_faults``, none of :data:`LONG_KINDS`; with
    ``kinds``, only those."""
    started = time.monotonic()
    chaos = ChaosEnvironment(postgres=postgres, standin_server=standin_server, template=template)
    try:
        platform = PlatformEnvironment(chaos)
        try:
            log(f"platform chaos: seed {seed}, {scenarios} scenarios; deployment up in "
                f"{time.monotonic() - started:.0f} s")
            suite = PlatformSuite(platform, seed, outage_seconds, log=log,
                                  long_faults=long_faults, kinds=kinds)
            if tally is not None:
                tallied(suite, "platform", tally, platform_faults, platform_findings)
            totals = suite.run(scenarios)
            if tally is not None:
                found = platform_findings(totals)
                found["unsettled"] += sum(f.startswith("backfill ") for f in totals.failures)
                tally.settle("platform", "backfill not completed", **found)
        finally:
            platform.close()
    finally:
        chaos.standin.clear_faults()
        chaos.standin.reset_cbr_rates()
        chaos.close()
    log(platform_summary(totals, seed, time.monotonic() - started))
    return totals
