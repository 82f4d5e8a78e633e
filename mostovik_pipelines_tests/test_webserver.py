"""The code location behind the real ``dagster-webserver`` and ``dagster-daemon``, on the
production instance (deploy/dagster.yaml: PostgreSQL storage, the run queue), driven only the way
the Dagster UI drives it: GraphQL over HTTP.

One webserver and daemon serve the whole module (starting them costs ~20 s), so the tests share a
warehouse and each works on partitions of its own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import date, datetime, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

import psycopg
import pytest

from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.conftest import TEMPLATE_DB
from mostovik_pipelines_tests.support.instances import production_instance
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, dsn_of
from mostovik_pipelines_tests.support.webserver import DagsterServices

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ASSET = "cbr_daily_rates"
JOB = "cbr_daily_rates_job"
SCHEDULE = "cbr_daily_rates_schedule"
RATES_PER_DATE = 12
MOSCOW = ZoneInfo("Europe/Moscow")


def _last_week(weekday: int) -> date:
    """The day of last week (Monday 0) in Moscow, where the CBR's dates are."""
    today = datetime.now(MOSCOW).date()
    return today - timedelta(days=today.weekday() + 7) + timedelta(days=weekday)


# Tuesday to Saturday carry rates of their own (see standin/cbr.py).
BACKFILL_DATES = [_last_week(1), _last_week(2), _last_week(3)]
FAILING_DATE = _last_week(5)
CORRECTED_DATE = _last_week(4)


@pytest.fixture(scope="module")
def services(postgres: ThrowawayPostgres, standin_server: StandinServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterServices]:
    """Webserver and daemon on a fresh production instance database and a fresh warehouse."""
    work_dir = tmp_path_factory.mktemp("webserver")
    suffix = uuid.uuid4().hex[:8]
    dagster_db, warehouse_db = f"dagster_ui_{suffix}", f"wh_ui_{suffix}"
    with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {warehouse_db} TEMPLATE {TEMPLATE_DB}")
    home, environment = production_instance(postgres, dagster_db, work_dir)
    environment.update({
        "MOSTOVIK_DATABASE_URL": postgres.url(warehouse_db),
        "MOSTOVIK_CBR_URL": standin_server.cbr_url,
        "MOSTOVIK_DATA_DIR": str(work_dir / "data"),
        "MOSTOVIK_EXECUTOR": "in_process",
    })
    try:
        with DagsterServices(work_dir, home, environment) as running:
            yield running
    finally:
        with psycopg.connect(postgres.dsn(), autocommit=True) as connection:
            for name in (dagster_db, warehouse_db):
                connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def warehouse_url(services: DagsterServices) -> str:
    return services.environment["MOSTOVIK_DATABASE_URL"]


def test_the_code_location_loads_with_its_asset_job_and_schedule(services):
    assert services.graphql.location_statuses()[services.location_name] == "LOADED"
    assert services.graphql.location_load_error() is None

    contents = services.graphql.repository_contents()
    assert ASSET in contents.asset_keys
    assert JOB in contents.jobs
    assert SCHEDULE in contents.schedules
    daemons = services.graphql.daemon_statuses()
    assert daemons["QUEUED_RUN_COORDINATOR"]["healthy"], daemons["QUEUED_RUN_COORDINATOR"]
    assert daemons["BACKFILL"]["healthy"], daemons["BACKFILL"]


def test_a_failed_run_is_re_executed_from_failure_as_the_ui_does_it(services, standin):
    partition = FAILING_DATE.isoformat()
    # 404 is permanent: the extract fails at once, without retries.
    standin.fault("status", status=404, match=f"date_req={FAILING_DATE:%d/%m/%Y}")

    failed_id = services.graphql.launch_job_run(JOB, partition, {"mostovik_test/case": "rerun"})
    failed = services.graphql.wait_for_run(failed_id, timeout=120)
    assert failed.status == "FAILURE", (failed, services.log_tails())
    failure = "\n".join(services.graphql.run_errors(failed_id))
    assert "404" in failure, failure
    assert failed.tags["dagster/partition"] == partition

    standin.clear_faults()
    rerun_id = services.graphql.launch_reexecution(failed_id, "FROM_FAILURE")
    rerun = services.graphql.wait_for_run(rerun_id, timeout=120)

    print(f"re-execution {rerun_id} of {failed_id}: {rerun.status}; tags {rerun.tags}")
    assert rerun.parent_run_id == failed_id
    assert rerun.root_run_id == failed_id
    assert rerun.status == "SUCCESS", services.graphql.run_errors(rerun_id)


