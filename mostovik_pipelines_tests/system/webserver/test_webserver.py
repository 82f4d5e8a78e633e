"""The operator's day in the Dagster UI, through the real ``dagster-webserver`` and
``dagster-daemon`` on the production instance (deploy/dagster.yaml: PostgreSQL storage, the run
queue, the deadlines' sensor), driven only the way the Dagster UI drives it: GraphQL over HTTP.

What the operator sees (assets with their schema, owners, kinds, checks and no freshness; a
partition's figures) and does (backfill partitions, re-execute a failed run from failure), and
what reaches the team: one webhook alert per failed job and per late period, at a local
receiver, with no secret in it.

One webserver and daemon serve the whole module (starting them costs ~20 s), so the tests share a
warehouse and each works on partitions of its own.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import psycopg
import pytest
from dagster import DagsterInstance

from mostovik_pipelines.core.settings import landing_dir, storage_dir
from mostovik_pipelines.definitions import defs
from mostovik_pipelines.framework.verification.check import MATCHES_SOURCE
from mostovik_pipelines.maintenance.job import PRUNE_JOB, PRUNE_SCHEDULE
from mostovik_pipelines.maintenance.policy import RetentionPolicy
from mostovik_pipelines.maintenance.prune import prune
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.graphql import BACKFILL_LIMIT_SECONDS
from mostovik_pipelines_tests.support.inbox import drop
from mostovik_pipelines_tests.support.operator_ui import (
    ALERT_SENSOR_INTERVAL_SECONDS,
    ALERT_SENSORS,
    ASSET,
    CHECKS,
    RATES_PER_DATE,
    SPECS,
    STALE_SOURCE,
    day_of_last_week,
    operator_ui_services,
    partitions_of,
    published_rates,
    rows_per_date,
    stored_rates,
    usd_rate,
    what_the_ui_shows,
)
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, dsn_of
from mostovik_pipelines_tests.support.waiting import (
    limit_for,
    wait_for_hanging_request,
    wait_until,
)
from mostovik_pipelines_tests.support.webhook import WebhookReceiver
from mostovik_pipelines_tests.support.webserver import DagsterServices

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

CORPUS = Path(__file__).parents[2] / "corpus"
INBOX_SENSOR_SECONDS = 15
"""The inbox sensor's interval: how long a dropped report waits for its run."""

JOB = "cbr_daily_rates_job"
SCHEDULE = "cbr_daily_rates_schedule"
OUR_RUN_TAGS = {"mostovik/source", "mostovik/job_type", "mostovik/status"}
"""The tags of ours a run shows in the run list (besides Dagster's own, period included): what
operators filter by."""


# Tuesday to Saturday carry rates of their own (see standin/cbr.py).
BACKFILL_DATES = [day_of_last_week(1), day_of_last_week(2), day_of_last_week(3)]
FAILING_DATE = day_of_last_week(5)
CORRECTED_DATE = day_of_last_week(4)
UNALERTED_DATE = day_of_last_week(0)
"""Monday: the CBR publishes no rates of its own for it, so no other test loads it."""
DAEMON_RESTART_DATES = [day_of_last_week(weekday) - timedelta(days=14) for weekday in (1, 2, 3)]
"""Tuesday to Thursday three weeks ago: loaded by the backfill whose daemon is killed."""
PRUNED_DATES = [day_of_last_week(weekday) - timedelta(days=7) for weekday in (1, 2, 3)]
"""Tuesday to Thursday two weeks ago: loaded, loaded twice, failed, then pruned."""


@pytest.fixture(scope="module")
def services(postgres: ThrowawayPostgres, standin_server: StandinServer, webhook: WebhookReceiver,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterServices]:
    """Webserver and daemon on a fresh production instance database and a fresh warehouse
    (:func:`~mostovik_pipelines_tests.support.operator_ui.operator_ui_services`)."""
    work_dir = tmp_path_factory.mktemp("webserver")
    with operator_ui_services(postgres, standin_server, webhook, work_dir) as running:
        yield running


@pytest.fixture
def warehouse_url(services: DagsterServices) -> str:
    return services.environment["MOSTOVIK_DATABASE_URL"]


