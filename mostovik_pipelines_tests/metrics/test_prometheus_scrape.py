"""`mostovik metrics` scraped by a real Prometheus server, after real runs on the production
instance (deploy/dagster.yaml on PostgreSQL): what a Grafana panel or an alert rule reads, asked
with PromQL over Prometheus' HTTP API, every series compared by value with what run storage
and the warehouse hold.

Two days of CBR rates load, a third fails on a malformed answer (a permanent error: it waits for
an operator), one is loaded again (every row unchanged), and the retention prune runs once as
its job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from unittest import mock
from zoneinfo import ZoneInfo

import pytest

from mostovik_pipelines.maintenance.policy import STORES
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.support.instances import (
    create_instance_storage,
    fresh_deployment,
)
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres, free_port
from mostovik_pipelines_tests.support.prometheus import ThrowawayPrometheus
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

BIN = Path(sys.executable).parent
SOURCE = "cbr_daily_rates"
RATES_PER_DATE = 12
MOSCOW = ZoneInfo("Europe/Moscow")


def _last_week(weekday: int) -> date:
    """The day of last week (Monday 0) in Moscow; Tuesday to Saturday carry rates of their own."""
    today = datetime.now(MOSCOW).date()
    return today - timedelta(days=today.weekday() + 7) + timedelta(days=weekday)


LOADED = [_last_week(1), _last_week(2)]
FAILED = _last_week(3)


@pytest.fixture(scope="module")
def environment(postgres: ThrowawayPostgres, standin_server: StandinServer,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The production instance on a fresh database and a fresh warehouse."""
    work_dir = tmp_path_factory.mktemp("metrics")
    with fresh_deployment(postgres, standin_server, work_dir, "metrics") as (home, settings):
        environment = {**os.environ, **settings}
        create_instance_storage(home, environment)
        yield environment


def _execute(environment: dict[str, str], job: str, partition: date | None = None) -> int:
    """``dagster job execute`` of ``job`` (for one partition), as CI runs it."""
    tags = ["--tags", json.dumps({"dagster/partition": partition.isoformat()})] if partition else []
    completed = subprocess.run(
        [str(BIN / "dagster"), "job", "execute", "-m", "mostovik_pipelines", "-j", job, *tags],
        env=environment, capture_output=True, text=True, timeout=PROCESS_START_MARGIN_SECONDS * 2)
    return completed.returncode


