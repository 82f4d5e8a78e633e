"""`mostovik metrics` scraped by a real Prometheus server, after real runs on the production
instance (deploy/dagster.yaml on PostgreSQL): what a Grafana panel or an alert rule reads, asked
with PromQL over Prometheus' HTTP API.

Two days of CBR rates load, a third fails on a malformed answer (a permanent error: it waits for
an operator), and the retention prune runs once as its job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import date, datetime, timedelta
from pathlib import Path
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


def test_prometheus_reads_loads_failures_and_the_prune_after_real_runs(
        environment, metrics_port, standin: StandinClient, tmp_path):
    for day in LOADED:
        assert _execute(environment, f"{SOURCE}_job", day) == 0
    standin.fault("malformed", times=1)
    assert _execute(environment, f"{SOURCE}_job", FAILED) != 0
    assert _execute(environment, "prune_storage_job") == 0

    with ThrowawayPrometheus(tmp_path, {"mostovik": f"127.0.0.1:{metrics_port}"}) as prometheus:
        source = f'source="{SOURCE}"'
        expected = {
            'up{job="mostovik"}': 1.0,
            f'mostovik_rows_in_window{{{source},change="inserted"}}':
                float(RATES_PER_DATE * len(LOADED)),
            f'mostovik_rows_in_window{{{source},change="rejected"}}': 0.0,
            f'mostovik_jobs_in_window{{{source},status="completed"}}': float(len(LOADED)),
            f'mostovik_jobs_in_window{{{source},status="failed"}}': 1.0,
            f'mostovik_source_partitions_waiting_for_operator{{{source}}}': 1.0,
            f'mostovik_source_partitions_failed{{{source}}}': 0.0,
            f'mostovik_source_newest_final_partition_timestamp_seconds{{{source}}}':
                datetime.combine(LOADED[-1] + timedelta(days=1), datetime.min.time(),
                                 MOSCOW).timestamp(),
            "mostovik_run_queue_depth": 0.0,
            f'count(mostovik_source_last_load_duration_seconds{{{source}}} > 0)': 1.0,
            f'count(mostovik_table_last_load_timestamp_seconds{{table="{SOURCE}"}} > 0)': 1.0,
            'count(mostovik_prune_last_removed_bytes{store="landing"} >= 0)': 1.0,
            "count(mostovik_prune_last_removed_bytes)": float(len(STORES) - 1),  # not runs
        }
        answers = wait_until(
            lambda: (lambda got: got if got == expected else None)(
                {promql: prometheus.value(promql) for promql in expected}),
            PROCESS_START_MARGIN_SECONDS, "Prometheus answering the expected values",
            lambda: json.dumps({promql: prometheus.value(promql) for promql in expected},
                               indent=1) + "\n" + prometheus.log()[-2000:],
            poll=1.0)
        assert answers == expected
        age = prometheus.value(
            f"mostovik_source_newest_final_partition_age_seconds{{{source}}}")
        assert age is not None and 0 < age < 14 * 86400
        # No label carries anything but a source, table, store or fixed word.
        labels = {name for series in prometheus.query('{__name__=~"mostovik_.+"}')
                  for name in series["metric"]}
        assert labels <= {"__name__", "job", "instance", "source", "status", "change",
                          "table", "store"}
