"""docs/operations.md's ``mostovik jobs`` commands, run as the operator types them on the
production instance (deploy/dagster.yaml on the throw-away PostgreSQL, the real webserver and
daemon, the PostgreSQL warehouse, the stand-in sources): each exits as the guide says and prints
what it shows.

First the guide's week (2026-11-10..16, the CBR down): the 12th failed permanently (the source
answered 404), the 13th failed (503 until its retries ran out), the 15th's run was cancelled in
the UI while its fetch hung. The dry run then prints the guide's preview, the same command with
``--wait`` submits it and follows the backfill to its end, as shown; then the "Jobs" block and
the one-run re-runs, ``RUN_ID`` being the week's failed runs. The laptop's commands and the check
that every shown command is run are in ``test_docs_commands_run.py``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import psycopg
import pytest

from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.support.doc_commands import (
    assert_shows,
    run_shown,
    shown_command,
)
from mostovik_pipelines_tests.support.instances import fresh_deployment
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, dsn_of
from mostovik_pipelines_tests.support.waiting import wait_for_hanging_request
from mostovik_pipelines_tests.support.webserver import DagsterServices

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

OPERATIONS = "docs/operations.md"
SOURCE = "cbr_daily_rates"
WEEK_FAILED, WEEK_CANCELLED = ("2026-11-12", "2026-11-13"), "2026-11-15"
TERMINATE_RUN = """mutation TerminateRun($runId: String!) {
  terminateRun(runId: $runId) { __typename }
}"""
"""What the run page's "Terminate" button sends."""
PICKED = tuple((OPERATIONS, start) for start in (
    "mostovik jobs list --source", "mostovik jobs list --type", "mostovik jobs list --stuck",
    "mostovik jobs show RUN_ID", "mostovik jobs rerun RUN_ID --reason",
    "mostovik jobs rerun RUN_ID --wait", "mostovik jobs rerun --source cbr_daily_rates --period",
    "mostovik jobs rerun --source erp_work_orders --period",
    "mostovik jobs rerun --source cbr_daily_rates --from 2026-11-10 --to 2026-11-16 --only "
    "failed --reason \"CBR down, OPS-112\"",
    "mostovik jobs rerun --source cbr_daily_rates --from 2026-11-10 --to 2026-11-16 --only "
    "failed --reason \"CBR down in week 46, OPS-112\" --dry-run",
    "mostovik jobs rerun --source cbr_daily_rates --from 2026-11-10 --to 2026-11-16 --only "
    "failed --reason \"CBR down in week 46, OPS-112\" --wait",
))
"""The commands this module runs, by document and how the line starts."""


@dataclasses.dataclass
class Operator:
    """The operator's shell on the production instance, and what it made."""

    services: DagsterServices
    standin: StandinClient
    environment: dict[str, str]
    failed_runs: dict[str, str] = dataclasses.field(default_factory=dict)

    def run(self, starts_with: str, **expected) -> str:
        """Type the guide's command; its output (stdout and stderr)."""
        return run_shown(shown_command(OPERATIONS, starts_with), cwd=self.services.work_dir,
                         environment=self.environment, **expected).stdout

    def rows_of(self, table: str, column: str, value: str) -> int:
        with psycopg.connect(dsn_of(self.environment["MOSTOVIK_DATABASE_URL"])) as connection:
            return connection.execute(f"SELECT count(*) FROM {table} WHERE {column} = %s",
                                      (date.fromisoformat(value),)).fetchone()[0]


