"""``mostovik jobs rerun --from --to --only``: an operator's recovery of a week, through the real
webserver and daemon on the production instance (PostgreSQL storage, the run queue).

A week of the CBR's rates four weeks ago (older than the schedule's lookback, and its schedule
stopped: nothing but the operator asks for them): three days loaded, two failed (the source
answered 404), two never loaded. The dry run lists what each selection takes and why; the same
command without ``--dry-run`` submits exactly that as a backfill, which the daemon launches
through the queue in the runs the dry run showed, each signed with who asked and why; the table
ends exact.
"""

from __future__ import annotations

import getpass
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import date, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import psycopg
import pytest
from dagster import DagsterEventType

from mostovik_pipelines.core.tags import (
    RANGE_END_TAG,
    RANGE_START_TAG,
    REASON_TAG,
    REQUESTED_BY_TAG,
)
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.graphql import BACKFILL_LIMIT_SECONDS
from mostovik_pipelines_tests.support.instances import fresh_deployment
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, dsn_of
from mostovik_pipelines_tests.support.waiting import wait_for_hanging_request
from mostovik_pipelines_tests.support.webserver import DagsterServices

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")
SOURCE = "cbr_daily_rates"
RATES_PER_DATE = 12
MOSCOW = ZoneInfo("Europe/Moscow")
_MONDAY = (datetime.now(MOSCOW).date() - timedelta(days=datetime.now(MOSCOW).weekday() + 28))
WEEK = [(_MONDAY + timedelta(days=n)).isoformat() for n in range(7)]
LOADED = [WEEK[0], WEEK[1], WEEK[4]]
FAILED = [WEEK[2], WEEK[5]]
MISSING = [WEEK[3], WEEK[6]]
IN_FLIGHT = WEEK[6]
"""Missing, but a run of it (launched from the UI) is held in its fetch while the operator
re-runs the week: listed as skipped, and left to that run."""
OPERATOR = "a.petrova"
REASON = "CBR down in week 47, ticket OPS-112"


@pytest.fixture(scope="module")
def services(postgres: ThrowawayPostgres, standin_server: StandinServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterServices]:
    work_dir = tmp_path_factory.mktemp("rerun")
    with fresh_deployment(postgres, standin_server, work_dir, "rerun") as (home, environment):
        environment.update({
            # The held fetch stays held until the test releases it, not retried after 30 s.
            "MOSTOVIK_CBR_TIMEOUT_SECONDS": "300",
        })
        services = DagsterServices(work_dir, home, environment, stopped_schedules=[
            f"{SOURCE}_schedule", "cbr_metal_prices_schedule", "erp_work_orders_schedule"])
        with services as running:
            yield running


def _mostovik(services: DagsterServices, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MOSTOVIK, *args], env=services.environment, cwd=services.work_dir,
                          capture_output=True, text=True, timeout=BACKFILL_LIMIT_SECONDS * 2)


def _rerun(services: DagsterServices, only: str, *extra: str) -> subprocess.CompletedProcess:
    return _mostovik(services, "jobs", "rerun", "--source", SOURCE, "--from", WEEK[0],
                     "--to", WEEK[-1], "--only", only, "--as", OPERATOR, "--reason", REASON,
                     "--json", *extra)


