"""The platform suite's faults of one run's own claim and settings on the production
deployment (the claim and the narrow error of issue 44):

* ``claim_cut``: run 1 holds its partition's claim, held inside its fetch at the stand-in, and
  is cut off from it while the run storage stays up for everyone; run 2 of the same partition is
  started (``dagster job execute``). In turn (:data:`CUT_MODES`): a run the daemon launched from
  the queue, its steps on Celery, its claim connections (the run worker's and the step's) cut
  once with ``ss -K`` (root); a ``dagster job execute`` run whose every route to the run storage
  (a relay) stays cut until run 2 has loaded; a ``dagster job execute`` run cut once. Cut once,
  run 1's keepers connect again at once, and it goes on while run 2 waits (the line says
  ``run 1 SUCCESS``); cut for good, run 2 takes over and the fence must stop run 1 (``run 1
  fenced``: it fails naming its lost claim and no stored row is its). Judged: both runs end,
  neither fails but as the fence says, each loads the partition at most once and never while
  the other could write it (a run that wrote after the cut ended before run 2 loaded), the
  partition exact, no key twice, nothing left unfinished.
* ``wrong_setting``: a run started with one run storage setting wrong (the password, or the
  database name). Judged: it exits failed well inside the outage budget (it did not wait as for
  a database away), its output names the setting's variable, nothing of its partition changed,
  no run of it left unfinished.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from datetime import UTC, date, datetime

import psycopg
from dagster import DagsterEventType, DagsterRunStatus, RunsFilter

from mostovik_pipelines.core.tags import PARTITION_TAG
from mostovik_pipelines.platform.instance_storage import DEFAULT_OUTAGE_SECONDS
from mostovik_pipelines_tests.chaos.parser_judge import duplicated_keys, partition_state
from mostovik_pipelines_tests.chaos.parser_source import CODES, random_rate
from mostovik_pipelines_tests.support.postgres import PartitionableLink, cut_claim_connections
from mostovik_pipelines_tests.support.processes import DAGSTER
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until

CLAIM_KINDS = ("claim_cut", "wrong_setting")
SCENARIO_TAG = "chaos/scenario"
JOB = "cbr_daily_rates_job"
RUN_LIMIT_SECONDS = 600
QUEUED_CUT = "ss -K, queued on Celery"
LASTING_CUT = "relay cut, job execute"
CUT_MODES = (QUEUED_CUT, LASTING_CUT, "ss -K, job execute")
"""How ``claim_cut`` cuts run 1 off, in turn: the first of a suite (the one of ``make test``'s
fixed-seed run) a daemon-launched run's connections cut once, then a lasting cut."""
QUEUED_START_SECONDS = 120
"""From the queue to a step inside its fetch: the daemon's pass, a run worker, a Celery task."""
WRONG_SETTINGS = {"MOSTOVIK_DAGSTER_PG_PASSWORD": "not-the-password",
                  "MOSTOVIK_DAGSTER_PG_DB": "no_such_database"}
CLAIM_LOST = "claim"
"""In the failure of a run the fence stopped (``RunClaimLost`` names the lost claim)."""


def claim_scenario(suite, number: int, kind: str) -> None:
    """One scenario of ``kind`` (of :data:`CLAIM_KINDS`) in ``suite`` (a ``PlatformSuite``):
    counted in its totals as the other platform faults are."""
    rng = random.Random(f"{suite.seed}:platform:{number}")
    started = time.monotonic()
    partition = rng.choice(suite.pool)
    tag = f"{suite.seed}:{number}"
    mode = CUT_MODES[suite.totals.faults[kind] % len(CUT_MODES)] if kind == "claim_cut" else None
    how = mode or rng.choice(sorted(WRONG_SETTINGS))
    queued = mode == QUEUED_CUT
    outcome: dict[str, object] = {}
    try:
        if kind == "claim_cut":
            for code in rng.sample(CODES, rng.randint(0, 3)):
                suite.chaos.standin.change_cbr_rates(partition,
                                                     set_values={code: random_rate(rng)})
            problems, runs = _claim_cut(suite, partition, tag, mode, outcome)
        else:
            problems, runs = _wrong_setting(suite, partition, tag, how)
    except (AssertionError, subprocess.TimeoutExpired) as error:
        suite.totals.left_unfinished += 1
        problems, runs = [f"did not end: {error}"[:3000]], 0
    totals = suite.totals
    totals.faults[kind] += 1
    totals.points["running" if kind == "claim_cut" else "before"] += 1
    totals.launches["queued" if queued else "job execute"] += 1
    totals.scenarios += 1
    totals.partitions += 1
    totals.runs += runs
    notes = [kind, how,
             partition, *(f"{name} {value}" for name, value in outcome.items()),
             f"{time.monotonic() - started:.0f}s"]
    if problems:
        totals.failures.append(f"scenario {number} ({' '.join(notes)}): " + "; ".join(problems))
    suite.log(f"  #{number:<4} {' '.join(notes)}{'  FAILED: ' if problems else ''}"
              f"{'; '.join(problems)}")