@pytest.fixture(scope="module")
def operator(postgres: ThrowawayPostgres, standin_server: StandinServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    work_dir = tmp_path_factory.mktemp("operator")
    standin = StandinClient(standin_server.url)
    with fresh_deployment(postgres, standin_server, work_dir, "docs") as (home, environment):
        environment["MOSTOVIK_CBR_TIMEOUT_SECONDS"] = "300"  # the hung fetch waits to be cancelled
        with DagsterServices(work_dir, home, environment, stopped_schedules=[
                f"{SOURCE}_schedule", "cbr_metal_prices_schedule",
                "erp_work_orders_schedule"]) as services:
            shell = {**services.environment,
                     "PATH": f"{Path(sys.executable).parent}:{services.environment['PATH']}"}
            yield Operator(services, standin, shell)
    standin.clear_faults()
    standin.release_hangs()


def _date_query(day: str) -> str:
    return f"date_req={date.fromisoformat(day):%d/%m/%Y}"


def _break_the_week(operator: Operator) -> None:
    """The guide's week: the 12th refused (404), the 13th unavailable (503) until its retries
    ran out, the 15th's run cancelled from the UI while its fetch hung."""
    operator.standin.fault("status", status=404, match=_date_query(WEEK_FAILED[0]))
    operator.standin.fault("status", status=503, times=-1, match=_date_query(WEEK_FAILED[1]))
    operator.standin.fault("hang", seconds=600, match=_date_query(WEEK_CANCELLED))
    graphql = operator.services.graphql
    cancelled = graphql.launch_job_run(f"{SOURCE}_job", WEEK_CANCELLED)
    for day in WEEK_FAILED:
        materialized = subprocess.run(
            ["mostovik", "materialize", "--source", SOURCE, "--partition", day],
            cwd=operator.services.work_dir, env=operator.environment, capture_output=True,
            text=True)
        assert materialized.returncode == 1, materialized.stdout + materialized.stderr
        [run] = [run for run in graphql.runs({"tags": [
            {"key": "dagster/partition", "value": day}]}) if run.status == "FAILURE"]
        operator.failed_runs[day] = run.run_id
    wait_for_hanging_request(operator.standin, _date_query(WEEK_CANCELLED))
    graphql.execute(TERMINATE_RUN, {"runId": cancelled})
    assert graphql.wait_for_run(cancelled).status == "CANCELED"
    operator.standin.clear_faults()
    operator.standin.release_hangs()


@pytest.mark.timeout(900)
def test_a_weeks_recovery_previewed_then_submitted_as_the_guide_shows(operator):
    _break_the_week(operator)

    preview = shown_command(OPERATIONS, 'mostovik jobs rerun --source cbr_daily_rates --from '
                                        '2026-11-10 --to 2026-11-16 --only failed --reason "CBR '
                                        'down in week 46, OPS-112" --dry-run')
    assert_shows(operator.run(preview.line), preview.output)
    assert preview.output[0] in operator.run(
        'mostovik jobs rerun --source cbr_daily_rates --from 2026-11-10 --to 2026-11-16 '
        '--only failed --reason "CBR down, OPS-112"')

    submitted = shown_command(OPERATIONS, 'mostovik jobs rerun --source cbr_daily_rates --from '
                                          '2026-11-10 --to 2026-11-16 --only failed --reason '
                                          '"CBR down in week 46, OPS-112" --wait')
    # The progress lines between depend on when each poll lands; the first and last do not.
    assert_shows(operator.run(submitted.line),
                 [submitted.output[0],
                  *(line for line in submitted.output if "submitted: backfill" in line),
                  submitted.output[-1]])
    for day in (*WEEK_FAILED, WEEK_CANCELLED):
        assert operator.rows_of("cbr_daily_rates", "partition_date", day) == 12, day


@pytest.mark.timeout(900)
def test_the_jobs_block_and_the_one_run_re_runs(operator):
    refused, unavailable = (operator.failed_runs[day] for day in WEEK_FAILED)

    listed = operator.run("mostovik jobs list --source")
    assert refused[:8] in listed and unavailable[:8] in listed, listed
    shown = json.loads(operator.run("mostovik jobs show RUN_ID",
                                    placeholders={"RUN_ID": refused}))
    assert shown["run_id"] == refused and shown["status"] == "failed", shown

    queued = operator.run("mostovik jobs rerun RUN_ID --reason",
                          placeholders={"RUN_ID": unavailable}).split()
    assert queued[-1] == "queued", queued
    assert operator.services.graphql.wait_for_run(queued[-2]).status == "SUCCESS"
    followed = operator.run("mostovik jobs rerun RUN_ID --wait", placeholders={"RUN_ID": refused})
    assert followed.splitlines()[-1].endswith(" completed"), followed
    fresh = operator.run("mostovik jobs rerun --source cbr_daily_rates --period")
    assert fresh.splitlines()[-1].endswith(" completed"), fresh
    assert operator.rows_of("cbr_daily_rates", "partition_date", "2026-11-02") == 12
    resynced = operator.run("mostovik jobs rerun --source erp_work_orders --period")
    assert resynced.splitlines()[-1].endswith(" completed"), resynced

    synced = json.loads(operator.run("mostovik jobs list --type"))
    assert [job["period"] for job in synced] == ["2026-11-12"], synced
    # Nothing stuck: exit 0 (checked by the run) and no job under the header.
    assert len(operator.run("mostovik jobs list --stuck").splitlines()) == 1