def test_an_old_run_re_executed_from_the_ui_never_puts_old_figures_back(
    services, warehouse_url, standin
):
    """The old run fetched 70 for USD and failed in load; the source then corrected it to 75.5
    and a new run loaded that. Re-executing the old run, from failure or all steps, as the UI's
    buttons do, leaves 75.5."""
    partition = CORRECTED_DATE.isoformat()
    standin.change_cbr_rates(partition, set_values={"USD": "70,0000"})
    with psycopg.connect(dsn_of(warehouse_url), autocommit=True) as connection:
        connection.execute("ALTER TABLE cbr_daily_rates RENAME TO cbr_daily_rates_away")
        try:
            old_id = services.graphql.launch_job_run(JOB, partition)
            old = services.graphql.wait_for_run(old_id, timeout=120)
        finally:
            connection.execute("ALTER TABLE cbr_daily_rates_away RENAME TO cbr_daily_rates")
    assert old.status == "FAILURE", services.graphql.run_errors(old_id)
    assert "load" in "\n".join(services.graphql.run_errors(old_id))

    standin.change_cbr_rates(partition, set_values={"USD": "75,5000"})
    newer = services.graphql.wait_for_run(services.graphql.launch_job_run(JOB, partition), 120)
    assert newer.status == "SUCCESS"
    assert _usd(warehouse_url, partition) == Decimal("75.5000")

    for strategy in ("FROM_FAILURE", "ALL_STEPS"):
        again_id = services.graphql.launch_reexecution(old_id, strategy)
        again = services.graphql.wait_for_run(again_id, timeout=120)
        assert again.status == "SUCCESS", (strategy, services.graphql.run_errors(again_id))
        assert again.parent_run_id == old_id
        assert again.tags.get("mostovik/status") == "completed"
        assert _usd(warehouse_url, partition) == Decimal("75.5000"), strategy


def _usd(warehouse_url: str, partition: str) -> Decimal:
    with psycopg.connect(dsn_of(warehouse_url)) as connection:
        return connection.execute(
            "SELECT value FROM cbr_daily_rates WHERE partition_date = %s AND char_code = 'USD'",
            (date.fromisoformat(partition),)).fetchone()[0]


def test_a_backfill_launched_from_the_ui_completes_through_the_daemon(
    services, warehouse_url, standin
):
    partitions = [day.isoformat() for day in BACKFILL_DATES]
    before = _rows_per_date(warehouse_url)
    assert not set(partitions) & set(before)
    started = time.monotonic()

    backfill_id = services.graphql.launch_partition_backfill([ASSET], partitions)
    backfill = services.graphql.wait_for_backfill(backfill_id, timeout=150)
    elapsed = time.monotonic() - started

    runs = services.graphql.runs_of_backfill(backfill_id)
    print(f"backfill {backfill_id} of {len(partitions)} partitions: {backfill.status} after "
          f"{elapsed:.1f} s, {len(runs)} runs")
    errors = {run.run_id: services.graphql.run_errors(run.run_id)
              for run in runs if run.status != "SUCCESS"}
    assert backfill.status == "COMPLETED_SUCCESS", (backfill, errors, services.log_tails())
    assert runs, "the backfill launched no run"
    assert [run.status for run in runs] == ["SUCCESS"] * len(runs), errors
    assert {run.tags.get("dagster/backfill") for run in runs} == {backfill_id}

    after = _rows_per_date(warehouse_url)
    assert {day: count for day, count in after.items() if day not in before} == {
        partition: RATES_PER_DATE for partition in partitions
    }
    assert {day: after[day] for day in before} == before


def _rows_per_date(warehouse_url: str) -> dict[str, int]:
    """Rows per ``partition_date`` in the warehouse, leaving out today and tomorrow: the
    schedule is running and loads those partitions should a tick fall within the test."""
    today = datetime.now(MOSCOW).date()
    with psycopg.connect(dsn_of(warehouse_url)) as connection:
        rows = connection.execute(
            "SELECT partition_date, count(*) FROM cbr_daily_rates WHERE partition_date < %s "
            "GROUP BY partition_date", (today,)
        ).fetchall()
    return {day.isoformat(): count for day, count in rows}