def _start(suite, partition: str, tag: str, change: dict[str, str] | None = None):
    environment = {**suite.platform.services.environment, "MOSTOVIK_EXECUTOR": "in_process",
                   **(change or {})}
    return subprocess.Popen(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", JOB,
         "--tags", json.dumps({PARTITION_TAG: partition, SCENARIO_TAG: tag})],
        env=environment, cwd=suite.platform.root, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


def _claim_cut(suite, partition: str, tag: str, mode: str,
               outcome: dict[str, object]) -> tuple[list[str], int]:
    """Run 1 held in its fetch, cut off from its claim, run 2 started. :data:`QUEUED_CUT`: run
    1 is launched by the daemon from the queue, its steps on Celery (its run worker and its step
    hold the claim; both connections are cut once); else by ``dagster job execute`` in process
    (one claim): cut once, or (:data:`LASTING_CUT`) its every route to the run storage cut off
    until run 2 has loaded, when the fence must stop it."""
    standin = suite.chaos.standin
    day = date.fromisoformat(partition)
    match = f"date_req={day:%d/%m/%Y}"
    queued, lasting = mode == QUEUED_CUT, mode == LASTING_CUT
    standin.fault("hang", seconds=RUN_LIMIT_SECONDS, match=match)
    link = PartitionableLink(suite.platform.run_storage.port) if lasting else None
    first = None if queued else _start(
        suite, partition, tag, {"MOSTOVIK_DAGSTER_PG_PORT": str(link.port)} if link else None)
    if queued:
        suite.graphql.launch_job_run(JOB, partition, tags={SCENARIO_TAG: tag})
    second = None
    problems: list[str] = []
    try:
        wait_until(lambda: any(match in r["query"] for r in standin.hanging("cbr")),
                   QUEUED_START_SECONDS if queued else PROCESS_START_MARGIN_SECONDS,
                   "run 1 inside its fetch")
        with suite.platform.instance() as instance:
            [run_1] = instance.get_runs(RunsFilter(tags={SCENARIO_TAG: tag}))
        if link is not None:
            link.cut()
        else:
            run_storage = suite.platform.run_storage
            with psycopg.connect(run_storage.dsn("dagster_platform"),
                                 autocommit=True) as observer:
                # Its run claim, not its driver claim: the partition's guard is what is cut.
                cut = cut_claim_connections(observer, run_storage.port, run_1.run_id)
            outcome["cut"] = len(cut)
            holders = (1, 2) if queued else (1,)
            if len(cut) not in holders:
                problems.append(f"{len(cut)} claim connections cut, not run 1's {holders}")
        cut_at = datetime.now(UTC).timestamp()
        second = _start(suite, partition, tag)
        with suite.platform.instance() as instance:
            wait_until(lambda: len(instance.get_runs(RunsFilter(tags={SCENARIO_TAG: tag}))) == 2,
                       PROCESS_START_MARGIN_SECONDS, "run 2 recorded")
        if lasting:  # run 2 takes the partition over and loads it; then run 1 goes on
            outputs = [None, second.communicate(timeout=RUN_LIMIT_SECONDS)[0]]
            standin.release_hangs()
            link.heal()
            outputs[0] = first.communicate(timeout=RUN_LIMIT_SECONDS)[0]
        else:
            standin.release_hangs()  # run 1's fetch answered once run 2 is on its way
            outputs = [_ended(suite, run_1.run_id) if queued else first.communicate(
                timeout=RUN_LIMIT_SECONDS)[0], second.communicate(timeout=RUN_LIMIT_SECONDS)[0]]
    finally:
        if link is not None:
            link.cut()
        standin.clear_faults()
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    with suite.platform.instance() as instance:
        runs = sorted(instance.get_runs(RunsFilter(tags={SCENARIO_TAG: tag})),
                      key=lambda run: instance.get_run_record_by_id(run.run_id).create_timestamp)
        if len(runs) != 2:
            return [*problems, f"{len(runs)} runs recorded, not 2"], len(runs)
        loads = {run.run_id: [r.timestamp for r in instance.get_records_for_run(
            run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records]
            for run in runs}
        ends = {run.run_id: instance.get_run_record_by_id(run.run_id).end_time for run in runs}
        run_1, run_2 = runs
        if queued:
            outputs[0] = _failure_text(instance, run_1.run_id)
        outcome["run 1"] = ("fenced" if CLAIM_LOST in outputs[0].lower()
                            and run_1.status == DagsterRunStatus.FAILURE else run_1.status.value)
        for run, output in zip(runs, outputs, strict=True):
            if run.status == DagsterRunStatus.SUCCESS:
                continue
            if run is run_1 and CLAIM_LOST in output.lower() and not [
                    t for t in loads[run.run_id] if t > cut_at]:
                continue  # fenced: refused once its claim was gone, nothing written after
            suite.totals.failed_runs += 1
            problems.append(f"run {run.run_id} {run.status}: {output[-1500:]}")
        if any(len(found) > 1 for found in loads.values()):
            suite.totals.not_once += 1
            problems.append(f"loaded more than once by a run: {loads}")
        late = [t for t in loads[run_1.run_id] if t > cut_at]
        if late and loads[run_2.run_id] and min(loads[run_2.run_id]) < (ends[run_1.run_id] or 0):
            suite.totals.not_once += 1
            problems.append("run 2 loaded while run 1, which wrote after the cut, was live")
        unfinished = [run.run_id for run in runs if not run.is_finished]
    if lasting:
        writers = _writers(suite, partition)
        if outcome["run 1"] != "fenced" or run_1.run_id in writers:
            suite.totals.not_once += 1
            problems.append(f"run 1 cut off for good was not fenced: {outcome['run 1']}, "
                            f"rows by {sorted(writers)}")
    if unfinished:
        suite.totals.left_unfinished += len(unfinished)
        problems.append(f"runs left unfinished: {unfinished}")
    return [*problems, *_data_problems(suite, partition)], 2


def _writers(suite, partition: str) -> set[str]:
    """The runs that loaded or last changed the partition's stored rows."""
    with psycopg.connect(suite.chaos.postgres.dsn(suite.chaos.database)) as db:
        return {run for row in db.execute(
            "SELECT DISTINCT loaded_by_run, changed_by_run FROM cbr_daily_rates "
            "WHERE partition_date = %s", (partition,)) for run in row}


def _ended(suite, run_id: str) -> str:
    """Wait for the daemon-launched run 1 to end (its failure is read from its event log)."""
    with suite.platform.instance() as instance:
        wait_until(lambda: instance.get_run_by_id(run_id).is_finished, RUN_LIMIT_SECONDS,
                   "run 1 ended")
    return ""


def _failure_text(instance, run_id: str) -> str:
    """What a run's failures say: its failed steps' errors and its own."""
    texts = []
    for kind in (DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE):
        for record in instance.get_records_for_run(run_id, of_type=kind).records:
            event = record.event_log_entry.dagster_event
            error = getattr(event.event_specific_data, "error", None)
            texts.append(f"{event.message or ''} {error.to_string() if error else ''}")
    return "\n".join(texts)


def _wrong_setting(suite, partition: str, tag: str, setting: str) -> tuple[list[str], int]:
    dsn = suite.chaos.postgres.dsn(suite.chaos.database)
    before = partition_state(dsn, partition)
    started = time.monotonic()
    process = _start(suite, partition, tag, {setting: WRONG_SETTINGS[setting]})
    try:
        output = process.communicate(timeout=RUN_LIMIT_SECONDS)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    took = time.monotonic() - started
    problems = []
    if process.returncode == 0:
        problems.append("the run succeeded with a wrong setting")
    if took > DEFAULT_OUTAGE_SECONDS:
        problems.append(f"failed after {took:.0f} s, as if the database were away")
    if setting not in output:
        suite.totals.failed_runs += 1
        problems.append(f"the failure does not name {setting}: {output[-1500:]}")
    if partition_state(dsn, partition) != before:
        suite.totals.differences += 1
        problems.append(f"{partition} changed by a run that should not have started")
    with suite.platform.instance() as instance:
        runs = instance.get_runs(RunsFilter(tags={SCENARIO_TAG: tag}))
    unfinished = [run.run_id for run in runs if not run.is_finished]
    if unfinished:
        suite.totals.left_unfinished += len(unfinished)
        problems.append(f"runs left unfinished: {unfinished}")
    return problems, len(runs)


def _data_problems(suite, partition: str) -> list[str]:
    differences = suite.judge.compare([partition])
    suite.totals.differences += len(differences)
    duplicates = duplicated_keys(suite.chaos.postgres.dsn(suite.chaos.database))
    suite.totals.duplicates += duplicates
    return [*differences, *([f"{duplicates} duplicated keys"] if duplicates else [])]