def _plan(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode in (0, 1), result.stderr
    [plan] = json.loads(result.stdout)["sources"]
    return plan


def _rows_per_date(services: DagsterServices) -> dict[str, int]:
    with psycopg.connect(dsn_of(services.environment["MOSTOVIK_DATABASE_URL"])) as connection:
        rows = connection.execute(
            "SELECT partition_date, count(*) FROM cbr_daily_rates GROUP BY partition_date"
        ).fetchall()
    return {day.isoformat(): count for day, count in rows}


def _date_query(day: str) -> str:
    return f"date_req={date.fromisoformat(day):%d/%m/%Y}"


def _run_span(run) -> list[str]:
    if "dagster/partition" in run.tags:
        return [run.tags["dagster/partition"]]
    start, end = run.tags[RANGE_START_TAG], run.tags[RANGE_END_TAG]
    return WEEK[WEEK.index(start):WEEK.index(end) + 1]


def _enqueued(services: DagsterServices, run_ids: list[str]) -> dict[str, bool]:
    """Whether each run went through the run queue: its event log records RUN_ENQUEUED."""
    with services.instance() as instance:
        return {run_id: bool(instance.get_records_for_run(
            run_id, of_type=DagsterEventType.RUN_ENQUEUED).records) for run_id in run_ids}


def _submitted_runs(services: DagsterServices, backfill_id: str, plan: dict) -> list:
    runs = services.graphql.wait_for_backfill_runs(backfill_id)
    assert sorted(_run_span(run) for run in runs) == sorted(plan["runs"]), (runs, plan)
    assert {run.status for run in runs} <= {"SUCCESS", "FAILURE"}
    assert all(_enqueued(services, [run.run_id for run in runs]).values())
    for run in runs:  # the UI's run list shows who asked and why
        assert run.tags[REQUESTED_BY_TAG] == OPERATOR, run.tags
        assert run.tags[REASON_TAG] == REASON, run.tags
        assert run.tags["dagster/backfill"] == backfill_id
    return runs


@pytest.mark.timeout(900)
def test_a_weeks_recovery_previewed_then_queued_exactly_and_signed(services, standin):
    # The week as it stands: three days loaded, two failed on the source's 404, two missing.
    loaded = _mostovik(services, "materialize", "--source", SOURCE,
                       *(arg for day in LOADED for arg in ("--partition", day)))
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    for day in FAILED:
        standin.fault("status", status=404, match=_date_query(day))
    failed = _mostovik(services, "materialize", "--source", SOURCE,
                       *(arg for day in FAILED for arg in ("--partition", day)))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    standin.clear_faults()
    assert _rows_per_date(services) == {day: RATES_PER_DATE for day in LOADED}

    # A run of one missing day is in flight, held in its fetch.
    standin.fault("hang", seconds=600, match=_date_query(IN_FLIGHT))
    held_run = services.graphql.launch_job_run(f"{SOURCE}_job", IN_FLIGHT)
    wait_for_hanging_request(standin, _date_query(IN_FLIGHT), limit=BACKFILL_LIMIT_SECONDS)

    # The dry runs: what each selection takes, why, and in which runs; nothing submitted.
    missing_preview = _plan(_rerun(services, "missing", "--dry-run"))
    assert list(missing_preview["selected"]) == [WEEK[3]]
    assert missing_preview["selected"][WEEK[3]].startswith("missing: never loaded")
    assert list(missing_preview["skipped"]) == [IN_FLIGHT]
    assert held_run in missing_preview["skipped"][IN_FLIGHT]
    assert missing_preview["runs"] == [[WEEK[3]]]
    failed_preview = _plan(_rerun(services, "failed", "--dry-run"))
    assert list(failed_preview["selected"]) == FAILED
    assert all("failed permanently" in why for why in failed_preview["selected"].values())
    assert failed_preview["runs"] == [[day] for day in FAILED]
    all_preview = _plan(_rerun(services, "all", "--dry-run"))
    assert list(all_preview["selected"]) == [day for day in WEEK if day != IN_FLIGHT]
    assert all_preview["runs"] == [WEEK[:6]], "one ranged run: the source's single-run policy"
    human = _mostovik(services, "jobs", "rerun", "--source", SOURCE, "--from", WEEK[0], "--to",
                      WEEK[-1], "--only", "failed", "--reason", REASON, "--dry-run")
    assert human.returncode == 0, human.stderr
    assert f"{FAILED[0]}   failed: run" in human.stdout and "run 2: " in human.stdout
    assert services.graphql.runs({"tags": [{"key": REQUESTED_BY_TAG, "value": OPERATOR}]}) == []

    # The missing day, while the source still fails it: the backfill fails, --wait says so.
    standin.fault("status", status=404, match=_date_query(WEEK[3]))
    submitted = _rerun(services, "missing", "--wait")
    assert submitted.returncode == 1, submitted.stdout + submitted.stderr
    plan = _plan(submitted)
    assert {k: plan[k] for k in ("selected", "skipped", "runs")} == {
        k: missing_preview[k] for k in ("selected", "skipped", "runs")}
    assert "failure" in submitted.stderr.splitlines()[-2], submitted.stderr
    assert submitted.stderr.splitlines()[-1].endswith(
        f"0 of 1 partition(s) succeeded; failed: {WEEK[3]}"), submitted.stderr
    [run] = _submitted_runs(services, plan["backfill_id"], plan)
    assert run.status == "FAILURE"

    # The failed days, now the source answers: the dry run shows the runs, submitted exactly.
    failed_preview = _plan(_rerun(services, "failed", "--dry-run"))
    assert list(failed_preview["selected"]) == [WEEK[2], WEEK[3], WEEK[5]]
    assert failed_preview["runs"] == [[WEEK[2], WEEK[3]], [WEEK[5]]]
    submitted = _rerun(services, "failed", "--wait")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    plan = _plan(submitted)
    assert {k: plan[k] for k in ("selected", "skipped", "runs")} == {
        k: failed_preview[k] for k in ("selected", "skipped", "runs")}
    runs = _submitted_runs(services, plan["backfill_id"], plan)
    assert {run.status for run in runs} == {"SUCCESS"}
    assert services.graphql.backfill_status(plan["backfill_id"]).status == "COMPLETED_SUCCESS"

    # The held run ends; the table holds every day of the week once.
    standin.clear_faults()
    standin.release_hangs()
    assert services.graphql.wait_for_run(held_run).status == "SUCCESS"
    assert _rows_per_date(services) == {day: RATES_PER_DATE for day in WEEK}
    assert _plan(_rerun(services, "failed", "--dry-run"))["selected"] == {}
    assert _plan(_rerun(services, "missing", "--dry-run"))["selected"] == {}

    # `jobs list` and `jobs show` say who asked and why.
    listed = _mostovik(services, "jobs", "list", "--source", SOURCE, "--json")
    assert listed.returncode == 0, listed.stderr
    signed = {job["run_id"]: (job["requested_by"], job["reason"])
              for job in json.loads(listed.stdout) if job["requested_by"]}
    asked = services.graphql.runs({"tags": [{"key": REQUESTED_BY_TAG, "value": OPERATOR}]})
    assert signed == {run.run_id: (OPERATOR, REASON) for run in asked}
    assert len(signed) == 3, "one run of the missing day, two of the failed days"
    shown = _mostovik(services, "jobs", "show", runs[0].run_id)
    assert f"requested_by      {OPERATOR}" in shown.stdout, shown.stdout
    assert f"reason            {REASON}" in shown.stdout, shown.stdout
    text_list = _mostovik(services, "jobs", "list", "--source", SOURCE)
    assert f"({OPERATOR}: {REASON})" in text_list.stdout, text_list.stdout


def test_a_range_needs_a_reason_and_partitions_the_source_has(services):
    no_reason = _mostovik(services, "jobs", "rerun", "--source", SOURCE, "--from", WEEK[0],
                          "--to", WEEK[-1], "--only", "failed")
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    bad_range = _mostovik(services, "jobs", "rerun", "--source", SOURCE, "--from", "1999-01-01",
                          "--to", WEEK[-1], "--only", "failed", "--reason", REASON)
    assert bad_range.returncode == 2 and "has no partition '1999-01-01'" in bad_range.stderr
    mixed = _mostovik(services, "jobs", "rerun", "some-run", "--from", WEEK[0], "--to",
                      WEEK[-1], "--only", "all", "--reason", REASON)
    assert mixed.returncode == 2 and "takes no RUN_ID" in mixed.stderr


def test_one_run_and_one_period_are_queued_for_the_daemon_and_signed(services, standin):
    day = (_MONDAY - timedelta(days=6)).isoformat()  # the Tuesday of the week before
    standin.fault("status", status=404, match=_date_query(day))
    failed = _mostovik(services, "materialize", "--source", SOURCE, "--partition", day)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    listed = json.loads(_mostovik(services, "jobs", "list", "--source", SOURCE, "--status",
                                  "failed", "--from", day, "--to", day, "--json").stdout)
    [failed_run] = [job["run_id"] for job in listed if job["period"] == day]

    # From its failure: queued, and launched by the daemon, not by the command.
    rerun = _mostovik(services, "jobs", "rerun", failed_run, "--as", OPERATOR,
                      "--reason", REASON)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    new_run, said = rerun.stdout.split()[-2:]
    assert said == "queued"
    run = services.graphql.wait_for_run(new_run)
    assert (run.status, run.parent_run_id) == ("SUCCESS", failed_run)
    assert (run.tags[REQUESTED_BY_TAG], run.tags[REASON_TAG]) == (OPERATOR, REASON)
    assert _enqueued(services, [new_run]) == {new_run: True}
    assert _rows_per_date(services)[day] == RATES_PER_DATE

    # A fresh run of the period, followed to its end; signed by the OS user, no reason given.
    fresh = _mostovik(services, "jobs", "rerun", "--source", SOURCE, "--period", day, "--wait")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    fresh_run, status = fresh.stdout.split()[-2:]
    assert status == "completed"
    run = services.graphql.run(fresh_run)
    assert run.tags[REQUESTED_BY_TAG] == getpass.getuser() and REASON_TAG not in run.tags
    assert run.tags["mostovik/rerun_of"] == new_run
    assert _enqueued(services, [fresh_run]) == {fresh_run: True}
    assert _rows_per_date(services)[day] == RATES_PER_DATE


def test_several_sources_are_planned_each_by_its_own_backfill_policy(services):
    # Forty days before those the other tests load: none ever loaded.
    forty_days = [(_MONDAY + timedelta(days=n)).isoformat() for n in range(-47, -7)]
    preview = _mostovik(services, "jobs", "rerun", "--source", "erp_work_orders", "--source",
                        SOURCE, "--from", forty_days[0], "--to", forty_days[-1],
                        "--only", "missing", "--reason", REASON, "--dry-run", "--json")
    assert preview.returncode == 0, preview.stderr
    plans = {plan["source"]: plan for plan in json.loads(preview.stdout)["sources"]}
    assert sorted(plans) == [SOURCE, "erp_work_orders"]
    # The sync in runs of at most 31 windows, the CBR's rates in one ranged run.
    assert plans["erp_work_orders"]["runs"] == [forty_days[:31], forty_days[31:]]
    assert plans[SOURCE]["runs"] == [forty_days]
    assert all(plan["backfill_id"] is None for plan in plans.values())