@pytest.fixture(scope="module")
def metrics_port(environment: dict[str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """``mostovik metrics`` as its systemd unit runs it (its first pass is at the first scrape,
    after the runs; later scrapes are answered from its cache, so none times out on a busy
    machine)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("metrics_process") / "metrics.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [str(BIN / "mostovik"), "metrics", "--port", str(port)],
            env=environment, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "metrics on http" in log_path.read_text() or process.poll(),
                   PROCESS_START_MARGIN_SECONDS, "mostovik metrics serving",
                   lambda: log_path.read_text()[-3000:])
        assert process.poll() is None, log_path.read_text()[-3000:]
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


def _truth(environment: dict[str, str]) -> dict[str, float]:
    """What run storage and the warehouse say, for each series (PromQL -> value)."""
    from dagster import AssetKey, DagsterInstance, RunsFilter

    from mostovik_pipelines.sources import cbr_daily_rates
    from mostovik_pipelines_tests.support.warehouse import table_rows

    spec = cbr_daily_rates.SOURCE
    url = environment["MOSTOVIK_DATABASE_URL"]
    with mock.patch.dict(os.environ, environment), DagsterInstance.from_config(
            environment["DAGSTER_HOME"]) as instance:
        runs = instance.get_runs(RunsFilter(tags={"mostovik/source": SOURCE}))
        loads = [r.asset_materialization.metadata for r in instance.fetch_materializations(
            AssetKey(SOURCE), limit=1000).records]
        first = min(instance.get_run_records(RunsFilter(tags={"mostovik/source": SOURCE})),
                    key=lambda record: record.create_timestamp).create_timestamp
    first = first if first.tzinfo else first.replace(tzinfo=UTC)
    now = datetime.now(MOSCOW)
    watched_from = first - spec.catch_up.lookback
    loaded = {row["partition_date"].isoformat() for row in table_rows(url, SOURCE)}
    late = 0
    for key in spec.partitions_def.get_partition_keys(current_time=now):
        window = spec.partitions_def.time_window_for_partition_key(key)
        due = spec.deadline.due(window.start, window.end)
        late += window.end > watched_from and due <= now and key not in loaded
    source = f'source="{SOURCE}"'
    truth = {f'mostovik_runs_total{{{source},status="{status}"}}': float(sum(
        1 for run in runs if run.tags.get("mostovik/status") == status))
        for status in ("completed", "partial", "failed")}
    truth.update({f'mostovik_rows_total{{{source},change="{change}"}}': float(sum(
        int(load[change].value) for load in loads))
        for change in ("inserted", "updated", "unchanged", "deleted", "rejected")})
    truth.update({
        f"mostovik_load_duration_seconds_count{{{source}}}": float(len(loads)),
        f'mostovik_load_duration_seconds_bucket{{{source},le="+Inf"}}': float(len(loads)),
        f"mostovik_load_duration_seconds_sum{{{source}}}": round(sum(
            float(load["duration_seconds"].value) for load in loads), 6),
        f"mostovik_source_late_periods{{{source}}}": float(late),
        # The warehouse: the rows inserted less those deleted are the table's.
        f'mostovik_rows_total{{{source},change="inserted"}} - ignoring(change) '
        f'mostovik_rows_total{{{source},change="deleted"}}': float(len(table_rows(url,
                                                                                  SOURCE))),
    })
    return truth


def test_prometheus_reads_every_series_as_run_storage_and_the_warehouse_hold_it(
        environment, metrics_port, standin: StandinClient, tmp_path):
    for day in LOADED:
        assert _execute(environment, f"{SOURCE}_job", day) == 0
    standin.fault("malformed", times=1)
    assert _execute(environment, f"{SOURCE}_job", FAILED) != 0
    assert _execute(environment, f"{SOURCE}_job", LOADED[0]) == 0  # every row unchanged
    assert _execute(environment, "prune_storage_job") == 0

    with ThrowawayPrometheus(tmp_path, {"mostovik": f"127.0.0.1:{metrics_port}"}) as prometheus:
        source = f'source="{SOURCE}"'
        truth = _truth(environment)
        # Checked against the figures these runs must give, so that the truth is no tautology.
        assert truth[f'mostovik_runs_total{{{source},status="completed"}}'] == 3.0
        assert truth[f'mostovik_runs_total{{{source},status="failed"}}'] == 1.0
        assert truth[f'mostovik_rows_total{{{source},change="inserted"}}'] == float(
            RATES_PER_DATE * len(LOADED))
        assert truth[f'mostovik_rows_total{{{source},change="unchanged"}}'] == float(
            RATES_PER_DATE)
        assert truth[f"mostovik_load_duration_seconds_count{{{source}}}"] == 3.0
        assert truth[f"mostovik_source_late_periods{{{source}}}"] >= 1.0  # FAILED is due
        expected = {
            **truth,
            'up{job="mostovik"}': 1.0,
            f'mostovik_source_partitions_waiting_for_operator{{{source}}}': 1.0,
            f'mostovik_source_partitions_failed{{{source}}}': 0.0,
            f'mostovik_source_newest_final_partition_timestamp_seconds{{{source}}}':
                datetime.combine(LOADED[-1] + timedelta(days=1), datetime.min.time(),
                                 MOSCOW).timestamp(),
            "mostovik_run_queue_depth": 0.0,
            "mostovik_alerts_pending": 0.0,
            "mostovik_alerts_sent_total": 0.0,  # dagster job execute runs: their caller sees
            f'count(mostovik_table_last_load_timestamp_seconds{{table="{SOURCE}"}} > 0)': 1.0,
            'count(mostovik_prune_last_removed_bytes{store="landing"} >= 0)': 1.0,
            "count(mostovik_prune_last_removed_bytes)": float(len(STORES) - 1),  # not runs
        }

        def answers() -> dict[str, float | None]:
            got = {promql: prometheus.value(promql) for promql in expected}
            sum_key = f"mostovik_load_duration_seconds_sum{{{source}}}"
            if got[sum_key] is not None:
                got[sum_key] = round(got[sum_key], 6)
            return got

        got = wait_until(lambda: (lambda got: got if got == expected else None)(answers()),
                         PROCESS_START_MARGIN_SECONDS, "Prometheus answering the expected values",
                         lambda: json.dumps({promql: [prometheus.value(promql), want]
                                             for promql, want in expected.items()}, indent=1)
                         + "\n" + prometheus.log()[-2000:], poll=1.0)
        assert got == expected
        age = prometheus.value(
            f"mostovik_source_newest_final_partition_age_seconds{{{source}}}")
        assert age is not None and 0 < age < 14 * 86400
        # No label carries anything but a source, table, store or fixed word.
        labels = {name for series in prometheus.query('{__name__=~"mostovik_.+"}')
                  for name in series["metric"]}
        assert labels <= {"__name__", "job", "instance", "source", "status", "change",
                          "table", "store", "le"}
        # Counters and the histogram are typed as such.
        metadata = prometheus.metadata()
        assert metadata["mostovik_runs"] == metadata["mostovik_rows"] == "counter"
        assert metadata["mostovik_load_duration_seconds"] == "histogram"
        assert metadata["mostovik_source_late_periods"] == "gauge"
