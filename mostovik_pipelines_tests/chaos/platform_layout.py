"""The platform suite's faults of the production layout itself (:mod:`..support.production_layout`):
the one code server, a deploy, a worker host and the object store.

* ``code_server``: while a run's step is held in its fetch on a Celery worker, the scenario's
  other runs are launched (the run queue takes them up at once) and the code server dies
  (SIGKILL) with every process of its unit, the held run's orchestrating process among them; it
  is started again 5 s later, as its unit's ``Restart=on-failure`` does. The held run is dead: the
  dead-run sensor marks it failed while its step still runs, and the daemon's run retries take
  it up once; the runs the queue met the restart with wait in the queue for the code server.
* ``deploy``: during a backfill's run, the next release is deployed as deploy/README says (the
  code location reloaded over GraphQL, the workers restarted, each draining its step first).
  Nothing may fail: the run in flight finishes on its code, the next runs use the new one.
* ``worker_host``: while a run's step is held on a worker, that worker's host is lost with its
  local disk; a replacement host with a new name is started. The executor's worker watch fails
  the step (``MOSTOVIK_CELERY_WORKER_LOST_SECONDS``), and the daemon's run retries take the run
  up once.
* ``object_store``: the S3 API store away under the scenario's runs (the first time exactly
  60 s with its port closed, then 3-60 s refusing, throttling with ``503 SlowDown``, not
  answering, or cutting answers mid-body): every run rides it out.
* ``object_store_past_budget``: the store refusing connections, while a run's step is let go from
  its fetch to land its payload, until that run has failed: it must fail cleanly, naming
  ``MOSTOVIK_OBJECT_STORE_OUTAGE_SECONDS``; then the store is back, and one re-execution from
  failure (the run page's, as an operator or the catch-up asks again) loads the data exactly.

Judged by the suite's judge; a run of the first four kinds that died (or failed past the budget)
is ridden out when its one retry succeeded (:meth:`.PlatformSuite._judge`).
"""

from __future__ import annotations

import random
import time

from dagster import DagsterEventType, RunsFilter

from mostovik_pipelines.core.outages import Store, setting_of
from mostovik_pipelines.core.retries import RETRY_METADATA_KEY
from mostovik_pipelines.framework.runs.dead_runs import INTERVAL_SECONDS
from mostovik_pipelines_tests.chaos.environment import JOB
from mostovik_pipelines_tests.support.deployments import step_workers
from mostovik_pipelines_tests.support.object_store_front import OUTAGES, REFUSING
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    limit_for,
    wait_for_hanging_request,
    wait_until,
)
from mostovik_pipelines_tests.support.webserver import SUPERVISOR_RESTART_SECONDS

CODE_SERVER = "code_server"
DEPLOY = "deploy"
WORKER_HOST = "worker_host"
OBJECT_STORE = "object_store"
STORE_PAST_BUDGET = "object_store_past_budget"
LAYOUT_KINDS = (CODE_SERVER, DEPLOY, WORKER_HOST, OBJECT_STORE, STORE_PAST_BUDGET)
HELD_KINDS = (CODE_SERVER, WORKER_HOST, STORE_PAST_BUDGET)
"""Kinds that strike while a step is held in its fetch at the stand-in."""
LONG_LAYOUT_KINDS = (CODE_SERVER, DEPLOY, WORKER_HOST, STORE_PAST_BUDGET)
"""Kinds of ``make chaos`` only (each takes minutes: a worker watch, a dead run and its retry,
a deploy, an outage past the budget); ``make test`` has the object store's 60 s."""
FAULT_LENGTHS = {CODE_SERVER: "restarted-5s", DEPLOY: "release",
                 WORKER_HOST: "lost", STORE_PAST_BUDGET: "until-given-up"}
"""A scenario line's length of the faults whose length is not a drawn outage."""
WORKER_LOST_SECONDS = 60.0
"""The executor's worker watch (deploy's ``MOSTOVIK_CELERY_WORKER_LOST_SECONDS``)."""
PAST_BUDGET_LIMIT_SECONDS = 900.0
"""How long the store stays away at most waiting for the run to give up."""


def store_outage_manner(suite, number: int) -> str:
    """How the store is away: its first outage with its port closed, then any of
    :data:`~.object_store_front.OUTAGES`."""
    if not suite.totals.faults[OBJECT_STORE]:
        return REFUSING
    return random.Random(f"{suite.seed}:store:{number}").choice(OUTAGES)