def test_the_code_location_loads_with_its_assets_checks_jobs_schedules_and_sensors(services):
    assert services.graphql.location_statuses()[services.location_name] == "LOADED"
    assert services.graphql.location_load_error() is None

    contents = services.graphql.repository_contents()
    assert contents.asset_keys == sorted(SPECS)
    assert set(contents.jobs) >= {f"{name}_job" for name in SPECS}
    assert contents.schedules == {
        PRUNE_SCHEDULE: "RUNNING",
        **{f"{name}_schedule": "STOPPED" if name == STALE_SOURCE else "RUNNING"
           for name, spec in SPECS.items() if spec.schedule},
        # The scheduled verifications are off unless MOSTOVIK_VERIFY_SOURCES names a source.
        **{f"{name}_verification": "STOPPED" for name in SPECS}}
    assert PRUNE_JOB in contents.jobs
    assert SCHEDULE in contents.schedules
    assert contents.sensors == {
        **{f"{name}_inbox_sensor": "RUNNING" for name, spec in SPECS.items() if spec.sensor},
        **{name: "RUNNING" for name in ALERT_SENSORS}, "dead_runs": "RUNNING"}
    assert contents.asset_checks == sorted(
        [f"{name}:{check}" for name, checks in CHECKS.items()
         for check in [*checks, MATCHES_SOURCE]]
        + [f"{name}:period_deadlines" for name, spec in SPECS.items() if spec.deadline])
    daemons = services.graphql.daemon_statuses()
    for daemon in ("QUEUED_RUN_COORDINATOR", "BACKFILL", "SENSOR", "SCHEDULER",
                   "FRESHNESS_DAEMON"):
        assert daemons[daemon]["healthy"], daemons[daemon]


def test_every_source_reads_well_in_the_asset_graph(services):
    for name, spec in SPECS.items():
        node = services.graphql.asset_node(name)
        assert node["description"] == spec.description
        assert node["groupName"] == spec.job_type.value
        assert sorted(node["kinds"]) == sorted({"postgres", spec.protocol})
        assert node["owners"] == [{"__typename": "TeamAssetOwner",
                                   "team": "back-office-data"}]
        assert node["isPartitioned"]
        [schema] = [entry["schema"] for entry in node["metadataEntries"]
                    if entry["label"] == "dagster/column_schema"]
        assert [column["name"] for column in schema["columns"]] == list(spec.table.columns.keys())
        assert all(column["type"] for column in schema["columns"])
        # No Dagster freshness policy (it reads the newest load of any partition): the UI never
        # calls a source fresh; the period_deadlines check says which periods are late.
        assert node["internalFreshnessPolicy"] is None
        assert node["freshnessStatusInfo"] is None


def test_a_failed_partition_alerts_once_and_is_re_executed_from_failure_to_exact_data(
    services, standin, standin_server, warehouse_url, webhook
):
    """A backfill of a partition the CBR refuses (404, permanent), launched as the UI launches
    it: its run (the implicit asset job) fails, the team gets one alert naming source, period
    and error with a link to the run; "Re-execute from failure" after the fault is cleared
    loads exactly what the source publishes, its checks passed."""
    partition = FAILING_DATE.isoformat()
    standin.fault("status", status=404, match=f"date_req={FAILING_DATE:%d/%m/%Y}")

    backfill_id = services.graphql.launch_partition_backfill([ASSET], [partition])
    [failed] = services.graphql.wait_for_backfill_runs(backfill_id)
    assert failed.job_name == "__ASSET_JOB"
    assert failed.status == "FAILURE", (failed, services.log_tails())
    failure = "\n".join(services.graphql.run_errors(failed.run_id))
    assert "404" in failure, failure
    assert failed.tags["mostovik/status"] == "failed"

    standin.clear_faults()
    rerun_id = services.graphql.launch_reexecution(failed.run_id, "FROM_FAILURE")
    # The run's failure alert (the deadline sensor's late alert of the same day names this run
    # too, as the day's latest, and may come first).
    [alert] = webhook.wait_for(lambda a: a.get("run_id") == failed.run_id
                               and a["kind"] == "run_failure",
                               timeout=limit_for(ALERT_SENSOR_INTERVAL_SECONDS))
    assert {k: alert[k] for k in ("kind", "source", "period", "job_status", "error_class",
                                  "error_kind")} == {
        "kind": "run_failure", "source": ASSET, "period": partition, "job_status": "failed",
        "error_class": "permanent", "error_kind": "request_rejected"}
    assert f"{ASSET} [{partition}] extract" in alert["message"] and "404" in alert["message"]
    assert alert["link"] == f"{services.url}/runs/{failed.run_id}"
    assert httpx.get(alert["link"]).status_code == 200

    rerun = services.graphql.wait_for_run(rerun_id)
    print(f"re-execution {rerun_id} of {failed.run_id}: {rerun.status}; tags {rerun.tags}")
    assert rerun.parent_run_id == failed.run_id
    assert rerun.root_run_id == failed.run_id
    assert rerun.status == "SUCCESS", services.graphql.run_errors(rerun_id)
    assert rerun.tags["mostovik/status"] == "completed"
    assert stored_rates(warehouse_url, partition) == published_rates(standin_server, partition)
    for check in CHECKS[ASSET]:
        latest = services.graphql.check_executions(ASSET, check, partition)[0]
        assert (latest["runId"], latest["status"]) == (rerun_id, "SUCCEEDED"), check


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
            old = services.graphql.wait_for_run(old_id)
        finally:
            connection.execute("ALTER TABLE cbr_daily_rates_away RENAME TO cbr_daily_rates")
    assert old.status == "FAILURE", services.graphql.run_errors(old_id)
    assert "load" in "\n".join(services.graphql.run_errors(old_id))

    standin.change_cbr_rates(partition, set_values={"USD": "75,5000"})
    newer = services.graphql.wait_for_run(services.graphql.launch_job_run(JOB, partition))
    assert newer.status == "SUCCESS"
    assert usd_rate(warehouse_url, partition) == Decimal("75.5000")

    for strategy in ("FROM_FAILURE", "ALL_STEPS"):
        again_id = services.graphql.launch_reexecution(old_id, strategy)
        again = services.graphql.wait_for_run(again_id)
        assert again.status == "SUCCESS", (strategy, services.graphql.run_errors(again_id))
        assert again.parent_run_id == old_id
        assert again.tags.get("mostovik/status") == "completed"
        assert usd_rate(warehouse_url, partition) == Decimal("75.5000"), strategy


