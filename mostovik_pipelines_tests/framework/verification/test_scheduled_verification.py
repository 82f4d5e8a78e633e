"""The scheduled verification of a source, run as the daemon runs it (queued, on the production
instance): a week of the CBR's rates loaded, two days edited by hand and one corrected at the
source; the verification alerts once per differing day (through the alert webhook) and fails
its ``matches_source`` check on exactly those days; a second verification says nothing again;
``mostovik jobs rerun --only differing`` re-runs exactly those days, signed; the next
verification passes, and ``mostovik verify`` exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, date, datetime
from pathlib import Path
from unittest import mock

import psycopg
from dagster import DagsterInstance, RunsFilter

from mostovik_pipelines.core.tags import (
    RANGE_END_TAG,
    RANGE_START_TAG,
    REASON_TAG,
    REQUESTED_BY_TAG,
    run_partitions,
)
from mostovik_pipelines.definitions import build_code_location
from mostovik_pipelines.framework.verification.check import MATCHES_SOURCE
from mostovik_pipelines.framework.verification.schedule import VERIFY_SOURCES_SETTING
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines_tests.support.instances import create_instance_storage, fresh_deployment
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.run_queue import run_queue_daemon

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")
SPEC = cbr_daily_rates.SOURCE
JOB = "cbr_daily_rates_verification_job"


def closed_days_of_the_lookback() -> list[str]:
    """The days whose period ended within the source's lookback: what the job verifies."""
    now = datetime.now(UTC)
    partitions_def = SPEC.partitions_def
    return [key for key in partitions_def.get_partition_keys()
            if now - SPEC.catch_up.lookback < partitions_def.time_window_for_partition_key(
                key).end <= now]


def mostovik(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([MOSTOVIK, *args], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)


def verification_alerts(webhook) -> list[dict]:
    return [alert for alert in webhook.alerts if alert["kind"] == "verification"]


def test_the_scheduled_verification_alerts_once_per_differing_day_and_a_rerun_makes_it_pass(
        postgres, standin_server, standin, webhook, tmp_path):
    days = closed_days_of_the_lookback()
    assert len(days) == 7
    # The CBR's rates of a Tuesday to Friday answer for that day alone (Saturday's also for
    # Sunday and Monday): that is the day corrected at the source.
    corrected = next(day for day in days if date.fromisoformat(day).weekday() in (1, 2, 3, 4))
    edited, deleted = [day for day in days if day != corrected][1:5:2]
    days_differing = sorted([edited, deleted, corrected])
    with fresh_deployment(postgres, standin_server, tmp_path, "verification") as (home, env):
        env.update({"MOSTOVIK_LANDING_DIR": str(tmp_path / "landing"),
                    "MOSTOVIK_STORAGE_DIR": str(tmp_path / "storage"),
                    "MOSTOVIK_ALERT_WEBHOOK_URL": webhook.url,
                    VERIFY_SOURCES_SETTING: SPEC.name})
        create_instance_storage(home, env)
        location = code_location_for(env["MOSTOVIK_DATABASE_URL"], standin_server, tmp_path,
                                     [SPEC])
        with mock.patch.dict(os.environ, env), DagsterInstance.from_config(str(home)) as instance:
            assert location.resolve_job_def("cbr_daily_rates_job").execute_in_process(
                instance=instance, tags={RANGE_START_TAG: days[0], RANGE_END_TAG: days[-1]},
            ).success
            # The setting turns the source's schedule on (off by default).
            schedules = {s.name: s for s in build_code_location().schedules}
            assert schedules["cbr_daily_rates_verification"].default_status.value == "RUNNING"
            assert schedules["erp_work_orders_verification"].default_status.value == "STOPPED"
        url = env["MOSTOVIK_DATABASE_URL"].replace("+psycopg", "")
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute("UPDATE cbr_daily_rates SET value = value + 1 "
                               "WHERE partition_date = %s AND char_code = 'USD'", (edited,))
            connection.execute("DELETE FROM cbr_daily_rates "
                               "WHERE partition_date = %s AND char_code = 'EUR'", (deleted,))
        standin.change_cbr_rates(corrected, {"CNY": "13,1234"})

        with run_queue_daemon(env, tmp_path / "daemon") as services:
            graphql = services.graphql

            def verification() -> None:
                run_id = graphql.launch_job_run(JOB)
                assert graphql.wait_for_run(run_id).status == "SUCCESS", (
                    graphql.run_errors(run_id))

            def verdicts() -> dict[str, str]:
                return {day: graphql.check_executions(SPEC.name, MATCHES_SOURCE, day,
                                                      limit=1)[0]["status"] for day in days}

            verification()
            alerts = verification_alerts(webhook)
            assert sorted(alert["period"] for alert in alerts) == days_differing
            by_day = {alert["period"]: alert["message"] for alert in alerts}
            assert "differs" in by_day[edited] and "USD value" in by_day[edited]
            assert "missing" in by_day[deleted] and "char_code=EUR" in by_day[deleted]
            assert "CNY value" in by_day[corrected] and "'13.1234'" in by_day[corrected]
            assert verdicts() == {day: "FAILED" if day in (edited, deleted, corrected)
                                  else "SUCCEEDED" for day in days}

            # The same differences on the same loads are not said again.
            verification()
            assert len(verification_alerts(webhook)) == 3

            rerun = mostovik(env, "jobs", "rerun", "--source", SPEC.name, "--from", days[0],
                             "--to", days[-1], "--only", "differing", "--reason",
                             "verification found differences", "--as", "a.petrova", "--wait")
            assert rerun.returncode == 0, rerun.stdout + rerun.stderr
            assert rerun.stdout.splitlines()[0].startswith(
                f"{SPEC.name}: 3 partition(s) of {days[0]}..{days[-1]} selected (differing)")
            with services.instance() as instance:
                reruns = instance.get_runs(RunsFilter(tags={REQUESTED_BY_TAG: "a.petrova"}))
            assert reruns and all(run.tags[REASON_TAG] == "verification found differences"
                                  for run in reruns)
            covered = [key for run in reruns for key in sorted(run_partitions(
                run.tags, SPEC.partitions_def))]
            assert sorted(covered) == days_differing

            verification()
            assert len(verification_alerts(webhook)) == 3
            assert set(verdicts().values()) == {"SUCCEEDED"}
        checked = mostovik(env, "verify", "--source", SPEC.name, "--from", days[0], "--to",
                           days[-1], "--against", "source")
        assert checked.returncode == 0, checked.stdout + checked.stderr