def layout_fault(suite, kind: str, outage: float, tag: dict[str, str], held: str | None,
                 manner: str, later: tuple[str, ...] = ()) -> list[str]:
    """Bring ``kind`` about under the scenario's runs; what went wrong before the judge looks.
    ``later``: partitions whose runs are launched just before the code server dies (queued as
    it restarts)."""
    platform = suite.platform
    if kind == DEPLOY:
        release = platform.layout.deploy()
        suite.log(f"    deployed release {release} (location reloaded, workers restarted)")
        return []
    if kind == OBJECT_STORE:
        before = dict(platform.store.requests)
        platform.store.set(manner)
        time.sleep(outage)
        platform.store.up()
        met = platform.store.requests.get(manner, 0) > before.get(manner, 0) or bool(
            _store_outage_retries(suite, tag))
        suite.totals.store_outages_met += met
        return []
    standin = suite.chaos.standin
    try:
        wait_for_hanging_request(standin, held)
        if kind == CODE_SERVER:
            for partition in later:
                suite.graphql.launch_job_run(JOB, partition, tags=tag)
            platform.layout.kill_code_server()
            time.sleep(SUPERVISOR_RESTART_SECONDS)
            platform.layout.start_code_server()
            return _wait_for_failed_run(suite, tag, limit_for(INTERVAL_SECONDS, ticks=2)
                                        + PROCESS_START_MARGIN_SECONDS,
                                        "the dead run marked failed while its step runs")
        if kind == WORKER_HOST:
            name = _worker_of_held_step(suite, tag)
            replacement = platform.layout.lose_worker_host(name)
            suite.log(f"    {name} lost with its disk; {replacement} started in its place")
            return _wait_for_failed_run(suite, tag, WORKER_LOST_SECONDS
                                        + PROCESS_START_MARGIN_SECONDS,
                                        "the run of the lost worker failed")
        return _store_away_until_a_run_gave_up(suite, tag)
    finally:
        standin.clear_faults()
        standin.release_hangs()


def _store_outage_retries(suite, tag: dict[str, str]) -> list[dict]:
    """The waits on the object store the scenario's runs recorded."""
    with suite.platform.instance() as instance:
        return [retry for run in instance.get_runs(RunsFilter(tags=tag))
                for retry in outage_retries(instance, run.run_id)
                if retry["kind"] == "object_store_unreachable"]


def _wait_for_failed_run(suite, tag: dict[str, str], limit: float, what: str) -> list[str]:
    try:
        wait_until(lambda: any(run.status == "FAILURE" for run in suite.runs_tagged(tag)),
                   limit, what)
    except AssertionError as error:
        return [str(error)[:3000]]
    return []


def _worker_of_held_step(suite, tag: dict[str, str]) -> str:
    """The name of the worker running a started extract step of the scenario's runs."""
    with suite.platform.instance() as instance:
        for run in suite.runs_tagged(tag, started=True):
            for step, hostname in step_workers(instance, run.run_id).items():
                if step.endswith(".extract_cbr_daily_rates") or step.startswith("extract"):
                    return hostname.split("@", 1)[0]
    raise AssertionError(f"no worker runs the held step of {tag}")


def _store_away_until_a_run_gave_up(suite, tag: dict[str, str]) -> list[str]:
    """The store refusing, the held fetch let go, until a run of the scenario failed; then back,
    and the failed run re-executed from its failure once."""
    store = suite.platform.store
    standin = suite.chaos.standin
    store.set(REFUSING)
    started = time.monotonic()
    try:
        standin.clear_faults()
        standin.release_hangs()
        try:
            failed = wait_until(
                lambda: [run for run in suite.runs_tagged(tag) if run.status == "FAILURE"],
                PAST_BUDGET_LIMIT_SECONDS, "a run giving up on the object store")
        except AssertionError as error:
            return [str(error)[:3000]]
        gave_up_after = time.monotonic() - started
    finally:
        store.up()
    suite.totals.store_gave_up_seconds.append(gave_up_after)
    problems = []
    for run in failed:
        errors = " ".join(suite.graphql.run_errors(run.run_id))
        setting = setting_of(Store.OBJECT_STORE)
        if setting not in errors:
            problems.append(f"run {run.run_id} failed without naming {setting}: {errors[:2000]}")
        suite.graphql.launch_reexecution(run.run_id, "FROM_FAILURE")
    suite.log(f"    the run gave up {gave_up_after:.0f} s into the outage; re-executed from "
              "its failure")
    return problems


def outage_retries(instance, run_id: str) -> list[dict]:
    """The retries run ``run_id`` recorded as waits on a part being away."""
    records = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_OBSERVATION).records
    retries = [record.event_log_entry.asset_observation.metadata.get(RETRY_METADATA_KEY)
               for record in records]
    return [retry.value for retry in retries if retry is not None and retry.value.get("outage")]