def test_a_backfill_launched_from_the_ui_completes_through_the_daemon(
    services, warehouse_url, standin
):
    partitions = [day.isoformat() for day in BACKFILL_DATES]
    before = rows_per_date(warehouse_url)
    assert not set(partitions) & set(before)
    started = time.monotonic()

    backfill_id = services.graphql.launch_partition_backfill([ASSET], partitions)
    backfill = services.graphql.wait_for_backfill(backfill_id)
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

    after = rows_per_date(warehouse_url)
    assert {day: count for day, count in after.items() if day not in before} == {
        partition: RATES_PER_DATE for partition in partitions
    }
    assert {day: after[day] for day in before} == before

    # What the asset's partition view shows, and its plots read: the figures of each partition.
    shown = services.graphql.partition_metadata(ASSET, partitions)
    assert sorted(shown) == partitions
    for partition, metadata in shown.items():
        assert metadata["dagster/row_count"] == metadata["inserted"] == RATES_PER_DATE
        assert metadata["updated"] == metadata["deleted"] == metadata["rejected"] == 0
        assert metadata["duration_seconds"] > 0 and metadata["payload_bytes"] > 1000
        assert len(metadata["content_hash"]) == 64
        assert metadata["preview"].startswith("| partition_date | rate_date |")
        assert partition in metadata["preview"]
    # Every check has passed on every partition, in the backfill's run(s).
    for check in CHECKS[ASSET]:
        for partition in partitions:
            [execution] = services.graphql.check_executions(ASSET, check, partition)
            assert execution["status"] == "SUCCEEDED", (check, partition, execution)
            assert execution["runId"] in {run.run_id for run in runs}


def test_a_daemon_killed_mid_backfill_and_started_again_finishes_it_each_partition_once(
    services, warehouse_url, standin
):
    """The daemon crashes while a UI backfill's run is fetching and is started again: the
    backfill completes, each partition loaded by one run, the table exact.

    The asset's backfill policy asks for one ranged run, which fetches its partitions one after
    another: its fetch of the first one is held at the stand-in, so the daemon dies with every
    run of the backfill launched and in flight. (Holding every partition's fetch cost 100 s: the
    run meets them in turn, each past the source's 30 s timeout.)"""
    partitions = [day.isoformat() for day in DAEMON_RESTART_DATES]
    first_query = f"date_req={DAEMON_RESTART_DATES[0]:%d/%m/%Y}"
    standin.fault("hang", seconds=600, match=first_query)
    before = rows_per_date(warehouse_url)
    backfill_id = services.graphql.launch_partition_backfill([ASSET], partitions)
    wait_for_hanging_request(standin, first_query, limit=BACKFILL_LIMIT_SECONDS)
    assert len(services.graphql.runs_of_backfill(backfill_id)) == 1, "one ranged run launched"
    services.kill_daemon()
    services.start_daemon()
    standin.release_hangs()

    backfill = services.graphql.wait_for_backfill(backfill_id)
    runs = services.graphql.runs_of_backfill(backfill_id)
    assert backfill.status == "COMPLETED_SUCCESS", (backfill, runs, services.log_tails())
    # Each partition in one run (one ranged run, as the asset's backfill policy asks).
    assert sorted(day for run in runs for day in partitions_of(run)) == partitions, runs
    assert {run.status for run in runs} == {"SUCCESS"}
    after = rows_per_date(warehouse_url)
    assert {day: count for day, count in after.items() if day not in before} == {
        partition: RATES_PER_DATE for partition in partitions}
    assert {day: after[day] for day in before} == before
    shown = services.graphql.partition_metadata(ASSET, partitions)
    assert {partition: metadata["inserted"] for partition, metadata in shown.items()} == {
        partition: RATES_PER_DATE for partition in partitions}


