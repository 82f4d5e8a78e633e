"""The platform suite's faults of one run's own claim and settings on the production
deployment (the claim and the narrow error of issue 44):

* ``claim_cut``: run 1 holds its partition's claim, held inside its fetch at the stand-in; its
  claim connections alone are cut (``ss -K``, root) while the run storage stays up for everyone,
  and run 2 of the same partition is started (``dagster job execute``). Run 1 is, in turn, a run
  the daemon launched from the queue with its steps on Celery (the run worker's claim and the
  step's, both cut), and a ``dagster job execute`` run (its one claim cut). ``ss -K`` cuts the
  connections once and run 1's keepers connect again at once, so the scenario line says what
  run 1 did (``run 1 SUCCESS``: it took its claim again within the grace and run 2 waited for
  it; ``run 1 fenced``). A cut that lasts, so that the fence refuses run 1's writes, is
  ``framework/runs/test_fence_processes.py`` (a relay cut off). Judged: both runs end, neither
  fails but as the fence says (run 1 refused for its lost claim), each loads the partition at
  most once and never while the other could write it (a run that wrote after the cut ended
  before run 2 loaded), the partition exact, no key twice, nothing left unfinished.
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

from mostovik_pipelines.framework.runs.tags import PARTITION_TAG
from mostovik_pipelines.instance_storage import DEFAULT_OUTAGE_SECONDS
from mostovik_pipelines_tests.chaos.scenarios import (
    CODES,
    _partition_state,
    duplicated_keys,
    random_rate,
)
from mostovik_pipelines_tests.support.postgres import cut_claim_connections
from mostovik_pipelines_tests.support.processes import DAGSTER
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until

CLAIM_KINDS = ("claim_cut", "wrong_setting")
SCENARIO_TAG = "chaos/scenario"
JOB = "cbr_daily_rates_job"
RUN_LIMIT_SECONDS = 600
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
    how = "ss -K" if kind == "claim_cut" else rng.choice(sorted(WRONG_SETTINGS))
    queued = kind == "claim_cut" and suite.totals.faults[kind] % 2 == 0
    outcome = {}
    try:
        if kind == "claim_cut":
            for code in rng.sample(CODES, rng.randint(0, 3)):
                suite.chaos.standin.change_cbr_rates(partition,
                                                     set_values={code: random_rate(rng)})
            problems, runs = _claim_cut(suite, partition, tag, queued, outcome)
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
    notes = [kind, how, "queued, on Celery" if queued else "job execute",
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


def _claim_cut(suite, partition: str, tag: str, queued: bool,
               outcome: dict[str, object]) -> tuple[list[str], int]:
    """Run 1 held in its fetch, its run claim cut, run 2 started. ``queued``: run 1 is launched
    by the daemon from the queue, its steps on Celery (then both its run worker and its step
    hold the claim, and both are cut: a holder's host cut off); else by ``dagster job
    execute`` in process (one claim)."""
    standin = suite.chaos.standin
    day = date.fromisoformat(partition)
    match = f"date_req={day:%d/%m/%Y}"
    standin.fault("hang", seconds=RUN_LIMIT_SECONDS, match=match)
    first = None if queued else _start(suite, partition, tag)
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
        run_storage = suite.platform.run_storage
        with psycopg.connect(run_storage.dsn("dagster_platform"), autocommit=True) as observer:
            # Its run claim, not its driver claim: the partition's guard is what is cut off.
            cut = cut_claim_connections(observer, run_storage.port, run_1.run_id)
        cut_at = datetime.now(UTC).timestamp()
        outcome["cut"] = len(cut)
        holders = (1, 2) if queued else (1,)
        if len(cut) not in holders:
            problems.append(f"{len(cut)} claim connections cut, not run 1's {holders}")
        second = _start(suite, partition, tag)
        with suite.platform.instance() as instance:
            wait_until(lambda: len(instance.get_runs(RunsFilter(tags={SCENARIO_TAG: tag}))) == 2,
                       PROCESS_START_MARGIN_SECONDS, "run 2 recorded")
        standin.release_hangs()  # run 1's fetch answered once run 2 is on its way
        outputs = [_ended(suite, run_1.run_id) if queued else first.communicate(
            timeout=RUN_LIMIT_SECONDS)[0], second.communicate(timeout=RUN_LIMIT_SECONDS)[0]]
    finally:
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
    if unfinished:
        suite.totals.left_unfinished += len(unfinished)
        problems.append(f"runs left unfinished: {unfinished}")
    return [*problems, *_data_problems(suite, partition)], 2


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
    before = _partition_state(dsn, partition)
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
    if _partition_state(dsn, partition) != before:
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
