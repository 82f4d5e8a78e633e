"""The inbox sensor run by the real ``dagster-daemon`` (with ``dagster-webserver``, on the
production instance: PostgreSQL storage, the run queue): a file dropped into the inbox gets a run
of ``material_deliveries_job`` for its version from the sensor's first tick that lists the inbox
after the drop (so within one sensor interval of the daemon's clock), the run loads it into
the warehouse; the same bytes dropped again are not run again (the daemon skips a run key it has
launched); a corrected version is. Observed only as an operator observes it: GraphQL, the
warehouse, the folders.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.graphql import RunInfo
from mostovik_pipelines_tests.support.inbox import (
    JOB,
    SENSOR,
    delivery_rows,
    drop,
    exact,
    expected_table,
    renumbered,
    sorted_rows,
    wait_for_tick_asking_after,
    wait_for_ticks_after,
)
from mostovik_pipelines_tests.support.instances import fresh_deployment
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.waiting import limit_for
from mostovik_pipelines_tests.support.webserver import DagsterServices

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

SENSOR_INTERVAL_SECONDS = 5
"""The inbox sensor's interval in these services (15 s by default): the tests wait on ticks."""
TICKS_LIMIT_SECONDS = limit_for(SENSOR_INTERVAL_SECONDS, ticks=2)
FILE_NAME = "Поставки МСК-ЖК-014 ноябрь.csv"


@pytest.fixture(scope="module")
def services(postgres: ThrowawayPostgres, standin_server: StandinServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterServices]:
    """Webserver and daemon on a fresh production instance database, a fresh warehouse, and
    an inbox and archive of their own."""
    work_dir = tmp_path_factory.mktemp("inbox_daemon")
    with fresh_deployment(postgres, standin_server, work_dir, "inbox") as (home, environment):
        environment.update({
            "MOSTOVIK_INBOX_DIR": str(work_dir / "inbox"),
            "MOSTOVIK_ARCHIVE_DIR": str(work_dir / "archive"),
            "MOSTOVIK_INBOX_SENSOR_INTERVAL_SECONDS": str(SENSOR_INTERVAL_SECONDS),
        })
        with DagsterServices(work_dir, home, environment) as running:
            yield running


def _runs_of(services: DagsterServices, version: str) -> list[RunInfo]:
    return services.graphql.runs({"tags": [{"key": "dagster/partition", "value": version}]})


def _drop_and_wait_for_its_run(services: DagsterServices, inbox: Path, content: bytes):
    dropped_at = time.time()
    version = drop(inbox, FILE_NAME, content)
    # The sensor's first tick that listed the inbox after the drop launched the version's run.
    tick = wait_for_tick_asking_after(services, dropped_at, timeout=TICKS_LIMIT_SECONDS)
    [run] = _runs_of(services, version)
    assert tick.run_ids == [run.run_id], (tick, run)
    assert tick.run_keys == [hashlib.sha256(content).hexdigest()], tick
    finished = services.graphql.wait_for_run(run.run_id)
    print(f"\n{version}: run {run.run_id} launched by the tick at {tick.timestamp - dropped_at:.1f}"
          f" s after the drop, {finished.status} {time.time() - dropped_at:.1f} s after it")
    assert finished.status == "SUCCESS", services.graphql.run_errors(run.run_id)
    assert finished.job_name == JOB
    assert finished.tags.get("dagster/sensor_name") == SENSOR
    assert finished.tags.get("mostovik/status") == "completed"
    return version, finished, tick


def test_the_daemon_runs_each_new_file_version_once(services: DagsterServices):
    inbox = Path(services.environment["MOSTOVIK_INBOX_DIR"])
    archive = Path(services.environment["MOSTOVIK_ARCHIVE_DIR"])
    warehouse_url = services.environment["MOSTOVIK_DATABASE_URL"]
    assert services.graphql.repository_contents().sensors.get(SENSOR) == "RUNNING"

    lines = renumbered(reports.deliveries(15, seed=11), 700_000)
    content = reports.csv_report(reports.report_table(lines), encoding="windows-1251")
    first, run, _ = _drop_and_wait_for_its_run(services, inbox, content)
    assert run.tags["dagster/run_key"] == hashlib.sha256(content).hexdigest()
    assert exact(delivery_rows(warehouse_url)) == exact(sorted_rows(
        expected_table(lines, FILE_NAME, first)))
    assert not (inbox / FILE_NAME).exists()
    assert (archive / first).read_bytes() == content

    # The same bytes again: the sensor asks for the version again, the daemon launches nothing.
    redropped_at = time.time()
    drop(inbox, FILE_NAME, content)
    # The first tick that asked for something (one that listed the inbox mid-drop saw nothing).
    seen = wait_for_tick_asking_after(services, redropped_at, timeout=TICKS_LIMIT_SECONDS)
    print(f"the tick after the same bytes were dropped again: {seen}")
    # The sensor did ask, with the version's run key; the daemon launched nothing for it.
    assert seen.run_keys == [run.tags["dagster/run_key"]], seen
    assert seen.run_ids == [] and seen.error is None, seen
    assert [r.run_id for r in _runs_of(services, first)] == [run.run_id]
    assert (inbox / FILE_NAME).read_bytes() == content, "the repeated upload left the inbox"

    # A corrected version under the same name is a new version: it runs, and replaces the rows.
    corrected = [*lines[:4], *lines[5:]]
    second, _, _ = _drop_and_wait_for_its_run(
        services, inbox, reports.csv_report(reports.report_table(corrected)))
    assert second != first
    assert exact(delivery_rows(warehouse_url)) == exact(sorted_rows(
        expected_table(corrected, FILE_NAME, second)))
    assert not (inbox / FILE_NAME).exists()
    # Two ticks and more have passed since the same bytes came again: still one run of them.
    ticks = wait_for_ticks_after(services, redropped_at, 2, timeout=TICKS_LIMIT_SECONDS)
    assert [r.run_id for r in _runs_of(services, first)] == [run.run_id], ticks