def test_the_late_periods_show_red_in_the_ui_and_each_raises_one_alert(
        services, webhook, warehouse_url):
    """The CBR's check period_deadlines, evaluated by its sensor, is red over GraphQL naming
    exactly the due dates of last week the warehouse does not hold, and each of them got one
    late alert. Two ticks: the first may have read the state while another test's run was
    ending; the one after it has recorded the truth again if that run left the check skipped."""
    services.graphql.wait_for_more_ticks("period_deadlines", 2, ALERT_SENSOR_INTERVAL_SECONDS)
    [execution] = services.graphql.check_executions(ASSET, "period_deadlines", limit=1)
    assert execution["status"] == "FAILED" and execution["evaluation"]["severity"] == "ERROR", (
        execution, services.graphql.check_executions(ASSET, "period_deadlines", limit=5))
    described = execution["evaluation"]["description"]
    spec = SPECS[ASSET]
    loaded = set(rows_per_date(warehouse_url))
    # Watched: the periods whose window ends after the first run's lookback (7 days).
    watched_from = datetime.now(UTC) - spec.catch_up.lookback + timedelta(hours=1)
    last_week = [key for key in (day_of_last_week(day).isoformat() for day in range(7))
                 if spec.partitions_def.time_window_for_partition_key(key).end > watched_from]
    due_unloaded = [day for day in last_week if day not in loaded]
    assert due_unloaded, "every day of last week loaded: nothing to see late"
    for day in last_week:
        assert (f"{day} (due" in described) is (day in due_unloaded), (day, described)
    late = webhook.wait_for(lambda a: a["kind"] == "late" and a["period"] in due_unloaded,
                            timeout=limit_for(ALERT_SENSOR_INTERVAL_SECONDS))
    assert sorted(a["period"] for a in late) == sorted(due_unloaded)
    assert all(a["source"] == ASSET and a["link"] == f"{services.url}/assets/{ASSET}"
               for a in late)
    assert all(count == 1 for count in webhook.delivered().values())
    window = spec.partitions_def.time_window_for_partition_key(late[0]["period"])
    due = spec.deadline.due(window.start, window.end)
    assert f"due {due.isoformat(timespec='minutes')}" in late[0]["message"]


def test_one_alert_per_failed_job_no_secret_in_any_and_a_readable_run_list(
    services, webhook, postgres, standin
):
    # A failed job of its own, besides those of the module's other tests (if they ran).
    standin.fault("status", status=404, match=f"date_req={UNALERTED_DATE:%d/%m/%Y}")
    backfill_id = services.graphql.launch_partition_backfill([ASSET], [
        UNALERTED_DATE.isoformat()])
    [own] = services.graphql.wait_for_backfill_runs(backfill_id)
    standin.clear_faults()
    assert own.status == "FAILURE", own
    runs = services.graphql.runs({}, limit=200)
    failed = {run.run_id for run in runs if run.status == "FAILURE"}
    webhook.wait_for(lambda a: failed <= {
        alert.get("run_id") for alert in webhook.alerts},
        timeout=limit_for(ALERT_SENSOR_INTERVAL_SECONDS))
    # A duplicate would come with one of the sensor's next ticks.
    services.graphql.wait_for_more_ticks("run_failure_alerts", 2, ALERT_SENSOR_INTERVAL_SECONDS)
    run_alerts = [alert["run_id"] for alert in webhook.alerts if alert["kind"] == "run_failure"]
    assert sorted(run_alerts) == sorted(failed)
    assert all(count == 1 for count in webhook.delivered().values())

    sent = json.dumps(webhook.alerts)
    for secret in (postgres.password, webhook.token, os.environ.get("MOSTOVIK_ERP_TOKEN")):
        assert not secret or secret not in sent
    # The webhook's own URL is a secret too: in no log, tick log or file the services wrote.
    token = webhook.token.encode()
    assert [path for path in services.work_dir.rglob("*")
            if path.is_file() and token in path.read_bytes()] == []
    # Run tags: what operators filter by; the steps' hosts and processes are events.
    for run in runs:
        assert {tag for tag in run.tags if not tag.startswith(("dagster/", ".dagster/"))} <= (
            OUR_RUN_TAGS), run.tags


def test_a_report_with_an_added_column_warns_on_its_check_and_raises_one_alert(
    services, webhook
):
    """A site's report arrives with a column the template does not have: the inbox sensor runs
    it, it loads (a file's policy: warn), the partition's check source_shape shows the warning
    naming the column, its materialisation the shape sent, and the daemon's shape sensor
    raises one alert naming source, column and partition."""
    report = CORPUS / "material_deliveries" / "shape_column_added.csv"
    partition = drop(services.work_dir / "data" / "inbox", "site_with_notes.csv",
                     report.read_bytes())
    wait_until(lambda: services.graphql.runs({"tags": [
        {"key": "dagster/partition", "value": partition}]}), limit_for(INBOX_SENSOR_SECONDS),
        f"the inbox sensor's run of {partition}", services.log_tails, poll=1)
    [run] = services.graphql.runs({"tags": [{"key": "dagster/partition", "value": partition}]})
    assert services.graphql.wait_for_run(run.run_id).status == "SUCCESS", (
        services.graphql.run_errors(run.run_id))

    [execution] = services.graphql.check_executions("material_deliveries", "source_shape",
                                                    partition)
    assert (execution["runId"], execution["status"]) == (run.run_id, "FAILED")
    assert execution["evaluation"]["severity"] == "WARN"
    assert execution["evaluation"]["description"].startswith(
        "added field Примечание: loaded as usual (policy warn)")
    shown = services.graphql.partition_metadata("material_deliveries", [partition])[partition]
    assert "Примечание (text)" in shown["source_shape"]
    [alert] = webhook.wait_for(lambda a: a["kind"] == "source_shape",
                               timeout=limit_for(ALERT_SENSOR_INTERVAL_SECONDS))
    assert (alert["source"], alert["period"]) == ("material_deliveries", partition)
    assert "added field Примечание" in alert["message"]
    services.graphql.wait_for_more_ticks("source_shape_alerts", 2, ALERT_SENSOR_INTERVAL_SECONDS)
    assert len([a for a in webhook.alerts if a["kind"] == "source_shape"]) == 1


def test_after_a_prune_the_ui_shows_every_partition_as_before(services, standin, monkeypatch):
    """A prune a decade on, with every window at zero, deletes every run no partition's
    present depends on: the UI (the asset's partition bar, each partition's latest
    materialisation and its metadata, each check's latest result) reads the same after it.
    Last in the module: it deletes the other tests' older runs too."""
    loaded, reloaded, failing = (day.isoformat() for day in PRUNED_DATES)
    standin.fault("status", status=404, times=-1, match=f"date_req={PRUNED_DATES[2]:%d/%m/%Y}")
    launched = [services.graphql.launch_job_run(JOB, partition)
                for partition in (loaded, reloaded, failing, reloaded)]
    runs = [services.graphql.wait_for_run(run_id) for run_id in launched]
    standin.clear_faults()
    assert [run.status for run in runs] == ["SUCCESS", "SUCCESS", "FAILURE", "SUCCESS"], [
        services.graphql.run_errors(run.run_id) for run in runs]
    superseded = launched[1]  # the second load of its partition ran after it (one at a time)

    before = what_the_ui_shows(services)
    assert {day: before["status"].get(day) for day in (loaded, reloaded, failing)} == {
        loaded: "MATERIALIZED", reloaded: "MATERIALIZED", failing: "FAILED"}
    assert before["metadata"][reloaded]["run_id"] == launched[3]
    runs_before = {run.run_id for run in services.graphql.runs({}, limit=1000)}

    for name, value in services.environment.items():
        monkeypatch.setenv(name, value)
    nothing_kept = RetentionPolicy(keep_failed_run_outputs=timedelta(0), grace=timedelta(0),
                                   keep_landed=timedelta(0), keep_runs=timedelta(0))
    with DagsterInstance.from_config(str(services.dagster_home)) as instance:
        report = prune(instance, landing_dir=Path(landing_dir()), op_output_dir=Path(storage_dir()),
                       check_keys=list(defs.resolve_asset_graph().asset_check_keys),
                       policy=nothing_kept, now=datetime.now(UTC) + timedelta(days=3650))
    print("prune:", "; ".join(report.lines()))

    runs_after = {run.run_id for run in services.graphql.runs({}, limit=1000)}
    assert superseded in runs_before - runs_after, "the prune deleted no run"
    assert runs_after < runs_before
    assert what_the_ui_shows(services) == before

